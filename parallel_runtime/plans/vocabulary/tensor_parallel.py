"""Tensor-parallel declarations: which layers of a family each rank of a TP group holds a slice of.

A family's ``TensorParallelPlan`` names layers by module pattern:

- ``Colwise``: output features split (Megatron column parallel). Fused
  projections are split per *segment* (Flux's ``qkv`` is three segments, the
  single block's ``linear1`` is q|k|v|mlp): each rank takes its slice of every
  segment, so the local result is again ``[q_r | k_r | v_r | mlp_r]``.
  ``gather=True``: the slices are all-gathered after the layer (modulation
  layers whose output feeds the replicated residual stream).
- ``Rowwise``: input features split, partial outputs summed with one all-reduce;
  the bias is added once (kept on TP rank 0 only).
- ``Norm``: an RMSNorm over a width that TP splits (Wan's q/k norms): the mean
  square is all-reduced.

Everything else is replicated (shared, not copied). Integer attributes that the
forward uses to reshape (head counts, widths) are divided on the shard.

The shard is cut in ``weights/shards.py``; its collectives run from hooks in
``parallel/tensor_parallel.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

import torch


Segments = Union[int, Callable[[torch.nn.Module, torch.nn.Module], "list[int] | int"], None]


@dataclass(frozen=True)
class Colwise:
    segments: Segments = None   # equal segments (int) or sizes from (parent, module)
    gather: bool = False
    dim: int = 0                # the weight's output-feature dim (1 for an Embedding: heads of T5's bias table)


@dataclass(frozen=True)
class ColwiseKV:
    """Key/value projection of grouped-query attention: heads split like ``Colwise`` while
    there are at least as many KV heads as ranks; beyond that each rank keeps the one KV
    head its query heads use (replicated, not crashing)."""

    heads: str = "num_heads"        # attributes of the parent attention module
    kv_heads: str = "num_kv_heads"
    head_dim: str = "head_dim"


@dataclass(frozen=True)
class Rowwise:
    segments: Segments = None


@dataclass(frozen=True)
class Norm:
    pass


Layer = Union[Colwise, ColwiseKV, Rowwise, Norm]


@dataclass(frozen=True)
class SliceInput:
    """An input of a module that carries per-head or per-feature data (LTXV's RoPE table spans
    the whole attention width): each TP rank takes its equal part along ``dim``, of element
    ``item`` when the input is a tuple. Like ``Split``, a spec applies only to its form (tensor
    or tuple), so a plan can name both where ComfyUI releases differ."""

    arg: str
    dim: int
    item: int | None = None


@dataclass(frozen=True)
class TensorParallelPlan:
    layers: dict[str, Layer]
    divide: dict[str, tuple[str, ...]] = field(default_factory=dict)  # module pattern -> int attributes
    # Sizes TP must divide, for the node's check: what users call it -> attribute path on the root.
    divisible: dict[str, str] = field(default_factory=dict)
    # Layer patterns that only some variants of the class have (Flux.1 per-block modulation vs
    # Flux.2 global modulation, Wan's I2V image branch): no match is not an error for these.
    optional: frozenset[str] = frozenset()
    # Module inputs cut per TP rank at every call (see SliceInput): module pattern -> specs.
    inputs: dict[str, tuple[SliceInput, ...]] = field(default_factory=dict)


class TensorParallelError(RuntimeError):
    pass


def kv_rows(heads: int, kv: int, d: int, rank: int, size: int, what: str) -> slice:
    """The rows of a ``ColwiseKV`` projection (``kv`` heads of ``d``) that TP rank ``rank`` of
    ``size`` keeps: its share of the KV heads, or the one its query heads use; refuses sizes that
    do not fit (the weight cut and the quantized cut both follow this rule)."""
    if heads % size:
        raise TensorParallelError(f"{what}: {heads} attention heads do not divide by tp_size {size}")
    if size <= kv:
        if kv % size:
            raise TensorParallelError(f"{what}: {kv} key/value heads do not divide by tp_size {size}")
        per = kv // size
        return slice(rank * per * d, (rank + 1) * per * d)
    if size % kv:
        raise TensorParallelError(f"{what}: tp_size {size} is not a multiple of the {kv} key/value heads")
    head = rank * kv // size  # the KV head this rank's query heads share
    return slice(head * d, (head + 1) * d)
