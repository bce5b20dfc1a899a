"""Wan 2.1 / 2.2 (``comfy.ldm.wan.model.WanModel``) and its VACE variant.

- The patch-embedded video (plus a Wan 2.2 reference latent, if any) enters
  ``blocks.0`` as ``x``: that is the token stream.
- ``freqs`` (RoPE table, one row per token) and ``e`` (modulation) reach every
  block. In ``WanModel`` ``e`` has one row for the whole clip, or one row per
  frame when Wan 2.2 denoises frames at different noise levels; the model then
  repeats it per token (``repeat_e``), so the plan expands it the same way before
  cutting it (the head's ``e`` likewise).
- Self-attention is context-parallel; cross-attention to the text (and, for I2V,
  to the image tokens) stays local.
- ``head`` is per token: its output (``out_dim * prod(patch)`` channels, narrower
  than the hidden width) is gathered before unpatchify.
- VACE: the control stream ``c`` has the video's length and runs through
  ``vace_blocks`` next to ``x``; it is cut the same way, and the hints the VACE
  blocks add to ``x`` are then already local. VACE modulates with one row per
  clip (``[B, 6, C]``), which is not cut.
- Not covered: the camera, S2V, HuMo and Animate variants (separate classes with
  per-frame audio or face attention that a token split would misalign).
"""
from __future__ import annotations

import torch

from .vocabulary.context_parallel import CachedBlocks, ContextParallelPlan, Gather, PatchSite, Split
from .vocabulary.tensor_parallel import Colwise, Norm, Rowwise, TensorParallelPlan
from .vocabulary.transformer import TransformerPlan


def expand_like_repeat_e(t: torch.Tensor, total: int) -> torch.Tensor:
    """What ``comfy.ldm.wan.model.repeat_e`` does to a per-frame modulation row."""
    repeats = total // t.shape[1]
    if repeats * t.shape[1] == total:
        return torch.repeat_interleave(t, repeats, dim=1)
    return torch.repeat_interleave(t, repeats + 1, dim=1)[:, :total]


def _attention_tp(prefix: str, image_branch: bool = False) -> dict:
    layers = {f"{prefix}.{p}": Colwise() for p in ("q", "k", "v")}
    layers.update({f"{prefix}.o": Rowwise(), f"{prefix}.norm_q": Norm(), f"{prefix}.norm_k": Norm()})
    if image_branch:
        layers.update({f"{prefix}.k_img": Colwise(), f"{prefix}.v_img": Colwise(), f"{prefix}.norm_k_img": Norm()})
    return layers


def _block_tp(blocks: str) -> tuple[dict, set, dict]:
    image_branch = {f"{blocks}.cross_attn.{p}" for p in ("k_img", "v_img", "norm_k_img")}
    layers = {**_attention_tp(f"{blocks}.self_attn"), **_attention_tp(f"{blocks}.cross_attn", image_branch=True),
              f"{blocks}.ffn.0": Colwise(), f"{blocks}.ffn.2": Rowwise()}
    return layers, image_branch, {f"{blocks}.self_attn": ("num_heads",), f"{blocks}.cross_attn": ("num_heads",)}


def wan_tensor_parallel(block_stacks: tuple[str, ...] = ("blocks.*",)) -> TensorParallelPlan:
    """Attention heads and the FFN split across TP ranks (the residual stream stays whole):
    q/k/v column-parallel, o row-parallel, the full-width q/k RMSNorms all-reduce their mean
    square; the text and time embeddings are column/row pairs too, and the 6-way modulation
    projection is column-parallel with its output gathered. VACE's control blocks are the same
    attention blocks (their before/after projections stay whole)."""
    layers = {"text_embedding.0": Colwise(), "text_embedding.2": Rowwise(),
              "time_embedding.0": Colwise(), "time_embedding.2": Rowwise(),
              "time_projection.1": Colwise(gather=True)}
    optional, divide = set(), {}
    for blocks in block_stacks:
        stack_layers, image_branch, stack_divide = _block_tp(blocks)
        layers.update(stack_layers)
        optional |= image_branch
        divide.update(stack_divide)
    return TensorParallelPlan(layers=layers, divide=divide, divisible={"FFN width": "ffn_dim", "width": "dim"},
                              optional=frozenset(optional))


ENTRY = {"blocks.0": (Split("x", dim=1, starts_stream=True),)}
ROPE = Split("freqs", dim=1)
PER_TOKEN_E = Split("e", dim=1, expand=expand_like_repeat_e)
SELF_ATTENTION = {"blocks.*.self_attn": ("x",)}
# Passed on unchanged: the stream once cut, the cut RoPE table, the text (cross-attention stays local).
WAN_BLOCK_ARGS = frozenset({"x", "freqs", "context", "context_img_len"})
GATHER_HEAD = {"head": Gather(dim=1)}
# Model patches after each block (Uni3C) receive the video stream as ``img`` (``x`` is the model's input).
PATCH_SITES = {"double_block": PatchSite(tokens={"img": "x"})}

PLAN = TransformerPlan(
    family="wan",
    title="Wan 2.1 / 2.2",
    classes=("comfy.ldm.wan.model.WanModel",),
    heads_attr="num_heads",
    context_parallel=ContextParallelPlan(
        inputs={**ENTRY, "blocks.*": (ROPE, PER_TOKEN_E), "head": (PER_TOKEN_E,)},
        outputs=GATHER_HEAD,
        attention=SELF_ATTENTION,
        passed=WAN_BLOCK_ARGS,
        patch_sites=PATCH_SITES,
    ),
    notes="T2V, I2V (CLIP image context), the 5B TI2V (per-frame timesteps), Wan 2.2 14B.",
    tensor_parallel=wan_tensor_parallel(),
    cached_blocks=(CachedBlocks("blocks.*"),),
)

VACE = TransformerPlan(
    family="wan_vace",
    title="Wan VACE",
    classes=("comfy.ldm.wan.model.VaceWanModel",),
    heads_attr="num_heads",
    context_parallel=ContextParallelPlan(
        inputs={**ENTRY, "blocks.*": (ROPE,),
                "vace_blocks.*": (Split("c", dim=1, when_full_length=True), Split("x", dim=1, when_full_length=True),
                                  ROPE)},
        outputs=GATHER_HEAD,
        attention={**SELF_ATTENTION, "vace_blocks.*.self_attn": ("x",)},
        passed=WAN_BLOCK_ARGS | {"e"},  # VACE's modulation is one row per sample (the 14B models)
    ),
    notes="Control video stream cut like the video; its control blocks cut like the main ones under TP.",
    tensor_parallel=wan_tensor_parallel(("blocks.*", "vace_blocks.*")),
    cached_blocks=(CachedBlocks("blocks.*"),),  # the control blocks run at every step
)
