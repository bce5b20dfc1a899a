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

from . import comm, scoped_hooks

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
    cut exactly for ``size`` ranks (the others are cut with their scales: ``comfy_quantized``)."""
    from . import comfy_quantized

    try:
        cuts = cut_plan(root, plan, size)
    except TensorParallelError:
        return []  # sizes that do not divide: the node's size check says so
    found = []
    for name, mod, _ in layer_specs(root, plan):
        for t in (getattr(mod, "weight", None), getattr(mod, "bias", None)):
            if t is not None and id(t) in cuts and comfy_quantized.layout_name(t) is not None:
                reason = comfy_quantized.why_not_cut(t, cuts[id(t)], size)
                if reason is not None:
                    found.append((name, reason))
                    break
    return found


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

    def apply(self, t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """This rank's part of ``t``: always a fresh tensor, never a view (a view would keep,
        and send, the full weight). ComfyUI's quantized layouts are cut with their scales."""
        from . import comfy_quantized

        if comfy_quantized.layout_name(t) is not None:
            reason = comfy_quantized.why_not_cut(t, self, size)
            if reason is not None:
                raise TensorParallelError(quantized_message(self.what, reason))
            return comfy_quantized.cut_quantized(t, self, rank, size)
        if self.kind == "bias_once":  # added once, after the all-reduce sums every rank's partial product
            return t.detach().clone() if rank == 0 else torch.zeros_like(t)
        if self.kind == "rows":
            heads, kv, d = self.kv
            return t[_kv_slice(heads, kv, d, rank, size, self.what)].clone()
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
            _kv_slice(heads, kv, d, 0, size, name)  # refuses sizes that do not fit
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
                dequantize: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> torch.nn.Module:
    """A copy of ``root`` holding TP rank ``rank``'s slices of the planned layers.

    ``weight_of(name, tensor)`` gives each tensor as the forward would use it (ComfyUI's LoRA
    patches applied; see ``comfy_weights``); by default the tensor itself. A replicated tensor
    that it returns unchanged is shared with ``root``, not copied. Packed (GGUF) tensors are
    cut as stored where they can be, else ``dequantize(name, tensor)`` is cut (``packed_weights``).
    """
    from . import packed_weights

    cuts = cut_plan(root, plan, size)
    memo: dict[int, object] = {}
    for name, t in named_tensors(root):
        w = t if weight_of is None else weight_of(name, t)
        cut = cuts.get(id(t))
        if cut is not None:
            undo = (lambda w, name=name: dequantize(name, w)) if dequantize is not None else _no_dequantize(name)
            memo[id(t)] = _param(packed_weights.cut_or_dequantize(cut, w, rank, size, undo), t)
        else:
            memo[id(t)] = t if w is t else _param(w, t)
    from .transport import without_forward_overrides

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
    from .plans.base import matching_modules

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
    from .packed_weights import stored_nbytes

    cuts = cut_plan(root, plan, size) if plan is not None and size > 1 else {}
    return sum(stored_nbytes(cuts.get(id(t)), t, size) for _, t in named_tensors(root))


def _kv_slice(heads: int, kv: int, d: int, rank: int, size: int, what: str) -> slice:
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
            _kv_slice(*(int(getattr(parent, a)) for a in (spec.heads, spec.kv_heads, spec.head_dim)), 0, size, name)
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
        comm.all_reduce(output, group=group)
        return output
    return hook


def _gather_hook(group, size: int):
    def hook(module, args, output):
        local = output.movedim(-1, 0).contiguous()
        full = local.new_empty((local.shape[0] * size, *local.shape[1:]))
        comm.all_gather_into(full, local, group=group)
        return full.movedim(0, -1)
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
    from .plans.base import on_item, replace_arguments

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
            from .plans.base import matching_modules

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
