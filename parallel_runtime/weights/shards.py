"""Tensor-parallel shards: how each tensor of a planned layer is cut, and a rank's shard made of the cuts.

The shard is built from the module as ComfyUI patched it (LoRA merged), as a new module whose
large weights are slices: rank 0 builds one per TP rank and sends each worker only its own. A
``Cut`` is metadata (so that a worker knows its shapes before any data moves); ComfyUI's
quantized layouts are cut with their scales (``quantized``), GGUF tensors as stored where they can
be (``packed``). Also here: the sizes a plan splits over, for the nodes' and layout auto's checks.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch

from . import packed, quantized
from .pickling import without_forward_overrides
from ..plans.vocabulary.matching import layer_specs, matching_modules
from ..plans.vocabulary.tensor_parallel import (Colwise, ColwiseKV, Norm, Rowwise, TensorParallelError,
                                               TensorParallelPlan, kv_rows)


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


def quantized_message(what: str, reason: str) -> str:
    return (f"{what} cannot be cut for tensor parallelism: {reason}. Use tp_size 1 (Ulysses, Ring and CFG "
            "work with it), another tp_size, or a bf16 / fp16 / GGUF file of this model for TP")


def quantized_layers(root: torch.nn.Module, plan: "TensorParallelPlan", size: int) -> list[tuple[str, str]]:
    """(layer, reason) of the planned layers stored in a ComfyUI quantized layout that TP cannot
    cut exactly for ``size`` ranks (the others are cut with their scales: ``quantized``)."""
    try:
        cuts = cut_plan(root, plan, size)
    except TensorParallelError:
        return []  # sizes that do not divide: the node's size check says so
    found = []
    for name, mod, _ in layer_specs(root, plan):
        for t in (getattr(mod, "weight", None), getattr(mod, "bias", None)):
            if t is not None and id(t) in cuts and quantized.layout_name(t) is not None:
                reason = quantized.why_not_cut(t, cuts[id(t)], size)
                if reason is not None:
                    found.append((name, reason))
                    break
    return found


def _parent(root: torch.nn.Module, name: str) -> torch.nn.Module:
    return root.get_submodule(name.rsplit(".", 1)[0]) if "." in name else root


def _param(t: torch.Tensor, like) -> torch.Tensor:
    return torch.nn.Parameter(t, requires_grad=False) if isinstance(like, torch.nn.Parameter) else t


@dataclass(frozen=True)
class Cut:
    """How one tensor of a planned layer is cut for each TP rank: metadata only, so rank 0 can
    tell a worker the shapes of its shard before any data moves, and both sides cut alike."""

    what: str                         # the layer, for messages
    kind: str                         # "segments", "rows" (grouped-query K/V), "bias_once", "part" (below)
    dim: int = 0
    sizes: tuple[int, ...] = ()       # "segments": the fused segments along ``dim``
    kv: tuple[int, int, int] = (0, 0, 0)  # "rows": heads, KV heads, head dim

    def shape(self, full: tuple[int, ...], size: int) -> tuple[int, ...]:
        out = list(full)
        if self.kind == "segments":
            out[self.dim] = full[self.dim] // size
        elif self.kind == "rows":
            heads, kv, d = self.kv
            out[0] = (kv // size if size <= kv else 1) * d
        elif self.kind == "part":  # one plain tensor of a quantized part: its shape, as given
            return tuple(self.sizes)
        return tuple(out)

    def view(self, t: torch.Tensor, rank: int, size: int) -> torch.Tensor | None:
        """This rank's part of a plain tensor as a view of ``t``'s storage where one strided view
        is that part (one segment along ``dim``; the whole bias on rank 0), else None. CPU ranks of
        one host compute on the pages of rank 0's tensor itself: nothing is copied for them."""
        if quantized.layout_name(t) is not None or packed.packing(t) is not None:
            return None
        if self.kind == "bias_once" and rank == 0:
            return t.detach()
        if self.kind == "segments" and len(self.sizes) == 1:
            part = self.sizes[0] // size
            return t.detach().narrow(self.dim, rank * part, part)
        return None

    def apply(self, t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """This rank's part of ``t``: always a fresh tensor, never a view (a view would keep,
        and send, the full weight). ComfyUI's quantized layouts are cut with their scales."""
        if quantized.layout_name(t) is not None:
            reason = quantized.why_not_cut(t, self, size)
            if reason is not None:
                raise TensorParallelError(quantized_message(self.what, reason))
            return quantized.cut_quantized(t, self, rank, size)
        if self.kind == "bias_once":  # added once, after the all-reduce sums every rank's partial product
            return t.detach().clone() if rank == 0 else torch.zeros_like(t)
        if self.kind == "rows":
            heads, kv, d = self.kv
            return t[kv_rows(heads, kv, d, rank, size, self.what)].clone()
        pieces, offset = [], 0
        for s in self.sizes:
            part = s // size
            pieces.append(t.narrow(self.dim, offset + rank * part, part))
            offset += s
        return torch.cat(pieces, dim=self.dim) if len(pieces) > 1 else \
            pieces[0].clone(memory_format=torch.contiguous_format)


def _segment_cut(what: str, dim: int, sizes: list[int], size: int) -> Cut:
    for s in sizes:
        if s % size:
            raise TensorParallelError(f"{what}: a segment of {s} features does not divide by tp_size {size}")
    return Cut(what, "segments", dim, tuple(sizes))


def cut_plan(root: torch.nn.Module, plan: TensorParallelPlan, size: int) -> dict[int, Cut]:
    """id(tensor) -> how it is cut, for every tensor of the planned layers of ``root``;
    every other tensor is replicated."""
    cuts: dict[int, Cut] = {}
    for name, mod, spec in layer_specs(root, plan):
        parent = _parent(root, name)
        weight = getattr(mod, "weight", None)
        bias = getattr(mod, "bias", None)
        if weight is None:
            raise TensorParallelError(f"tensor-parallel plan: {name} has no weight")
        if isinstance(spec, ColwiseKV):
            heads, kv, d = (int(getattr(parent, a)) for a in (spec.heads, spec.kv_heads, spec.head_dim))
            kv_rows(heads, kv, d, 0, size, name)  # refuses sizes that do not fit
            cut = Cut(name, "rows", kv=(heads, kv, d))
            weight_cut, bias_cut = cut, cut
        elif isinstance(spec, (Colwise, Norm)):
            dim = spec.dim if isinstance(spec, Colwise) else 0
            sizes = _segment_sizes(spec, parent, mod, weight.shape[dim]) if isinstance(spec, Colwise) else \
                [weight.shape[0]]
            weight_cut = _segment_cut(name, dim, sizes, size)
            bias_cut = _segment_cut(name, 0, sizes, size)
        else:  # Rowwise
            weight_cut = _segment_cut(name, 1, _segment_sizes(spec, parent, mod, weight.shape[1]), size)
            bias_cut = Cut(name, "bias_once")
        cuts[id(weight)] = weight_cut
        if bias is not None:
            cuts[id(bias)] = bias_cut
    return cuts


def _identity(t):
    return t


def build_shard(root: torch.nn.Module, plan: TensorParallelPlan, rank: int, size: int,
                weight_of: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                dequantize: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                views: bool = False) -> torch.nn.Module:
    """A copy of ``root`` holding TP rank ``rank``'s slices of the planned layers.

    ``weight_of(name, tensor)`` gives each tensor as the forward would use it (ComfyUI's LoRA
    patches applied; see ``sources``); by default the tensor itself. A replicated tensor
    that it returns unchanged is shared with ``root``, not copied. Packed (GGUF) tensors are
    cut as stored where they can be, else ``dequantize(name, tensor)`` is cut (``packed``).
    ``views``: a slice that is one strided view of the weight is that view (``Cut.view``), not a copy.
    """
    cuts = cut_plan(root, plan, size)
    memo: dict[int, object] = {}
    for name, t in named_tensors(root):
        w = t if weight_of is None else weight_of(name, t)
        cut = cuts.get(id(t))
        part = cut.view(w, rank, size) if cut is not None and views else None
        if part is not None:
            memo[id(t)] = _param(part, t)
        elif cut is not None:
            undo = (lambda w, name=name: dequantize(name, w)) if dequantize is not None else _no_dequantize(name)
            memo[id(t)] = _param(packed.cut_or_dequantize(cut, w, rank, size, undo), t)
        else:
            memo[id(t)] = t if w is t else _param(w, t)
    with without_forward_overrides(root):
        shard = copy.deepcopy(root, memo)
    return finish_shard(shard, plan, rank, size)


def _no_dequantize(name: str):
    def refuse(w):
        raise TensorParallelError(f"tensor parallel: {name} is packed and cannot be cut as stored, and nothing was "
                                  "given to dequantize it")
    return refuse


def named_tensors(root: torch.nn.Module):
    """Every parameter and buffer of ``root`` once, with its name."""
    seen = set()
    for name, t in (*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)):
        if id(t) not in seen:
            seen.add(id(t))
            yield name, t


def finish_shard(shard: torch.nn.Module, plan: TensorParallelPlan, rank: int, size: int) -> torch.nn.Module:
    """What a shard needs besides its sliced tensors: divided head counts and widths, and the
    norm shapes of the layers TP splits."""
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


def shard_nbytes(root: torch.nn.Module, plan: TensorParallelPlan | None, size: int) -> int:
    """Bytes of weights one TP rank holds (every rank the same), from shapes alone."""
    cuts = cut_plan(root, plan, size) if plan is not None and size > 1 else {}
    return sum(packed.stored_nbytes(cuts.get(id(t)), t, size) for _, t in named_tensors(root))


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


def encoder_group_size(valid: list[int], world_size: int) -> int:
    """The ranks a text encoder runs tensor parallel over in a world of ``world_size``: the largest
    size it splits over (``valid``) that divides the world, so that the world tiles into groups of
    it (1: the encoder runs whole on rank 0). The one rule Shard Text Encoder and the runtime read."""
    return max(v for v in valid if world_size % v == 0)


def encoder_layout_sizes(group: int, world_size: int) -> dict[str, int]:
    """The mesh an encoder runs in: ``group`` ranks tensor parallel (innermost, neighbouring
    devices), ``world_size // group`` such groups across, each computing the same conditioning (no
    sequence split: the ring dimension only replicates)."""
    return {"cfg": 1, "ring": world_size // group, "ulysses": 1, "tp": group}


def _check_splits(root: torch.nn.Module, plan: "TensorParallelPlan", size: int) -> None:
    """Raise TensorParallelError if some planned layer or attribute does not split over ``size``."""
    for name, mod, spec in layer_specs(root, plan):
        parent = _parent(root, name)
        if isinstance(spec, ColwiseKV):
            kv_rows(*(int(getattr(parent, a)) for a in (spec.heads, spec.kv_heads, spec.head_dim)), 0, size, name)
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
