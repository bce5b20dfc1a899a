"""User plans: plans for model classes the pack does not ship, written by a user in plan files.

A plan file is Python that sets ``PLAN`` (or ``PLANS``, a tuple) to a ``ModelPlan`` (a
``TransformerPlan``) built from the same vocabulary as the built-in plans, which the file finds
already defined (``VOCABULARY``: no import of the pack is needed, nor possible, since the pack's
package name depends on the folder it was cloned into). docs/user_plans.md has an example and the rules.

- The pack reads every ``*.py`` of the plan folders it is given (``refresh``; the folders come from
  ``comfyui_glue/user_plans.py``), again when a file changes, so a new plan needs no restart.
- A plan is checked against the model like a built-in one (``TransformerPlan.check_matches``: a
  module the plan names that the model lacks is refused, naming the plan and the module), and it
  may not take a built-in family's name or class.
- A plan travels to the workers with the model as its source text (``wire`` / ``from_wire``): a
  worker builds it from that text, never from files of its own, so a worker on another host needs
  no copy and every rank runs the very plan rank 0 checked.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import logging
from pathlib import Path

from .context_parallel import MAIN_STREAM, ContextParallelPlan, Gather, Split
from .patches import PatchPlan
from .plan import Plan
from .tensor_parallel import Colwise, ColwiseKV, Norm, Rowwise, SliceInput, TensorParallelPlan
from .transformer import TransformerPlan

log = logging.getLogger(__name__)

# What a plan file finds defined: the declarations of the built-in plans, nothing that runs. A plan
# file's transformer plan is a ``ModelPlan`` (the name docs/user_plans.md gives it).
VOCABULARY = {obj.__name__: obj for obj in (ContextParallelPlan, Split, Gather, TensorParallelPlan,
                                            Colwise, ColwiseKV, Rowwise, Norm, SliceInput, PatchPlan)}
VOCABULARY.update(ModelPlan=TransformerPlan, MAIN_STREAM=MAIN_STREAM)


class UserPlanError(ValueError):
    """A plan file that does not give usable plans (the message names the file)."""


# family -> plan (with its ``source``), the plans of the files read so far on this process.
_PLANS: dict[str, TransformerPlan] = {}
# path -> (stamp of the text read, families it gave, or the error it raised)
_FILES: dict[str, tuple[str, tuple[str, ...], str | None]] = {}
# path -> the model patch declarations (``PATCH_PLANS``) its file gave (``patches.py``'s vocabulary).
_PATCH_PLANS: dict[str, tuple[PatchPlan, ...]] = {}


def _stamp(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def build(text: str, origin: str, builtin_families: set[str],
          builtin_classes: dict[str, str]) -> tuple[TransformerPlan, ...]:
    """The plans a plan file's ``text`` gives, each carrying ``(origin, text)`` as its source."""
    namespace = {**VOCABULARY, "__name__": f"parallel_user_plan_{Path(origin).stem}", "__file__": origin}
    try:
        exec(compile(text, origin, "exec"), namespace)  # a file the user put in a plan folder, like a custom node
    except Exception as exc:
        raise UserPlanError(f"user plan file {origin}: {type(exc).__name__}: {exc}") from exc
    plans = namespace.get("PLANS", (namespace["PLAN"],) if "PLAN" in namespace else None)
    patch_plans = _patch_plans(namespace, origin, text)
    if patch_plans and plans is None:
        plans = ()
    elif not isinstance(plans, (tuple, list)) or not plans:
        raise UserPlanError(f"user plan file {origin}: it sets neither PLAN (a ModelPlan) nor PLANS (a tuple of them) "
                            "nor PATCH_PLANS (a tuple of PatchPlan)")
    built = []
    for plan in plans:
        if not isinstance(plan, TransformerPlan):  # user plans are for transformers (Shard Transformer) only
            raise UserPlanError(f"user plan file {origin}: {plan!r} is not a ModelPlan")
        if plan.family in builtin_families:
            raise UserPlanError(f"user plan file {origin}: the family name '{plan.family}' is a built-in plan's; "
                                "give the plan a name of its own")
        taken = [c for c in plan.classes if c in builtin_classes]
        if taken or not plan.classes or not all(isinstance(c, str) and "." in c for c in plan.classes):
            why = (f"{taken[0]} is covered by the built-in plan '{builtin_classes[taken[0]]}'" if taken
                   else "classes must be qualified class names, e.g. 'my_pack.model.MyDiT'")
            raise UserPlanError(f"user plan file {origin}: plan '{plan.family}': {why}")
        built.append(dataclasses.replace(plan, source=(origin, text)))
    _PATCH_PLANS[origin] = patch_plans
    return tuple(built)


def _patch_plans(namespace: dict, origin: str, text: str) -> tuple[PatchPlan, ...]:
    """A plan file's ``PATCH_PLANS``: how a custom pack's model patches run on every rank."""
    given = namespace.get("PATCH_PLANS", ())
    if not isinstance(given, (tuple, list)) or not all(isinstance(p, PatchPlan) for p in given):
        raise UserPlanError(f"user plan file {origin}: PATCH_PLANS must be a tuple of PatchPlan")
    for spec in given:
        if spec.tokens not in ("local", "whole") or (spec.replaces and (spec.tokens != "local" or spec.cut)):
            raise UserPlanError(f"user plan file {origin}: patch plan '{spec.title}': tokens must be 'local' or 'whole', "
                                "and a block replacement ('replaces') is 'local' with nothing to cut")
        if not spec.classes or not all(isinstance(c, str) and "." in c for c in spec.classes):
            raise UserPlanError(f"user plan file {origin}: patch plan '{spec.title}': classes must be qualified class "
                                "names, e.g. '*my_pack.patches.MyPatch'")
    return tuple(dataclasses.replace(spec, source=(origin, text)) for spec in given)


def patch_plan(class_name: str) -> PatchPlan | None:
    """The user patch declaration whose ``classes`` name this qualified class name (globs as for ``find``)."""
    for specs in _PATCH_PLANS.values():
        for spec in specs:
            if any(fnmatch.fnmatchcase(class_name, pattern) for pattern in spec.classes):
                return spec
    return None


def patch_plan_from_wire(class_name: str, source: tuple[str, str]) -> PatchPlan | None:
    """On a worker: the user patch declaration for ``class_name`` from the file text rank 0 sent."""
    origin, text = source
    if not any(s.source == (origin, text) for s in _PATCH_PLANS.get(origin, ())):
        build(text, origin, set(), {})
    return patch_plan(class_name)


def refresh(folders, builtin_families: set[str], builtin_classes: dict[str, str]) -> list[str]:
    """Read the plan files of ``folders`` that are new or changed (files gone drop their plans).
    Returns the errors of files that give no plans, one line each (they are logged too)."""
    seen = set()
    for folder in folders:
        for path in sorted(Path(folder).glob("*.py")) if Path(folder).is_dir() else ():
            key = str(path.resolve())
            seen.add(key)
            text = path.read_text(encoding="utf-8")
            if key in _FILES and _FILES[key][0] == _stamp(text):
                continue
            _forget(key)
            try:
                plans = build(text, key, builtin_families, builtin_classes)
                clash = [p.family for p in plans if p.family in _PLANS]
                if clash:
                    raise UserPlanError(f"user plan file {key}: the family name '{clash[0]}' is taken by "
                                        f"{_PLANS[clash[0]].source[0]}")
            except UserPlanError as exc:
                log.error("%s", exc)
                _FILES[key] = (_stamp(text), (), str(exc))
                continue
            for plan in plans:
                _PLANS[plan.family] = plan
            _FILES[key] = (_stamp(text), tuple(p.family for p in plans), None)
            log.info("user plan file %s: %s", key, ", ".join(f"{p.family} ({', '.join(p.classes)})" for p in plans))
    for key in [k for k in _FILES if k not in seen]:
        _forget(key)
    return [error for _, _, error in _FILES.values() if error]


def _forget(key: str) -> None:
    _PATCH_PLANS.pop(key, None)
    _, families, _ = _FILES.pop(key, ("", (), None))
    for family in families:
        _PLANS.pop(family, None)


def plans() -> tuple[TransformerPlan, ...]:
    return tuple(_PLANS.values())


def find(class_name: str) -> TransformerPlan | None:
    """The user plan whose ``classes`` name this qualified class name, exactly or as a glob
    (``*my_pack.model.MyDiT``: ComfyUI imports a custom node pack under its folder's path)."""
    for plan in _PLANS.values():
        if any(fnmatch.fnmatchcase(class_name, pattern) for pattern in plan.classes):
            return plan
    return None


def plan(family: str) -> TransformerPlan | None:
    return _PLANS.get(family)


def wire(plan: Plan):
    """How a plan travels to the workers: a built-in plan by its family name, a user plan as
    ``(family, origin, text)``."""
    return plan.family if plan.source is None else (plan.family, *plan.source)


def from_wire(value, builtin: dict[str, Plan]) -> Plan:
    """The plan ``wire`` sent: a built-in one by name, a user plan built from its text (once per text)."""
    if isinstance(value, str):
        return builtin[value]
    family, origin, text = value
    known = _PLANS.get(family)
    if known is None or known.source != (origin, text):
        for built in build(text, origin, set(builtin), {}):
            _PLANS[built.family] = built
    return _PLANS[family]
