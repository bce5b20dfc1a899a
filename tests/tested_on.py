"""Which plan families this ComfyUI's tests run: the support matrix's "Tested on ComfyUI" column is
this, recorded per release in tests/tested_on.json (tools/support_matrix.py), so that a family is never
marked tested on a release whose tests skip it (tests/test_tested_on.py compares the record with
this host's registries).

A family counts as tested here when a case of the tests' own registries builds a model it plans,
on this ComfyUI: a tiny family file of tools/tiny_families.py (through a real server, every family
under Ulysses 2 and TP 2: tests/test_comfy_families.py, in the smoke subset too), a text encoder
case of text_encoder_cases.py (tests/test_text_encoders.py) or a VAE case of vae_cases.py
(tests/test_vae_parallel.py). Registries leave out what this ComfyUI lacks: that is the skip."""
from __future__ import annotations

import torch

from parallel_runtime.plans import PLANS, find_encoder_plan
from parallel_runtime.plans import check_vae
from text_encoder_cases import ENCODERS
from tiny_families import FAMILIES
from vae_cases import VAES


def release() -> str:
    """This ComfyUI's version, as the record keys it."""
    import comfyui_version

    return comfyui_version.__version__


def transformer_families() -> set[str]:
    """The plan families of the tiny family files this ComfyUI can build (by class, as find_plan)."""
    by_class = {c: plan.family for plan in PLANS for c in plan.classes}
    return {by_class[spec.cls] for spec in FAMILIES.values()}


def encoder_families() -> set[str]:
    """The encoder plan families the text encoder cases build: the module each case's plan finds."""
    found = set()
    for build in ENCODERS.values():
        clip, _ = build()
        found |= {plan.family for m in clip.cond_stage_model.modules() if (plan := find_encoder_plan(m))}
    return found


def vae_families() -> set[str]:
    """The VAE plan families the VAE cases build (check_vae picks among a class's plans)."""
    return {check_vae(build()[0]).family for build in VAES.values()}


def families_run_here() -> list[str]:
    """Every plan family this ComfyUI's tests run, sorted."""
    with torch.inference_mode():
        return sorted(transformer_families() | encoder_families() | vae_families())
