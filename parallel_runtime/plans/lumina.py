"""Lumina2 and Z-Image (``NextDiT``).

The caption and image tokens are refined separately (``context_refiner``,
``noise_refiner``: short stacks over one kind of token each), then joined as
``[caption, image]`` for the main ``layers``. The joined sequence is one stream,
cut where it enters ``layers.0`` together with its RoPE table ``freqs_cis``
(tokens on dim 1); the refiners stay whole on every rank (a few layers of
redundant work, no communication). ``final_layer`` is per token and gathered
before unpatchify, which slices the image back out.
"""
from __future__ import annotations

from .base import ContextParallelPlan, Gather, ModelPlan, Split

PLAN = ModelPlan(
    family="lumina2",
    title="Lumina2 / Z-Image",
    classes=("comfy.ldm.lumina.model.NextDiT",),
    heads_attr="n_heads",
    context_parallel=ContextParallelPlan(
        inputs={
            "layers.0": (Split("x", dim=1, starts_stream=True),),
            "layers.*": (Split("freqs_cis", dim=1),),
        },
        outputs={"final_layer": Gather(dim=1)},
        attention={"layers.*": ("x",)},
        # Not 0.33's timestep_zero_index (Z-Image Omni): absolute token ranges, refused when given.
        passed=frozenset({"x", "x_mask", "adaln_input", "c"}),
    ),
    notes="Refiner layers run whole on every rank.",
)
