"""KL autoencoders (``AutoencoderKL`` / ``AutoencodingEngine`` with ComfyUI's 2D ``Encoder`` /
``Decoder``): the SD1.x, SD2, SDXL, SD3, Flux.1 and Flux.2 VAEs. ``Downsample`` pads one row at the
bottom with ``F.pad`` before its stride-2 conv; the mid-block ``AttnBlock`` attends over all pixels.
The Flux.2 VAE adds a latent batch norm (running statistics, per pixel) over 2x2 latent pixels
folded into channels."""
from __future__ import annotations

import torch

from ..vocabulary.vae import TORCH_ROW_LOCAL, AttentionSite, PaddedConv, VaePlan

KL_MODEL = "comfy.ldm.modules.diffusionmodules.model"


def kl_encode_rows(module) -> int:
    # One 2x Downsample per level but the last; the Flux.2 VAE then folds 2x2 latent pixels
    # into channels (its batch-norm latent), another factor 2.
    factor = 2 ** (module.encoder.num_resolutions - 1)
    return factor * (2 if getattr(module, "bn", None) is not None else 1)


# F.pad(x, (0, 1, 0, 1)) on 4D input (a 2D conv); the 3D variant below pads otherwise.
KL_DOWNSAMPLE = PaddedConv(f"{KL_MODEL}.Downsample", "conv",
                            lambda m: (0, 1) if isinstance(m.conv, torch.nn.Conv2d) else (0, 0))


KL = VaePlan(
    family="vae_kl",
    title="KL autoencoder (SD1.x / SD2 / SDXL / SD3 / Flux.1 / Flux.2 VAE)",
    classes=("comfy.ldm.models.autoencoder.AutoencoderKL", "comfy.ldm.models.autoencoder.AutoencodingEngine"),
    notes="row bands; halo exchange per conv, GroupNorm statistics all-reduced, mid-block attention gathers K/V",
    attention=(AttentionSite(f"{KL_MODEL}.AttnBlock"),),
    padded=(KL_DOWNSAMPLE,),
    row_local=(
        *TORCH_ROW_LOCAL,
        "comfy.ldm.models.autoencoder.AutoencoderKL", "comfy.ldm.models.autoencoder.AutoencodingEngine",
        "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer",
        f"{KL_MODEL}.Encoder", f"{KL_MODEL}.Decoder", f"{KL_MODEL}.ResnetBlock",
        f"{KL_MODEL}.Upsample",  # nearest 2x, then a conv
        # Flux.2: latent batch norm with running statistics (per pixel), 2x2 pixel (un)shuffle.
        "torch.nn.modules.batchnorm.BatchNorm2d",
    ),
    encode_rows=kl_encode_rows,
)
