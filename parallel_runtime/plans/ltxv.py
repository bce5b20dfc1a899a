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
"""
from __future__ import annotations

from .base import ContextParallelPlan, Gather, ModelPlan, Split

PLAN = ModelPlan(
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
)
