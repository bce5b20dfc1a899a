"""Test set-up: ComfyUI importable in this process (CPU), the pack's runtime and tools on the path.

The ComfyUI root goes first on sys.path (its ``nodes.py`` must win over the pack's
``nodes/`` folder); the checkout follows so that ``parallel_runtime`` imports as a
top-level package, the way the workers import it.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


sys.path.append(str(REPO))
from parallel_runtime.comfyui_location import comfyui_path as _comfyui_path  # noqa: E402

COMFYUI_PATH = _comfyui_path("run the tests with tools/test.sh (it sets up the host)")
sys.path.insert(0, COMFYUI_PATH)
sys.path.append(str(REPO / "tools"))

import comfy.options  # noqa: E402,F401
import comfy.cli_args  # noqa: E402

comfy.cli_args.args.cpu = True


@pytest.fixture(scope="session")
def comfyui_path() -> str:
    return COMFYUI_PATH


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    """A ComfyUI base directory with the tiny Wan model, VAE, LoRAs and prompt embedding."""
    from tiny_families import write_family_files
    from tiny_models import LARGE_FILES, TINY_FILES, write_tiny_wan_files

    base = tmp_path_factory.mktemp("comfy_base")
    write_tiny_wan_files(base, only=[name for name in TINY_FILES if name not in LARGE_FILES])
    write_family_files(base)
    return base


@pytest.fixture(scope="session")
def tiny_server(tiny_base, comfyui_path):
    """One real ComfyUI server with the pack for the end-to-end tests of a session, with
    ComfyUI-GGUF where the host has it, plus the test-only extensions: tiny files that state their own config (FLUX.2, text encoders, the
    per-family files), a loader that changes a model the way a ComfyUI update does, and a pack
    with a model of its own for the user plans (see their docstrings)."""
    from comfy_server import ComfyServer

    extensions = REPO / "tests" / "comfy_extensions"
    gguf = Path(comfyui_path) / "custom_nodes" / "ComfyUI-GGUF"  # the third-party pack, as tools/host.py installs it
    server = ComfyServer(comfyui_path, tiny_base, python=sys.executable,
                         extra_custom_nodes=[extensions / "tiny_config_from_metadata",
                                             extensions / "simulated_comfyui_update",
                                             extensions / "user_plan_model",
                                             extensions / "tiny_model_patches",
                                             *([gguf] if gguf.is_dir() else [])]).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_prompt(tiny_server) -> dict:
    """The bundled tiny workflow in API format."""
    from workflows import load, ui_to_api

    return ui_to_api(load(REPO / "example_workflows" / "tiny_wan_ulysses2_demo.json"), tiny_server.object_info())


def _load_pack_nodes():
    """The pack's nodes module, imported as a package the way ComfyUI imports the pack."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hybrid_parallel_pack", REPO / "__init__.py",
                                                  submodule_search_locations=[str(REPO)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["hybrid_parallel_pack"] = module
    spec.loader.exec_module(module)
    import hybrid_parallel_pack.nodes  # noqa: F401  (the node classes and the runtime they use)
    import hybrid_parallel_pack.parallel_runtime.comfyui_glue.wrappers  # noqa: F401
    import hybrid_parallel_pack.parallel_runtime.config  # noqa: F401
    import hybrid_parallel_pack.parallel_runtime.world.runtime  # noqa: F401

    return module


# The pack as ComfyUI loads it (a package with relative imports), for tests that drive its
# nodes directly; ``parallel_runtime`` imported top-level (as the workers do) is a separate copy.
PACK = _load_pack_nodes()


@pytest.fixture(scope="module")
def runtime(comfyui_path):
    """A Runtime (the top-level ``parallel_runtime`` copy, as the workers import it) that knows
    this ComfyUI, shut down when the module's tests are done."""
    from parallel_runtime.world.runtime import Runtime
    rt = Runtime()
    rt.comfyui_path = comfyui_path
    yield rt
    rt.shutdown("tests done")


def cpu_world(runtime, sizes: dict, config_module=None):
    """The runtime's world for these mesh sizes on as many CPU ranks."""
    if config_module is None:
        import parallel_runtime.config as config_module
    n = 1
    for v in sizes.values():
        n *= v
    config = config_module.build_config(**sizes, devices=",".join(["cpu"] * n),
                                        host=config_module.HostDevices("cpu"))
    return runtime.world_for(config)


class VersionedSource:
    """A weight source outside ComfyUI (``comfy_weights.WeightSource``'s interface): the module's
    tensors as they are, under a version the test changes by hand."""

    def __init__(self, checkpoint: str | None = None):
        self.number = 0
        self.path = checkpoint  # the file the test saved the model to, if any (weights/file_reads.py)
        self.patched_names: set[str] = set()

    def version(self):
        return ("test", self.number)

    def checkpoint(self):
        return self.path, "a test model built in memory"

    def patched(self, name, owner=None):
        return name in self.patched_names

    def refuse_unsupported(self, what):
        pass

    def weight(self, name, tensor, device, owner=None):
        return tensor if tensor.device == device else tensor.to(device)

    def compute_dtype(self):
        return None

    def packed_patches(self, name):
        return []


def run_gloo_ranks(script: str, world: int, *args: str, env: dict | None = None) -> list[dict]:
    """``world`` processes of ``python -c script rank world port repo *args``, one gloo group on a
    free port; each prints ``REPORT <json>`` last. Their reports, by rank. ``env``: the processes'
    whole environment (default: this one's), OMP_NUM_THREADS=1 added."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(world), str(port), str(REPO), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"})
             for r in range(world)]
    reports = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        line = [entry for entry in out.splitlines() if entry.startswith("REPORT ")]
        assert line, out
        reports.append(json.loads(line[-1][len("REPORT "):]))
    return sorted(reports, key=lambda r: r["rank"])


def single_process_references(cases: dict):
    """case name -> (model, args, kwargs, the model's output in this one process), each built
    on first use and kept for the module."""
    import torch

    cache = {}

    def get(name):
        if name not in cache:
            model, args, kwargs = cases[name]()
            with torch.inference_mode():
                ref = model(*args, **kwargs, transformer_options={})
            cache[name] = (model, args, kwargs, ref)
        return cache[name]
    return get


def check_every_family(world, built, cases, tol: float, compile=None, forwards: int = 1) -> int:
    """Every family case (tests/families.py) through ``world`` equals its single-process output
    (cases whose inputs the plan refuses are left out), ``forwards`` times each, compiled with
    ``compile`` (compile_regions.CompileSettings) if given; returns how many were checked."""
    import torch

    from parallel_runtime.plans import find_plan
    from test_context_parallel import refused_input

    checked = 0
    for case in cases:
        model, args, kwargs, ref = built(case)
        if refused_input(model, kwargs):
            continue
        for _ in range(forwards):
            with torch.inference_mode():
                out = world.forward(model, find_plan(model), model._forward, args,
                                    {**kwargs, "transformer_options": {}}, compile=compile)
            err = (out - ref).abs().max().item()
            assert out.shape == ref.shape and err <= tol, (case, err)
        checked += 1
    return checked


def counted_forwards(world, at_least: list[int], timeout: float = 10.0) -> list[int]:
    """Each rank's forward count once every rank has counted ``at_least`` (or the timeout passed).
    A worker counts its forward after its part of the output has left it, so rank 0 can return
    from ``world.forward`` and read the status a moment before the last worker's count lands."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        counts = [r["forwards"] for r in world.status()["ranks"]]
        if all(c >= n for c, n in zip(counts, at_least)) or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


# Parameters that name the layout a server-level test runs in (its Parallel Config).
LAYOUT_PARAMS = ("layout", "hybrid", "parallel")


FULL_ENV = "PARALLEL_FULL_SUITE"


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the rest of the layout matrix: the cases each module's QUICK_TIER rule leaves out "
                          f"of the default run (or set {FULL_ENV}=1); they carry the 'matrix' marker")


def in_quick_tier(item) -> bool:
    """A module may define ``QUICK_TIER(test_name, params) -> bool``: the default run keeps only the
    cases it accepts (each feature under its representative layouts and families), the full run
    (``--full``) all of them (``-m smoke`` selects within the tier it runs in)."""
    rule = getattr(item.module, "QUICK_TIER", None)
    if rule is None:
        return True
    return bool(rule(item.originalname, getattr(getattr(item, "callspec", None), "params", {})))


def _select_tier(config, items) -> None:
    deselected = []
    for item in items:
        if not in_quick_tier(item):
            item.add_marker("matrix")
            deselected.append(item)
    if config.getoption("--full") or os.environ.get(FULL_ENV) == "1" or not deselected:
        return
    config.hook.pytest_deselected(items=deselected)
    kept = set(map(id, deselected))
    items[:] = [item for item in items if id(item) not in kept]


def pytest_report_header(config):
    full = config.getoption("--full") or os.environ.get(FULL_ENV) == "1"
    return ("tier: full (the whole layout matrix)" if full else
            "tier: quick (each feature under its representative layouts; --full adds the 'matrix' cases)")


def pytest_collection_modifyitems(config, items):
    """The tier first (``in_quick_tier``). Then, within each module that sets ``LAYOUT_MAJOR = True``, the tests that run in a named layout
    are grouped by that layout, in the order the layouts first appear (the rest keep their place
    before them). A world restarts with its workers whenever the layout changes, so layout-major
    order starts it once per layout, not once per test group (tests/test_comfy_families.py has a
    group per family and feature)."""
    _select_tier(config, items)

    def layout_of(item):
        if not getattr(item.module, "LAYOUT_MAJOR", False):
            return None
        params = getattr(getattr(item, "callspec", None), "params", {})
        value = next((params[p] for p in LAYOUT_PARAMS if p in params), None)
        return value if isinstance(value, str) else None

    order: dict[tuple[str, str], int] = {}
    keyed = []
    for index, item in enumerate(items):
        layout = layout_of(item)
        module = item.nodeid.split("::", 1)[0]
        if layout is not None:
            order.setdefault((module, layout), len(order))
        keyed.append(((module, -1 if layout is None else order[(module, layout)], index), item))
    first = {}
    for (module, _, index), _ in keyed:
        first.setdefault(module, index)
    keyed.sort(key=lambda pair: (first[pair[0][0]], pair[0][1], pair[0][2]))
    items[:] = [item for _, item in keyed]
