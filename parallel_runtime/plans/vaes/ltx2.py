"""The LTX-2 video VAE (LTX's ``CausalVideoAutoencoder``, ``VideoVAE``; also LTXV 0.9.0's): causal
3x3x3 convs whose inner ``Conv3d`` pads the rows itself (zeros, or reflect in a decoder built
without a config) and the time by repeating frames (caches per rank); 2x2 space-to-depth /
depth-to-space around convs; per-pixel norms; no attention. LTX sizes its time chunks from the
tensor it holds, so every band runs as one chunk (``call_globals``), and its ``output_buffer`` is
filled on rank 0. Decoders that add fresh noise (LTXV 0.9.1 to 0.9.8) are refused."""
from __future__ import annotations

import torch

from ..vocabulary.vae import TORCH_ROW_LOCAL, ModuleGlobal, VaePlan

_LTX = "comfy.ldm.lightricks.vae"


def _ltx_row_stride(block) -> int:
    conv = getattr(block, "conv", None)
    if type(block).__qualname__ == "SpaceToDepthDownsample":
        return int(block.stride[1])
    return int(conv.stride[1]) if isinstance(conv, torch.nn.Conv3d) else 1  # a compress_* CausalConv3d


def _ltx_encode_rows(module) -> int:
    rows = int(module.encoder.patch_size)
    for block in module.encoder.down_blocks:
        rows *= _ltx_row_stride(block)
    return rows


def _ltx_refuse(module) -> str | None:
    noisy = [m for m in module.modules() if getattr(m, "inject_noise", False)]
    if getattr(module, "timestep_conditioning", False) or noisy:
        return ("its decoder adds fresh random noise (timestep conditioning or noise injection, LTXV 0.9.1 to "
                "0.9.8), so no two decodes agree and a band could not equal the untiled one")
    return None


def _unchunked(device) -> int:
    return 1 << 62


LTX2 = VaePlan(
    family="vae_ltx2",
    title="LTX-2 video VAE (also LTXV 0.9.0)",
    classes=(f"{_LTX}.causal_video_autoencoder.VideoVAE",),
    notes="row bands; causal time caches per rank, one time chunk per band; halo exchange per conv",
    row_local=(
        *TORCH_ROW_LOCAL,
        "comfy.ops.disable_weight_init.LayerNorm",  # over channels, per pixel
        f"{_LTX}.causal_video_autoencoder.VideoVAE", f"{_LTX}.causal_video_autoencoder.Encoder",
        f"{_LTX}.causal_video_autoencoder.Decoder", f"{_LTX}.causal_video_autoencoder.UNetMidBlock3D",
        f"{_LTX}.causal_video_autoencoder.ResnetBlock3D", f"{_LTX}.causal_video_autoencoder.LayerNorm",
        f"{_LTX}.causal_video_autoencoder.processor",  # per-channel statistics
        f"{_LTX}.causal_video_autoencoder.SpaceToDepthDownsample",  # a conv, then 2x2 pixels -> channels
        f"{_LTX}.causal_video_autoencoder.DepthToSpaceUpsample",  # a conv, then channels -> 2x2 pixels
        f"{_LTX}.causal_conv3d.CausalConv3d",  # time padding and cache; its Conv3d pads the rows
        f"{_LTX}.pixel_norm.PixelNorm",
    ),
    encode_rows=_ltx_encode_rows,
    refuse=_ltx_refuse,
    call_globals=(ModuleGlobal(f"{_LTX}.causal_video_autoencoder", "get_max_chunk_size", _unchunked),),
    output_argument="output_buffer",
)
