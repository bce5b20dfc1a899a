"""The Wan 2.1 VAE (Wan 2.1, Wan 2.2 14B, Qwen-Image) and the Wan 2.2 VAE (TI2V 5B). ``CausalConv3d``
pads its rows itself (up to ComfyUI 0.3.x with ``F.pad``; from 0.33 the conv does), down-sampling
pads with a ``ZeroPad2d`` before a stride-2 conv; causal time caches hold the band's rows (per
rank); attention runs per frame. Wan 2.2 patchifies 2x2 pixels before its encoder."""
from __future__ import annotations

import torch

from ..vocabulary.vae import TORCH_ROW_LOCAL, AttentionSite, PaddedConv, VaePlan

_WAN = "comfy.ldm.wan.vae"
_WAN22 = "comfy.ldm.wan.vae2_2"

_WAN_COMMON = (
    *TORCH_ROW_LOCAL,
    f"{_WAN}.RMS_norm",  # over channels, per pixel
    "torch.nn.modules.upsampling.Upsample",  # nearest-exact 2x
    "torch.nn.modules.padding.ZeroPad2d",  # see the padded conv after it
)


def _zero_pad_rows(pad: torch.nn.Module) -> tuple[int, int]:
    """Rows a ``ZeroPad2d`` adds (its padding is (left, right, top, bottom)); none for other layers."""
    if isinstance(pad, torch.nn.ZeroPad2d):
        return int(pad.padding[2]), int(pad.padding[3])
    return 0, 0


def _causal_rows(conv) -> tuple[int, int]:
    pad = conv._padding
    return (int(pad[2]), int(pad[3])) if isinstance(pad, (tuple, list)) else (0, 0)


def _wan_padded(resample: str) -> tuple[PaddedConv, ...]:
    return (
        # Causal conv: up to ComfyUI 0.3.x it pads rows itself with F.pad(x, self._padding) (left,
        # right, top, bottom, front, back); from 0.33 ``_padding`` is the time padding alone and
        # the conv pads the rows.
        PaddedConv(f"{_WAN}.CausalConv3d", "", _causal_rows),
        # Down-sampling: ZeroPad2d((0, 1, 0, 1)) then a stride-2 conv (up-sampling has no pad layer).
        PaddedConv(resample, "resample.1", lambda m: _zero_pad_rows(m.resample[0])),
    )


WAN21 = VaePlan(
    family="vae_wan21",
    title="Wan 2.1 VAE (Wan 2.1, Wan 2.2 14B, Qwen-Image)",
    classes=(f"{_WAN}.WanVAE",),
    notes="row bands; causal time caches per rank; frame attention gathers K/V",
    attention=(AttentionSite(f"{_WAN}.AttentionBlock"),),  # per frame
    padded=_wan_padded(f"{_WAN}.Resample"),
    row_local=(*_WAN_COMMON, f"{_WAN}.WanVAE", f"{_WAN}.Encoder3d", f"{_WAN}.Decoder3d", f"{_WAN}.ResidualBlock"),
    encode_rows=lambda m: 2 ** (len(m.dim_mult) - 1),
)


WAN22 = VaePlan(
    family="vae_wan22",
    title="Wan 2.2 VAE (Wan 2.2 TI2V 5B)",
    classes=(f"{_WAN22}.WanVAE",),
    notes="row bands; causal time caches per rank; frame attention gathers K/V",
    attention=(AttentionSite(f"{_WAN}.AttentionBlock"),),
    padded=_wan_padded(f"{_WAN22}.Resample"),
    row_local=(
        *_WAN_COMMON, f"{_WAN}.ResidualBlock",
        f"{_WAN22}.WanVAE", f"{_WAN22}.Encoder3d", f"{_WAN22}.Decoder3d", f"{_WAN22}.ResidualBlock",
        f"{_WAN22}.Down_ResidualBlock", f"{_WAN22}.Up_ResidualBlock",
        f"{_WAN22}.AvgDown3D", f"{_WAN22}.DupUp3D",  # 2x2 average / duplicate shortcuts
    ),
    # 2x2 patchify before the encoder, then one 2x down-sampling per level but the last.
    encode_rows=lambda m: 2 * 2 ** (len(m.dim_mult) - 1),
)
