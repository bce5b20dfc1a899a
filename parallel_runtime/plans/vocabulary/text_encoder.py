"""A text encoder plan: tensor parallel over the ranks Shard Text Encoder gives it.

Text encoding runs once per prompt while every rank would otherwise wait, so the encoder is sliced
over all ranks of the world (or, where its heads do not split over that many, the largest group
they split over that tiles the world), not over the transformer's tp dimension: each rank holds its
share of every attention and MLP layer; the token embedding table and the norms stay whole. The
input is whole on every rank and nothing is split by token; the hidden states are whole on every
rank after each layer (row-parallel outputs are all-reduced), so the conditioning rank 0 returns to
ComfyUI is the full one. Only the ``TensorParallelPlan`` is particular to an encoder."""
from __future__ import annotations

from dataclasses import dataclass, field

from .plan import Plan
from .tensor_parallel import TensorParallelPlan


@dataclass(frozen=True)
class TextEncoderPlan(Plan):
    classes: tuple[str, ...]  # qualified class names this plan covers
    tensor_parallel: TensorParallelPlan = field()
    notes: str = ""           # the support matrix's notes
