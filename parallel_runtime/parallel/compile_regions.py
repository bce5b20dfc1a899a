"""torch.compile under every layout: the repeated blocks compiled one by one, on every rank.

ComfyUI's TorchCompileModel compiles the whole diffusion model, which would trace the
communication between ranks. Here each rank compiles the ``forward`` of the blocks its plan
names (regional compilation: blocks of one class share one compiled graph), and everything
that communicates runs between the graphs: the plans' hooks and ComfyUI's attention override
run behind ``torch._dynamo.disable`` (scoped_hooks, plans/vocabulary/context_parallel.py), so the compiler breaks the
graph there and calls them as they are. The compiled ``forward`` is set on the block only
for the length of a sharded forward: the module ComfyUI owns is left as it was.

``CompileSettings`` is what the user asked for (backend, mode, ...), read from the model
options TorchCompileModel writes; it travels to the workers with each forward.
``CompileWatch`` counts, per rank, the frames torch compiled during each forward (the
status route says "compiling" while it happens, and tests count recompiles with it).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from dataclasses import dataclass

import torch
from torch._dynamo.callback import callback_handler
from torch._dynamo.utils import counters

from ..plans.vocabulary.matching import matching_modules
from ..plans.vocabulary.transformer import TransformerPlan

log = logging.getLogger("parallel")

COMPILE_KWARGS = "torch_compile_kwargs"  # comfy_api.torch_helpers.torch_compile.TORCH_COMPILE_KWARGS
COMPILE_OPTION = "hybrid_parallel_compile"  # transformer_options entry for one sampling run (rank 0 only)


@dataclass(frozen=True)
class CompileSettings:
    backend: str = "inductor"
    mode: str | None = None
    dynamic: bool | None = None
    options: tuple = ()  # (name, value) pairs torch passes to the backend

    @classmethod
    def from_model_options(cls, model_options: dict) -> "CompileSettings | None":
        """The settings TorchCompileModel (or a node built on ComfyUI's set_torch_compile_wrapper)
        stored in ``model_options``; None when the model is not compiled."""
        kwargs = (model_options or {}).get(COMPILE_KWARGS)
        if not kwargs:
            return None
        options = {k: v for k, v in (kwargs.get("options") or {}).items()
                   if not callable(v)}  # ComfyUI's guard filter: ours is below, the same on every rank
        if kwargs.get("fullgraph"):
            log.info("torch.compile: fullgraph is off under Shard Transformer: the collectives between the "
                     "graphs are graph breaks by design")
        return cls(backend=str(kwargs.get("backend") or "inductor"), mode=kwargs.get("mode"),
                   dynamic=kwargs.get("dynamic"), options=tuple(sorted(options.items())))

    def describe(self) -> str:
        return self.backend + (f" ({self.mode})" if self.mode else "")


# Guards that say which code runs (an entry's presence, the identity or type of what it holds,
# e.g. the context-parallel attention override): kept. Guards on values (block_index, sigmas): not.
_BEHAVIOUR_GUARDS = ("ID_MATCH", "TYPE_MATCH", "DICT_KEYS_MATCH", "DICT_CONTAINS", "CLOSURE_MATCH",
                     "FUNCTION_MATCH", "NOT_NONE_MATCH", "IS_NONE_MATCH")


def skip_transformer_options_guards(guard_entries):
    """No guards on the values in ``transformer_options`` (ComfyUI 0.33's TorchCompileModel skips
    every guard there): block_index and sigmas change from block to block and step to step, and a
    guard on them would compile every block of every step again. Unlike ComfyUI's, guards on what
    is there and which function it holds stay: a graph compiled without the context-parallel
    attention override must not run where it is set."""
    keep = []
    for entry in guard_entries:
        kinds = (entry.guard_type, *entry.derived_guard_types)
        keep.append("transformer_options" not in entry.name or any(k in _BEHAVIOUR_GUARDS for k in kinds))
    return keep


def hooked_patterns(plan: TransformerPlan) -> list[str]:
    """Every module the plan may put a hook on, in any layout."""
    cp = plan.context_parallel
    patterns = [*cp.inputs, *cp.outputs, *cp.attention]
    if plan.tensor_parallel is not None:
        patterns += [*plan.tensor_parallel.layers, *plan.tensor_parallel.inputs]
    return patterns


def region_patterns(plan: TransformerPlan) -> tuple[str, ...]:
    """The repeated blocks the plan hooks (``blocks.*``, ``double_blocks.*``), from the patterns it
    already names: each pattern cut after its first ``*``."""
    if plan.compile_regions:
        return plan.compile_regions
    found = []
    for pattern in hooked_patterns(plan):
        parts = pattern.split(".")
        if "*" in parts:
            region = ".".join(parts[:parts.index("*") + 1])
            if region not in found:
                found.append(region)
    return tuple(found)


_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_REGIONS: "weakref.WeakKeyDictionary[type, object]" = weakref.WeakKeyDictionary()

# Frames of one code object compiled before torch gives up on it and runs it eagerly: one block
# class sees a graph per layout and per resolution in a long-lived ComfyUI (torch's default is 8).
RECOMPILE_LIMIT = 64


def _region_function(cls: type):
    """``cls.forward`` behind a ``layout`` argument that the compiler guards on, so a graph traced
    under one layout (the attention override set or not, hooks here or there) never runs under
    another: torch's own guards did not always tell them apart (a graph compiled unsharded was
    reused sharded, local attention on rank 0, the ranks deadlocked). One code object per block
    class, so that each class has its own allowance of recompiles."""
    region = _REGIONS.get(cls)
    if region is None:
        forward = cls.forward

        def region(self, layout: str, *args, **kwargs):
            if layout:  # a string: one guard on its value
                return forward(self, *args, **kwargs)
            return forward(self, *args, **kwargs)

        name = f"compiled_region_{cls.__name__}"
        region.__code__ = region.__code__.replace(co_name=name, co_qualname=name)
        _REGIONS[cls] = region
    return region


def _compiled_forward(module: torch.nn.Module, settings: CompileSettings):
    per_module = _COMPILED.setdefault(module, {})
    compiled = per_module.get(settings)
    if compiled is None:
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        options = {**dict(settings.options), "guard_filter_fn": skip_transformer_options_guards}
        compiled = per_module[settings] = torch.compile(
            _region_function(type(module)).__get__(module), backend=settings.backend, mode=settings.mode,
            dynamic=settings.dynamic, options=options)
    return compiled


@contextlib.contextmanager
def compiled_regions(root: torch.nn.Module, plan: TransformerPlan, settings: CompileSettings | None, layout: str = "single"):
    """For one forward: the plan's blocks run their compiled ``forward``; ``layout`` names what the
    plan does around and inside them in this forward (the mesh), one set of graphs per layout."""
    if settings is None:
        yield
        return
    swapped = []
    try:
        for pattern in region_patterns(plan):
            for _, mod in matching_modules(root, pattern):
                if "forward" not in mod.__dict__:
                    mod.__dict__["forward"] = functools.partial(_call_region, _compiled_forward(mod, settings), layout)
                    swapped.append(mod)
        yield
    finally:
        for mod in swapped:
            mod.__dict__.pop("forward", None)


def _call_region(compiled, layout: str, *args, **kwargs):
    # Guards on the modules' hooks too (torch skips them by default): a graph compiled before a
    # layout hooked a module inside the block would otherwise never call that hook.
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        return compiled(layout, *args, **kwargs)


class CompileWatch:
    """What torch compiles in this process: ``compiles`` (frames compiled), ``recompiles`` (frames
    compiled during a forward whose inputs had the same shapes as an earlier one: the first step
    of a prompt may compile, later steps and later prompts of that size must not), and
    ``compiling`` while it happens (the first compiled step is slow; the status route says why).
    ``cache_counts()``: graphs inductor loaded from its on-disk cache and graphs it built, which
    tell whether fresh workers (after a restart, a new config) reuse what earlier ones compiled."""

    def __init__(self):
        self.compiles = 0
        self.recompiles = 0
        self.compiling = False
        self._during = 0
        self._seen: set = set()
        self.listener = None  # called on every change (a worker publishes its status row)
        callback_handler.register_start_callback(self._started)
        callback_handler.register_end_callback(self._ended)

    def _started(self, _args) -> None:
        self.compiles += 1
        self._during += 1
        self.compiling = True
        self._changed()

    def _ended(self, _args) -> None:
        self.compiling = False
        self._changed()

    def _changed(self) -> None:
        if self.listener is not None:
            self.listener(self)

    @contextlib.contextmanager
    def forward(self, signature):
        """Around one compiled forward; ``signature``: its input shapes and settings."""
        self._during = 0
        try:
            yield
        finally:
            if signature in self._seen and self._during:
                self.recompiles += self._during
                log.warning("torch.compile: %d frame(s) compiled again for inputs of a size already run; "
                            "something in the model changes between steps", self._during)
            self._seen.add(signature)
            self.compiling = False

    @staticmethod
    def cache_counts() -> tuple[int, int]:
        """(graphs loaded from inductor's cache, graphs it compiled) in this process so far."""
        inductor = counters["inductor"]
        return inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]

    def row(self) -> tuple[float, ...]:
        hits, misses = self.cache_counts()
        return float(self.compiling), float(self.compiles), float(self.recompiles), float(hits), float(misses)


_WATCH: CompileWatch | None = None


def watch() -> CompileWatch:
    global _WATCH
    if _WATCH is None:
        _WATCH = CompileWatch()
    return _WATCH


@contextlib.contextmanager
def watched(settings: CompileSettings | None, key, meta):
    """A forward counted by this process's CompileWatch (nothing when not compiled); ``key``: the
    model copy and the mesh, ``meta``: the input shapes."""
    if settings is None:
        yield
        return
    with watch().forward((key, settings, tuple(map(repr, meta)))):
        yield
