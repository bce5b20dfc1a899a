"""Registry of the plans: every declaration the pack ships, and the look-ups that find a model's plan.
Adding a family means adding one plan module here; the generic runtime never branches on the model.
The vocabulary the declarations are written in is ``plans/vocabulary/``; ``parallel/`` applies them.
User plans (``vocabulary/user.py``) join the built-in ones from plan files, for classes the pack does
not ship."""
from __future__ import annotations

import torch

from . import (chroma_radiance, cogvideo, ernie, flux, hunyuan_video, joyimage, kandinsky5, krea2, ltxav, ltxv, lumina,
               minimax_h3, model_patches, qwen_image, wan)
from .model_patches import PATCH_MODEL_PLAN
from .text_encoders import llama, t5
from .vaes import hunyuan_image21, hunyuan_video15, kl, ltx2
from .vaes import hunyuan_video as hunyuan_video_vae
from .vaes import wan as wan_vae
from .vocabulary import user
from .vocabulary.patches import PatchPlan
from .vocabulary.plan import Plan, listing
from .vocabulary.text_encoder import TextEncoderPlan
from .vocabulary.transformer import TransformerPlan
from .vocabulary.vae import VaePlan, choose_vae_plan

PLANS: tuple[TransformerPlan, ...] = (
    flux.FLUX, flux.CHROMA, wan.PLAN, wan.VACE, qwen_image.PLAN, hunyuan_video.PLAN, ltxv.PLAN, ltxav.PLAN,
    lumina.PLAN, cogvideo.PLAN, kandinsky5.PLAN, krea2.PLAN, joyimage.PLAN, chroma_radiance.PLAN,
    minimax_h3.PLAN, ernie.PLAN,
)
ENCODER_PLANS: tuple[TextEncoderPlan, ...] = (t5.T5, llama.LLAMA)
# A class may have several VAE plans: the first that covers every layer of the model is used.
VAE_PLANS: tuple[VaePlan, ...] = (kl.KL, hunyuan_video_vae.HUNYUAN_VIDEO, hunyuan_image21.HUNYUAN_IMAGE21,
                                  hunyuan_video15.HUNYUAN_VIDEO15, wan_vae.WAN21, wan_vae.WAN22, ltx2.LTX2)
# ControlNets that run under the transformer's layout (ComfyUI computes them before each forward).
CONTROLNET_PLANS: tuple[TransformerPlan, ...] = (flux.CONTROLNET,)
PATCH_PLANS: tuple[PatchPlan, ...] = model_patches.PLANS
_BY_FAMILY: dict[str, Plan] = {plan.family: plan for plan in (*PLANS, *ENCODER_PLANS, *VAE_PLANS, *CONTROLNET_PLANS,
                                                              PATCH_MODEL_PLAN)}


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def plan_for_family(family: str) -> Plan:
    return _BY_FAMILY.get(family) or user.plan(family) or _BY_FAMILY[family]


def find_plan(module: torch.nn.Module) -> TransformerPlan | None:
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


def plan_wire(plan: Plan):
    """What tells a worker which plan a model runs with (user plans travel as their text)."""
    return user.wire(plan)


def plan_from_wire(value) -> Plan:
    return user.from_wire(value, _BY_FAMILY)


def find_encoder_plan(module: torch.nn.Module) -> TextEncoderPlan | None:
    name = qualified_name(type(module))
    for plan in ENCODER_PLANS:
        if name in plan.classes:
            return plan
    return None


def find_controlnet_plan(module: torch.nn.Module) -> TransformerPlan | None:
    """The plan for a ControlNet's ``control_model`` of exactly this class, or None (it then runs on rank 0)."""
    name = qualified_name(type(module))
    return next((plan for plan in CONTROLNET_PLANS if name in plan.classes), None)


def check_vae(module: torch.nn.Module) -> VaePlan:
    """The plan for a VAE (``first_stage_model``), or a ValueError that says why there is none."""
    return choose_vae_plan(module, VAE_PLANS)


def find_vae_plan(module: torch.nn.Module) -> VaePlan | None:
    """The plan for a VAE (``first_stage_model``), or None; ``check_vae`` says why not."""
    try:
        return check_vae(module)
    except ValueError:
        return None


def patch_plan_named(name: str) -> PatchPlan | None:
    """The pack's declaration for the model patch class of qualified name ``name``, or None."""
    return next((plan for plan in PATCH_PLANS if name in plan.classes), None)


def supported_encoders_text() -> str:
    return listing(ENCODER_PLANS)


def supported_models_text() -> str:
    return listing((*PLANS, *user.plans()))


def supported_vaes_text() -> str:
    return listing(VAE_PLANS)


def declared_patches_text() -> str:
    return listing(PATCH_PLANS)


__all__ = ["CONTROLNET_PLANS", "ENCODER_PLANS", "PATCH_MODEL_PLAN", "PATCH_PLANS", "PLANS", "VAE_PLANS", "Plan",
           "check_vae", "declared_patches_text", "find_controlnet_plan", "find_encoder_plan",
           "find_plan", "find_vae_plan", "patch_plan_named", "plan_for_family", "plan_from_wire", "plan_wire",
           "refresh_user_plans", "supported_encoders_text", "supported_models_text", "supported_vaes_text"]
