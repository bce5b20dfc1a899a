"""Declarative per-family parallel plans and the machinery that applies them.

A plan names module paths (glob patterns over ``named_modules()``) and what
happens there, in the style of diffusers' ``_cp_plan``:

- ``inputs``: inputs cut along the token dimension when the module is called.
  One entry point per model ``starts_sequence`` and fixes the token count; side
  inputs (RoPE tables, per-token modulation) are cut the same way wherever they
  are passed.
- ``outputs``: module outputs gathered back to the full sequence.
- ``attention``: modules whose attention calls are context-parallel. Attention
  anywhere else (cross-attention to the text) stays local: each rank attends
  its query shard to the full keys.

The machinery installs forward hooks for the duration of one forward and
removes them afterwards, so the module ComfyUI owns is left untouched.
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

from ..attention import ulysses_attention
from ..sequence import SeqShard, gather_chunks, take_chunk

OVERRIDE_KEY = "optimized_attention_override"


@dataclass(frozen=True)
class Split:
    """Cut the input ``arg`` of a module along ``dim``.

    ``starts_sequence``: this input is the token sequence itself and fixes its length.
    Otherwise the input is a side input: cut when its size along ``dim`` equals the
    token count, passed unchanged when it is 1 (broadcast), and first expanded with
    ``expand(t, total)`` when the model itself would expand it per token.
    """

    arg: str
    dim: int = 1
    starts_sequence: bool = False
    expand: Callable[[torch.Tensor, int], torch.Tensor] | None = None


@dataclass(frozen=True)
class Gather:
    """Gather the module's output back to the full sequence along ``dim``."""

    dim: int = 1


@dataclass(frozen=True)
class ContextParallelPlan:
    inputs: dict[str, tuple[Split, ...]]
    outputs: dict[str, Gather]
    attention: tuple[str, ...]


@dataclass(frozen=True)
class ModelPlan:
    family: str               # short id, e.g. "wan"
    title: str                # what users call it, e.g. "Wan 2.1 / 2.2"
    classes: tuple[str, ...]  # qualified class names this plan covers
    heads_attr: str           # attribute of the root module holding the head count
    context_parallel: ContextParallelPlan
    notes: str = ""
    # Which mesh dimensions the plan supports (for the support matrix and node checks).
    supports: tuple[str, ...] = field(default=("ulysses",))

    def heads(self, module: torch.nn.Module) -> int:
        return int(getattr(module, self.heads_attr))


class ForwardContext:
    """State of one context-parallel forward on one rank."""

    def __init__(self, group, parts: int, index: int, distributed_attention: bool = True):
        self.group = group
        self.distributed_attention = distributed_attention
        self.parts = parts
        self.index = index
        self.shard: SeqShard | None = None
        self.cp_depth = 0
        self._memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def start_sequence(self, total: int) -> SeqShard:
        if self.shard is not None and self.shard.total != total:
            raise RuntimeError(f"context parallel: a second token sequence of length {total} entered the model "
                               f"(the first had {self.shard.total}); the model plan does not cover this input")
        self.shard = SeqShard(total, self.parts, self.index)
        return self.shard

    def split(self, t: torch.Tensor, spec: Split, site: str) -> torch.Tensor:
        memo = self._memo.get(id(t))
        if memo is not None and memo[0] is t:
            return memo[1]
        if spec.starts_sequence:
            shard = self.start_sequence(t.shape[spec.dim])
        else:
            shard = self.shard
            if shard is None:
                raise RuntimeError(f"context parallel plan error: side input '{spec.arg}' of {site} arrived "
                                   "before the token sequence was split")
        size = t.shape[spec.dim]
        if not spec.starts_sequence and size != shard.total:
            if size == 1:
                return t  # broadcast over tokens
            if spec.expand is None:
                raise RuntimeError(f"context parallel: input '{spec.arg}' of {site} has {size} entries along "
                                   f"dim {spec.dim} but the sequence has {shard.total} tokens")
            t_full = spec.expand(t, shard.total)
        else:
            t_full = t
        out = take_chunk(t_full, spec.dim, shard)
        if not spec.starts_sequence:  # side inputs recur at every block: cut them once
            self._memo[id(t)] = (t, out)
        return out

    def gather(self, t: torch.Tensor, spec: Gather) -> torch.Tensor:
        if self.shard is None:
            return t
        return gather_chunks(t, spec.dim, self.shard, self.group)

    def attention_override(self, previous):
        def override(func, *args, **kwargs):
            attend = func if previous is None else functools.partial(previous, func)
            if self.cp_depth > 0 and self.shard is not None and self.parts > 1 and self.distributed_attention:
                return ulysses_attention(attend, args, kwargs, group=self.group, shard=self.shard)
            return attend(*args, **kwargs)
        return override


_POSITIONS: "weakref.WeakKeyDictionary[type, dict[str, int]]" = weakref.WeakKeyDictionary()


def _position_of(module: torch.nn.Module, arg: str) -> int | None:
    cls = type(module)
    table = _POSITIONS.get(cls)
    if table is None:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]  # drop self
        table = {p.name: i for i, p in enumerate(params)
                 if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
        _POSITIONS[cls] = table
    return table.get(arg)


def _split_hook(ctx: ForwardContext, splits: tuple[Split, ...], site: str):
    def hook(module, args, kwargs):
        args = list(args)
        for spec in splits:
            if spec.arg in kwargs:
                value = kwargs[spec.arg]
                if isinstance(value, torch.Tensor):
                    kwargs[spec.arg] = ctx.split(value, spec, site)
                continue
            pos = _position_of(module, spec.arg)
            if pos is not None and pos < len(args) and isinstance(args[pos], torch.Tensor):
                args[pos] = ctx.split(args[pos], spec, site)
        return tuple(args), kwargs
    return hook


def _gather_hook(ctx: ForwardContext, spec: Gather):
    def hook(module, args, output):
        return ctx.gather(output, spec)
    return hook


def _enter_site(ctx: ForwardContext):
    def hook(module, args):
        ctx.cp_depth += 1
    return hook


def _leave_site(ctx: ForwardContext):
    def hook(module, args, output):
        ctx.cp_depth -= 1
    return hook


def path_matches(name: str, pattern: str) -> bool:
    """Glob match per dotted segment: ``blocks.*`` is every block, not every module inside one."""
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats))


_MATCHES: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, list]]" = weakref.WeakKeyDictionary()


def matching_modules(root: torch.nn.Module, pattern: str) -> list[tuple[str, torch.nn.Module]]:
    """Submodules whose qualified name matches the glob ``pattern`` (cached per root:
    walking a 40-block model on every forward would cost milliseconds)."""
    per_root = _MATCHES.setdefault(root, {})
    found = per_root.get(pattern)
    if found is None:
        if pattern == "":
            found = [("", root)]
        else:
            found = [(name, mod) for name, mod in root.named_modules() if name and path_matches(name, pattern)]
        per_root[pattern] = found
    return found


def check_plan_matches(root: torch.nn.Module, plan: ModelPlan) -> None:
    """Every pattern of the plan must name at least one module: a plan that silently
    matches nothing would leave attention local-only."""
    cp = plan.context_parallel
    for pattern in (*cp.inputs, *cp.outputs, *cp.attention):
        if not matching_modules(root, pattern):
            raise RuntimeError(f"{plan.title} plan: no module matches '{pattern}' in {type(root).__name__}; "
                               "this model variant is not covered by the plan")


@contextlib.contextmanager
def context_parallel(root: torch.nn.Module, plan: ModelPlan, transformer_options: dict, *, group, parts: int,
                     index: int, distributed_attention: bool = True):
    """Apply ``plan`` to one forward of ``root``: split, context-parallel attention, gather.

    ``distributed_attention=False`` is a diagnostic: attention then sees only the local
    tokens, which is what a silently broken implementation computes; tests use it to
    prove the real path communicates."""
    ctx = ForwardContext(group, parts, index, distributed_attention)
    cp = plan.context_parallel
    handles = []
    try:
        for pattern, splits in cp.inputs.items():
            for name, mod in matching_modules(root, pattern):
                handles.append(mod.register_forward_pre_hook(_split_hook(ctx, splits, name or "model"),
                                                             with_kwargs=True))
        for pattern in cp.attention:
            for _, mod in matching_modules(root, pattern):
                handles.append(mod.register_forward_pre_hook(_enter_site(ctx)))
                handles.append(mod.register_forward_hook(_leave_site(ctx)))
        for pattern, spec in cp.outputs.items():
            for _, mod in matching_modules(root, pattern):
                handles.append(mod.register_forward_hook(_gather_hook(ctx, spec)))
        had_override = OVERRIDE_KEY in transformer_options
        previous = transformer_options.get(OVERRIDE_KEY)
        transformer_options[OVERRIDE_KEY] = ctx.attention_override(previous)
        try:
            yield ctx
        finally:
            if had_override:
                transformer_options[OVERRIDE_KEY] = previous
            else:
                transformer_options.pop(OVERRIDE_KEY, None)
    finally:
        for h in handles:
            h.remove()
