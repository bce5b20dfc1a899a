"""What every plan is, whatever model it describes: a family name the workers look it up by, and a
title for messages. Each kind of model has its own plan type with the fields it needs
(``TransformerPlan``, ``TextEncoderPlan``, ``VaePlan``, ``PatchModelPlan``); the engine asks the plan
what applies to it (the class-level answers below), never which kind it is."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class Plan:
    family: str  # short id the workers look the plan up by, e.g. "wan"
    title: str   # what users call it, e.g. "Wan 2.1 / 2.2"

    # A forward runs in the Parallel Config's layout (cfg x ring x ulysses x tp, or the one layout auto
    # picks): layout auto measures it, the status shows each rank's share of its heads, a cfg dimension
    # without a batch to split is reported. Otherwise it runs over the ranks its node chose (a text
    # encoder's TP group, a VAE's bands over the world).
    configured_layout: ClassVar[bool] = False
    # Its forward takes ComfyUI's ``transformer_options`` (model patches, the attention override).
    takes_transformer_options: ClassVar[bool] = False
    # What tensor parallelism cuts (``TensorParallelPlan``); None: every rank holds the model whole.
    # A class attribute here (not annotated: no field), a field of the plan types that have one.
    tensor_parallel = None
    # A user plan's (file, text) that the workers build it from; None: the pack's own, imported everywhere.
    source = None

    def for_module(self, module: torch.nn.Module) -> "Plan":
        """The plan for this very module (a family whose ComfyUI releases differ chooses by structure)."""
        return self

    def check_matches(self, root: torch.nn.Module) -> None:
        """Refuse (``matching.PlanMismatch``) a model not built the way the plan was written for."""


def listing(plans) -> str:
    """``plans`` (anything with a ``title`` and ``classes``) for a message: each title with the
    short names of its classes."""
    return "; ".join(f"{plan.title} ({', '.join(c.rsplit('.', 1)[1] for c in plan.classes)})" for plan in plans)
