"""LTXV (``comfy.ldm.lightricks.model.LTXVModel``): self-attention over video tokens
plus cross-attention to the text in every block.

- The video tokens (keyframe guide tokens appended at the end included) are cut
  where they enter ``transformer_blocks.0``; ``pe`` and the per-token ``timestep``
  modulation (``[B, N, ...]`` with a denoise mask, else ``[B, 1, ...]``) follow at
  every block. ``pe`` is a tensor with the tokens on dim 2 up to ComfyUI 0.3.x and a
  ``(rotation matrix [B, N, H, ...], split)`` tuple from 0.33 on.
- ``attn1`` (self) is context-parallel; ``attn2`` (cross) stays local.
- After the blocks the model modulates with a per-token embedding that is not
  passed through a module, so the stream is gathered at the last block.
- Block Cache: each block returns the update of ``x`` (in place; nothing runs between blocks).

Tensor parallelism cuts the heads of both attentions (q/k/v columns, ``to_out`` rows; the
q/k RMSNorms span all heads and all-reduce their mean square; the optional per-head gate
columns) and the feed-forward (columns, then rows). Self-attention's RoPE table spans all
heads too, so each TP rank takes its heads' part of it: the pairs on dim 3 of the 0.3.x
tensor, the heads on dim 2 of 0.33's rotation matrix. The timestep embedding is a
column/row pair and the 6-way modulation projection column-parallel, gathered.
"""
from __future__ import annotations

from .vocabulary.context_parallel import CachedBlocks, ContextParallelPlan, Gather, Split
from .vocabulary.tensor_parallel import Colwise, Norm, Rowwise, SliceInput, TensorParallelPlan
from .vocabulary.transformer import TransformerPlan


def attention_tp(attn: str) -> dict:
    return {f"{attn}.to_q": Colwise(), f"{attn}.to_k": Colwise(), f"{attn}.to_v": Colwise(),
            f"{attn}.to_out.0": Rowwise(), f"{attn}.q_norm": Norm(), f"{attn}.k_norm": Norm(),
            f"{attn}.to_gate_logits": Colwise()}


def adaln_tp(adaln: str) -> dict:
    return {f"{adaln}.emb.timestep_embedder.linear_1": Colwise(),
            f"{adaln}.emb.timestep_embedder.linear_2": Rowwise(),
            f"{adaln}.linear": Colwise(gather=True)}


ATTENTION = ("transformer_blocks.*.attn1", "transformer_blocks.*.attn2")
TENSOR_PARALLEL = TensorParallelPlan(
    layers={k: v for attn in ATTENTION for k, v in attention_tp(attn).items()}
    | {"transformer_blocks.*.ff.net.0.proj": Colwise(), "transformer_blocks.*.ff.net.2": Rowwise()}
    | adaln_tp("adaln_single") | adaln_tp("prompt_adaln_single"),
    divide={attn: ("heads",) for attn in ATTENTION},
    divisible={"heads": "transformer_blocks.0.attn1.heads",
               "feed-forward width": "transformer_blocks.0.ff.net.2.in_features"},
    # Per-head gates and the prompt's own modulation exist only in LTX-2 models (0.33).
    optional=frozenset({f"{attn}.to_gate_logits" for attn in ATTENTION} | set(adaln_tp("prompt_adaln_single"))),
    inputs={"transformer_blocks.*.attn1": (SliceInput("pe", dim=3), SliceInput("pe", dim=2, item=0))},
)

PLAN = TransformerPlan(
    family="ltxv",
    title="LTXV",
    classes=("comfy.ldm.lightricks.model.LTXVModel",),
    heads_attr="transformer_blocks.0.attn1.heads",
    context_parallel=ContextParallelPlan(
        inputs={
            "transformer_blocks.0": (Split("x", dim=1, starts_stream=True),),
            "transformer_blocks.*": (Split("pe", dim=2), Split("pe", dim=1, item=0), Split("timestep", dim=1)),
        },
        outputs={"transformer_blocks.-1": Gather(dim=1)},
        attention={"transformer_blocks.*.attn1": ("x",)},
        # Not 0.33's self_attention_mask, k_pe or prompt_timestep: refused when they carry a value.
        passed=frozenset({"x", "pe", "context", "attention_mask", "mask"}),
    ),
    notes="Keyframe conditioning and per-token timesteps.",
    tensor_parallel=TENSOR_PARALLEL,
    cached_blocks=(CachedBlocks("transformer_blocks.*"),),
)
