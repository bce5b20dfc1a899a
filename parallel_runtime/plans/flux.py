"""Flux.1 (dev, schnell, Kontext), Flux.2 and Chroma: double-stream then single-stream blocks.

- Two token streams: ``txt`` and ``img`` (the image, then any Kontext / Flux.2
  reference tokens appended after it). Both are cut where they enter
  ``double_blocks.0``; every rank then holds ``[txt chunk ; img chunk]``.
- ``pe`` (RoPE, ``[B, 1, L_txt + L_img, D/2, 2, 2]``) covers ``[txt, img]`` on dim 2
  and reaches every block.
- Attention in both block kinds is joint over ``[txt, img]``; RoPE is applied
  before ComfyUI's attention call, so the override sees final q/k.
- The single-stream part is ``cat(txt, img)``; the model slices the image back out
  with the *local* text length, so ``final_layer`` (per token) sees this rank's
  image chunk and its output is gathered.
- ControlNet residuals cover the main image tokens (a prefix of the ``img``
  stream); each rank adds the part inside its chunk.
"""
from __future__ import annotations

from .base import ContextParallelPlan, Gather, ModelPlan, Split

JOINT = ("txt", "img")
ROPE = Split("pe", dim=2, segments=JOINT)


def _flux_style_plan(unsupported: dict[str, str]) -> ContextParallelPlan:
    return ContextParallelPlan(
        inputs={
            "double_blocks.0": (Split("txt", dim=1, stream="txt", starts_stream=True),
                                Split("img", dim=1, stream="img", starts_stream=True)),
            "double_blocks.*": (ROPE,),
            "single_blocks.*": (ROPE,),
        },
        outputs={"final_layer": Gather(dim=1, stream="img")},
        attention={"double_blocks.*": JOINT, "single_blocks.*": JOINT},
        call_inputs=(Split("control", dim=1, stream="img", prefix=True),),
        unsupported=unsupported,
    )


MASK_WHY = "the style-model attention mask covers the joint sequence; run without the mask option"

FLUX = ModelPlan(
    family="flux",
    title="Flux.1 / Flux.2",
    classes=("comfy.ldm.flux.model.Flux",),
    heads_attr="num_heads",
    context_parallel=_flux_style_plan({"attention_mask": MASK_WHY}),
    notes="dev, schnell, Kontext and Flux.2 reference images, ControlNet residuals.",
)

CHROMA = ModelPlan(
    family="chroma",
    title="Chroma",
    classes=("comfy.ldm.chroma.model.Chroma",),
    heads_attr="num_heads",
    context_parallel=_flux_style_plan({"attention_mask": MASK_WHY}),
    notes="ControlNet residuals.",
)
