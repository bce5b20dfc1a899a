"""Declarative per-family parallel plans and the machinery that applies them.

A plan names module paths (glob patterns per dotted segment over
``named_modules()``) and what happens there, in the style of diffusers' ``_cp_plan``:

- ``inputs``: inputs cut along a token dimension when the module is called. A
  model may have several token *streams* (text and image); for each stream one
  input ``starts_stream`` and fixes its length. Side inputs (RoPE tables,
  per-token modulation, masks) are cut the same way wherever they are passed; a
  side input that covers several streams back to back (RoPE for ``[txt, img]``)
  names them as ``segments``.
- ``outputs``: module outputs gathered back to full streams.
- ``attention``: modules whose attention calls are context-parallel, with the
  order in which the model concatenates the streams there. Attention anywhere
  else (cross-attention to the text) stays local: each rank attends its query
  shard to the full keys.

The machinery installs forward hooks for the duration of one forward and removes
them afterwards, so the module ComfyUI owns is left untouched.
"""
from __future__ import annotations

import contextlib
import fnmatch
import functools
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import arguments, scoped_hooks
from ..tensor_parallel import TensorParallelPlan
from ..attention import JointLayout, SequenceParallel, context_parallel_attention
from ..sequence import SeqShard, gather_chunks, take_chunk, weighted_sizes

OVERRIDE_KEY = "optimized_attention_override"
MAIN_STREAM = "x"
ALWAYS_PASSED = frozenset({"transformer_options"})


class PlanMismatch(RuntimeError):
    """The model is not built the way its plan was written for (another ComfyUI release)."""


def comfyui_release() -> str:
    """The running ComfyUI's version, for messages."""
    try:
        import comfyui_version

        return f"ComfyUI {comfyui_version.__version__}"
    except Exception:  # an unusual install
        return "this ComfyUI"


@dataclass(frozen=True)
class Split:
    """Cut the input ``arg`` of a module along ``dim``.

    ``starts_stream``: this input is the token stream ``stream`` itself and fixes its
    length. Otherwise it is a side input of ``stream``: cut when its size along
    ``dim`` equals the stream's token count, passed unchanged when it is 1
    (broadcast), and first expanded with ``expand(t, total)`` when the model itself
    would expand it per token. ``segments``: the input covers these streams back to
    back along ``dim`` (each part is cut by its own stream). ``when_full_length``: pass
    the input through when it is not full length (it was cut already, e.g. a stream
    a block returns). ``prefix``: the input covers the first N <= total tokens of the
    stream (ControlNet residuals cover the main image, not reference tokens after
    it); each rank gets the part inside its chunk, unpadded when N < total. ``item``: the
    input is a tuple and its element ``item`` is cut (LTXV's RoPE became ``(matrix, split)`` in
    ComfyUI 0.33). A spec with ``item`` applies only to a tuple, one without only to a tensor,
    so a plan can name both forms where ComfyUI releases differ.
    """

    arg: str
    dim: int = 1
    stream: str = MAIN_STREAM
    starts_stream: bool = False
    segments: tuple[str, ...] | None = None
    expand: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    when_full_length: bool = False
    prefix: bool = False
    item: int | None = None


@dataclass(frozen=True)
class Gather:
    """Gather a module's output back to the full stream along ``dim``
    (``segments``: the output holds these streams back to back; ``item``: element ``item`` of a
    tuple output). ``keep_local``: segments
    left as this rank's chunk, for a model that drops them itself by their local length
    (Chroma Radiance slices the text off the joint stream with the text chunk's length)."""

    dim: int = 1
    stream: str = MAIN_STREAM
    segments: tuple[str, ...] | None = None
    keep_local: tuple[str, ...] = ()
    item: int | None = None  # the output is a tuple (a block returning (img, txt)): gather this element


# The ComfyUI releases the whole test suite runs on (tools/host.py installs each).
TESTED_RELEASES = ("0.3.75", "0.33.0")


@dataclass(frozen=True)
class ContextParallelPlan:
    inputs: dict[str, tuple[Split, ...]]
    outputs: dict[str, Gather]
    attention: dict[str, tuple[str, ...]]  # module pattern -> streams in the order the model joins them
    # Arguments of the model's forward cut once their stream exists (tensors nested in
    # dicts and lists too, e.g. ControlNet residuals); the model reads them later.
    call_inputs: tuple[Split, ...] = ()
    # Arguments this plan cannot shard yet: forward argument -> why. Refused before any work.
    unsupported: dict[str, str] = field(default_factory=dict)
    # Arguments the hooked modules (blocks, attention sites, gathered layers) receive that do not
    # depend on the token split and pass on unchanged. Any other argument that arrives with a value
    # means ComfyUI changed the model since the plan was written: refused, named (never computed).
    passed: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ModelPlan:
    family: str               # short id, e.g. "wan"
    title: str                # what users call it, e.g. "Wan 2.1 / 2.2"
    classes: tuple[str, ...]  # qualified class names this plan covers
    heads_attr: str           # attribute path (dotted) of the root module holding the head count
    context_parallel: ContextParallelPlan
    notes: str = ""
    tensor_parallel: "TensorParallelPlan | None" = None
    # "transformer": the mesh applies (cfg x ring x ulysses x tp). "encoder" (text encoders):
    # tensor parallel over every rank of the world, once per prompt, no sequence split.
    # "vae": spatial bands over every rank of the world (parallel_runtime/vae_parallel.py).
    kind: str = "transformer"
    vae: object = None  # the VAE's band plan (plans/vae.py), for kind "vae"
    # Where ComfyUI releases build the family differently (HunyuanVideo's joint order): the
    # plan for this very module, chosen from its own structure, so every rank chooses alike.
    variant: "Callable[[torch.nn.Module], ModelPlan] | None" = None
    # ComfyUI releases whose stock classes this plan's exactness tests passed on (README matrix).
    tested_on: tuple[str, ...] = TESTED_RELEASES
    # Modules whose forward torch.compile compiles one by one (compile_regions.py); empty: the
    # repeated blocks the plan's patterns name.
    compile_regions: tuple[str, ...] = ()

    def for_module(self, module: torch.nn.Module) -> "ModelPlan":
        return self if self.variant is None else self.variant(module)

    @property
    def supports(self) -> tuple[str, ...]:
        """Mesh dimensions the plan supports (for the support matrix and the node's checks)."""
        if self.kind == "encoder":
            return ("tp",)
        return ("ulysses", "ring", "cfg") + (("tp",) if self.tensor_parallel is not None else ())

    def heads(self, module: torch.nn.Module) -> int:
        value = module
        for part in self.heads_attr.split("."):
            value = getattr(value, part)
        return int(value)


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
        self._memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
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

    def attend(self, previous, func, args, kwargs):
        attend = func if previous is None else functools.partial(previous, func)
        if self.cp_sites and self.parts > 1 and self.distributed_attention:
            return context_parallel_attention(attend, args, kwargs, sp=self.sp, layout=self.layout(self.cp_sites[-1]))
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


def check_supported_arguments(plan: "ModelPlan", bound) -> None:
    """Refuse inputs the plan cannot shard, naming them, before any rank starts work."""
    for name, why in plan.context_parallel.unsupported.items():
        place, key = arguments.find(bound, name)
        if place is not None and place[key] is not None:
            raise RuntimeError(f"{plan.title}: '{name}' is not supported with context parallelism yet ({why})")


_SIGNATURES: "weakref.WeakKeyDictionary[type, tuple[list[str], bool, set[str]]]" = weakref.WeakKeyDictionary()


def _signature(module: torch.nn.Module) -> tuple[list[str], bool, set[str]]:
    """(positional parameters of ``forward`` after self, whether it takes **kwargs, every parameter name)."""
    cls = type(module)
    found = _SIGNATURES.get(cls)
    if found is None:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]  # drop self
        positional = [p.name for p in params
                      if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        named = {p.name for p in params if p.kind != inspect.Parameter.VAR_POSITIONAL}
        var_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
        found = _SIGNATURES[cls] = (positional, var_kw, named)
    return found


def _position_of(module: torch.nn.Module, arg: str) -> int | None:
    positional = _signature(module)[0]
    return positional.index(arg) if arg in positional else None


def _has_value(value) -> bool:
    if value is None or value is False:
        return False
    return not (isinstance(value, (list, tuple, dict)) and not value)


def _guard_hook(plan: "ModelPlan", known: frozenset[str], site: str):
    """Refuse a call that brings an argument the plan does not know (see ``passed``)."""
    def hook(module, args, kwargs):
        positional = _signature(module)[0]
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


def on_item(value, item: int | None, fn):
    """``fn(value)`` for a tensor (``item`` None) or the tuple with ``fn`` applied to element
    ``item``; None where the form does not match (so specs for both forms can stand side by side)."""
    if item is None:
        return fn(value) if isinstance(value, torch.Tensor) else None
    if isinstance(value, tuple) and len(value) > item and isinstance(value[item], torch.Tensor):
        items = list(value)
        items[item] = fn(items[item])
        return tuple(items)
    return None


def replace_arguments(module, args, kwargs, specs, cut):
    """A forward pre-hook's (args, kwargs) with each ``spec.arg`` replaced by ``cut(value, spec)``
    (by keyword or by its position in ``forward``), where that is not None."""
    args = list(args)
    for spec in specs:
        if spec.arg in kwargs:
            new = cut(kwargs[spec.arg], spec)
            if new is not None:
                kwargs[spec.arg] = new
            continue
        pos = _position_of(module, spec.arg)
        if pos is not None and pos < len(args):
            new = cut(args[pos], spec)
            if new is not None:
                args[pos] = new
    return tuple(args), kwargs


def _split_hook(ctx: ForwardContext, splits: tuple[Split, ...], site: str):
    def cut(value, spec):
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
    return hook


def _leave_site(ctx: ForwardContext):
    def hook(module, args, output):
        ctx.cp_sites.pop()
    return hook


def path_matches(name: str, pattern: str) -> bool:
    """Glob match per dotted segment: ``blocks.*`` is every block, not every module inside one."""
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats))


def _is_last_child(root: torch.nn.Module, parts: list[str], i: int) -> bool:
    parent = root.get_submodule(".".join(parts[:i])) if i else root
    children = [name for name, _ in parent.named_children()]
    return bool(children) and children[-1] == parts[i]


def _matches_with_last(root: torch.nn.Module, name: str, pattern: str) -> bool:
    """``-1`` names the last child of its parent, whatever the depth of this model:
    ``single_blocks.-1`` the last block, ``layers.*.adaLN_modulation.-1`` the last module of
    each block's modulation (a Sequential whose length differs between variants)."""
    pats = pattern.split(".")
    if "-1" not in pats:
        return path_matches(name, pattern)
    parts = name.split(".")
    if not path_matches(name, ".".join("*" if p == "-1" else p for p in pats)):
        return False
    return all(_is_last_child(root, parts, i) for i, p in enumerate(pats) if p == "-1")


_MATCHES: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, list]]" = weakref.WeakKeyDictionary()


def matching_modules(root: torch.nn.Module, pattern: str) -> list[tuple[str, torch.nn.Module]]:
    """Submodules whose qualified name matches ``pattern`` (cached per root: walking a
    40-block model on every forward would cost milliseconds)."""
    per_root = _MATCHES.setdefault(root, {})
    found = per_root.get(pattern)
    if found is None:
        found = [(name, mod) for name, mod in root.named_modules() if name and _matches_with_last(root, name, pattern)]
        per_root[pattern] = found
    return found


def check_plan_matches(root: torch.nn.Module, plan: ModelPlan) -> None:
    """The model is built the way the plan was written for: every pattern names a module (a
    plan that silently matched nothing would leave attention local-only), and every argument the
    plan cuts is still a parameter of the forward it hooks (or a cut would silently not happen)."""
    cp = plan.context_parallel
    for pattern in (*cp.inputs, *cp.outputs, *cp.attention):
        if not matching_modules(root, pattern):
            raise PlanMismatch(f"{plan.title} plan: no module matches '{pattern}' in {type(root).__name__} of "
                               f"{comfyui_release()}; this model variant is not covered by the plan")
    for pattern, splits in cp.inputs.items():
        for name, module in matching_modules(root, pattern):
            _, var_kw, named = _signature(module)
            missing = [s.arg for s in splits if s.arg not in named and not var_kw]
            if missing:
                raise PlanMismatch(
                    f"{plan.title} plan: {name} ({type(module).__name__}) of {comfyui_release()} takes no "
                    f"{', '.join(map(repr, sorted(set(missing))))}, which the plan cuts across ranks: this ComfyUI "
                    "builds the model differently from what the plan was written for. Refused rather than computing "
                    "a wrong result; run this model without Shard Transformer here, or use a pack release that "
                    "knows it")


@contextlib.contextmanager
def context_parallel(root: torch.nn.Module, plan: ModelPlan, bound, *,
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
    cp = plan.context_parallel
    transformer_options = arguments.get_options(bound)
    for spec in cp.call_inputs:
        place, key = arguments.find(bound, spec.arg)
        value = place[key] if place is not None else None
        if isinstance(value, (dict, list, tuple)):
            place[key] = copied = _copy_nested(value)
            ctx.defer(copied, spec)
        elif value is not None:
            raise RuntimeError(f"{plan.title} plan: call input '{spec.arg}' is a {type(value).__name__}, "
                               "not a dict or list of tensors")
    handles = []
    try:
        # Guards first (they see the arguments as the model passes them), one per hooked module.
        cut_by: dict[int, set[str]] = {}
        for pattern, splits in cp.inputs.items():
            for _, mod in matching_modules(root, pattern):
                cut_by.setdefault(id(mod), set()).update(s.arg for s in splits)
        guarded = set()
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
            for _, mod in matching_modules(root, pattern):
                handles.append(scoped_hooks.pre_hook(mod, _enter_site(ctx, streams)))
                handles.append(scoped_hooks.post_hook(mod, _leave_site(ctx)))
        for pattern, spec in cp.outputs.items():
            for _, mod in matching_modules(root, pattern):
                handles.append(scoped_hooks.post_hook(mod, _gather_hook(ctx, spec)))
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
        for h in handles:
            h.remove()
