"""Sharded models' ModelPatchers: where ComfyUI's memory manager meets the ranks.

Shard Transformer, Shard Text Encoder and Shard VAE give their model a patcher whose class
is a subclass of its own (ComfyUI's ``clone()`` keeps the class, so LoRA loaders after the
node keep it too), with a ``Sharding`` attachment. It changes three things:

- ``load``: records which patcher loaded each sharded module (``source_of``: where its
  weights and their version come from). With tensor parallelism the sharded subtrees are left
  out of ComfyUI's loading: their full weights stay where ComfyUI offloads models, and the
  runtime cuts every rank's slices from them layer by layer, patched, so rank 0's device
  holds only its own shard. Where an earlier unsharded run left them on the device, they are
  cut from there and leave it a tensor at a time during the send.
- ``model_size``: ComfyUI's memory manager is told what rank 0's device really holds (with
  TP: the rest of the model plus rank 0's shard) and frees that much room before loading.
- ``detach``: when ComfyUI unloads the model (a model switch, ``/free``, low memory), every
  rank frees its copy.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass

import torch

from ..weights.sources import WeightSource, leave_device_after_cut
from ..world import memory

log = logging.getLogger("parallel")

ATTACHMENT = "hybrid_parallel"

# Sharded module -> where its weights come from (the patcher that last loaded it).
_SOURCES: "weakref.WeakKeyDictionary[torch.nn.Module, WeightSource]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Sharding:
    """What a sharded patcher knows (shared by its clones)."""

    paths: tuple[str, ...]     # the sharded modules, as paths in the patcher's model ("" = the model itself)
    keep_off_device: bool      # tensor parallel: their full weights never go to the device
    model_bytes: int           # the whole model's weights (what the host holds)
    sharded_bytes: int = 0     # the sharded modules' full weights
    rank0_bytes: int = 0       # what rank 0 holds of them (its shard)
    release: object = None     # callable(module): free it on every rank

    def device_bytes(self) -> int:
        """Bytes of weights on rank 0's device once loaded."""
        if not self.keep_off_device:
            return self.model_bytes
        return max(0, self.model_bytes - self.sharded_bytes) + self.rank0_bytes


def source_of(module: torch.nn.Module) -> WeightSource | None:
    return _SOURCES.get(module)


def note_patcher(patcher) -> None:
    """``patcher`` is the one ComfyUI loads (or has loaded) its sharded modules with: a sampling
    run's own patcher. Needed besides ``load``: ComfyUI may keep a model loaded under a parent
    patcher after the clone that loaded it was garbage-collected, without loading it again."""
    sharding = patcher.attachments.get(ATTACHMENT) if hasattr(patcher, "attachments") else None
    if sharding is None:
        return
    for path in sharding.paths:
        _SOURCES[_module_at(patcher.model, path)] = WeightSource(patcher, f"{path}." if path else "")


def _module_at(root: torch.nn.Module, path: str) -> torch.nn.Module:
    return root.get_submodule(path) if path else root


class _Withheld(torch.nn.Module):
    """Stands in for a sharded subtree while ComfyUI loads the rest of the model."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("a sharded module was called while ComfyUI was loading its model")


@contextlib.contextmanager
def _withheld(root: torch.nn.Module, paths):
    """Take the modules at ``paths`` out of ``root``'s tree for the duration (ComfyUI's
    loading walks ``named_modules()`` and calls ``.to()`` on the whole model)."""
    taken = []
    try:
        for path in paths:
            parent_path, _, name = path.rpartition(".")
            parent = _module_at(root, parent_path)
            taken.append((parent, name, parent._modules[name]))
            parent._modules[name] = _Withheld()
        yield [module for _, _, module in taken]
    finally:
        for parent, name, module in reversed(taken):
            parent._modules[name] = module


def _on_device(module: torch.nn.Module, device) -> bool:
    return any(t.device == torch.device(device) for t in (*module.parameters(), *module.buffers()))


class ShardedPatcherMixin:
    """Mixed in before ComfyUI's own patcher class (see ``sharded_patcher``)."""

    def _sharding(self) -> Sharding | None:
        return self.attachments.get(ATTACHMENT)

    def model_size(self):
        sharding = self._sharding()
        if sharding is None:
            return super().model_size()
        return sharding.device_bytes()

    def clone(self, *args, **kwargs):
        # Some patcher classes reset the class of their clones (ComfyUI-GGUF's sets its own):
        # a LoRA loader after the shard node must still get a sharded patcher.
        clone = super().clone(*args, **kwargs)
        if type(clone) is not type(self) and isinstance(self, type(clone)):
            clone.__class__ = type(self)
        return clone

    def get_ram_usage(self):
        sharding = self._sharding()
        return super().get_ram_usage() if sharding is None else sharding.model_bytes

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False, **kwargs):
        sharding = self._sharding()
        if sharding is None or not sharding.keep_off_device:
            # Keywords: some patchers (ComfyUI-GGUF's) take force_patch_weights by keyword only.
            out = super().load(device_to, lowvram_model_memory, force_patch_weights=force_patch_weights,
                               full_load=full_load, **kwargs)
            if sharding is not None:
                memory.SHARDED_MODELS[self.model] = 0
        else:
            with _withheld(self.model, sharding.paths) as subtrees:
                out = super().load(device_to, lowvram_model_memory, force_patch_weights=force_patch_weights,
                                   full_load=full_load, **kwargs)
            for subtree in subtrees:
                if self.offload_device != device_to and _on_device(subtree, device_to):
                    # An unsharded run loaded it on the device: the weight send cuts each tensor
                    # from there and then moves it off, one at a time (weights/sources.py).
                    leave_device_after_cut(subtree, self.offload_device)
            if self.model.model_lowvram:  # a partial load counted the loaded modules only
                self.model.model_loaded_weight_memory += sharding.rank0_bytes
            # ComfyUI's count now includes rank 0's shard where we added it, or where a full load
            # counted ``model_size()`` (ours: the rest plus the shard); the status's
            # device_weight_peak_bytes counts the shard itself instead.
            memory.SHARDED_MODELS[self.model] = sharding.rank0_bytes if self.model.model_lowvram or full_load else 0
            # True: the sharded weights are not on the device, so a clone of this model that runs
            # unsharded loads them, instead of taking the model for fully loaded.
            self.model.model_lowvram = True
        note_patcher(self)
        return out

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False, **kwargs):
        sharding = self._sharding()
        if sharding is not None and sharding.keep_off_device and not self.model.model_lowvram \
                and self.model.model_loaded_weight_memory > 0:
            # A clone that runs unsharded loaded the whole model (our own load always leaves
            # model_lowvram set): ComfyUI would take it for loaded and skip ``load``, leaving the
            # full weights on the device. Have it load again, through ours.
            self.model.model_lowvram = True
        return super().partially_load(device_to, extra_memory, force_patch_weights=force_patch_weights, **kwargs)

    def detach(self, unpatch_all=True):
        out = super().detach(unpatch_all)
        sharding = self._sharding()
        # unpatch_all=False is ComfyUI switching between clones of a loaded model (every sampling
        # run does it): the weights stay. True is an unload: free every rank's copy.
        if sharding is not None and unpatch_all and sharding.release is not None:
            for path in sharding.paths:
                try:
                    sharding.release(_module_at(self.model, path))
                except Exception:  # never let a rank's trouble break ComfyUI's unloading
                    log.warning("could not free a sharded model on the other ranks", exc_info=True)
        return out


_CLASSES: dict[type, type] = {}


def plain_clone(patcher):
    """A clone whose model holds ordinary tensors. ComfyUI 0.33 on NVIDIA loads models for
    dynamic VRAM (comfy-aimdo): memory-mapped weights fetched per layer, LoRA applied per op,
    raw device pointers on the layers. None of that can be cut or sent to another rank, so a
    sharded model takes ComfyUI's own non-dynamic delegate (``clone(disable_dynamic=True)``)."""
    is_dynamic = getattr(patcher, "is_dynamic", None)
    if callable(is_dynamic) and is_dynamic():
        with classic_loading():
            return patcher.clone(disable_dynamic=True)
    return patcher.clone()


@contextlib.contextmanager
def classic_loading():
    """ComfyUI 0.33's ``main.py`` turns dynamic VRAM on with two process-wide switches:
    ``comfy.memory_management.aimdo_enabled`` and ``comfy.model_patcher.CoreModelPatcher =
    ModelPatcherDynamic``. Its non-dynamic delegate (a fresh load from the file) is built with
    both still on, so the layers take the lazy loader and the loaders assign the file's tensors
    as they are: a float16 model with float32 weights, a bfloat16 VAE with float32 biases (seen on
    an H100: "mat1 and mat2 must have the same dtype, but got Half and Float" on every rank).
    The delegate is built with both switches as ``--disable-dynamic-vram`` leaves them: weights
    in the model's dtype, no raw-pointer state. Prompts run on ComfyUI's one prompt thread,
    which is also the one loading here."""
    import comfy.model_patcher

    try:
        import comfy.memory_management
    except ImportError:  # before 0.33: no dynamic VRAM, nothing to switch
        yield
        return
    switches = ((comfy.memory_management, "aimdo_enabled", False),
                (comfy.model_patcher, "CoreModelPatcher", comfy.model_patcher.ModelPatcher))
    before = [getattr(owner, name, None) for owner, name, _ in switches]
    for owner, name, classic in switches:
        setattr(owner, name, classic)
    try:
        yield
    finally:
        for (owner, name, _), value in zip(switches, before):
            setattr(owner, name, value)


def sharded_patcher(patcher, sharding: Sharding):
    """A clone of ``patcher`` that carries ``sharding`` (the previous node's sharding, if any,
    is replaced)."""
    clone = plain_clone(patcher)
    base = getattr(type(clone), "_unsharded_class", type(clone))
    sharded = _CLASSES.get(base)
    if sharded is None:
        sharded = _CLASSES[base] = type(f"Sharded{base.__name__}", (ShardedPatcherMixin, base),
                                        {"_unsharded_class": base})
    clone.__class__ = sharded
    clone.attachments[ATTACHMENT] = sharding
    clone.size = sharding.model_bytes  # the whole model, whatever a sharded parent reported
    return clone
