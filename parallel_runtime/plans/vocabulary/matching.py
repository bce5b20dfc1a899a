"""Where a plan's names land in a model: module patterns, forward arguments, tuple items.

A plan names modules by glob patterns per dotted segment over ``named_modules()`` (``blocks.*``
is every block, ``single_blocks.-1`` the last one) and inputs by their parameter name in
``forward``. The engines that apply plans (``parallel/``), the tensor-parallel cuts
(``weights/shards.py``) and layout auto find what a plan names here, and a plan's ``check_matches``
refuses a model that is not built the way the plan was written for (``PlanMismatch``).
"""
from __future__ import annotations

import fnmatch
import inspect
import sys
import weakref

import torch

from .context_parallel import AttentionGlobal
from .tensor_parallel import Layer, TensorParallelError, TensorParallelPlan


class PlanMismatch(RuntimeError):
    """The model is not built the way its plan was written for (another ComfyUI release)."""


def comfyui_release() -> str:
    """The running ComfyUI's version, for messages."""
    try:
        import comfyui_version

        return f"ComfyUI {comfyui_version.__version__}"
    except Exception:  # an unusual install
        return "this ComfyUI"


_SIGNATURES: "weakref.WeakKeyDictionary[type, tuple[list[str], bool, set[str]]]" = weakref.WeakKeyDictionary()


def forward_signature(module: torch.nn.Module) -> tuple[list[str], bool, set[str]]:
    """(positional parameters of ``forward`` after self, whether it takes **kwargs, every parameter name)."""
    cls = type(module)
    found = _SIGNATURES.get(cls)
    if found is None:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]  # drop self
        positional = [p.name for p in params
                      if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        named = {p.name for p in params if p.kind != inspect.Parameter.VAR_POSITIONAL}
        var_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
        found = _SIGNATURES[cls] = (positional, var_kw, named)
    return found


def _position_of(module: torch.nn.Module, arg: str) -> int | None:
    positional = forward_signature(module)[0]
    return positional.index(arg) if arg in positional else None


def on_item(value, item: int | None, fn):
    """``fn(value)`` for a tensor (``item`` None) or the tuple with ``fn`` applied to element
    ``item``; None where the form does not match (so specs for both forms can stand side by side)."""
    if item is None:
        return fn(value) if isinstance(value, torch.Tensor) else None
    if isinstance(value, tuple) and len(value) > item and isinstance(value[item], torch.Tensor):
        items = list(value)
        items[item] = fn(items[item])
        return tuple(items)
    return None


def replace_arguments(module, args, kwargs, specs, cut):
    """A forward pre-hook's (args, kwargs) with each ``spec.arg`` replaced by ``cut(value, spec)``
    (by keyword or by its position in ``forward``), where that is not None."""
    args = list(args)
    for spec in specs:
        if spec.arg in kwargs:
            new = cut(kwargs[spec.arg], spec)
            if new is not None:
                kwargs[spec.arg] = new
            continue
        pos = _position_of(module, spec.arg)
        if pos is not None and pos < len(args):
            new = cut(args[pos], spec)
            if new is not None:
                args[pos] = new
    return tuple(args), kwargs


def path_matches(name: str, pattern: str) -> bool:
    """Glob match per dotted segment: ``blocks.*`` is every block, not every module inside one."""
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats))


def _is_last_child(root: torch.nn.Module, parts: list[str], i: int) -> bool:
    parent = root.get_submodule(".".join(parts[:i])) if i else root
    children = [name for name, _ in parent.named_children()]
    return bool(children) and children[-1] == parts[i]


def _matches_with_last(root: torch.nn.Module, name: str, pattern: str) -> bool:
    """``-1`` names the last child of its parent, whatever the depth of this model:
    ``single_blocks.-1`` the last block, ``layers.*.adaLN_modulation.-1`` the last module of
    each block's modulation (a Sequential whose length differs between variants)."""
    pats = pattern.split(".")
    if "-1" not in pats:
        return path_matches(name, pattern)
    parts = name.split(".")
    if not path_matches(name, ".".join("*" if p == "-1" else p for p in pats)):
        return False
    return all(_is_last_child(root, parts, i) for i, p in enumerate(pats) if p == "-1")


_MATCHES: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, list]]" = weakref.WeakKeyDictionary()


def matching_modules(root: torch.nn.Module, pattern: str) -> list[tuple[str, torch.nn.Module]]:
    """Submodules whose qualified name matches ``pattern`` (cached per root: walking a
    40-block model on every forward would cost milliseconds)."""
    per_root = _MATCHES.setdefault(root, {})
    found = per_root.get(pattern)
    if found is None:
        found = [(name, mod) for name, mod in root.named_modules() if name and _matches_with_last(root, name, pattern)]
        per_root[pattern] = found
    return found


def attention_global_holder(plan, spec: AttentionGlobal):
    """The Python module holding ``spec``'s attention function, or PlanMismatch: a model whose
    attention no stand-in can reach would attend its local tokens only."""
    module = sys.modules.get(spec.module)
    if module is None or not callable(module.__dict__.get(spec.name)):
        raise PlanMismatch(
            f"{plan.title}: the pack's {plan.family} plan routes attention through {spec.module}.{spec.name}, which "
            f"{comfyui_release()} does not have: this ComfyUI calls the model's attention differently, and it would "
            "silently attend only each rank's own tokens. Refused rather than computing a wrong result; run this "
            "model without Shard Transformer on this ComfyUI, or use a pack release that knows it")
    return module


def layer_specs(root: torch.nn.Module, plan: TensorParallelPlan) -> list[tuple[str, torch.nn.Module, Layer]]:
    found, seen = [], set()
    for pattern, spec in plan.layers.items():
        matches = matching_modules(root, pattern)
        if not matches and pattern in plan.optional:
            continue
        if not matches:
            raise TensorParallelError(f"tensor-parallel plan: no module matches '{pattern}' in "
                                      f"{type(root).__name__}")
        for name, mod in matches:
            if id(mod) not in seen:
                seen.add(id(mod))
                found.append((name, mod, spec))
    return found
