"""Registry of per-family plans. Adding a family means adding one plan module here;
the generic runtime never branches on the model. Declarations only: ``parallel/`` applies them."""
from __future__ import annotations

import torch

from . import (chroma_radiance, cogvideo, flux, hunyuan_video, joyimage, kandinsky5, krea2, ltxav, ltxv, lumina,
               qwen_image, text_encoders, vae, wan)
from .base import ModelPlan
from .matching import check_plan_matches

PLANS: tuple[ModelPlan, ...] = (
    flux.FLUX, flux.CHROMA, wan.PLAN, wan.VACE, qwen_image.PLAN, hunyuan_video.PLAN, ltxv.PLAN, ltxav.PLAN,
    lumina.PLAN, cogvideo.PLAN, kandinsky5.PLAN, krea2.PLAN, joyimage.PLAN, chroma_radiance.PLAN,
)
ENCODER_PLANS: tuple[ModelPlan, ...] = text_encoders.PLANS
VAE_PLANS: tuple[ModelPlan, ...] = vae.PLANS
_BY_FAMILY = {plan.family: plan for plan in (*PLANS, *ENCODER_PLANS, *VAE_PLANS)}


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def plan_for_family(family: str) -> ModelPlan:
    return _BY_FAMILY[family]


def find_plan(module: torch.nn.Module) -> ModelPlan | None:
    """The plan for exactly this class (subclasses such as VACE add inputs a plan
    must know about, so they are not matched by inheritance)."""
    name = qualified_name(type(module))
    for plan in PLANS:
        if name in plan.classes:
            return plan
    return None


def find_encoder_plan(module: torch.nn.Module) -> ModelPlan | None:
    name = qualified_name(type(module))
    for plan in ENCODER_PLANS:
        if name in plan.classes:
            return plan
    return None


def find_vae_plan(module: torch.nn.Module) -> ModelPlan | None:
    """The band plan for a VAE (``first_stage_model``), or None; ``vae.check_vae`` says why not."""
    return vae.find_vae_plan(module)


def supported_encoders_text() -> str:
    return "; ".join(f"{plan.title} ({', '.join(c.rsplit('.', 1)[1] for c in plan.classes)})"
                     for plan in ENCODER_PLANS)


def supported_models_text() -> str:
    return "; ".join(f"{plan.title} ({', '.join(c.rsplit('.', 1)[1] for c in plan.classes)})" for plan in PLANS)


__all__ = ["PLANS", "ENCODER_PLANS", "VAE_PLANS", "find_encoder_plan", "find_vae_plan", "supported_encoders_text", "ModelPlan", "check_plan_matches", "find_plan", "plan_for_family", "supported_models_text"]
