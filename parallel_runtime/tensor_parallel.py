"""Tensor parallelism: each rank of a TP group holds a slice of every large layer.

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

The shard is built from the module as ComfyUI patched it (LoRA merged), as a new
module whose large weights are slices: rank 0 builds one per TP rank and sends
each worker only its own. The collectives are installed as forward hooks for the
duration of one forward, like the context-parallel ones.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Callable, Union

import torch
import torch.distributed as dist

from .sequence import _all_gather

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
class TensorParallelPlan:
    layers: dict[str, Layer]
    divide: dict[str, tuple[str, ...]] = field(default_factory=dict)  # module pattern -> int attributes
    # Sizes TP must divide, for the node's check: what users call it -> attribute path on the root.
    divisible: dict[str, str] = field(default_factory=dict)
    # Layer patterns that only some variants of the class have (Flux.1 per-block modulation vs
    # Flux.2 global modulation, Wan's I2V image branch): no match is not an error for these.
    optional: frozenset[str] = frozenset()


class TensorParallelError(RuntimeError):
    pass


def _segment_sizes(spec, parent, module, total: int) -> list[int]:
    seg = spec.segments
    if seg is None:
        return [total]
    if callable(seg):
        seg = seg(parent, module)
    if isinstance(seg, int):
        if total % seg:
            raise TensorParallelError(f"{total} features do not split into {seg} equal segments")
        return [total // seg] * seg
    sizes = list(seg)
    if sum(sizes) != total:
        raise TensorParallelError(f"segments {sizes} do not add up to the layer's {total} features")
    return sizes


def _slice_segments(t: torch.Tensor, dim: int, sizes: list[int], rank: int, size: int, what: str) -> torch.Tensor:
    _refuse_quantized(t, what)
    pieces, offset = [], 0
    for s in sizes:
        if s % size:
            raise TensorParallelError(f"{what}: a segment of {s} features does not divide by tp_size {size}")
        part = s // size
        pieces.append(t.narrow(dim, offset + rank * part, part))
        offset += s
    # A fresh tensor, never a view: a view would keep (and share with the workers) the full weight.
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0].clone(memory_format=torch.contiguous_format)


def _refuse_quantized(t: torch.Tensor, what: str) -> None:
    if type(t).__name__ == "QuantizedTensor" or (isinstance(t, torch.nn.Parameter) and
                                                 type(t.data).__name__ == "QuantizedTensor"):
        raise TensorParallelError(f"{what} is stored in one of ComfyUI's quantized layouts (QuantizedTensor), which "
                                  "this version cannot slice without dequantizing the whole layer; use a scaled fp8 "
                                  "or a full-precision checkpoint, or tp_size 1")


def _parent(root: torch.nn.Module, name: str) -> torch.nn.Module:
    return root.get_submodule(name.rsplit(".", 1)[0]) if "." in name else root


def _param(t: torch.Tensor, like) -> torch.Tensor:
    return torch.nn.Parameter(t, requires_grad=False) if isinstance(like, torch.nn.Parameter) else t


def layer_specs(root: torch.nn.Module, plan: TensorParallelPlan) -> list[tuple[str, torch.nn.Module, Layer]]:
    from .plans.base import matching_modules

    found, seen = [], set()
    for pattern, spec in plan.layers.items():
        matches = matching_modules(root, pattern)
        if not matches and pattern in plan.optional:
            continue
        if not matches:
            raise TensorParallelError(f"tensor-parallel plan: no module matches '{pattern}' in "
                                      f"{type(root).__name__}")
        for name, mod in matches:
            if id(mod) not in seen:
                seen.add(id(mod))
                found.append((name, mod, spec))
    return found


def build_shard(root: torch.nn.Module, plan: TensorParallelPlan, rank: int, size: int) -> torch.nn.Module:
    """A copy of ``root`` holding TP rank ``rank``'s slices of the planned layers; every
    other tensor is shared with ``root``, not copied."""
    from .plans.base import matching_modules

    memo: dict[int, object] = {}
    for name, mod, spec in layer_specs(root, plan):
        parent = _parent(root, name)
        weight = getattr(mod, "weight", None)
        bias = getattr(mod, "bias", None)
        if weight is None:
            raise TensorParallelError(f"tensor-parallel plan: {name} has no weight")
        if isinstance(spec, ColwiseKV):
            rows = _kv_rows(parent, spec, rank, size, name)
            memo[id(weight)] = _param(weight[rows].clone(), weight)
            if bias is not None:
                memo[id(bias)] = _param(bias[rows].clone(), bias)
        elif isinstance(spec, (Colwise, Norm)):
            dim = spec.dim if isinstance(spec, Colwise) else 0
            sizes = _segment_sizes(spec, parent, mod, weight.shape[dim]) if isinstance(spec, Colwise) else \
                [weight.shape[0]]
            memo[id(weight)] = _param(_slice_segments(weight, dim, sizes, rank, size, name), weight)
            if bias is not None:
                memo[id(bias)] = _param(_slice_segments(bias, 0, sizes, rank, size, name), bias)
        else:  # Rowwise
            dim = 1
            sizes = _segment_sizes(spec, parent, mod, weight.shape[dim])
            memo[id(weight)] = _param(_slice_segments(weight, dim, sizes, rank, size, name), weight)
            if bias is not None:
                # Added once, after the all-reduce sums the partial products of every rank.
                memo[id(bias)] = _param(bias.detach().clone() if rank == 0 else torch.zeros_like(bias), bias)
    for t in list(root.parameters()) + list(root.buffers()):
        memo.setdefault(id(t), t)  # replicated: the same tensor, no copy
    from .transport import without_forward_overrides

    with without_forward_overrides(root):
        shard = copy.deepcopy(root, memo)
    for name, mod, spec in layer_specs(shard, plan):
        if isinstance(spec, Norm) and hasattr(mod, "normalized_shape"):
            # The module's own (local) normalisation runs first and is replaced by the hook.
            mod.normalized_shape = (*tuple(mod.normalized_shape)[:-1], mod.weight.shape[-1])
    for pattern, attrs in plan.divide.items():
        for name, mod in matching_modules(shard, pattern):
            for attr in attrs:
                attr, _, rule = attr.partition(":")
                value = getattr(mod, attr)
                if rule == "kv" and value < size:
                    setattr(mod, attr, 1)  # each rank keeps one KV head (see ColwiseKV)
                    continue
                if value % size:
                    raise TensorParallelError(f"{name}.{attr} = {value} does not divide by tp_size {size}")
                setattr(mod, attr, value // size)
    shard.tensor_parallel_rank = (rank, size)
    return shard


def _kv_rows(attention, spec: ColwiseKV, rank: int, size: int, what: str) -> slice:
    heads, kv, d = (int(getattr(attention, a)) for a in (spec.heads, spec.kv_heads, spec.head_dim))
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


def encoder_valid_sizes(root: torch.nn.Module, plan, limit: int = 256) -> list[int]:
    """World sizes a text encoder splits over: every planned layer must cut evenly."""
    valid = []
    for n in range(1, limit + 1):
        try:
            _check_splits(root, plan.tensor_parallel, n)
        except TensorParallelError:
            continue
        valid.append(n)
    return valid


def _check_splits(root: torch.nn.Module, plan: "TensorParallelPlan", size: int) -> None:
    """Raise TensorParallelError if some planned layer or attribute does not split over ``size``."""
    from .plans.base import matching_modules

    for name, mod, spec in layer_specs(root, plan):
        parent = _parent(root, name)
        if isinstance(spec, ColwiseKV):
            _kv_rows(parent, spec, 0, size, name)
        elif isinstance(spec, Colwise):
            for s in _segment_sizes(spec, parent, mod, mod.weight.shape[spec.dim]):
                if s % size:
                    raise TensorParallelError(name)
        elif isinstance(spec, Rowwise):
            for s in _segment_sizes(spec, parent, mod, mod.weight.shape[1]):
                if s % size:
                    raise TensorParallelError(name)
    for pattern, attrs in plan.divide.items():
        for _, mod in matching_modules(root, pattern):
            for attr in attrs:
                attr, _, rule = attr.partition(":")
                value = getattr(mod, attr)
                if not (rule == "kv" and value < size) and value % size:
                    raise TensorParallelError(attr)


def valid_sizes(root: torch.nn.Module, plan: TensorParallelPlan, heads_attr_value: int) -> list[int]:
    """tp sizes that divide every size the plan needs divided."""
    values = [heads_attr_value] + [int(_resolve(root, path)) for path in plan.divisible.values()]
    limit = min(values)
    return [d for d in range(1, limit + 1) if all(v % d == 0 for v in values)]


def _resolve(root, path: str):
    value = root
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _all_reduce_hook(group):
    def hook(module, args, output):
        dist.all_reduce(output, group=group)
        return output
    return hook


def _gather_hook(group, size: int):
    def hook(module, args, output):
        local = output.movedim(-1, 0).contiguous()
        full = local.new_empty((local.shape[0] * size, *local.shape[1:]))
        _all_gather(full, local, group=group)
        return full.movedim(0, -1)
    return hook


def _norm_hook(group, size: int):
    def hook(module, args, output):
        x = args[0]
        local = x.float().pow(2).sum(dim=-1, keepdim=True)
        dist.all_reduce(local, group=group)
        mean = local / (x.shape[-1] * size)
        eps = getattr(module, "eps", None) or 1e-6
        weight = module.weight.to(device=x.device, dtype=torch.float32) if module.weight is not None else 1.0
        return (x.float() * torch.rsqrt(mean + eps) * weight).to(output.dtype)
    return hook


@contextlib.contextmanager
def tensor_parallel(shard: torch.nn.Module, plan: TensorParallelPlan | None, group, size: int):
    """Install the TP collectives on ``shard`` for one forward."""
    if plan is None or size == 1:
        yield
        return
    handles = []
    try:
        for _, mod, spec in layer_specs(shard, plan):
            if isinstance(spec, Rowwise):
                handles.append(mod.register_forward_hook(_all_reduce_hook(group)))
            elif isinstance(spec, Colwise) and spec.gather:
                handles.append(mod.register_forward_hook(_gather_hook(group, size)))
            elif isinstance(spec, Norm):
                handles.append(mod.register_forward_hook(_norm_hook(group, size)))
        yield
    finally:
        for h in handles:
            h.remove()
