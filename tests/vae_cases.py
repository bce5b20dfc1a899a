"""Tiny VAEs of every family the parallel VAE supports, built from ComfyUI's own classes with
seeded random weights, and inputs whose height does not divide by the world size.

Each case returns ``(module, decode_input, encode_input)``. Heights are 13 latent rows
(13 x 8 or 13 x 16 pixel rows), so that neither 2 nor 4 ranks split them evenly.

Families: KL (SD, SD3 / Flux.1, Flux.2), Wan 2.1, Wan 2.2, the HunyuanVideo VAE, the HunyuanImage
2.1 32x VAE and the LTX-2 video VAE (their classes exist in 0.3.75 as in 0.33: the HunyuanVideo
VAE's convs are ``VideoConv3d`` in 0.3.75, ``CarriedConv3d`` with time carries in 0.33). The
HunyuanVideo 1.5 VAE and the HunyuanImage 2.1 refiner's (``hunyuan_video.vae_refiner``) are
registered only where ComfyUI builds them as 0.33 does (0.3.75's ``vae_refiner`` has other layers,
which the parallel VAE refuses by name).
"""
from __future__ import annotations

import math

import torch

from text_encoder_cases import available

VAES = {}
LATENT_ROWS = 13


def vae_case(name, needs: str | None = None):
    """Registers a case (only where this ComfyUI has ``needs``, "package.module.attribute")."""
    def register(fn):
        if available(needs):
            VAES[name] = fn
        return fn
    return register


def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights that keep activations around unit scale through a deep random net
    (ComfyUI's layers skip initialisation, so every tensor is set here)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if p.ndim >= 2:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / math.sqrt(fan_in)))
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:  # norm scales
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
        for name, b in sorted(module.named_buffers()):
            if name.endswith("running_mean"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
            elif name.endswith("running_var"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))
    return module.eval().requires_grad_(False)


def _inputs(seed: int, latent: tuple, pixels: tuple):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(latent, generator=gen), torch.rand(pixels, generator=gen) * 2 - 1


def kl_ddconfig(**extra) -> dict:
    # Channels are multiples of 32: ComfyUI's GroupNorm has 32 groups. Three 2x levels: factor 8.
    return {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 32,
            "ch_mult": [1, 2, 2, 2], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0, **extra}


@vae_case("kl_sd")
def kl_sd():
    """SD1.x / SDXL layout: AutoencoderKL with quant convs, 4 latent channels; a batch of 2."""
    from comfy.ldm.models.autoencoder import AutoencoderKL

    vae = randomize(AutoencoderKL(ddconfig=kl_ddconfig(), embed_dim=4), 1)
    z, x = _inputs(11, (2, 4, LATENT_ROWS, 6), (2, 3, LATENT_ROWS * 8, 40))
    return vae, z, x


@vae_case("kl_flux1")
def kl_flux1():
    """SD3 / Flux.1 layout: AutoencodingEngine without quant convs, 16 latent channels."""
    from comfy.ldm.models.autoencoder import AutoencodingEngine

    model = "comfy.ldm.modules.diffusionmodules.model"
    config = kl_ddconfig(z_channels=16)
    vae = randomize(AutoencodingEngine(
        regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
        encoder_config={"target": f"{model}.Encoder", "params": config},
        decoder_config={"target": f"{model}.Decoder", "params": config}), 2)
    z, x = _inputs(12, (1, 16, LATENT_ROWS, 5), (1, 3, LATENT_ROWS * 8, 48))
    return vae, z, x


@vae_case("kl_flux2")
def kl_flux2():
    """Flux.2 layout: AutoencoderKL with the batch-norm latent (2x2 pixels folded into channels)."""
    from comfy.ldm.models.autoencoder import AutoencoderKL

    vae = randomize(AutoencoderKL(ddconfig=kl_ddconfig(batch_norm_latent=True), embed_dim=4), 3)
    z, x = _inputs(13, (1, 16, LATENT_ROWS, 3), (1, 3, LATENT_ROWS * 16, 32))
    return vae, z, x


@vae_case("wan21")
def wan21():
    """Wan 2.1 VAE (also Qwen-Image's): 3 latent frames decode to 9, 5 frames encode to 2."""
    from comfy.ldm.wan.vae import WanVAE

    vae = randomize(WanVAE(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
                           temperal_downsample=[False, True, True]), 4)
    z, x = _inputs(14, (1, 16, 3, LATENT_ROWS, 5), (1, 3, 5, LATENT_ROWS * 8, 40))
    return vae, z, x


@vae_case("wan22")
def wan22():
    """Wan 2.2 VAE (TI2V 5B): 2x2 patchify around a factor-8 encoder / decoder."""
    from comfy.ldm.wan.vae2_2 import WanVAE

    vae = randomize(WanVAE(dim=8, dec_dim=8, z_dim=8, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
                           temperal_downsample=[False, True, True]), 5)
    z, x = _inputs(15, (1, 8, 2, LATENT_ROWS, 3), (1, 3, 5, LATENT_ROWS * 16, 32))
    return vae, z, x



@vae_case("hunyuan_video")
def hunyuan_video():
    """HunyuanVideo VAE as comfy/sd.py builds it: AutoencoderKL with ``conv3d`` (replicate-padded
    3x3x3 convs), 4x time compression; 2 latent frames decode to 5, 5 frames encode to 2."""
    from comfy.ldm.models.autoencoder import AutoencoderKL

    vae = randomize(AutoencoderKL(ddconfig=kl_ddconfig(z_channels=16, conv3d=True, time_compress=4), embed_dim=16), 6)
    z, x = _inputs(16, (1, 16, 2, LATENT_ROWS, 5), (1, 3, 5, LATENT_ROWS * 8, 40))
    return vae, z, x


@vae_case("hunyuan_image21")
def hunyuan_image21():
    """HunyuanImage 2.1 VAE as comfy/sd.py builds it (AutoencodingEngine around
    hunyuan_video.vae's Encoder / Decoder), with 16x instead of 32x (four 2x levels)."""
    from comfy.ldm.models.autoencoder import AutoencodingEngine

    config = {"block_out_channels": [32, 32, 64, 64], "in_channels": 3, "out_channels": 3, "num_res_blocks": 1,
              "ffactor_spatial": 16, "downsample_match_channel": True, "upsample_match_channel": True,
              "z_channels": 16}
    vae = randomize(AutoencodingEngine(
        regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
        encoder_config={"target": "comfy.ldm.hunyuan_video.vae.Encoder", "params": config},
        decoder_config={"target": "comfy.ldm.hunyuan_video.vae.Decoder", "params": config}), 7)
    z, x = _inputs(17, (1, 16, LATENT_ROWS, 3), (1, 3, LATENT_ROWS * 16, 48))
    return vae, z, x


def refiner_vae(config: dict, regularizer: str, seed: int):
    """``hunyuan_video.vae_refiner``'s Encoder / Decoder in an AutoencodingEngine, as comfy/sd.py builds them."""
    from comfy.ldm.models.autoencoder import AutoencodingEngine

    refiner = "comfy.ldm.hunyuan_video.vae_refiner"
    vae = randomize(AutoencodingEngine(
        regularizer_config={"target": f"comfy.ldm.models.autoencoder.{regularizer}"},
        encoder_config={"target": f"{refiner}.Encoder", "params": config},
        decoder_config={"target": f"{refiner}.Decoder", "params": config}), seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # RMS norm scales (randomize takes a 4D parameter for a weight)
        for name, p in sorted(vae.named_parameters()):
            if name.endswith("gamma"):
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
    return vae


# 0.33's vae_refiner builds its convs from model.py's CarriedConv3d (0.3.75: its own NoPadConv3d).
REFINER_VAE = "comfy.ldm.hunyuan_video.vae_refiner.CarriedConv3d"


@vae_case("hunyuan_video15", needs=REFINER_VAE)
def hunyuan_video15():
    """HunyuanVideo 1.5 VAE (``refiner_vae``: replicate-padded CarriedConv3d with time carries, RMS
    norms), 16x in space and 4x in time as the real one, narrow: 3 latent frames decode to 9 in two
    time chunks, 13 frames encode to 4 (the first frame alone, then chunks of 8 and 4)."""
    config = {"block_out_channels": [8, 16, 32, 32, 32], "in_channels": 3, "out_channels": 3, "num_res_blocks": 1,
              "ffactor_spatial": 16, "ffactor_temporal": 4, "downsample_match_channel": True,
              "upsample_match_channel": True, "z_channels": 8}
    vae = refiner_vae(config, "EmptyRegularizer", 9)
    z, x = _inputs(19, (1, 8, 3, LATENT_ROWS, 3), (1, 3, 13, LATENT_ROWS * 16, 32))
    return vae, z, x


@vae_case("hunyuan_image21_refiner", needs=REFINER_VAE)
def hunyuan_image21_refiner():
    """HunyuanImage 2.1 refiner VAE (the same Encoder / Decoder with ``refiner_vae`` off: zero-padded
    Conv3d, GroupNorm), 16x in space, 4x in time: one latent frame decodes to one (the last of 4),
    one image frame encodes to one (repeated to 4 first)."""
    config = {"block_out_channels": [32, 32, 64, 64, 64], "in_channels": 3, "out_channels": 3, "num_res_blocks": 1,
              "ffactor_spatial": 16, "ffactor_temporal": 4, "downsample_match_channel": True,
              "upsample_match_channel": True, "refiner_vae": False, "z_channels": 32}
    vae = refiner_vae(config, "DiagonalGaussianRegularizer", 10)
    z, x = _inputs(20, (1, 32, 1, LATENT_ROWS, 3), (1, 3, 1, LATENT_ROWS * 16, 32))
    return vae, z, x


LTX2_CONFIG = {
    # LTX-2's layout (space-to-depth encoder levels, depth-to-space decoder levels, pixel norm,
    # 2x2 patches), narrow and shallow: 8x in space, 4x in time. No ``spatial_padding_mode``:
    # ComfyUI then pads the encoder's convs with zeros and the decoder's by reflection.
    "dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128, "patch_size": 2,
    "encoder_blocks": [["res_x", {"num_layers": 1}], ["compress_space_res", {"multiplier": 2}],
                       ["res_x", {"num_layers": 1}], ["compress_time_res", {"multiplier": 2}],
                       ["compress_all_res", {"multiplier": 2}], ["res_x", {"num_layers": 1}]],
    "decoder_blocks": [["res_x", {"num_layers": 1}], ["compress_space", {"multiplier": 2}],
                       ["res_x", {"num_layers": 1}], ["compress_time", {"multiplier": 2}],
                       ["compress_all", {"residual": True, "multiplier": 2}], ["res_x", {"num_layers": 1}]],
    "norm_layer": "pixel_norm", "latent_log_var": "uniform", "causal_decoder": False,
    "timestep_conditioning": False, "encoder_base_channels": 8, "decoder_base_channels": 8,
}


@vae_case("ltx2")
def ltx2():
    """LTX-2 video VAE (``VideoVAE`` with an LTX-2-style config): 2 latent frames decode to 5,
    9 frames encode to 3 (``encode`` keeps 1 + 8k frames)."""
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

    vae = randomize(VideoVAE(config=LTX2_CONFIG), 8)
    stats = vae.per_channel_statistics  # buffers named with dashes: randomize leaves them empty
    gen = torch.Generator().manual_seed(28)
    with torch.no_grad():
        stats.get_buffer("std-of-means").copy_(0.5 + torch.rand(128, generator=gen))
        stats.get_buffer("mean-of-means").copy_(torch.randn(128, generator=gen) * 0.1)
    z, x = _inputs(18, (1, 128, 2, LATENT_ROWS, 4), (1, 3, 9, LATENT_ROWS * 8, 32))
    return vae, z, x
