"""The context-parallel engine: one family's plan applied to one forward on one rank.

Around a forward of the model ComfyUI owns, hooks on the modules the plan names cut the inputs
into this rank's share of each token stream, make the attention sites context-parallel (through
ComfyUI's ``optimized_attention_override``) and gather the outputs back; a guard on every hooked
module refuses an argument the plan does not know. An attention site's streams are either one joint
sequence attending to itself or, as a pair of stream tuples, queries from some split streams over
keys and values from others (``site_layouts``). A model whose attention call does not pass
``transformer_options`` (so the override cannot reach it) names the module global it calls in its
plan's ``attention_globals``: for the forward that global is a stand-in that routes the calls made
inside the plan's attention sites the same way (``routed_attention``), and a site of such a plan
whose attention reached neither is refused. The hooks and stand-ins live for the duration of one
forward and are removed afterwards, so the module ComfyUI owns is left untouched. The plans
themselves are declarations (``plans/``).
"""
from __future__ import annotations

import contextlib
import functools

import torch

from . import arguments, scoped_hooks
from .attention import JointLayout, SequenceParallel, context_parallel_attention
from .sequence import SeqShard, gather_chunks, take_chunk, weighted_sizes
from ..plans.vocabulary.context_parallel import Gather, Split
from ..plans.vocabulary.matching import (PlanMismatch, attention_global_holder, comfyui_release, forward_signature,
                                         matching_modules, on_item, replace_arguments)
from ..plans.vocabulary.transformer import TransformerPlan


OVERRIDE_KEY = "optimized_attention_override"


ALWAYS_PASSED = frozenset({"transformer_options"})


class ForwardContext:
    """State of one context-parallel forward on one rank."""

    def __init__(self, sp: SequenceParallel, sp_group, distributed_attention: bool = True,
                 weights: tuple[float, ...] | None = None):
        self.sp = sp
        self.weights = weights  # per sequence-parallel rank: token shares of a weighted split
        self.sp_group = sp_group
        self.parts = sp.ulysses_size * sp.ring_size
        self.index = sp.sp_rank
        self.distributed_attention = distributed_attention
        self.streams: dict[str, SeqShard] = {}
        self.cp_sites: list[tuple[str, ...]] = []  # stack of the attention sites being executed
        self.site_calls: list[int] = []  # attention calls made inside each of them (``_leave_site`` checks)
        self._memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._converted: dict[int, tuple[object, object]] = {}  # Split.convert's results, once per object
        self._layouts: dict[tuple[str, ...], JointLayout] = {}
        self._pending: list[tuple[object, Split]] = []  # (container, spec) waiting for their stream

    # ------------------------------------------------------------ streams
    def start_stream(self, name: str, total: int) -> SeqShard:
        known = self.streams.get(name)
        if known is not None and known.total != total:
            raise RuntimeError(f"context parallel: stream '{name}' entered again with {total} tokens (first "
                               f"{known.total}); the model plan does not cover this input")
        sizes = weighted_sizes(total, self.weights) if self.weights else None
        shard = SeqShard(total, self.parts, self.index, sizes)
        self.streams[name] = shard
        waiting = [(c, spec) for c, spec in self._pending if spec.stream == name]
        self._pending = [(c, spec) for c, spec in self._pending if spec.stream != name]
        for container, spec in waiting:
            _cut_nested(container, lambda t, spec=spec: self.split(t, spec, f"argument '{spec.arg}'"))
        return shard

    def defer(self, container, spec: "Split") -> None:
        self._pending.append((container, spec))

    def _stream(self, name: str, what: str) -> SeqShard:
        shard = self.streams.get(name)
        if shard is None:
            raise RuntimeError(f"context parallel plan error: {what} needs stream '{name}', which has not been "
                               "split yet")
        return shard

    def split(self, t: torch.Tensor, spec: Split, site: str) -> torch.Tensor:
        memo = self._memo.get(id(t))
        if memo is not None and memo[0] is t:
            return memo[1]
        what = f"input '{spec.arg}' of {site}"
        if spec.segments:
            shards = [self._stream(s, what) for s in spec.segments]
            if t.shape[spec.dim] != sum(s.total for s in shards):
                raise RuntimeError(f"context parallel: {what} has {t.shape[spec.dim]} entries along dim {spec.dim}, "
                                   f"not the {sum(s.total for s in shards)} tokens of streams {spec.segments}")
            pieces, offset = [], 0
            for shard in shards:
                pieces.append(take_chunk(t.narrow(spec.dim, offset, shard.total), spec.dim, shard))
                offset += shard.total
            out = torch.cat(pieces, dim=spec.dim)
        else:
            if spec.starts_stream:
                shard = self.start_stream(spec.stream, t.shape[spec.dim])
            else:
                shard = self._stream(spec.stream, what)
            size = t.shape[spec.dim]
            if spec.prefix and size < shard.total:
                start, stop = min(shard.start, size), min(shard.stop, size)
                return t.narrow(spec.dim, start, stop - start)
            if not spec.starts_stream and size != shard.total:
                if spec.when_full_length:
                    return t
                if size == 1:
                    return t  # broadcast over tokens
                if spec.expand is None:
                    raise RuntimeError(f"context parallel: {what} has {size} entries along dim {spec.dim} but "
                                       f"stream '{spec.stream}' has {shard.total} tokens")
                t_full = spec.expand(t, shard.total)
            else:
                t_full = t
            out = take_chunk(t_full, spec.dim, shard)
            if spec.starts_stream:
                return out
        self._memo[id(t)] = (t, out)  # side inputs recur at every block: cut them once
        return out

    def cut_spans(self, spans, spec: Split, site: str):
        """This rank's part of a table of ``(start, stop, *rest)`` spans over a stream (``Split.spans``),
        at local positions; per-token tensors in ``rest`` cut alike. Once per table: it recurs at every block."""
        memo = self._memo.get(id(spans))
        if memo is not None and memo[0] is spans:
            return memo[1]
        what = f"input '{spec.arg}' of {site}"
        shard = self._stream(spec.stream, what)
        out = []
        for span in spans:
            start, stop, *rest = span
            if not 0 <= start <= stop <= shard.total:
                raise RuntimeError(f"context parallel: {what} has a span {start}:{stop} outside the "
                                   f"{shard.total} tokens of stream '{spec.stream}'")
            lo, hi = max(start, shard.start), min(stop, shard.stop)
            if lo >= hi:
                continue
            local = []
            for item in rest:
                if isinstance(item, torch.Tensor) and item.ndim:
                    if item.shape[0] != stop - start:
                        raise RuntimeError(f"context parallel: {what} has a span {start}:{stop} whose tensor has "
                                           f"{item.shape[0]} entries, not one per token")
                    item = item.narrow(0, lo - start, hi - lo)
                local.append(item)
            out.append((lo - shard.start, hi - shard.start, *local))
        out = type(spans)(out)
        self._memo[id(spans)] = (spans, out)
        return out

    def convert(self, value, convert):
        """``convert(value)`` (``Split.convert``), once per object: side inputs recur at every block."""
        memo = self._converted.get(id(value))
        if memo is None or memo[0] is not value:
            memo = self._converted[id(value)] = (value, convert(value))
        return memo[1]

    def gather(self, t: torch.Tensor, spec: Gather) -> torch.Tensor:
        group = self.sp_group
        if spec.segments:
            shards = [self._stream(s, "gather") for s in spec.segments]
            locals_ = torch.split(t, [s.local for s in shards], dim=spec.dim)
            return torch.cat([part if name in spec.keep_local else gather_chunks(part, spec.dim, s, group)
                              for part, s, name in zip(locals_, shards, spec.segments)], dim=spec.dim)
        shard = self.streams.get(spec.stream)
        if shard is None:
            return t
        return gather_chunks(t, spec.dim, shard, group)

    # ------------------------------------------------------------ attention
    def layout(self, streams: tuple[str, ...]) -> JointLayout:
        layout = self._layouts.get(streams)
        if layout is None:
            shards = [self._stream(s, "attention") for s in streams]
            chunk = sum(s.chunk for s in shards)
            valid = []
            for r in range(self.parts):
                if all(s.for_rank(r).valid == s.chunk for s in shards):
                    valid.append(None)
                    continue
                idx, offset = [], 0
                for s in shards:
                    idx.append(torch.arange(s.for_rank(r).valid) + offset)
                    offset += s.chunk
                valid.append(torch.cat(idx))
            weighted = any(s.sizes is not None for s in shards)
            local = tuple((s.local, s.chunk) for s in shards) if weighted else None
            layout = JointLayout(chunk, tuple(valid), local)
            self._layouts[streams] = layout
        return layout

    def site_layouts(self, site) -> tuple[JointLayout, JointLayout]:
        """(query layout, key/value layout) of an attention site: joint streams (``("txt", "img")``)
        attend to themselves; a pair of stream tuples (``(("v",), ("a",))``) is cross-stream
        attention, queries from the first streams, keys and values from the second."""
        if site and isinstance(site[0], tuple):
            queries, keys = site
            return self.layout(queries), self.layout(keys)
        layout = self.layout(site)
        return layout, layout

    def attend(self, previous, func, args, kwargs):
        attend = func if previous is None else functools.partial(previous, func)
        if self.site_calls:
            self.site_calls[-1] += 1
        if self.cp_sites and self.parts > 1 and self.distributed_attention:
            q_layout, kv_layout = self.site_layouts(self.cp_sites[-1])
            return context_parallel_attention(attend, args, kwargs, sp=self.sp, layout=q_layout, kv_layout=kv_layout)
        return attend(*args, **kwargs)


# (context, the override it stands in front of) of the forwards running on this rank, innermost last.
_RUNNING: list[tuple[ForwardContext, object]] = []


@torch._dynamo.disable
def attention_override(func, *args, **kwargs):
    """ComfyUI's attention override while a context-parallel forward runs: one object for every
    forward (a compiled block's guard on it holds from step to step), run outside compiled graphs
    (it communicates), and finding the forward's state in ``_RUNNING``."""
    ctx, previous = _RUNNING[-1]
    return ctx.attend(previous, func, args, kwargs)


# id(original attention function) -> (that function, its stand-in): one stand-in per function, so a
# compiled block's guard on the module global holds from step to step.
_ROUTED: dict[int, tuple[object, object]] = {}


def routed_attention(original):
    """The stand-in for an attention function a model calls without ``transformer_options``
    (``ContextParallelPlan.attention_globals``): inside a context-parallel forward, a call from one
    of the plan's attention sites is distributed as the override distributes the other families'
    calls. The forward's own override (SageAttention's, say) is not chained: the model never sees
    it unsharded either. A call whose transformer_options hold an attention override goes to the
    original, which calls it (ours, inside a sharded forward); one with none or an empty dict (the
    Flux ControlNet's blocks take the default ``{}``) is routed here."""
    known = _ROUTED.get(id(original))
    if known is not None and known[0] is original:
        return known[1]

    @torch._dynamo.disable
    def attention(*args, **kwargs):
        if not _RUNNING or OVERRIDE_KEY in (kwargs.get("transformer_options") or {}):
            return original(*args, **kwargs)
        return _RUNNING[-1][0].attend(None, original, args, kwargs)

    attention.__wrapped__ = original
    attention.__name__ = getattr(original, "__name__", "attention")
    _ROUTED[id(original)] = (original, attention)
    return attention


def _cut_nested(container, cut) -> None:
    """Replace, in place, every tensor inside a dict/list container by ``cut(tensor)``."""
    items = container.items() if isinstance(container, dict) else enumerate(container)
    for key, value in list(items):
        if isinstance(value, torch.Tensor):
            container[key] = cut(value)
        elif isinstance(value, (dict, list)):
            _cut_nested(value, cut)
        elif isinstance(value, tuple):
            as_list = list(value)
            _cut_nested(as_list, cut)
            container[key] = tuple(as_list)


def _copy_nested(value):
    """Copy the dict/list structure (not the tensors), so cutting never touches the caller's objects."""
    if isinstance(value, dict):
        return {k: _copy_nested(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy_nested(v) for v in value] if isinstance(value, list) else tuple(_copy_nested(v) for v in value)
    return value


def check_supported_arguments(plan: "TransformerPlan", bound) -> None:
    """Refuse inputs the plan cannot shard, naming them, before any rank starts work."""
    cp = plan.context_parallel
    for name, why in cp.unsupported.items():
        place, key = arguments.find(bound, name)
        when = cp.unsupported_when.get(name)
        if place is not None and place[key] is not None and (when is None or when(place[key])):
            raise RuntimeError(f"{plan.title}: '{name}' is not supported with context parallelism yet ({why})")


def _has_value(value) -> bool:
    if value is None or value is False:
        return False
    return not (isinstance(value, (list, tuple, dict)) and not value)


def _guard_hook(plan: "TransformerPlan", known: frozenset[str], site: str):
    """Refuse a call that brings an argument the plan does not know (see ``passed``)."""
    def hook(module, args, kwargs):
        positional = forward_signature(module)[0]
        given = {**dict(zip(positional, args)), **kwargs}
        unknown = sorted(name for name, value in given.items() if name not in known and _has_value(value))
        if unknown:
            raise PlanMismatch(
                f"{plan.title}: {site} ({type(module).__name__}) was called with {', '.join(map(repr, unknown))}, "
                f"which the pack's {plan.family} plan does not know how to split across ranks: {comfyui_release()} "
                "changed this model since the plan was written. Refused rather than computing a wrong result; run "
                "this model without Shard Transformer on this ComfyUI, or use a pack release that knows it")
        return None
    return hook


def _split_hook(ctx: ForwardContext, splits: tuple[Split, ...], site: str):
    def cut(value, spec):
        if spec.spans:
            return ctx.cut_spans(value, spec, site) if isinstance(value, (list, tuple)) else None
        if spec.convert is not None and value is not None and not isinstance(value, (torch.Tensor, tuple)):
            value = ctx.convert(value, spec.convert)
        return on_item(value, spec.item, lambda t: ctx.split(t, spec, site))

    def hook(module, args, kwargs):
        return replace_arguments(module, args, kwargs, splits, cut)
    return hook


def _gather_hook(ctx: ForwardContext, spec: Gather):
    def hook(module, args, output):
        return on_item(output, spec.item, lambda t: ctx.gather(t, spec))
    return hook


def _enter_site(ctx: ForwardContext, streams: tuple[str, ...]):
    def hook(module, args):
        ctx.cp_sites.append(streams)
        ctx.site_calls.append(0)
    return hook


def _leave_site(ctx: ForwardContext, plan: TransformerPlan, site: str):
    """With ``attention_globals``, a site whose attention never reached the distributed attention
    (ComfyUI now calls it some other way) is refused: it attended its local tokens only."""
    def hook(module, args, output):
        ctx.cp_sites.pop()
        calls = ctx.site_calls.pop()
        if calls == 0 and plan.context_parallel.attention_globals:
            names = ", ".join(f"{g.module}.{g.name}" for g in plan.context_parallel.attention_globals)
            raise PlanMismatch(
                f"{plan.title}: the attention of {site} ({type(module).__name__}) did not go through {names} nor "
                f"ComfyUI's attention override, where the pack's {plan.family} plan distributes it: {comfyui_release()} "
                "calls it differently, and each rank would attend only its own tokens. Refused rather than computing a "
                "wrong result; run this model without Shard Transformer on this ComfyUI, or use a pack release that "
                "knows it")
    return hook


@contextlib.contextmanager
def context_parallel(root: torch.nn.Module, plan: TransformerPlan, bound, *,
                     sp: SequenceParallel, sp_group, distributed_attention: bool = True,
                     weights: tuple[float, ...] | None = None):
    """Apply ``plan`` to one forward of ``root``: split, context-parallel attention, gather.

    ``distributed_attention=False`` is a diagnostic: attention then sees only the local
    tokens, which is what a silently broken implementation computes; tests use it to
    prove that the real path communicates. ``weights``: token shares per sequence-parallel
    rank (a weighted split, ``sequence``), None for the even split."""
    ctx = ForwardContext(sp, sp_group, distributed_attention, weights)
    if ctx.parts == 1:
        yield ctx
        return
    transformer_options = arguments.get_options(bound)
    _defer_call_inputs(ctx, plan, bound)
    handles = []
    stand_ins = scoped_hooks.Overrides()
    try:
        handles = _install_hooks(ctx, plan, root)
        for spec in plan.context_parallel.attention_globals:
            module = attention_global_holder(plan, spec)
            current = module.__dict__[spec.name]
            if not any(current is routed for _, routed in _ROUTED.values()):
                stand_ins.set(module, spec.name, routed_attention(current))
        had_override = OVERRIDE_KEY in transformer_options
        previous = transformer_options.get(OVERRIDE_KEY)
        transformer_options[OVERRIDE_KEY] = attention_override
        _RUNNING.append((ctx, previous))
        try:
            yield ctx
        finally:
            _RUNNING.pop()
            if had_override:
                transformer_options[OVERRIDE_KEY] = previous
            else:
                transformer_options.pop(OVERRIDE_KEY, None)
    finally:
        stand_ins.restore()
        for h in handles:
            h.remove()


def _defer_call_inputs(ctx: ForwardContext, plan: TransformerPlan, bound) -> None:
    """The forward's own arguments cut once their stream exists (ControlNet residuals): a copy
    of each nested dict or list replaces it, so the caller's stays whole."""
    for spec in plan.context_parallel.call_inputs:
        place, key = arguments.find(bound, spec.arg)
        value = place[key] if place is not None else None
        if isinstance(value, (dict, list, tuple)):
            place[key] = copied = _copy_nested(value)
            ctx.defer(copied, spec)
        elif value is not None:
            raise RuntimeError(f"{plan.title} plan: call input '{spec.arg}' is a {type(value).__name__}, "
                               "not a dict or list of tensors")


def _install_hooks(ctx: ForwardContext, plan: TransformerPlan, root: torch.nn.Module) -> list:
    """The plan's hooks on ``root``: guards first (they see the arguments as the model passes
    them, one per hooked module), then the splits, the attention sites and the gathers."""
    cp = plan.context_parallel
    handles = []
    cut_by: dict[int, set[str]] = {}
    for pattern, splits in cp.inputs.items():
        for _, mod in matching_modules(root, pattern):
            cut_by.setdefault(id(mod), set()).update(s.arg for s in splits)
    guarded = set()
    try:
        for pattern in (*cp.inputs, *cp.outputs, *cp.attention):
            for name, mod in matching_modules(root, pattern):
                if id(mod) not in guarded:
                    guarded.add(id(mod))
                    known = frozenset(cut_by.get(id(mod), ())) | cp.passed | ALWAYS_PASSED
                    handles.append(scoped_hooks.pre_hook(mod, _guard_hook(plan, known, name), with_kwargs=True))
        for pattern, splits in cp.inputs.items():
            for name, mod in matching_modules(root, pattern):
                handles.append(scoped_hooks.pre_hook(mod, _split_hook(ctx, splits, name), with_kwargs=True))
        for pattern, streams in cp.attention.items():
            for name, mod in matching_modules(root, pattern):
                handles.append(scoped_hooks.pre_hook(mod, _enter_site(ctx, streams)))
                handles.append(scoped_hooks.post_hook(mod, _leave_site(ctx, plan, name)))
        for pattern, spec in cp.outputs.items():
            for _, mod in matching_modules(root, pattern):
                handles.append(scoped_hooks.post_hook(mod, _gather_hook(ctx, spec)))
    except BaseException:
        for h in handles:
            h.remove()
        raise
    return handles
