"""VAEs: every rank decodes (or encodes) a band of image rows, exactly.

A band plan says, per family, which modules of the VAE need to see beyond their
own band and how (``parallel_runtime/parallel/vae_bands.py`` does the rest, the same
way for every family):

- ``convs``: convolutions. A kernel taller than one row reads rows of the
  neighbouring bands (a halo, exchanged with the neighbour ranks); zero padding
  is applied only at the top and bottom of the whole image.
- ``padded``: convolutions whose input the code around them pads along the rows
  before the conv runs (ComfyUI's ``Downsample`` pads ``(0, 1)`` with ``F.pad``,
  Wan's ``CausalConv3d`` pads itself, Wan's ``Resample`` has a ``ZeroPad2d``,
  HunyuanVideo's ``CarriedConv3d`` / ``VideoConv3d`` pad by replication).
  On a band those rows are wrong at the band edges; the runtime removes them and
  treats them as the conv's global padding, in the declared mode.
- ``group_norms``: normalisations over space; their statistics are combined
  over all ranks.
- ``attention``: modules that call ``fn(q, k, v)`` on ``[B, C, H, W]`` tensors
  (attention over all pixels); every rank attends its own query rows to the
  gathered keys and values. They run at the lowest resolution.
- ``row_local``: every other module class allowed inside the model. Each of
  them treats every row on its own, or every pair of rows for a 2x up/down
  sampler (nearest upsampling, pixel (un)shuffle, average pooling, per-pixel
  norms): exact on any band whose edges are aligned to the sampling factors.
  A model holding any class the plan does not name is refused, so a variant
  with an unknown layer cannot be decoded silently wrong.

- ``call_globals``: module globals set for the call (LTX sizes its time chunks
  from the tensor it holds; on bands of different heights the ranks would chunk
  differently, so every band runs unchunked, as one chunk).
- ``output_argument``: a decode keyword naming the caller's output tensor (LTX's
  ``output_buffer``); the bands decode without it and rank 0 fills it.

A class may have several plans (ComfyUI's ``AutoencoderKL`` is also the
HunyuanVideo VAE, its ``AutoencodingEngine`` also HunyuanImage 2.1's and HunyuanVideo
1.5's): the first plan that covers every layer of the model is used.

Families: KL autoencoders (SD, SDXL, SD3, Flux.1, Flux.2), the HunyuanVideo VAE
(3D ``AutoencoderKL``), the HunyuanImage 2.1 32x VAE, the HunyuanVideo 1.5 VAE (also
the HunyuanImage 2.1 refiner's; ComfyUI 0.33), the Wan 2.1 and 2.2 VAEs and the
LTX-2 video VAE (also LTXV 0.9.0's).

Classes are named by qualified name. Convs and norms match through the class
hierarchy (ComfyUI's ``ops.Conv2d`` is a ``torch.nn.Conv2d``); every other
class must match exactly (a subclass may do something else).

Time (video VAEs): each rank runs the model's own frame loop on its band; the
causal time caches (Wan's, HunyuanVideo's conv carries, LTX's) hold only the
band's rows, so they stay per rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .base import ContextParallelPlan, ModelPlan

NO_SEQUENCE_SPLIT = ContextParallelPlan(inputs={}, outputs={}, attention={})


@dataclass(frozen=True)
class PaddedConv:
    """A conv whose input the forward of ``owner`` pads along the rows first.

    ``conv``: dotted attribute path from the owner to the conv ("" when the owner
    is the conv itself). ``rows(owner) -> (top, bottom)``: the rows added ((0, 0):
    this spec does not pad that conv). ``mode(owner)``: how ("zeros", "replicate", "reflect").
    """

    owner: str
    conv: str
    rows: Callable[[torch.nn.Module], tuple[int, int]]
    mode: Callable[[torch.nn.Module], str] = field(default=lambda owner: "zeros")


@dataclass(frozen=True)
class ModuleGlobal:
    """``module.name = value`` for the duration of a banded call."""

    module: str
    name: str
    value: object


@dataclass(frozen=True)
class AttentionSite:
    """``owner`` calls ``getattr(owner, function)(q, k, v)`` with ``[B, C, H, W]`` tensors."""

    owner: str
    function: str = "optimized_attention"


@dataclass(frozen=True)
class BandPlan:
    convs: tuple[str, ...]
    group_norms: tuple[str, ...]
    attention: tuple[AttentionSite, ...]
    row_local: tuple[str, ...]
    # Pixel rows per latent row: the bands of an encode start at multiples of it, so that
    # every strided conv and pooling sees whole windows.
    encode_rows: Callable[[torch.nn.Module], int]
    padded: tuple[PaddedConv, ...] = ()
    # Why a model of a covered class is not supported after all (None: it is).
    refuse: Callable[[torch.nn.Module], "str | None"] = field(default=lambda module: None)
    call_globals: tuple[ModuleGlobal, ...] = ()
    output_argument: str | None = None

    def known(self) -> frozenset[str]:
        return frozenset((*self.row_local, *(a.owner for a in self.attention), *(p.owner for p in self.padded)))


TORCH_CONVS = ("torch.nn.modules.conv.Conv2d", "torch.nn.modules.conv.Conv3d")
TORCH_GROUP_NORM = ("torch.nn.modules.normalization.GroupNorm",)
TORCH_ROW_LOCAL = (
    "torch.nn.modules.module.Module",  # plain containers (``down = nn.Module()``)
    "torch.nn.modules.container.Sequential", "torch.nn.modules.container.ModuleList",
    "torch.nn.modules.activation.SiLU", "torch.nn.modules.dropout.Dropout", "torch.nn.modules.linear.Identity",
)


def _zero_pad_rows(pad: torch.nn.Module) -> tuple[int, int]:
    """Rows a ``ZeroPad2d`` adds (its padding is (left, right, top, bottom)); none for other layers."""
    if isinstance(pad, torch.nn.ZeroPad2d):
        return int(pad.padding[2]), int(pad.padding[3])
    return 0, 0


# ---------------------------------------------------------------- 2D KL autoencoder
_KL = "comfy.ldm.modules.diffusionmodules.model"


def _kl_encode_rows(module) -> int:
    # One 2x Downsample per level but the last; the Flux.2 VAE then folds 2x2 latent pixels
    # into channels (its batch-norm latent), another factor 2.
    factor = 2 ** (module.encoder.num_resolutions - 1)
    return factor * (2 if getattr(module, "bn", None) is not None else 1)


# F.pad(x, (0, 1, 0, 1)) on 4D input (a 2D conv); the 3D variant below pads otherwise.
_KL_DOWNSAMPLE = PaddedConv(f"{_KL}.Downsample", "conv",
                            lambda m: (0, 1) if isinstance(m.conv, torch.nn.Conv2d) else (0, 0))

KL_BANDS = BandPlan(
    convs=TORCH_CONVS,
    group_norms=TORCH_GROUP_NORM,
    attention=(AttentionSite(f"{_KL}.AttnBlock"),),
    padded=(_KL_DOWNSAMPLE,),
    row_local=(
        *TORCH_ROW_LOCAL,
        "comfy.ldm.models.autoencoder.AutoencoderKL", "comfy.ldm.models.autoencoder.AutoencodingEngine",
        "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer",
        f"{_KL}.Encoder", f"{_KL}.Decoder", f"{_KL}.ResnetBlock",
        f"{_KL}.Upsample",  # nearest 2x, then a conv
        # Flux.2: latent batch norm with running statistics (per pixel), 2x2 pixel (un)shuffle.
        "torch.nn.modules.batchnorm.BatchNorm2d",
    ),
    encode_rows=_kl_encode_rows,
)

KL = ModelPlan(
    family="vae_kl",
    title="KL autoencoder (SD1.x / SD2 / SDXL / SD3 / Flux.1 / Flux.2 VAE)",
    classes=("comfy.ldm.models.autoencoder.AutoencoderKL", "comfy.ldm.models.autoencoder.AutoencodingEngine"),
    heads_attr="decoder.ch",  # no heads in a VAE; an int every variant has
    context_parallel=NO_SEQUENCE_SPLIT,
    kind="vae",
    vae=KL_BANDS,
    notes="row bands; halo exchange per conv, GroupNorm statistics all-reduced, mid-block attention gathers K/V",
)

# ---------------------------------------------------------------- HunyuanVideo VAE
# ComfyUI's AutoencoderKL with ``conv3d``: every 3x3x3 conv pads (1, 1) rows by replication
# first, in ``conv_carry_causal_3d`` (CarriedConv3d, whose time carry holds the band's rows),
# in ``VideoConv3d`` or in ``Downsample`` (5D input).


def _video_conv_rows(conv) -> tuple[int, int]:
    pad = conv.padding
    return (int(pad[2]), int(pad[3])) if isinstance(pad, (tuple, list)) else (0, 0)


def _is_video_conv(module) -> bool:
    return type(module).__qualname__ == "VideoConv3d"


# ``conv_carry_causal_3d`` pads by replication; a 1x1x1 CarriedConv3d (nin_shortcut) is called directly.
_CARRIED_CONV = PaddedConv(f"{_KL}.CarriedConv3d", "conv", lambda m: (1, 1) if m.conv.kernel_size[-2] > 1 else (0, 0),
                           mode=lambda m: "replicate")

HUNYUAN_VIDEO_BANDS = BandPlan(
    convs=TORCH_CONVS,
    group_norms=TORCH_GROUP_NORM,
    attention=(AttentionSite(f"{_KL}.AttnBlock"),),  # over all frames and pixels
    padded=(
        _KL_DOWNSAMPLE,
        PaddedConv(f"{_KL}.Downsample", "conv.conv", lambda m: (1, 1) if _is_video_conv(m.conv) else (0, 0),
                   mode=lambda m: "replicate"),
        _CARRIED_CONV,
        PaddedConv(f"{_KL}.VideoConv3d", "conv", _video_conv_rows, mode=lambda m: m.padding_mode),
    ),
    row_local=(
        *TORCH_ROW_LOCAL,
        "comfy.ldm.models.autoencoder.AutoencoderKL", "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer",
        f"{_KL}.Encoder", f"{_KL}.Decoder", f"{_KL}.ResnetBlock",
        f"{_KL}.Upsample",  # nearest 2x (the first frame alone in space), then a conv
    ),
    encode_rows=_kl_encode_rows,
)

HUNYUAN_VIDEO = ModelPlan(
    family="vae_hunyuan_video",
    title="HunyuanVideo VAE",
    classes=("comfy.ldm.models.autoencoder.AutoencoderKL",),
    heads_attr="decoder.ch",
    context_parallel=NO_SEQUENCE_SPLIT,
    kind="vae",
    vae=HUNYUAN_VIDEO_BANDS,
    notes="row bands; replicate padding at the image edges; conv carries per rank; mid-block attention gathers K/V",
)

# ---------------------------------------------------------------- HunyuanImage 2.1 VAE
# 32x: a 2D AutoencodingEngine whose levels fold 2x2 pixels into channels (PixelShuffle2D /
# PixelUnshuffle2D around a 3x3 conv), with ComfyUI's ResnetBlock and AttnBlock.
_HYI = "comfy.ldm.hunyuan_video.vae"

HUNYUAN_IMAGE21_BANDS = BandPlan(
    convs=TORCH_CONVS,
    group_norms=TORCH_GROUP_NORM,
    attention=(AttentionSite(f"{_KL}.AttnBlock"),),
    row_local=(
        *TORCH_ROW_LOCAL,
        "comfy.ldm.models.autoencoder.AutoencodingEngine", "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer",
        f"{_HYI}.Encoder", f"{_HYI}.Decoder", f"{_KL}.ResnetBlock",
        f"{_HYI}.PixelShuffle2D", f"{_HYI}.PixelUnshuffle2D",  # 2x2 pixels <-> channels
    ),
    encode_rows=lambda m: 2 ** sum(hasattr(stage, "downsample") for stage in m.encoder.down),
)

HUNYUAN_IMAGE21 = ModelPlan(
    family="vae_hunyuan_image21",
    title="HunyuanImage 2.1 32x VAE",
    classes=("comfy.ldm.models.autoencoder.AutoencodingEngine",),
    heads_attr="decoder.z_channels",
    context_parallel=NO_SEQUENCE_SPLIT,
    kind="vae",
    vae=HUNYUAN_IMAGE21_BANDS,
    notes="row bands; halo exchange per conv, GroupNorm statistics all-reduced, mid-block attention gathers K/V",
)

# ---------------------------------------------------------------- HunyuanVideo 1.5 VAE
# ComfyUI 0.33's ``hunyuan_video.vae_refiner`` Encoder / Decoder in an AutoencodingEngine: the
# HunyuanVideo 1.5 VAE (``refiner_vae``: CarriedConv3d padded by replication in
# ``conv_carry_causal_3d``, time carries per rank, per-pixel RMS norms) and the HunyuanImage 2.1
# refiner's (zero-padded Conv3d, GroupNorm). Levels fold 2x2 pixels (and 2 frames) into channels
# around a 3x3x3 conv (DnSmpl / UpSmpl); the first frame alone in time, whole in space.
_HYR = "comfy.ldm.hunyuan_video.vae_refiner"

HUNYUAN_VIDEO15_BANDS = BandPlan(
    convs=TORCH_CONVS,
    group_norms=TORCH_GROUP_NORM,
    attention=(AttentionSite(f"{_KL}.AttnBlock"),),  # over all frames and pixels
    padded=(
        _CARRIED_CONV,
    ),
    row_local=(
        *TORCH_ROW_LOCAL,
        "comfy.ldm.models.autoencoder.AutoencodingEngine", "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer",
        "comfy.ldm.models.autoencoder.EmptyRegularizer",
        f"{_HYR}.Encoder", f"{_HYR}.Decoder", f"{_KL}.ResnetBlock",
        f"{_HYR}.RMS_norm",  # over channels, per pixel
        f"{_HYR}.DnSmpl", f"{_HYR}.UpSmpl",  # a conv, then 2x2 pixels <-> channels (mean / repeat of the input)
        "comfy.ops.disable_weight_init.Linear",  # the mid ResnetBlocks' temb_proj, unused (no timestep)
    ),
    encode_rows=lambda m: 2 ** sum(hasattr(stage, "downsample") for stage in m.encoder.down),
)

HUNYUAN_VIDEO15 = ModelPlan(
    family="vae_hunyuan_video15",
    title="HunyuanVideo 1.5 VAE (also the HunyuanImage 2.1 refiner's)",
    classes=("comfy.ldm.models.autoencoder.AutoencodingEngine",),
    heads_attr="decoder.z_channels",
    context_parallel=NO_SEQUENCE_SPLIT,
    kind="vae",
    vae=HUNYUAN_VIDEO15_BANDS,
    notes="row bands; replicate padding at the image edges; conv carries per rank; mid-block attention gathers K/V",
)

# ---------------------------------------------------------------- Wan VAEs
_WAN = "comfy.ldm.wan.vae"
_WAN22 = "comfy.ldm.wan.vae2_2"

_WAN_COMMON = (
    *TORCH_ROW_LOCAL,
    f"{_WAN}.RMS_norm",  # over channels, per pixel
    "torch.nn.modules.upsampling.Upsample",  # nearest-exact 2x
    "torch.nn.modules.padding.ZeroPad2d",  # see the padded conv after it
)


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


WAN21_BANDS = BandPlan(
    convs=TORCH_CONVS,
    group_norms=TORCH_GROUP_NORM,
    attention=(AttentionSite(f"{_WAN}.AttentionBlock"),),  # per frame
    padded=_wan_padded(f"{_WAN}.Resample"),
    row_local=(*_WAN_COMMON, f"{_WAN}.WanVAE", f"{_WAN}.Encoder3d", f"{_WAN}.Decoder3d", f"{_WAN}.ResidualBlock"),
    encode_rows=lambda m: 2 ** (len(m.dim_mult) - 1),
)

WAN21 = ModelPlan(
    family="vae_wan21",
    title="Wan 2.1 VAE (Wan 2.1, Wan 2.2 14B, Qwen-Image)",
    classes=(f"{_WAN}.WanVAE",),
    heads_attr="z_dim",
    context_parallel=NO_SEQUENCE_SPLIT,
    kind="vae",
    vae=WAN21_BANDS,
    notes="row bands; causal time caches per rank; frame attention gathers K/V",
)

WAN22_BANDS = BandPlan(
    convs=TORCH_CONVS,
    group_norms=TORCH_GROUP_NORM,
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

WAN22 = ModelPlan(
    family="vae_wan22",
    title="Wan 2.2 VAE (Wan 2.2 TI2V 5B)",
    classes=(f"{_WAN22}.WanVAE",),
    heads_attr="z_dim",
    context_parallel=NO_SEQUENCE_SPLIT,
    kind="vae",
    vae=WAN22_BANDS,
    notes="row bands; causal time caches per rank; frame attention gathers K/V",
)

# ---------------------------------------------------------------- LTX-2 video VAE
# LTX's CausalVideoAutoencoder (``VideoVAE``): causal 3x3x3 convs whose inner Conv3d pads the
# rows itself (zeros, or reflect in a decoder built without a config), the time by repeating
# frames (caches per rank); 2x2 space-to-depth / depth-to-space around convs; per-pixel norms.
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


LTX2_BANDS = BandPlan(
    convs=TORCH_CONVS,
    group_norms=TORCH_GROUP_NORM,
    attention=(),
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

LTX2 = ModelPlan(
    family="vae_ltx2",
    title="LTX-2 video VAE (also LTXV 0.9.0)",
    classes=(f"{_LTX}.causal_video_autoencoder.VideoVAE",),
    heads_attr="decoder.patch_size",
    context_parallel=NO_SEQUENCE_SPLIT,
    kind="vae",
    vae=LTX2_BANDS,
    notes="row bands; causal time caches per rank, one time chunk per band; halo exchange per conv",
)

PLANS: tuple[ModelPlan, ...] = (KL, HUNYUAN_VIDEO, HUNYUAN_IMAGE21, HUNYUAN_VIDEO15, WAN21, WAN22, LTX2)


# ---------------------------------------------------------------- lookup
def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def matches_any(module: torch.nn.Module, names, *, inherited: bool) -> bool:
    classes = type(module).__mro__ if inherited else (type(module),)
    return any(_qualified(c) in names for c in classes)


def unknown_layers(module: torch.nn.Module, bands: BandPlan) -> list[str]:
    """Classes inside ``module`` the band plan does not cover (sorted, each once)."""
    known = bands.known()
    layered = (*bands.convs, *bands.group_norms)
    out = set()
    for _, m in module.named_modules():
        if matches_any(m, known, inherited=False) or matches_any(m, layered, inherited=True):
            continue
        out.add(_qualified(type(m)))
    return sorted(out)


def supported_vaes_text() -> str:
    return "; ".join(f"{plan.title} ({', '.join(c.rsplit('.', 1)[1] for c in plan.classes)})" for plan in PLANS)


def _plans_of_class(module: torch.nn.Module) -> list[ModelPlan]:
    name = _qualified(type(module))
    return [plan for plan in PLANS if name in plan.classes]


def check_vae(module: torch.nn.Module) -> ModelPlan:
    """The band plan for this VAE (``first_stage_model`` of ComfyUI's ``VAE``), or a
    ValueError that names the class and the supported ones. Of the plans for its class,
    the first that covers every layer of the model."""
    name = _qualified(type(module))
    plans = _plans_of_class(module)
    if not plans:
        raise ValueError(f"parallel VAE: {name} is not supported. Supported VAEs: {supported_vaes_text()}")
    covering = [plan for plan in plans if not unknown_layers(module, plan.vae)]
    # None covers it: name the plan it comes closest to (the fewest layers unknown).
    plan = covering[0] if covering else min(plans, key=lambda p: len(unknown_layers(module, p.vae)))
    why = plan.vae.refuse(module)
    if why:
        raise ValueError(f"parallel VAE: this {type(module).__name__} is not supported: {why}")
    if not covering:
        unknown = unknown_layers(module, plan.vae)
        raise ValueError(f"parallel VAE: this {type(module).__name__} contains layers the {plan.title} plan does "
                         f"not cover ({', '.join(unknown)}), so it cannot be split into row bands exactly. "
                         f"Supported VAEs: {supported_vaes_text()}")
    return plan


def find_vae_plan(module: torch.nn.Module) -> ModelPlan | None:
    try:
        return check_vae(module)
    except ValueError:
        return None
