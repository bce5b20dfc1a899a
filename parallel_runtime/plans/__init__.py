"""Registry of per-family plans. Adding a family means adding one plan module here;
the generic runtime never branches on the model. Declarations only: ``parallel/`` applies them.
User plans (plans/user.py) join the built-in ones from plan files, for classes the pack does not ship."""
from __future__ import annotations

import torch

from . import (chroma_radiance, cogvideo, ernie, flux, hunyuan_video, joyimage, kandinsky5, krea2, ltxav, ltxv, lumina,
               minimax_h3, patches, qwen_image, text_encoders, user, vae, wan)
from .base import ModelPlan
from .matching import check_plan_matches

PLANS: tuple[ModelPlan, ...] = (
    flux.FLUX, flux.CHROMA, wan.PLAN, wan.VACE, qwen_image.PLAN, hunyuan_video.PLAN, ltxv.PLAN, ltxav.PLAN,
    lumina.PLAN, cogvideo.PLAN, kandinsky5.PLAN, krea2.PLAN, joyimage.PLAN, chroma_radiance.PLAN,
    minimax_h3.PLAN, ernie.PLAN,
)
ENCODER_PLANS: tuple[ModelPlan, ...] = text_encoders.PLANS
VAE_PLANS: tuple[ModelPlan, ...] = vae.PLANS
# ControlNets that run under the transformer's layout (ComfyUI computes them before each forward).
CONTROLNET_PLANS: tuple[ModelPlan, ...] = (flux.CONTROLNET,)
_BY_FAMILY = {plan.family: plan for plan in (*PLANS, *ENCODER_PLANS, *VAE_PLANS, *CONTROLNET_PLANS,
                                             patches.MODEL_PLAN)}


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def plan_for_family(family: str) -> ModelPlan:
    return _BY_FAMILY.get(family) or user.plan(family) or _BY_FAMILY[family]


def find_plan(module: torch.nn.Module) -> ModelPlan | None:
    """The plan for exactly this class (subclasses such as VACE add inputs a plan
    must know about, so they are not matched by inheritance): a built-in one, else a user plan."""
    name = qualified_name(type(module))
    for plan in PLANS:
        if name in plan.classes:
            return plan
    return user.find(name)


def refresh_user_plans(folders) -> list[str]:
    """Read the user plan files of ``folders`` (new or changed ones); the errors of broken files."""
    classes = {c: plan.family for plan in (*PLANS, *ENCODER_PLANS, *VAE_PLANS) for c in plan.classes}
    return user.refresh(folders, set(_BY_FAMILY), classes)


def plan_wire(plan: ModelPlan):
    """What tells a worker which plan a model runs with (user plans travel as their text)."""
    return user.wire(plan)


def plan_from_wire(value) -> ModelPlan:
    return user.from_wire(value, _BY_FAMILY)


def find_encoder_plan(module: torch.nn.Module) -> ModelPlan | None:
    name = qualified_name(type(module))
    for plan in ENCODER_PLANS:
        if name in plan.classes:
            return plan
    return None


def find_controlnet_plan(module: torch.nn.Module) -> ModelPlan | None:
    """The plan for a ControlNet's ``control_model`` of exactly this class, or None (it then runs on rank 0)."""
    name = qualified_name(type(module))
    return next((plan for plan in CONTROLNET_PLANS if name in plan.classes), None)


def find_vae_plan(module: torch.nn.Module) -> ModelPlan | None:
    """The band plan for a VAE (``first_stage_model``), or None; ``vae.check_vae`` says why not."""
    return vae.find_vae_plan(module)


def supported_encoders_text() -> str:
    return "; ".join(f"{plan.title} ({', '.join(c.rsplit('.', 1)[1] for c in plan.classes)})"
                     for plan in ENCODER_PLANS)


def supported_models_text() -> str:
    return "; ".join(f"{plan.title} ({', '.join(c.rsplit('.', 1)[1] for c in plan.classes)})"
                     for plan in (*PLANS, *user.plans()))


__all__ = ["PLANS", "CONTROLNET_PLANS", "ENCODER_PLANS", "VAE_PLANS", "find_controlnet_plan", "find_encoder_plan", "find_vae_plan", "supported_encoders_text", "ModelPlan", "check_plan_matches", "find_plan", "plan_for_family", "plan_from_wire", "plan_wire", "refresh_user_plans",
           "supported_models_text"]
