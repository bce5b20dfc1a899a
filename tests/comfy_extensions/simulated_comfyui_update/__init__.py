"""Test-only ComfyUI extension: a diffusion model loader whose model changed under the pack's
plan, the way a ComfyUI update changes a model class. Never shipped with the pack.

``SimulatedUpdateUNETLoader`` loads a file like the stock UNETLoader (its own copy, so other
prompts keep the stock model) and then, per ``change``:

- ``renamed block argument``: every block of the main stack gets a subclass whose forward
  names an argument differently (the plan cuts the old name; Wan's ``freqs`` becomes ``rope``);
- ``new block argument``: every block is called with one more per-token argument the plan does
  not know (what 0.33 did with ``timestep_zero_index``).
"""
import inspect

import torch

import comfy.sd
import folder_paths

CHANGES = ("renamed block argument", "new block argument")


def _main_blocks(model):
    for name in ("blocks", "double_blocks", "transformer_blocks", "layers"):
        blocks = getattr(model, name, None)
        if isinstance(blocks, torch.nn.ModuleList) and len(blocks):
            return blocks
    raise ValueError(f"no block stack found in {type(model).__name__}")


def _rename_first_cut_argument(blocks):
    base = type(blocks[0])
    params = list(inspect.signature(base.forward).parameters)
    old = "freqs" if "freqs" in params else "pe"
    new = "rope"

    def forward(self, *args, **kwargs):
        if new in kwargs:
            kwargs[old] = kwargs.pop(new)
        return base.forward(self, *args, **kwargs)

    sig = inspect.signature(base.forward)
    forward.__signature__ = sig.replace(parameters=[p.replace(name=new) if p.name == old else p
                                                    for p in sig.parameters.values()])
    newer = type("Newer" + base.__name__, (base,), {"forward": forward})
    for block in blocks:
        block.__class__ = newer


def _add_argument(blocks):
    def hook(module, args, kwargs):
        x = args[0] if args else next(iter(kwargs.values()))
        return args, {**kwargs, "token_mask": torch.ones(x.shape[0], x.shape[1], device=x.device)}

    for block in blocks:
        block.register_forward_pre_hook(hook, with_kwargs=True)


class SimulatedUpdateUNETLoader:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"unet_name": (folder_paths.get_filename_list("diffusion_models"),),
                             "change": (list(CHANGES),)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    CATEGORY = "testing"

    def load(self, unet_name, change):
        patcher = comfy.sd.load_diffusion_model(folder_paths.get_full_path_or_raise("diffusion_models", unet_name))
        blocks = _main_blocks(patcher.model.diffusion_model)
        (_rename_first_cut_argument if change == CHANGES[0] else _add_argument)(blocks)
        return (patcher,)


NODE_CLASS_MAPPINGS = {"SimulatedUpdateUNETLoader": SimulatedUpdateUNETLoader}
