"""The HunyuanImage 2.1 32x VAE: a 2D ``AutoencodingEngine`` whose levels fold 2x2 pixels into
channels (``PixelShuffle2D`` / ``PixelUnshuffle2D`` around a 3x3 conv), with ComfyUI's
``ResnetBlock`` and ``AttnBlock``."""
from __future__ import annotations

from ..vocabulary.vae import TORCH_ROW_LOCAL, AttentionSite, VaePlan
from .kl import KL_MODEL

_HYI = "comfy.ldm.hunyuan_video.vae"


HUNYUAN_IMAGE21 = VaePlan(
    family="vae_hunyuan_image21",
    title="HunyuanImage 2.1 32x VAE",
    classes=("comfy.ldm.models.autoencoder.AutoencodingEngine",),
    notes="row bands; halo exchange per conv, GroupNorm statistics all-reduced, mid-block attention gathers K/V",
    attention=(AttentionSite(f"{KL_MODEL}.AttnBlock"),),
    row_local=(
        *TORCH_ROW_LOCAL,
        "comfy.ldm.models.autoencoder.AutoencodingEngine", "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer",
        f"{_HYI}.Encoder", f"{_HYI}.Decoder", f"{KL_MODEL}.ResnetBlock",
        f"{_HYI}.PixelShuffle2D", f"{_HYI}.PixelUnshuffle2D",  # 2x2 pixels <-> channels
    ),
    encode_rows=lambda m: 2 ** sum(hasattr(stage, "downsample") for stage in m.encoder.down),
)
