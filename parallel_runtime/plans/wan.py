"""Wan 2.1 / 2.2 (``comfy.ldm.wan.model.WanModel``): where the token sequence is cut and gathered.

- The patch-embedded video (plus a Wan 2.2 reference latent, if any) enters
  ``blocks.0`` as ``x``; that is the sequence.
- ``freqs`` (RoPE table, one row per token) and ``e`` (modulation) reach every
  block. ``e`` is one row for the whole clip, or one row per frame when Wan 2.2
  denoises frames at different noise levels; the model then repeats it per token
  (``repeat_e``), so the plan expands it the same way before cutting it.
- Self-attention is context-parallel; cross-attention to the text (and, for I2V,
  to the image tokens) stays local.
- ``head`` is per-token: its output (``out_dim * prod(patch)`` channels, narrower
  than the hidden width) is gathered before unpatchify.
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


PLAN = ModelPlan(
    family="wan",
    title="Wan 2.1 / 2.2",
    classes=("comfy.ldm.wan.model.WanModel",),
    heads_attr="num_heads",
    context_parallel=ContextParallelPlan(
        inputs={
            "blocks.0": (Split("x", dim=1, starts_stream=True),),
            "blocks.*": (Split("freqs", dim=1), Split("e", dim=1, expand=expand_like_repeat_e)),
            "head": (Split("e", dim=1, expand=expand_like_repeat_e),),
        },
        outputs={"head": Gather(dim=1)},
        attention={"blocks.*.self_attn": ("x",)},
    ),
    notes="T2V, I2V and the 5B TI2V; VACE and the other Wan variants are separate classes, not covered yet.",
)
