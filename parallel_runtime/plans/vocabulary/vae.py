"""A VAE plan: every rank decodes (or encodes) a band of image rows, exactly.

A VAE plan says which modules of the VAE need to see beyond their
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

from .plan import Plan, listing


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


TORCH_CONVS = ("torch.nn.modules.conv.Conv2d", "torch.nn.modules.conv.Conv3d")
TORCH_GROUP_NORM = ("torch.nn.modules.normalization.GroupNorm",)
TORCH_ROW_LOCAL = (
    "torch.nn.modules.module.Module",  # plain containers (``down = nn.Module()``)
    "torch.nn.modules.container.Sequential", "torch.nn.modules.container.ModuleList",
    "torch.nn.modules.activation.SiLU", "torch.nn.modules.dropout.Dropout", "torch.nn.modules.linear.Identity",
)


@dataclass(frozen=True, kw_only=True)
class VaePlan(Plan):
    classes: tuple[str, ...]  # qualified class names this plan covers (one class may have several plans)
    row_local: tuple[str, ...]
    # Pixel rows per latent row: the bands of an encode start at multiples of it, so that
    # every strided conv and pooling sees whole windows.
    encode_rows: Callable[[torch.nn.Module], int]
    notes: str = ""  # the support matrix's notes
    convs: tuple[str, ...] = TORCH_CONVS
    group_norms: tuple[str, ...] = TORCH_GROUP_NORM
    attention: tuple[AttentionSite, ...] = ()
    padded: tuple[PaddedConv, ...] = ()
    # Why a model of a covered class is not supported after all (None: it is).
    refuse: Callable[[torch.nn.Module], "str | None"] = field(default=lambda module: None)
    call_globals: tuple[ModuleGlobal, ...] = ()
    output_argument: str | None = None

    def known(self) -> frozenset[str]:
        return frozenset((*self.row_local, *(a.owner for a in self.attention), *(p.owner for p in self.padded)))


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def matches_any(module: torch.nn.Module, names, *, inherited: bool) -> bool:
    classes = type(module).__mro__ if inherited else (type(module),)
    return any(_qualified(c) in names for c in classes)


def unknown_layers(module: torch.nn.Module, plan: VaePlan) -> list[str]:
    """Classes inside ``module`` the plan does not cover (sorted, each once)."""
    known = plan.known()
    layered = (*plan.convs, *plan.group_norms)
    out = set()
    for _, m in module.named_modules():
        if matches_any(m, known, inherited=False) or matches_any(m, layered, inherited=True):
            continue
        out.add(_qualified(type(m)))
    return sorted(out)


def choose_vae_plan(module: torch.nn.Module, known: "tuple[VaePlan, ...]") -> VaePlan:
    """The plan of ``known`` for this VAE (``first_stage_model`` of ComfyUI's ``VAE``), or a
    ValueError that names the class and the supported ones. Of the plans for its class,
    the first that covers every layer of the model."""
    name = _qualified(type(module))
    plans = [plan for plan in known if name in plan.classes]
    if not plans:
        raise ValueError(f"parallel VAE: {name} is not supported. Supported VAEs: {listing(known)}")
    covering = [plan for plan in plans if not unknown_layers(module, plan)]
    # None covers it: name the plan it comes closest to (the fewest layers unknown).
    plan = covering[0] if covering else min(plans, key=lambda p: len(unknown_layers(module, p)))
    why = plan.refuse(module)
    if why:
        raise ValueError(f"parallel VAE: this {type(module).__name__} is not supported: {why}")
    if not covering:
        unknown = unknown_layers(module, plan)
        raise ValueError(f"parallel VAE: this {type(module).__name__} contains layers the {plan.title} plan does "
                         f"not cover ({', '.join(unknown)}), so it cannot be split into row bands exactly. "
                         f"Supported VAEs: {listing(known)}")
    return plan
