"""Importing, in any process, the modules ComfyUI imported under names no import statement gives.

ComfyUI imports a custom node pack under its folder's path (dots as ``_x_``) and its own
``comfy_extras`` node modules under their file path without ``.py``. A layer class, hook or model
patch from such a module travels to the workers by that name (weights/pickling.py unpickles with
``import_module``; parallel/model_patches.py rebuilds a patch's class with it), so a worker must
import it the same way.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys


# Custom node packages this process knows by folder but whose __init__ has not run: a worker
# needs a layer class from one module of the pack (ComfyUI-GGUF's ops), not its nodes, whose
# imports (comfy.sd, nodes, ...) would cost every worker some 70 MB of its own memory.
_PENDING_PACKAGE_INIT: set[str] = set()


def import_module(name: str):
    """``importlib.import_module``, also for the modules of ComfyUI custom node packs, which
    ComfyUI imports under their folder's path (dots as ``_x_``) rather than an importable name:
    a layer class, hook or patch from another node pack travels to the workers like ComfyUI's own.
    A pack's own ``__init__`` runs only when what is asked for needs it. ComfyUI's own
    ``comfy_extras`` node modules it imports under their file path without ``.py`` (the Qwen-Image
    DiffSynth ControlNet's class lives in ``comfy_extras/nodes_model_patch``): loaded from that file."""
    if os.path.isabs(name) and name not in sys.modules and os.path.isfile(name + ".py"):
        return _import_file(name)
    top = name.split(".", 1)[0]
    if top in _PENDING_PACKAGE_INIT:
        if name != top:
            try:
                return importlib.import_module(name)
            except ImportError:  # the submodule wants what the package's __init__ sets up
                pass
        _run_package_init(top)
        return importlib.import_module(name)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        folder = top.replace("_x_", ".")
        if not os.path.isabs(folder) or top in sys.modules:
            raise
        init = os.path.join(folder, "__init__.py") if os.path.isdir(folder) else folder
        if not os.path.isfile(init):
            raise
        spec = importlib.util.spec_from_file_location(top, init, submodule_search_locations=(
            [folder] if os.path.isdir(folder) else None))
        sys.modules[top] = importlib.util.module_from_spec(spec)
        _PENDING_PACKAGE_INIT.add(top)
        return import_module(name)


def _import_file(name: str):
    spec = importlib.util.spec_from_file_location(name, name + ".py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _run_package_init(top: str) -> None:
    _PENDING_PACKAGE_INIT.discard(top)
    module = sys.modules[top]
    try:
        module.__spec__.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(top, None)
        raise
