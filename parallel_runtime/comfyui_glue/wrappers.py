"""The two wrappers Shard Transformer puts on ComfyUI's ModelPatcher.

- ``OUTER_SAMPLE`` (once per sampling run): starts or reuses the workers before
  ComfyUI loads the model, and moves our forward wrapper innermost, so that
  wrappers of other nodes (caches that skip steps, for example) decide on rank 0
  whether a forward happens at all, and every forward that does happen runs on
  all ranks.
- ``DIFFUSION_MODEL`` (every forward): dispatches the forward to all ranks and
  runs rank 0's shard under the model's context-parallel plan.

A model class whose ``forward`` runs no DIFFUSION_MODEL wrappers (it has no ``_forward``:
ERNIE-Image) gets ``ShardedModelForward`` instead, as its ``forward`` through an object patch
(``forward_method`` tells them apart by the class, never by the family).

Both are plain callables holding the config; they carry no ``.to`` method, so
ComfyUI's cast of wrappers leaves them alone.
"""
from __future__ import annotations

import inspect
import logging

import torch

from . import interrupts, load_bar  # noqa: F401  (load_bar: ComfyUI's progress bar during a load)
from .patcher import note_patcher, source_of
from ..config import ParallelConfig
from ..distributed.mesh import MeshLayout
from ..parallel import arguments
from ..parallel.compile_regions import COMPILE_OPTION, CompileSettings
from ..layout.refusal import plan_refusal
from ..plans import find_controlnet_plan, plan_for_family
from ..world.runtime import RUNTIME

log = logging.getLogger("parallel")

WRAPPER_KEY = "hybrid_parallel"
OUTER_SAMPLE = "outer_sample"        # comfy.patcher_extension.WrappersMP names
DIFFUSION_MODEL = "diffusion_model"


APPLY_MODEL = "apply_model"
TORCH_COMPILE_KEY = "torch.compile"  # comfy_api.torch_helpers.torch_compile.COMPILE_KEY


class ShardedRun:
    def __init__(self, config: ParallelConfig, first_step=None):
        self.config = config
        self.first_step = first_step  # verification.FirstStep, shared with the forward wrapper

    def __call__(self, executor, *args, **kwargs):
        guider = executor.class_obj
        options = getattr(guider, "model_options", {}).get("transformer_options", {})
        wrappers = options.get("wrappers", {})
        # TorchCompileModel would compile the whole model, communication included: its wrapper is
        # taken out of this run (the model options are the run's own copy here) and every rank
        # compiles the plan's blocks instead, with the same settings (compile_regions).
        if wrappers.get(APPLY_MODEL, {}).pop(TORCH_COMPILE_KEY, None) is not None:
            settings = CompileSettings.from_model_options(guider.model_options)
            if settings is not None:
                options[COMPILE_OPTION] = settings
                log.info("Shard Transformer: every rank compiles the model's blocks with torch.compile (%s); the "
                         "first step of a new size is slow while they compile", settings.describe())
        forward_wrappers = wrappers.get(DIFFUSION_MODEL, {})
        if WRAPPER_KEY in forward_wrappers:
            forward_wrappers[WRAPPER_KEY] = forward_wrappers.pop(WRAPPER_KEY)  # last = innermost
        RUNTIME.world_for(self.config)
        note_patcher(guider.model_patcher)  # the weights of this run are this patcher's
        if self.first_step is not None:
            self.first_step.begin_run()
        controls = shard_controlnets(getattr(guider, "conds", None) or {}, self.config)
        for patcher in patch_model_patchers(options):
            release_on_unload(patcher, patcher.model)
        try:
            return executor(*args, **kwargs)
        finally:
            for module in controls:
                module.__dict__.pop("forward", None)


RELEASE_KEY = "hybrid_parallel_release"


def release_on_unload(patcher, module: torch.nn.Module) -> None:
    """When ComfyUI unloads ``patcher`` (``/free``, a model switch, low memory), every rank frees its
    copy of ``module`` (a ControlNet's or a model patch's model, which the workers hold next to the
    transformer); the next run sends it again. Once per patcher."""
    import comfy.patcher_extension

    detach = comfy.patcher_extension.CallbacksMP.ON_DETACH
    if patcher is None or RELEASE_KEY in (getattr(patcher, "callbacks", {}).get(detach) or {}):
        return
    patcher.add_callback_with_key(detach, RELEASE_KEY, lambda _patcher, _unpatch_all: RUNTIME.release(module))


def patch_model_patchers(options: dict) -> list:
    """The ModelPatchers of the run's model patches (``patch.models()``, ComfyUI's protocol for them)."""
    found = {}
    for kind in ("patches", "patches_replace"):
        for entries in (options.get(kind) or {}).values():
            for patch in (entries.values() if isinstance(entries, dict) else entries):
                for patcher in (patch.models() if callable(getattr(patch, "models", None)) else ()):
                    if isinstance(getattr(patcher, "model", None), torch.nn.Module):
                        found.setdefault(id(patcher), patcher)
    return list(found.values())


def controlnet_models(conds: dict) -> list[torch.nn.Module]:
    """The ``control_model`` of every ControlNet in a sampling run's conditioning (chains included);
    each is freed on every rank when ComfyUI unloads it."""
    found: dict[int, torch.nn.Module] = {}
    for entries in conds.values():
        for cond in entries or ():
            control = cond.get("control") if isinstance(cond, dict) else None
            while control is not None:
                module = getattr(control, "control_model", None)
                if isinstance(module, torch.nn.Module) and id(module) not in found:
                    found[id(module)] = module
                    release_on_unload(getattr(control, "control_model_wrapped", None), module)
                control = getattr(control, "previous_controlnet", None)
    return list(found.values())


def shard_controlnets(conds: dict, config: ParallelConfig) -> list[torch.nn.Module]:
    """For one sampling run, every ControlNet whose model has a plan runs on every rank under the
    transformer's layout (``ShardedControlForward`` as its ``forward``); the others run on rank 0
    as before, with the reason in the log. Returns the modules to restore afterwards."""
    installed = []
    for module in controlnet_models(conds):
        plan = find_controlnet_plan(module)
        name = type(module).__name__
        why = None
        if plan is None:
            why = "the pack has no plan for it"
        elif config.auto_layout:
            why = "layout auto picks the transformer's layout at its first step, after the ControlNet has run"
        else:
            why = plan_refusal(module, plan, {**config.mesh_sizes, "tp": 1})  # under TP it runs whole
        if why is not None:
            log.info("parallel: the ControlNet %s runs on rank 0 only (%s); its residuals are split", name, why)
            continue
        module.forward = ShardedControlForward(config, plan.family, module)
        installed.append(module)
        log.info("parallel: the ControlNet %s runs on every rank under the transformer's layout%s", name,
                 " (whole on each rank of a TP group: no tensor-parallel plan for it)" if config.tp_size > 1 else "")
    return installed


class ShardedForward:
    def __init__(self, config: ParallelConfig, family: str, first_step=None):
        self.config = config
        self.family = family
        self.first_step = first_step

    def __call__(self, executor, *args, **kwargs):
        inner = executor.wrappers[executor.idx + 1:]
        if inner:
            names = ", ".join(f"{getattr(w, '__module__', '?')}.{getattr(w, '__qualname__', type(w).__name__)}"
                              for w in inner)
            raise RuntimeError(f"Shard Transformer: other forward wrappers ({names}) would run inside the sharded "
                               "forward on rank 0 only; this version cannot run them on every rank")
        module = executor.class_obj
        world = RUNTIME.world_for(self.config)
        plan = plan_for_family(self.family)
        compile = _transformer_options(module, args, kwargs).get(COMPILE_OPTION)
        with interrupts.deferred():  # Cancel lands right after this forward, on every rank alike
            out = world.forward(module, plan, executor, args, kwargs, source=source_of(module), compile=compile)
        if self.first_step is not None and self.first_step.pending:  # the same step, unsharded, on rank 0
            self.first_step.check(plan.title, out, lambda: executor(*args, **kwargs))
        return out


def forward_method(module) -> str:
    """The method a sharded forward runs: ``_forward`` where the class's ``forward`` runs ComfyUI's
    DIFFUSION_MODEL wrappers around it (``ShardedForward`` is one), else ``forward`` itself (the
    class has no ``_forward``; ``ShardedModelForward`` stands in for it)."""
    return "_forward" if callable(getattr(type(module), "_forward", None)) else "forward"


class ShardedModelForward:
    """Installed (by an object patch on the sharded ModelPatcher) as the ``forward`` of a diffusion
    model whose class runs no DIFFUSION_MODEL wrappers: every call runs on all ranks, as
    ``ShardedForward`` runs the others'. ``module``: the diffusion model of the patcher that carries
    the patch (the instance the patch is set on)."""

    def __init__(self, config: ParallelConfig, family: str, module, first_step=None):
        self.config = config
        self.family = family
        self.module = module
        self.first_step = first_step

    def __call__(self, *args, **kwargs):
        module = self.module
        forward = type(module).forward.__get__(module)
        world = RUNTIME.world_for(self.config)
        plan = plan_for_family(self.family)
        compile = _transformer_options(module, args, kwargs).get(COMPILE_OPTION)
        with interrupts.deferred():
            out = world.forward(module, plan, forward, args, kwargs, source=source_of(module), compile=compile)
        if self.first_step is not None and self.first_step.pending:
            self.first_step.check(plan.title, out, lambda: forward(*args, **kwargs))
        return out


class ShardedModuleForward:
    """A module's ``forward`` whose every call runs on all ranks (Cancel lands after it)."""

    def __init__(self, config: ParallelConfig, family: str, module, layout: MeshLayout | None = None):
        self.config = config
        self.family = family
        self.module = module
        self.layout = layout  # None: the config's

    def run(self, args, kwargs, source=None):
        world = RUNTIME.world_for(self.config)
        forward = type(self.module).forward.__get__(self.module)
        with interrupts.deferred():
            return world.forward(self.module, plan_for_family(self.family), forward, args, kwargs, source=source,
                                 layout=self.layout)


class ShardedControlForward(ShardedModuleForward):
    """A ControlNet's ``forward`` for one sampling run: every call runs on all ranks, each on its
    share of the tokens (and of the batch under CFG), and returns the whole residuals on rank 0."""

    def __call__(self, *args, **kwargs):
        return self.run(args, kwargs)


class ShardedEncoderForward(ShardedModuleForward):
    """Installed (by an object patch on the CLIP's ModelPatcher) as a text encoder's
    ``forward``: every call runs on all ranks, each with its slice of the encoder."""

    def __call__(self, *args, **kwargs):
        out = self.run(args, kwargs, source=source_of(self.module))
        # The caller computed its inputs where the encoder's own weights are (where ComfyUI
        # offloads them, with tensor parallelism); it gets its output there too.
        return _to_device(out, _input_device(args, kwargs))


class ShardedFirstStage:
    """Stands in for a VAE's ``first_stage_model`` on a copy of ComfyUI's VAE object: decode and
    encode run on every rank, each on a band of rows (parallel/vae_bands.py); everything else is the model's."""

    def __init__(self, module, config: ParallelConfig, family: str):
        self._module = module
        self._config = config
        self._family = family

    def _dispatch(self, method: str, args, kwargs):
        world = RUNTIME.world_for(self._config)
        bound = getattr(type(self._module), method).__get__(self._module)
        with interrupts.deferred():
            return world.forward(self._module, plan_for_family(self._family), bound, args, kwargs,
                                 source=source_of(self._module))

    def decode(self, *args, **kwargs):
        return self._dispatch("decode", args, kwargs)

    def encode(self, *args, **kwargs):
        return self._dispatch("encode", args, kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


def _transformer_options(module, args, kwargs) -> dict:
    """The forward's transformer_options, passed by keyword or by position (Wan's forward)."""
    bound = inspect.signature(getattr(type(module), forward_method(module))).bind(module, *args, **kwargs)
    return arguments.get_options(bound) or {}


def _input_device(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def _to_device(out, device):
    if device is None:
        return out
    if isinstance(out, torch.Tensor):
        return out if out.device == device else out.to(device)
    if isinstance(out, (list, tuple)):
        items = [_to_device(v, device) for v in out]
        return type(out)(items) if type(out) in (list, tuple) else type(out)(*items)
    if isinstance(out, dict):
        return {k: _to_device(v, device) for k, v in out.items()}
    return out
