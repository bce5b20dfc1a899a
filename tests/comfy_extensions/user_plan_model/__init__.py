"""Test-only ComfyUI extension: a custom node pack with a diffusion model of its own
(``model.TinyUserDiT``), which the pack does not ship a plan for. ``TinyUserDiTLoader`` builds it
with seeded weights as a ComfyUI MODEL (a flow model on 16-channel SD3-style latents), so the stock
KSampler samples it. Never shipped with the pack."""
import torch

import comfy.latent_formats
import comfy.model_base
import comfy.model_management
import comfy.model_patcher
import comfy.supported_models_base

from .model import TinyUserDiT


class TinyUserDiTConfig(comfy.supported_models_base.BASE):
    unet_config = {}
    latent_format = comfy.latent_formats.SD3
    sampling_settings = {"shift": 3.0}
    supported_inference_dtypes = [torch.float32]


class TinyUserDiTLoader:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2**31})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    CATEGORY = "testing"

    def load(self, seed):
        config = TinyUserDiTConfig({"dtype": torch.float32})
        model = comfy.model_base.BaseModel(config, model_type=comfy.model_base.ModelType.FLOW, device="cpu",
                                           unet_model=TinyUserDiT)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in sorted(model.diffusion_model.named_parameters()):
                p.copy_(torch.randn(p.shape, generator=gen) * (0.02 if p.ndim == 1 else 1.0 / p.shape[-1] ** 0.5))
        return (comfy.model_patcher.ModelPatcher(model, load_device=comfy.model_management.get_torch_device(),
                                                 offload_device=comfy.model_management.unet_offload_device()),)


NODE_CLASS_MAPPINGS = {"TinyUserDiTLoader": TinyUserDiTLoader}
