"""Tensor parallelism at run time: the collectives a shard needs, as hooks for one forward.

A shard (``weights/shards.py``) holds its rank's slices of the layers a ``TensorParallelPlan``
names (``plans/vocabulary/tensor_parallel.py``). Around one forward: the partial outputs of a ``Rowwise``
layer are summed with one all-reduce, the slices of a ``Colwise(gather=True)`` layer are
all-gathered, a ``Norm`` over a split width all-reduces its mean square, and ``SliceInput``
inputs are cut per rank at every call. The hooks are removed after the forward, like the
context-parallel ones.
"""
from __future__ import annotations

import contextlib

import torch

from . import scoped_hooks
from ..distributed import comm
from ..plans.vocabulary.matching import layer_specs, matching_modules, on_item, replace_arguments
from ..plans.vocabulary.tensor_parallel import (Colwise, Norm, Rowwise, SliceInput, TensorParallelError,
                                               TensorParallelPlan)


def _all_reduce_hook(group):
    def hook(module, args, output):
        comm.all_reduce(output, group=group)
        return output
    return hook


def _gather_hook(group, size: int):
    def hook(module, args, output):
        local = output.movedim(-1, 0).contiguous()
        full = local.new_empty((local.shape[0] * size, *local.shape[1:]))
        comm.all_gather_into(full, local, group=group)
        return full.movedim(0, -1).contiguous()  # as the whole layer's output is (MiniMax-H3 views it)
    return hook


def _norm_hook(group, size: int):
    def hook(module, args, output):
        x = args[0]
        local = x.float().pow(2).sum(dim=-1, keepdim=True)
        comm.all_reduce(local, group=group)
        mean = local / (x.shape[-1] * size)
        eps = getattr(module, "eps", None) or 1e-6
        weight = module.weight.to(device=x.device, dtype=torch.float32) if module.weight is not None else 1.0
        return (x.float() * torch.rsqrt(mean + eps) * weight).to(output.dtype)
    return hook


def _slice_input(value: torch.Tensor, spec: SliceInput, rank: int, size: int, memo: dict) -> torch.Tensor:
    found = memo.get((id(value), spec.dim))
    if found is not None and found[0] is value:
        return found[1]
    total = value.shape[spec.dim]
    if total % size:
        raise TensorParallelError(f"tensor parallel: input '{spec.arg}' has {total} entries along dim {spec.dim}, "
                                  f"which do not divide by tp_size {size}")
    part = total // size
    out = value.narrow(spec.dim, rank * part, part)
    memo[(id(value), spec.dim)] = (value, out)  # the same table reaches every block: cut it once
    return out


def _slice_inputs_hook(specs: tuple[SliceInput, ...], rank: int, size: int, memo: dict):
    def cut(value, spec):
        return on_item(value, spec.item, lambda t: _slice_input(t, spec, rank, size, memo))

    def hook(module, args, kwargs):
        return replace_arguments(module, args, kwargs, specs, cut)
    return hook


@contextlib.contextmanager
def tensor_parallel(shard: torch.nn.Module, plan: TensorParallelPlan | None, group, size: int):
    """Install the TP collectives (and input slices) on ``shard`` for one forward."""
    if plan is None or size == 1:
        yield
        return
    handles = []
    try:
        if plan.inputs:
            rank, memo = shard.tensor_parallel_rank[0], {}
            for pattern, specs in plan.inputs.items():
                for _, mod in matching_modules(shard, pattern):
                    handles.append(scoped_hooks.pre_hook(mod, _slice_inputs_hook(specs, rank, size, memo),
                                                        with_kwargs=True))
        for _, mod, spec in layer_specs(shard, plan):
            if isinstance(spec, Rowwise):
                handles.append(scoped_hooks.post_hook(mod, _all_reduce_hook(group)))
            elif isinstance(spec, Colwise) and spec.gather:
                handles.append(scoped_hooks.post_hook(mod, _gather_hook(group, size)))
            elif isinstance(spec, Norm):
                handles.append(scoped_hooks.post_hook(mod, _norm_hook(group, size)))
        yield
    finally:
        for h in handles:
            h.remove()
