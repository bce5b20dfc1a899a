"""The HunyuanVideo VAE: ComfyUI's ``AutoencoderKL`` with ``conv3d``. Every 3x3x3 conv pads (1, 1)
rows by replication first, in ``conv_carry_causal_3d`` (``CarriedConv3d``, whose time carry holds
the band's rows, so it stays per rank), in ``VideoConv3d`` or in ``Downsample`` (5D input); the
mid-block attention runs over all frames and pixels."""
from __future__ import annotations

from ..vocabulary.vae import TORCH_ROW_LOCAL, AttentionSite, PaddedConv, VaePlan
from .kl import KL_DOWNSAMPLE, KL_MODEL, kl_encode_rows


def _video_conv_rows(conv) -> tuple[int, int]:
    pad = conv.padding
    return (int(pad[2]), int(pad[3])) if isinstance(pad, (tuple, list)) else (0, 0)


def _is_video_conv(module) -> bool:
    return type(module).__qualname__ == "VideoConv3d"


# ``conv_carry_causal_3d`` pads by replication; a 1x1x1 CarriedConv3d (nin_shortcut) is called directly.
CARRIED_CONV = PaddedConv(f"{KL_MODEL}.CarriedConv3d", "conv",
                          lambda m: (1, 1) if m.conv.kernel_size[-2] > 1 else (0, 0), mode=lambda m: "replicate")


HUNYUAN_VIDEO = VaePlan(
    family="vae_hunyuan_video",
    title="HunyuanVideo VAE",
    classes=("comfy.ldm.models.autoencoder.AutoencoderKL",),
    notes="row bands; replicate padding at the image edges; conv carries per rank; mid-block attention gathers K/V",
    attention=(AttentionSite(f"{KL_MODEL}.AttnBlock"),),  # over all frames and pixels
    padded=(
        KL_DOWNSAMPLE,
        PaddedConv(f"{KL_MODEL}.Downsample", "conv.conv", lambda m: (1, 1) if _is_video_conv(m.conv) else (0, 0),
                   mode=lambda m: "replicate"),
        CARRIED_CONV,
        PaddedConv(f"{KL_MODEL}.VideoConv3d", "conv", _video_conv_rows, mode=lambda m: m.padding_mode),
    ),
    row_local=(
        *TORCH_ROW_LOCAL,
        "comfy.ldm.models.autoencoder.AutoencoderKL", "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer",
        f"{KL_MODEL}.Encoder", f"{KL_MODEL}.Decoder", f"{KL_MODEL}.ResnetBlock",
        f"{KL_MODEL}.Upsample",  # nearest 2x (the first frame alone in space), then a conv
    ),
    encode_rows=kl_encode_rows,
)
