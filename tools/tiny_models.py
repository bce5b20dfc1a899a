"""Tiny model files that ComfyUI's stock loaders accept, with seeded random weights.

Used by the demo and the tests (nothing is downloaded). Needs ComfyUI importable
(``comfy`` on ``sys.path``) with ``comfy.cli_args.args.cpu`` set by the caller.

- a Wan 2.1 T2V transformer (UNETLoader detects it from its keys and shapes)
- a Wan 2.1 VAE (VAELoader)
- LoRA files for that transformer (LoraLoaderModelOnly)
- a prompt embedding stored as a one-sample dataset that the stock
  LoadTrainingDataset node reads: ComfyUI's Wan text encoder (UMT5-XXL) has a
  fixed 5.7B-parameter config, far too big to generate, so the demo's tiny
  workflow takes its conditioning from a file instead
- for the example-workflow test: Flux.1 and Qwen-Image at the widths their
  detection fixes, the Flux.1 / FLUX.2 autoencoders, and files whose family
  ComfyUI only builds at full size (FLUX.2 here, the text encoders in
  tiny_text_encoders.py), which state their small config in their metadata
  for the test server's extension (tests/comfy_extensions)
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

import tiny_text_encoders
from tiny_text_encoders import TEXT_DIM
from tiny_weights import _random_state_dict, comfy_json_config, stating_config  # noqa: F401  (tiny_families, tiny_gguf)

WAN_TEXT_DIM = 4096  # WanModel's default; ComfyUI's detection does not read it from the file


@dataclass(frozen=True)
class TinyWan:
    dim: int = 256        # detection derives heads = dim // 128
    ffn_dim: int = 512
    num_layers: int = 2
    in_dim: int = 16
    out_dim: int = 16

    @property
    def num_heads(self) -> int:
        return self.dim // 128


# Parameters newer ComfyUI releases require of a model's params dataclass, with the value that keeps
# the older behaviour (0.33.0: Flux's and Chroma's txt_ids_dims, Chroma's vec_in_dim, HunyuanVideo's
# meanflow_sum, Chroma Radiance's use_x0 and use_sequential_txt_ids). Older releases do not know them and do
# not get them.
OLDER_BEHAVIOUR = {"txt_ids_dims": [], "meanflow_sum": False, "vec_in_dim": None, "use_x0": False,
                   "use_sequential_txt_ids": False}


def make(cls, **kwargs):
    """``cls(**kwargs)`` on whichever ComfyUI is installed (see ``OLDER_BEHAVIOUR``)."""
    import dataclasses
    import sys

    params = [obj for obj in vars(sys.modules[cls.__module__]).values()
              if dataclasses.is_dataclass(obj) and isinstance(obj, type) and obj.__name__.endswith("Params")]
    if params:  # the dataclass the model builds from its keyword arguments: the one that knows most of them
        best = max(params, key=lambda p: len({f.name for f in dataclasses.fields(p)} & kwargs.keys()))
        for f in dataclasses.fields(best):
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required and f.name not in kwargs and f.name in OLDER_BEHAVIOUR:
                kwargs[f.name] = OLDER_BEHAVIOUR[f.name]
    return cls(**kwargs)


def _seeded_(tensors, seed: int, scale: float = 0.05):
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        with torch.no_grad():
            t.copy_(torch.randn(t.shape, generator=gen) * scale)


def build_wan_model(spec: TinyWan = TinyWan(), seed: int = 0, dtype=torch.float32, text_dim: int = WAN_TEXT_DIM,
                    model_type: str = "t2v"):
    """A ComfyUI WanModel with seeded weights (eval mode); ``model_type`` "i2v" adds the image branch."""
    import comfy.ldm.wan.model
    import comfy.ops

    model = comfy.ldm.wan.model.WanModel(
        model_type=model_type, patch_size=(1, 2, 2), dim=spec.dim, ffn_dim=spec.ffn_dim, num_heads=spec.num_heads,
        num_layers=spec.num_layers, in_dim=spec.in_dim, out_dim=spec.out_dim, text_dim=text_dim, dtype=dtype,
        operations=comfy.ops.disable_weight_init)
    _seeded_([p for _, p in sorted(model.named_parameters())], seed)
    return model.eval()


def wan_state_dict(spec: TinyWan = TinyWan(), seed: int = 0) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in build_wan_model(spec, seed).state_dict().items()}


def wan_vae_state_dict(dim: int = 8, seed: int = 1) -> dict[str, torch.Tensor]:
    import comfy.ldm.wan.vae

    vae = comfy.ldm.wan.vae.WanVAE(dim=dim, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                  temperal_downsample=[False, True, True], dropout=0.0)
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for k, v in sorted(vae.state_dict().items()):
        if v.ndim <= 1:  # norms' gamma and biases: keep activations sane
            sd[k] = torch.ones_like(v) if "gamma" in k else torch.zeros_like(v)
        else:
            fan_in = v[0].numel()
            sd[k] = torch.randn(v.shape, generator=gen) / fan_in ** 0.5
    return sd


def wan_lora_state_dict(spec: TinyWan = TinyWan(), rank: int = 4, seed: int = 2, targets=None) -> dict[str, torch.Tensor]:
    """A LoRA in the generic ``<key>.lora_up/.lora_down/.alpha`` format ComfyUI maps for any model."""
    targets = targets or [f"blocks.{i}.{name}" for i in range(spec.num_layers)
                          for name in ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "ffn.0")]
    shapes = dict((k, v.shape) for k, v in build_wan_model(spec).state_dict().items())
    return lora_state_dict(shapes, targets, rank, seed)


def lora_state_dict(shapes: dict, targets, rank: int = 4, seed: int = 2) -> dict[str, torch.Tensor]:
    """A LoRA for the Linear layers ``targets`` of a model whose state dict has ``shapes``
    (key -> shape), in the generic format ComfyUI maps for any diffusion model."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for target in targets:
        out_dim, in_dim = shapes[f"{target}.weight"]
        sd[f"diffusion_model.{target}.lora_up.weight"] = torch.randn(out_dim, rank, generator=gen) * 0.2
        sd[f"diffusion_model.{target}.lora_down.weight"] = torch.randn(rank, in_dim, generator=gen) * 0.2
        sd[f"diffusion_model.{target}.alpha"] = torch.tensor(float(rank))
    return sd


def prompt_embedding(tokens: int = 12, seed: int = 3, text_dim: int = WAN_TEXT_DIM) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, tokens, text_dim, generator=gen)


DATASET_DIRS = ("output", "datasets")  # where LoadTrainingDataset looks: ComfyUI 0.3.75, and 0.33 on


def write_conditioning_dataset(base_dir: Path, name: str, embedding: torch.Tensor, extra: dict | None = None) -> None:
    """One sample in the layout of ComfyUI's SaveTrainingDataset / LoadTrainingDataset, under every
    folder a ComfyUI release reads it from (0.33 lists only folders with a metadata.json)."""
    latent = {"samples": torch.zeros(1, 16, 1, 8, 8)}  # unused by the workflow, required by the format
    shard = {"latents": [latent], "conditioning": [[[embedding, dict(extra or {})]]]}
    for root in DATASET_DIRS:
        folder = Path(base_dir) / root / name
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(shard, folder / "shard_0000.pkl")
        (folder / "metadata.json").write_text(json.dumps({"num_samples": 1, "num_shards": 1, "shard_size": 1}))


def saved_dataset(base_dir: Path, name: str) -> Path:
    """The folder SaveTrainingDataset wrote ``name`` to, whichever release ran it."""
    for root in reversed(DATASET_DIRS):
        folder = Path(base_dir) / root / name
        if (folder / "shard_0000.pkl").exists():
            return folder
    raise FileNotFoundError(f"no saved dataset {name!r} under {base_dir}")


def hunyuan_video_state_dict(seed: int = 6) -> dict[str, torch.Tensor]:
    """A HunyuanVideo with hidden 256 (2 heads of 128: detection derives heads = hidden // 128),
    one double and one single block, text width 64, CLIP-L pooled width 768 (``vector_in``)
    and guidance: the Flux-layer stand-in that UNETLoader detects."""
    import comfy.ldm.hunyuan_video.model
    import comfy.ops

    model = make(comfy.ldm.hunyuan_video.model.HunyuanVideo,
        image_model="hunyuan_video", in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=64,
        hidden_size=256, mlp_ratio=4.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56],
        theta=256, patch_size=[1, 2, 2], qkv_bias=True, guidance_embed=True, byt5=False, meanflow=False,
        use_cond_type_embedding=False, vision_in_dim=None, dtype=torch.float32, device="cpu",
        operations=comfy.ops.disable_weight_init)
    _seeded_([p for _, p in sorted(model.named_parameters())], seed, scale=0.03)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def t5_base_state_dict(seed: int = 10) -> dict[str, torch.Tensor]:
    """T5-base (Stable Audio's text encoder): the smallest text encoder ComfyUI's CLIPLoader
    detects (~110M parameters); its layers are ComfyUI's T5 class, like T5-XXL and UMT5-XXL."""
    import comfy.ops
    import comfy.text_encoders.t5

    config = comfy_json_config(comfy.text_encoders.t5, "t5_config_base.json")
    return _random_state_dict(lambda: comfy.text_encoders.t5.T5(config, torch.float32, None, comfy.ops.disable_weight_init),
                              seed, dtype=torch.float32)


def flux1_state_dict(seed: int = 11, depth: int = 1, depth_single: int = 1, text_dim: int | None = None,
                     pooled_dim: int | None = None, dtype=torch.float16, device="cpu") -> dict[str, torch.Tensor]:
    """The smallest Flux.1 UNETLoader accepts: its detection fixes 24 heads of 128 (width 3072);
    one double and one single block (about 0.5B parameters, stored in fp16). Text and pooled
    widths (read from the file) are the tiny T5-XXL's and CLIP-L's. With Flux.1 dev's depths
    (19 and 38) and widths (T5-XXL 4096, CLIP-L 768) it is Flux.1-dev-sized: 11.9B parameters."""
    import comfy.ldm.flux.model
    import comfy.ops

    return _random_state_dict(lambda: make(comfy.ldm.flux.model.Flux,
        image_model="flux", in_channels=16, out_channels=16, vec_in_dim=pooled_dim or TEXT_DIM,
        context_in_dim=text_dim or TEXT_DIM, hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=depth,
        depth_single_blocks=depth_single, axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True,
        guidance_embed=True, dtype=torch.float32, operations=comfy.ops.disable_weight_init), seed, dtype=dtype,
        device=device)


FP8_E4M3_MAX = 448.0


def scaled_fp8_state_dict(sd: dict) -> dict[str, torch.Tensor]:
    """``sd`` as a "scaled fp8" checkpoint (the form of ComfyUI's ``*_fp8_scaled`` files): every
    matrix (the model's Linear weights) in float8_e4m3fn with a per-tensor fp32 ``scale_weight``
    beside it, and the empty ``scaled_fp8`` tensor that tells ComfyUI's loader. ComfyUI 0.3.75
    loads it with its scaled-fp8 layers; 0.33 converts it to QuantizedTensor (TensorCoreFP8Layout)."""
    fp8 = torch.float8_e4m3fn
    out = {}
    for key, value in sd.items():
        if key.endswith(".weight") and value.ndim == 2 and value.is_floating_point():
            scale = value.float().abs().max().clamp_min(1e-12) / FP8_E4M3_MAX
            out[key] = (value.float() / scale).to(fp8)
            out[key[:-len("weight")] + "scale_weight"] = scale.reshape(())
        else:
            out[key] = value
    out["scaled_fp8"] = torch.empty(0, dtype=fp8)
    return out


QWEN_IMAGE_CONFIG = {"joint_attention_dim": 64}  # the tiny Qwen2.5-VL's width; detection fixes 3584


def qwen_image_state_dict(seed: int = 12) -> tuple[dict, dict]:
    """The smallest Qwen-Image UNETLoader accepts (detection fixes 24 heads of 128): one block; its
    text width (the tiny Qwen2.5-VL's) is stated in the file's metadata."""
    import comfy.ldm.qwen_image.model
    import comfy.ops

    return stating_config(_random_state_dict(lambda: comfy.ldm.qwen_image.model.QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=1, attention_head_dim=128, num_attention_heads=24,
        axes_dims_rope=(16, 56, 56), dtype=torch.float32, operations=comfy.ops.disable_weight_init,
        **QWEN_IMAGE_CONFIG), seed), "transformer", QWEN_IMAGE_CONFIG)


def flux_vae_state_dict(seed: int = 13) -> dict[str, torch.Tensor]:
    """A Flux.1-style KL autoencoder (16 latent channels, no quant convs): VAELoader fixes its
    widths (128 base channels), about 84M parameters."""
    import comfy.ldm.models.autoencoder

    ddconfig = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    return _random_state_dict(lambda: comfy.ldm.models.autoencoder.AutoencodingEngine(
        regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
        encoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Encoder", "params": ddconfig},
        decoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Decoder", "params": ddconfig}), seed,
        dtype=torch.float32)


# Detection reads the text width from txt_in (Mistral 3 Small gives 15360): 768 is T5-base's, the
# encoder that stands in for Mistral in the FLUX.2 example's test.
FLUX2_TEXT_DIM = 768
# FLUX.2's detection fixes 48 heads of 128 (width 6144, about two billion parameters for one
# block of each kind). The tiny file states its own heads and rope axes in its safetensors
# metadata, in the ``config`` -> ``transformer`` form ComfyUI reads from LTXV files; stock
# ComfyUI ignores it for FLUX.2, the tests' server applies it (tests/comfy_extensions).
FLUX2_CONFIG = {"num_heads": 4, "axes_dim": [16, 16, 16, 16]}


def flux2_state_dict(seed: int = 17) -> tuple[dict, dict]:
    """FLUX.2 at width 256 (4 heads of 64: room for Ulysses 2 x TP 2), one double and one single block."""
    import comfy.ldm.flux.model
    import comfy.ops

    return stating_config(_random_state_dict(lambda: make(comfy.ldm.flux.model.Flux,
        image_model="flux2", in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=FLUX2_TEXT_DIM,
        hidden_size=256, mlp_ratio=3.0, depth=1, depth_single_blocks=1, theta=2000, patch_size=1, qkv_bias=False,
        guidance_embed=True, global_modulation=True, mlp_silu_act=True, ops_bias=False, default_ref_method="index",
        ref_index_scale=10.0, dtype=torch.float32, operations=comfy.ops.disable_weight_init, **FLUX2_CONFIG), seed),
        "transformer", FLUX2_CONFIG)


def flux2_vae_state_dict(seed: int = 18) -> dict[str, torch.Tensor]:
    """The FLUX.2 autoencoder's layout (32 latent channels, quant convs, a batch norm over 2 x 2
    patches that makes 128 channels): VAELoader fixes its widths too, about 84M parameters."""
    import comfy.ldm.models.autoencoder

    ddconfig = {"double_z": True, "z_channels": 32, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
                "batch_norm_latent": True}
    return _random_state_dict(lambda: comfy.ldm.models.autoencoder.AutoencoderKL(ddconfig=ddconfig, embed_dim=32),
                              seed, dtype=torch.float32)


TINY_FILES = {
    "unet": "tiny_wan21_t2v.safetensors",
    "vae": "tiny_wan21_vae.safetensors",
    "lora_a": "tiny_wan21_lora_a.safetensors",
    "lora_b": "tiny_wan21_lora_b.safetensors",
    "prompt_dataset": "tiny_wan_prompt",
    "hunyuan_unet": "tiny_hunyuan_video.safetensors",
    "unet_4heads": "tiny_wan21_t2v_4heads.safetensors",
    "t5_base": "tiny_t5_base.safetensors",
    "flux1": "tiny_flux1.safetensors",
    "qwen_image": "tiny_qwen_image.safetensors",
    "flux_vae": "tiny_flux_ae.safetensors",
    "umt5_xxl": "tiny_umt5_xxl.safetensors",
    "t5_xxl": "tiny_t5_xxl.safetensors",
    "clip_l": "tiny_clip_l.safetensors",
    "qwen25_vl_7b": "tiny_qwen25_vl_7b.safetensors",
    "flux2": "tiny_flux2.safetensors",
    "flux2_vae": "tiny_flux2_vae.safetensors",
    "hunyuan_prompt_dataset": "tiny_hunyuan_prompt",
}


DEMO_FILES = ("unet", "vae", "lora_a", "lora_b", "prompt_dataset")
# Only for the example-workflow test: the large ones (Flux.1, Qwen-Image at the widths their
# detection fixes) and the files that need the test server's extension (FLUX.2, text encoders).
LARGE_FILES = ("flux1", "qwen_image", "flux_vae", "flux2", "flux2_vae", "umt5_xxl", "t5_xxl", "clip_l", "qwen25_vl_7b")


def write_tiny_wan_files(base_dir: Path, spec: TinyWan = TinyWan(), only=None) -> dict[str, Path]:
    """Write the tiny model files under a ComfyUI base directory (all, or the names in ``only``,
    e.g. ``DEMO_FILES``). Idempotent."""
    from safetensors.torch import save_file


    base_dir = Path(base_dir)
    paths = {
        "unet": base_dir / "models" / "diffusion_models" / TINY_FILES["unet"],
        "vae": base_dir / "models" / "vae" / TINY_FILES["vae"],
        "lora_a": base_dir / "models" / "loras" / TINY_FILES["lora_a"],
        "lora_b": base_dir / "models" / "loras" / TINY_FILES["lora_b"],
        "prompt_dataset": base_dir / "datasets" / TINY_FILES["prompt_dataset"],
        "hunyuan_unet": base_dir / "models" / "diffusion_models" / TINY_FILES["hunyuan_unet"],
        "unet_4heads": base_dir / "models" / "diffusion_models" / TINY_FILES["unet_4heads"],
        "t5_base": base_dir / "models" / "text_encoders" / TINY_FILES["t5_base"],
        "flux1": base_dir / "models" / "diffusion_models" / TINY_FILES["flux1"],
        "qwen_image": base_dir / "models" / "diffusion_models" / TINY_FILES["qwen_image"],
        "flux_vae": base_dir / "models" / "vae" / TINY_FILES["flux_vae"],
        "hunyuan_prompt_dataset": base_dir / "datasets" / TINY_FILES["hunyuan_prompt_dataset"],
        "flux2": base_dir / "models" / "diffusion_models" / TINY_FILES["flux2"],
        "flux2_vae": base_dir / "models" / "vae" / TINY_FILES["flux2_vae"],
        **{name: base_dir / "models" / "text_encoders" / TINY_FILES[name]
           for name in ("umt5_xxl", "t5_xxl", "clip_l", "qwen25_vl_7b")},
    }
    makers = {
        "unet": lambda: wan_state_dict(spec),
        "vae": lambda: wan_vae_state_dict(),
        "lora_a": lambda: wan_lora_state_dict(spec, seed=2),
        "lora_b": lambda: wan_lora_state_dict(spec, seed=5, targets=[f"blocks.{i}.cross_attn.q"
                                                                     for i in range(spec.num_layers)]),
        "hunyuan_unet": hunyuan_video_state_dict,
        # Width 512 = 4 heads of 128 for ComfyUI's detection: room for TP 4 (and TP 2 x Ulysses 2).
        "unet_4heads": lambda: wan_state_dict(TinyWan(dim=512, ffn_dim=1024, num_layers=2), seed=9),
        "t5_base": t5_base_state_dict,
        "flux1": flux1_state_dict,
        "qwen_image": qwen_image_state_dict,
        "flux_vae": flux_vae_state_dict,
        "flux2": flux2_state_dict,
        "flux2_vae": flux2_vae_state_dict,
        "umt5_xxl": tiny_text_encoders.umt5_xxl,
        "t5_xxl": tiny_text_encoders.t5_xxl,
        "clip_l": tiny_text_encoders.clip_l,
        "qwen25_vl_7b": tiny_text_encoders.qwen25_vl_7b,
    }
    for name, make in makers.items():
        if only is not None and name not in only:
            continue
        path = paths[name]
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".partial")
            made = make()  # a state dict, or (state dict, metadata) from stating_config
            sd, metadata = made if isinstance(made, tuple) else (made, None)
            save_file(sd, str(tmp), metadata=metadata)
            os.replace(tmp, path)
    if (only is None or "prompt_dataset" in only) and not (paths["prompt_dataset"] / "shard_0000.pkl").exists():
        write_conditioning_dataset(base_dir, TINY_FILES["prompt_dataset"], prompt_embedding())
    if (only is None or "hunyuan_prompt_dataset" in only) and \
            not (paths["hunyuan_prompt_dataset"] / "shard_0000.pkl").exists():
        pooled = torch.randn(1, 768, generator=torch.Generator().manual_seed(8))
        write_conditioning_dataset(base_dir, TINY_FILES["hunyuan_prompt_dataset"],
                                   prompt_embedding(tokens=9, seed=7, text_dim=64),
                                   extra={"pooled_output": pooled})
    return paths


# HunyuanVideo 1.5's image inputs. ComfyUI matches a 1.5 transformer by its vision projection's
# width, 1152 (SigLIP so400m's), so the vision encoder keeps that width: two layers (the encode
# also returns the penultimate one) of 16 heads and a narrow MLP, over 3 x 3 patches of 16. Its
# file states that config for the test server's extension (ComfyUI's SigLIP config fixes 27 layers).
SIGLIP_TINY = {"num_channels": 3, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152, "image_size": 48,
               "intermediate_size": 64, "model_type": "siglip_vision_model", "num_attention_heads": 16,
               "num_hidden_layers": 2, "patch_size": 16, "image_mean": [0.5, 0.5, 0.5],
               "image_std": [0.5, 0.5, 0.5]}


def siglip_tiny_state_dict(seed: int = 30) -> tuple[dict, dict]:
    """A one-layer SigLIP vision encoder of width 1152 that CLIPVisionLoader loads through the
    test server's extension (``config`` -> ``clip_vision``)."""
    import comfy.clip_model
    import comfy.ops

    sd = _random_state_dict(lambda: comfy.clip_model.CLIPVisionModelProjection(
        SIGLIP_TINY, torch.float32, "cpu", comfy.ops.disable_weight_init), seed, dtype=torch.float32)
    return stating_config(sd, "clip_vision", SIGLIP_TINY)


def taehv_hv15_state_dict(seed: int = 31) -> dict[str, torch.Tensor]:
    """ComfyUI's light autoencoder for HunyuanVideo 1.5 (TAEHV, 32 latent channels, 16x in space,
    4x in time; VAELoader detects it from its keys), the one small VAE that encodes 1.5's
    latents (ComfyUI 0.33 on; 0.3.75's refuses to encode)."""
    import comfy.taesd.taehv

    return _random_state_dict(lambda: comfy.taesd.taehv.TAEHV(latent_channels=32), seed, dtype=torch.float32)


# LTX-2's video VAE at LTX's real compression (32x in space, 8x in time: ComfyUI's LTXV VAE wrapper
# fixes those factors, and LTXVImgToVideoInplace / LTXVAddGuide size their images from them), eight
# channels wide, about 1.2M parameters. VAELoader detects it from its keys and builds it from the
# ``config`` -> ``vae`` the file states, as it does for LTX-2's own files.
LTX2_VAE_TINY = {
    "dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128, "patch_size": 4,
    "encoder_blocks": [["res_x", {"num_layers": 1}], ["compress_space_res", {"multiplier": 2}],
                       ["compress_time_res", {"multiplier": 2}], ["compress_all_res", {"multiplier": 2}],
                       ["compress_all_res", {"multiplier": 1}], ["res_x", {"num_layers": 1}]],
    "decoder_blocks": [["res_x", {"num_layers": 1}], ["compress_all", {"residual": True, "multiplier": 1}],
                       ["compress_all", {"residual": True, "multiplier": 2}], ["compress_time", {"multiplier": 2}],
                       ["compress_space", {"multiplier": 2}], ["res_x", {"num_layers": 1}]],
    "norm_layer": "pixel_norm", "latent_log_var": "uniform", "causal_decoder": False,
    "timestep_conditioning": False, "encoder_base_channels": 8, "decoder_base_channels": 8,
}


def ltx2_video_vae_state_dict(seed: int = 32) -> tuple[dict, dict]:
    """The tiny LTX-2 video VAE (``LTX2_VAE_TINY``) with its per-channel latent statistics near
    LTX's (means about 0, spreads about 1: the random-weights default of zero spreads would divide
    the latent by zero)."""
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

    sd = _random_state_dict(lambda: VideoVAE(config=LTX2_VAE_TINY), seed, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    sd["per_channel_statistics.std-of-means"] = 0.5 + torch.rand(128, generator=gen)
    sd["per_channel_statistics.mean-of-means"] = torch.randn(128, generator=gen) * 0.1
    return stating_config(sd, "vae", LTX2_VAE_TINY)
