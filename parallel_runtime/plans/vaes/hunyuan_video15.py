"""The HunyuanVideo 1.5 VAE and the HunyuanImage 2.1 refiner's (ComfyUI 0.33's
``hunyuan_video.vae_refiner`` Encoder / Decoder in an ``AutoencodingEngine``). HunyuanVideo 1.5's
``refiner_vae`` pads its ``CarriedConv3d`` by replication in ``conv_carry_causal_3d`` (time carries
per rank) and normalises per pixel (RMS); the refiner's uses zero-padded ``Conv3d`` and GroupNorm.
Levels fold 2x2 pixels (and 2 frames) into channels around a 3x3x3 conv (``DnSmpl`` / ``UpSmpl``);
the first frame is alone in time, whole in space."""
from __future__ import annotations

from ..vocabulary.vae import TORCH_ROW_LOCAL, AttentionSite, VaePlan
from .hunyuan_video import CARRIED_CONV
from .kl import KL_MODEL

_HYR = "comfy.ldm.hunyuan_video.vae_refiner"


HUNYUAN_VIDEO15 = VaePlan(
    family="vae_hunyuan_video15",
    title="HunyuanVideo 1.5 VAE (also the HunyuanImage 2.1 refiner's)",
    classes=("comfy.ldm.models.autoencoder.AutoencodingEngine",),
    notes="row bands; replicate padding at the image edges; conv carries per rank; mid-block attention gathers K/V",
    attention=(AttentionSite(f"{KL_MODEL}.AttnBlock"),),  # over all frames and pixels
    padded=(
        CARRIED_CONV,
    ),
    row_local=(
        *TORCH_ROW_LOCAL,
        "comfy.ldm.models.autoencoder.AutoencodingEngine", "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer",
        "comfy.ldm.models.autoencoder.EmptyRegularizer",
        f"{_HYR}.Encoder", f"{_HYR}.Decoder", f"{KL_MODEL}.ResnetBlock",
        f"{_HYR}.RMS_norm",  # over channels, per pixel
        f"{_HYR}.DnSmpl", f"{_HYR}.UpSmpl",  # a conv, then 2x2 pixels <-> channels (mean / repeat of the input)
        "comfy.ops.disable_weight_init.Linear",  # the mid ResnetBlocks' temb_proj, unused (no timestep)
    ),
    encode_rows=lambda m: 2 ** sum(hasattr(stage, "downsample") for stage in m.encoder.down),
)
