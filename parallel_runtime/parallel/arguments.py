"""Where ``transformer_options`` sits in a model forward's bound arguments.

Most ComfyUI models name it as a parameter; some (Lumina2) take it through
``**kwargs``. Everything that reads or replaces it goes through here.
"""
from __future__ import annotations

import inspect

OPTIONS = "transformer_options"


def _var_keyword(bound: inspect.BoundArguments) -> str | None:
    for p in bound.signature.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return p.name
    return None


def holder(bound: inspect.BoundArguments) -> dict:
    """The dict that holds (or would hold) transformer_options: the arguments or the **kwargs dict."""
    if OPTIONS in bound.signature.parameters:
        return bound.arguments
    name = _var_keyword(bound)
    if name is None:
        return {}
    return bound.arguments.setdefault(name, {})


def get_options(bound: inspect.BoundArguments) -> dict:
    place = holder(bound)
    if place.get(OPTIONS) is None:
        place[OPTIONS] = {}
    return place[OPTIONS]


def set_options(bound: inspect.BoundArguments, options: dict) -> None:
    holder(bound)[OPTIONS] = options


def find(bound: inspect.BoundArguments, name: str):
    """(dict, key) holding argument ``name``, looking into **kwargs too; (None, name) if absent."""
    if name in bound.arguments:
        return bound.arguments, name
    var_kw = _var_keyword(bound)
    if var_kw and name in bound.arguments.get(var_kw, {}):
        return bound.arguments[var_kw], name
    return None, name
