"""The runtime's import graph, read from the code with ``ast`` (imports inside functions too).

``parallel_runtime`` is built in wings, each on a layer; a module may import its own wing and the
layers below it, never above, and the two wings of layer 3 do not import each other:

    0  config, comfyui_location,  the configuration, which ComfyUI this checkout runs with, importing
       comfyui_modules           the modules ComfyUI imported under their paths
    1  distributed                collectives, the rank mesh
    2  plans                      declarations: per-family plans, TP specs, where their names land
    3  weights | parallel         a rank's weights (cuts, pickling, streams) | applying plans to a forward
    4  layout                     layout auto, cost model, probe
    5  world                      rank 0's World, the workers, protocol, watchdog, memory, other hosts
    6  comfyui_glue               where ComfyUI meets the runtime (wrappers, patcher, routes, first-step check)

Fails on: an import circle (between modules of any wing); an upward or sideways import between
wings; an import placed inside a function, except of what must stay optional or late there:
``torch.distributed``, ComfyUI (``comfy``, ``comfy_*``, ``comfyui_version``, ``nodes``, ``server``,
``folder_paths``, ``aiohttp`` of its server) and the optional ``gguf`` package; a package
``__init__`` (but the plans' registry) that imports anything, so that importing a module never runs
another wing's code on the way.
"""
from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parent.parent / "parallel_runtime"
PACKAGE = "parallel_runtime"

LAYERS = {
    "config": 0, "comfyui_location": 0, "comfyui_modules": 0,
    "distributed": 1,
    "plans": 2,
    "weights": 3, "parallel": 3,
    "layout": 4,
    "world": 5,
    "comfyui_glue": 6,
}
ALLOWED_IN_FUNCTIONS = ("torch.distributed", "comfy", "comfy_", "comfyui_version", "nodes", "server", "folder_paths",
                        "aiohttp", "gguf")


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the runtime (packages by their ``__init__``)."""
    out = {}
    for path in sorted(RUNTIME.rglob("*.py")):
        parts = path.relative_to(RUNTIME.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> list[tuple[str, int, bool, str]]:
    """(imported runtime module, line, inside a function, the import's text) of module ``name``;
    outside modules are listed as ``("", line, inside, their name)``."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = []

    def visit(node, inside: bool):
        for child in ast.iter_child_nodes(node):
            nested = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    target = alias.name if alias.name.split(".")[0] == PACKAGE else ""
                    found.append((_longest_module(target) if target else "", child.lineno, inside, alias.name))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                if module.split(".")[0] != PACKAGE:
                    found.append(("", child.lineno, inside, module))
                    continue
                for alias in child.names:
                    sub = f"{module}.{alias.name}"
                    found.append((sub if sub in MODULES else _longest_module(module), child.lineno, inside,
                                  f"from {'.' * child.level}{child.module or ''} import {alias.name}"))
            visit(child, nested)

    visit(tree, False)
    return found


def _longest_module(dotted: str) -> str:
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in MODULES:
            return ".".join(parts[:k])
    raise AssertionError(f"{dotted} is no module of the runtime")


def _wing(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def _graph() -> dict[str, set[str]]:
    return {name: {target for target, *_ in _imports(name) if target and target != name} for name in MODULES}


def test_every_module_is_in_a_wing():
    assert {_wing(name) for name in MODULES} - {None} <= set(LAYERS), "a new wing: give it a layer in LAYERS"


def test_no_import_circle():
    graph = _graph()
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def strongly_connect(v):  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongly_connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            strongly_connect(v)
    assert not circles, f"modules that import each other in a circle: {circles}"


def test_imports_point_down_the_layers():
    wrong = []
    for name in MODULES:
        wing = _wing(name)
        if wing is None:
            continue
        for target, line, _, text in _imports(name):
            other = _wing(target) if target else None
            if other is None or other == wing:
                continue
            if LAYERS[other] > LAYERS[wing]:
                wrong.append(f"{MODULES[name].relative_to(RUNTIME.parent)}:{line}: {wing} (layer {LAYERS[wing]}) "
                             f"imports {target} ({other}, layer {LAYERS[other]}) above it: `{text}`")
            elif LAYERS[other] == LAYERS[wing]:
                wrong.append(f"{MODULES[name].relative_to(RUNTIME.parent)}:{line}: {wing} imports {target} of "
                             f"{other}, a wing beside it on layer {LAYERS[wing]}: `{text}`")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_imports_inside_functions_only_for_what_must_stay_late():
    wrong = []
    for name in MODULES:
        for target, line, inside, text in _imports(name):
            if not inside:
                continue
            if target or not any(text == allowed or text.startswith(allowed if allowed.endswith("_") else
                                                                     allowed + ".")
                                 for allowed in ALLOWED_IN_FUNCTIONS):
                wrong.append(f"{MODULES[name].relative_to(RUNTIME.parent)}:{line}: `{text}`")
    assert not wrong, "imports inside functions (put them at the top of the module):\n" + "\n".join(wrong)


def test_package_faces_import_nothing():
    busy = [f"{MODULES[name].relative_to(RUNTIME.parent)}" for name in MODULES
            if _is_package(name) and name != f"{PACKAGE}.plans" and _imports(name)]
    assert not busy, f"package __init__ files that import (they run whenever a module below them is imported): {busy}"


def test_the_graph_is_read():
    """The reader itself: known arrows of the code are found (a reader that found none would pass the rest)."""
    graph = _graph()
    assert "parallel_runtime.distributed.comm" in graph["parallel_runtime.parallel.attention"]
    assert "parallel_runtime.plans.vocabulary.tensor_parallel" in graph["parallel_runtime.weights.quantized"]
    assert "parallel_runtime.world.dispatch" in graph["parallel_runtime.world.world"]
    assert len(MODULES) > 40
