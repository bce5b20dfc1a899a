"""Where a sharded module's weights come from in ComfyUI, and when they change.

ComfyUI's ModelPatcher owns the weights. LoRA and other weight patches are merged into the
tensors when it loads a model completely, and applied per layer at every forward when it
loads one partially (lowvram: ``weight_function`` on the layer). With tensor parallelism the
pack keeps the full weights off the device altogether and patches them itself, a layer at a
time (``comfyui_glue/patcher.py``). Every rank must compute with the same values as an unsharded run,
so ``WeightSource.weight`` gives each tensor exactly as ComfyUI's forward would use it, and
the other ranks receive that, merged.

``WeightSource.version`` says when those values may have changed: it is made of what ComfyUI
changes (the patcher's ``patches_uuid``, which patched tensors it patches per forward), never of
tensor comparisons.
"""
from __future__ import annotations

import weakref

import torch

from . import file_reads, packed

# Per-process state ComfyUI puts on its layers when it loads a model: what a worker receives
# is merged already, so this state must not travel with the structure.
_LOWVRAM_ATTRS = ("weight_function", "bias_function")
# What ComfyUI 0.33's dynamic VRAM (comfy-aimdo, NVIDIA only) puts on a model it loaded: the model's
# virtual address ranges (``dynamic_vbars``), each layer's slice of one (``_v``: raw pointers in ctypes
# arrays, which cannot be pickled), its device views and residency signature, pinning and prefetch
# state. Valid in rank 0's process only. Such a layer keeps ``comfy_cast_weights``, so without them it
# casts its weights per forward, as ComfyUI's classic loader runs a layer it did not fully load. Seen
# on an H100 with the stock Flux ControlNet, which ComfyUI loads dynamically and has no non-dynamic
# delegate (no ``cached_patcher_init``) to take instead (comfyui_glue/patcher.plain_clone).
_DYNAMIC_VRAM_ATTRS = ("dynamic_vbars", "_v", "_v_weight", "_v_bias", "_v_signature", "_v_block", "_pin_state",
                       "_prefetch")


def worker_module_state(module: torch.nn.Module, state: dict) -> dict:
    """A layer's attributes as they travel to a worker: weights arrive merged, so the layer
    casts as it would fully loaded (no per-forward patch functions, no lowvram flag, none of
    dynamic VRAM's per-process state)."""
    if not any(k in state for k in (*_LOWVRAM_ATTRS, *_DYNAMIC_VRAM_ATTRS, "prev_comfy_cast_weights",
                                    "comfy_patched_weights")):
        return state
    state = {k: v for k, v in state.items() if k not in _DYNAMIC_VRAM_ATTRS}
    for name in _LOWVRAM_ATTRS:
        if name in state:
            state[name] = []
    if "prev_comfy_cast_weights" in state:
        state["comfy_cast_weights"] = state.pop("prev_comfy_cast_weights")
    state.pop("comfy_patched_weights", None)
    return state


# Sharded modules whose full weights ComfyUI left on rank 0's device (an unsharded or
# context-parallel run of the same model loaded them there) while tensor parallelism wants them
# off it: module -> where ComfyUI offloads the model. The weight send cuts each tensor from the
# device and moves that tensor to the offload device right after (``offload_tensor``), one at a
# time, instead of a whole-subtree ``.to()`` through pageable memory before the send.
_LEAVE_DEVICE: "weakref.WeakKeyDictionary[torch.nn.Module, torch.device]" = weakref.WeakKeyDictionary()


def leave_device_after_cut(module: torch.nn.Module, offload_device) -> None:
    _LEAVE_DEVICE[module] = torch.device(offload_device)


def offload_target(module: torch.nn.Module) -> torch.device | None:
    """Where ``module``'s full weights go once cut, if they are to leave the device."""
    return _LEAVE_DEVICE.get(module)


def offload_tensor(owner: torch.nn.Module, leaf: str, device: torch.device) -> None:
    """Move one parameter or buffer of ``owner`` to ``device`` in place (the Parameter object stays)."""
    if leaf in owner._parameters and owner._parameters[leaf] is not None:
        param = owner._parameters[leaf]
        if param.device != device:
            moved = param.data.to(device)
            if torch._has_compatible_shallow_copy_type(param, moved):  # as Module.to does
                param.data = moved
            else:
                owner._parameters[leaf] = torch.nn.Parameter(moved, requires_grad=param.requires_grad)
    elif leaf in owner._buffers and owner._buffers[leaf] is not None:
        if owner._buffers[leaf].device != device:
            owner._buffers[leaf] = owner._buffers[leaf].to(device)


def finish_offload(module: torch.nn.Module) -> None:
    """Whatever of ``module`` is still off its offload device goes there, a tensor at a time (the
    weights did not need sending: the ranks held this version already)."""
    target = _LEAVE_DEVICE.pop(module, None)
    if target is None:
        return
    for name, owner in owners(module).items():
        offload_tensor(owner, name.rsplit(".", 1)[-1], target)


class WeightSource:
    """The ModelPatcher a module was loaded by, and the module's key prefix in its model."""

    def __init__(self, patcher, prefix: str):
        self._patcher = weakref.ref(patcher)
        self.prefix = prefix  # "diffusion_model.", "t5xxl.transformer.", "" (a VAE's first_stage_model)

    @property
    def patcher(self):
        patcher = self._patcher()
        if patcher is None:
            raise RuntimeError("the ComfyUI model this sharded module belongs to is gone")
        return patcher

    def version(self) -> tuple:
        """Changes whenever the values ``weight`` returns may change: the patch set, and which
        patched tensors ComfyUI patches per forward (lowvram: its rounding path, not its merged
        one). How much of the model ComfyUI keeps loaded on rank 0 changes nothing else, so a
        partial unload sends nothing again."""
        patcher = self.patcher
        per_forward = tuple(sorted(key for key in patcher.patches if self._patched_per_forward(patcher.model, key)))
        return (str(patcher.patches_uuid), per_forward)

    @staticmethod
    def _patched_per_forward(model, key: str) -> bool:
        owner_path, _, leaf = key.rpartition(".")
        owner = model
        for part in owner_path.split(".") if owner_path else ():
            owner = getattr(owner, part, None)
            if owner is None:
                return False
        return bool(_patch_functions(owner, leaf))

    def packed_patches(self, name: str) -> list:
        """ComfyUI-GGUF's form of the patches of a packed tensor: ``[(patches, key)]``, applied by
        its layer when it dequantizes (its patcher never merges them into the stored data)."""
        key = self.prefix + name
        patches = self.patcher.patches.get(key)
        return [(patches, key)] if patches else []

    def patched(self, name: str, owner=None) -> bool:
        """Whether a weight patch (merged or applied per forward) changes tensor ``name``."""
        return self.prefix + name in self.patcher.patches or bool(_patch_functions(owner, name))

    def checkpoint(self) -> tuple[str | None, str]:
        """The file the model was loaded from, or None and why not (``file_reads.checkpoint_of``)."""
        return file_reads.checkpoint_of(self.patcher)

    def refuse_unsupported(self, what: str) -> None:
        """Scheduled weight hooks change the weights per step on rank 0 only."""
        patcher = self.patcher
        if getattr(patcher, "hook_patches", None) or getattr(patcher, "current_hooks", None) is not None:
            raise RuntimeError(f"{what}: scheduled weight hooks (Create Hook LoRA / Set CLIP Hooks and friends) change "
                               "the weights during sampling, which this version cannot repeat on every rank; apply "
                               "the LoRA with a plain LoRA loader instead")

    def compute_dtype(self):
        """The dtype the model's layers cast their weights to at every forward, where ComfyUI says."""
        model = self.patcher.model
        dtype = getattr(model, "manual_cast_dtype", None)
        if dtype is None and hasattr(model, "get_dtype"):
            try:
                dtype = model.get_dtype()
            except Exception:  # a model that keeps no dtype
                dtype = None
        return dtype

    def weight(self, name: str | None, tensor: torch.Tensor, device: torch.device, owner=None) -> torch.Tensor:
        """``tensor`` (the module's attribute ``name``) as ComfyUI's forward would use it, on ``device``.

        Returns ``tensor`` itself when nothing applies and it is on ``device`` already."""
        if name is None:
            return tensor if tensor.device == device else tensor.to(device)
        import comfy.model_patcher

        patcher = self.patcher
        key = self.prefix + name
        packing = packed.packing(tensor)
        if packing is not None and packing.quantized:  # GGUF blocks: the layer dequantizes and patches them
            on_device = tensor if tensor.device == device else tensor.to(device)
            return packed.with_patches(on_device, self.packed_patches(name))
        if packing is not None:  # a GGUF F16 / F32 tensor: patched like any other (ComfyUI-GGUF merges those)
            tensor = packed.stored(tensor)
        backup = patcher.backup.get(key)
        merged = backup is not None and patcher.model.current_weight_patches_uuid == patcher.patches_uuid
        base = tensor if backup is None or merged else backup.weight
        functions = _patch_functions(owner, name)
        if functions:  # lowvram: the layer applies its patches at every cast (comfy.ops.cast_bias_weight)
            dtype = self.compute_dtype() or base.dtype
            out = base.to(device=device).to(dtype=dtype)
            for f in functions:
                out = f(out)
            return out
        if merged or key not in patcher.patches:
            return base if base.device == device else base.to(device)
        # What ModelPatcher.patch_weight_to_device computes, without touching ComfyUI's module.
        import comfy.float
        import comfy.lora
        import comfy.model_management

        _, set_func, convert_func = comfy.model_patcher.get_key_weight(patcher.model, key)
        temp = comfy.model_management.cast_to_device(base, device, torch.float32, copy=True)
        if convert_func is not None:
            temp = convert_func(temp, inplace=True)
        out = comfy.lora.calculate_weight(patcher.patches[key], temp, key)
        seed = comfy.model_patcher.string_to_seed(key)
        if set_func is None:
            return comfy.float.stochastic_rounding(out, base.dtype, seed=seed)
        return set_func(out, inplace_update=False, seed=seed, return_weight=True)


def _patch_functions(owner, name: str) -> list:
    """The patch functions a ComfyUI layer applies to this tensor at every forward."""
    if owner is None:
        return []
    leaf = name.rsplit(".", 1)[-1]
    attr = {"weight": "weight_function", "bias": "bias_function"}.get(leaf)
    return list(getattr(owner, attr, None) or ()) if attr else []


def owners(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Tensor name -> the layer holding it (patch functions live on layers)."""
    out = {}
    for mod_name, mod in module.named_modules():
        for leaf, _ in (*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)):
            out[f"{mod_name}.{leaf}" if mod_name else leaf] = mod
    return out
