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

from .base import ContextParallelPlan, Gather, ModelPlan, Split


def expand_like_repeat_e(t: torch.Tensor, total: int) -> torch.Tensor:
    """What ``comfy.ldm.wan.model.repeat_e`` does to a per-frame modulation row."""
    repeats = total // t.shape[1]
    if repeats * t.shape[1] == total:
        return torch.repeat_interleave(t, repeats, dim=1)
    return torch.repeat_interleave(t, repeats + 1, dim=1)[:, :total]


ENTRY = {"blocks.0": (Split("x", dim=1, starts_stream=True),)}
ROPE = Split("freqs", dim=1)
PER_TOKEN_E = Split("e", dim=1, expand=expand_like_repeat_e)
SELF_ATTENTION = {"blocks.*.self_attn": ("x",)}
GATHER_HEAD = {"head": Gather(dim=1)}

PLAN = ModelPlan(
    family="wan",
    title="Wan 2.1 / 2.2",
    classes=("comfy.ldm.wan.model.WanModel",),
    heads_attr="num_heads",
    context_parallel=ContextParallelPlan(
        inputs={**ENTRY, "blocks.*": (ROPE, PER_TOKEN_E), "head": (PER_TOKEN_E,)},
        outputs=GATHER_HEAD,
        attention=SELF_ATTENTION,
    ),
    notes="T2V, I2V (CLIP image context), the 5B TI2V (per-frame timesteps), Wan 2.2 14B.",
)

VACE = ModelPlan(
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
    ),
    notes="Control video stream cut like the video.",
)
