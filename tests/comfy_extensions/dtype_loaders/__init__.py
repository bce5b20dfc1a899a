"""Test-only ComfyUI extension: a diffusion model loader and a VAE loader with the dtype stated, so
that the GPU check (tools/gpu_check.py) runs the same graph in bf16 and in fp32 on any device:
the rounding measured between the two unsharded runs is what its bf16 tolerances are derived from
(docs/gpu_check.md#tolerances). ComfyUI's own loaders pick the dtype themselves (bf16 on most
GPUs, fp32 on the CPU). Never shipped with the pack."""
import comfy.sd
import comfy.utils
import folder_paths
import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class UNETLoaderDtype:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"unet_name": (folder_paths.get_filename_list("diffusion_models"),),
                             "dtype": (list(DTYPES),)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load_unet"
    CATEGORY = "testing"

    def load_unet(self, unet_name: str, dtype: str):
        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        return (comfy.sd.load_diffusion_model(path, model_options={"dtype": DTYPES[dtype]}),)


class VAELoaderDtype:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"vae_name": (folder_paths.get_filename_list("vae"),), "dtype": (list(DTYPES),)}}

    RETURN_TYPES = ("VAE",)
    FUNCTION = "load_vae"
    CATEGORY = "testing"

    def load_vae(self, vae_name: str, dtype: str):
        sd, metadata = comfy.utils.load_torch_file(folder_paths.get_full_path_or_raise("vae", vae_name),
                                                   return_metadata=True)
        vae = comfy.sd.VAE(sd=sd, metadata=metadata, dtype=DTYPES[dtype])
        vae.throw_exception_if_invalid()
        return (vae,)


NODE_CLASS_MAPPINGS = {"UNETLoaderDtype": UNETLoaderDtype, "VAELoaderDtype": VAELoaderDtype}
