"""Compiled regions (parallel_runtime/parallel/compile_regions.py) and the hook dispatchers they rely on
(scoped_hooks.py), in-process; tests/test_comfy_compile.py runs every layout through a server."""
import copy
import pickle
import sys

import pytest
import torch

from parallel_runtime.parallel import scoped_hooks
from parallel_runtime.parallel.compile_regions import (CompileSettings, compiled_regions, region_patterns,
                                                       skip_transformer_options_guards, watch)
from parallel_runtime.plans import PLANS, plan_for_family



def QUICK_TIER(test: str, params: dict) -> bool:
    """The default run (conftest.in_quick_tier) compiles Wan in a server under two layouts
    (test_comfy_compile.py) and the tests here compile one model each; ``--full`` compiles every family's blocks."""
    return test != "test_every_family_compiled_under_ulysses_2_equals_one_process"

def test_settings_come_from_the_compile_nodes_model_options():
    assert CompileSettings.from_model_options({}) is None
    options = {"torch_compile_kwargs": {"backend": "inductor", "options": {"guard_filter_fn": len, "x": 1},
                                        "mode": "max-autotune", "fullgraph": True, "dynamic": None}}
    settings = CompileSettings.from_model_options(options)
    # ComfyUI's guard filter is replaced by ours (it would skip the guards on the attention override)
    assert settings == CompileSettings(backend="inductor", mode="max-autotune", dynamic=None, options=(("x", 1),))
    pickle.loads(pickle.dumps(settings))  # it travels to the workers with each forward


def test_guard_filter_skips_values_in_transformer_options_but_not_what_runs():
    from torch._dynamo.types import GuardFilterEntry

    def entry(name, kind):
        return GuardFilterEntry(name=name, has_value=False, value=None, guard_type=kind, derived_guard_types=(),
                                is_global=False, orig_guard=None)

    entries = [entry("L['transformer_options']['block_index']", "EQUALS_MATCH"),
               entry("L['transformer_options']['sigmas']", "TENSOR_MATCH"),
               entry("L['transformer_options']['optimized_attention_override']", "ID_MATCH"),
               entry("L['transformer_options']", "DICT_KEYS_MATCH"),
               entry("L['x']", "TENSOR_MATCH"),
               entry("L['self'].heads", "EQUALS_MATCH")]
    assert skip_transformer_options_guards(entries) == [False, False, True, True, True, True]


def test_every_transformer_plan_names_regions():
    for plan in PLANS:
        regions = region_patterns(plan)
        assert regions and all(p.endswith("*") for p in regions), plan.family


def _counting_hook(calls, name):
    def hook(module, args):
        calls.append(name)
        return (args[0] + 1,)
    return hook


def test_scoped_hooks_run_in_order_only_while_active_and_survive_copies():
    lin = torch.nn.Linear(2, 2)
    calls = []
    a = scoped_hooks.pre_hook(lin, _counting_hook(calls, "a"))
    b = scoped_hooks.pre_hook(lin, _counting_hook(calls, "b"))
    post = scoped_hooks.post_hook(lin, lambda m, args, out: out * 0)
    x = torch.zeros(1, 2)
    assert lin(x).abs().sum() == 0 and calls == ["a", "b"]
    for h in (a, b, post):
        h.remove()
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))  # nothing active: as it was
    assert calls == ["a", "b"]
    # One permanent dispatcher per kind, whatever was added and removed; a copy (as a worker
    # unpickles it) brings its dispatchers, and adding a hook to it installs none twice.
    for copied in (lin, copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
        scoped_hooks.pre_hook(copied, _counting_hook(calls, "c")).remove()
        assert list(copied._forward_pre_hooks.values()) == [scoped_hooks.dispatch_pre]
        assert list(copied._forward_hooks.values()) == [scoped_hooks.dispatch_post]


def test_compiled_regions_are_set_for_one_forward_only():
    from families import wan_t2v

    model, _, _ = wan_t2v()
    plan = plan_for_family("wan")
    blocks = [m for name, m in model.named_modules() if name.count(".") == 1 and name.startswith("blocks.")]
    assert blocks
    with compiled_regions(model, plan, CompileSettings()):
        assert all("forward" in b.__dict__ for b in blocks)
    assert not any("forward" in b.__dict__ for b in blocks)  # the model ComfyUI owns is left as it was


def test_a_graph_compiled_unsharded_is_not_reused_sharded(runtime, monkeypatch):
    """Compiled at world size 1 first, then Ulysses 2 in the same process: rank 0 must compile
    again where the context-parallel attention override is set (reusing the world-1 graph
    computed local attention on rank 0 and left the ranks waiting on each other)."""
    import parallel_runtime.world.settings as world_module
    from conftest import REPO, cpu_world

    sys.path.insert(0, str(REPO / "bench"))
    from scenarios import FluxShape, build_flux

    monkeypatch.setattr(world_module, "COLLECTIVE_TIMEOUT_S", 120)  # a regression fails, it does not hang
    model, args, kwargs = build_flux(FluxShape(hidden=128, heads=4, double=1, single=1, image_side=16,
                                               text_tokens=8, context_dim=64, vec_dim=32))
    plan = plan_for_family("flux")
    method = model._forward
    options = {"transformer_options": {}}
    settings = CompileSettings()
    with torch.inference_mode():
        reference = method(*args, **kwargs, **options)
        with compiled_regions(model, plan, settings):
            compiled_one = method(*args, **kwargs, **options)
        world = cpu_world(runtime, {"ulysses_size": 2})
        before = watch().compiles
        out = world.forward(model, plan, method, args, {**kwargs, **options}, compile=settings)
    rel = lambda t: ((t - reference).abs().max() / reference.abs().max()).item()  # noqa: E731
    print(f"\ncompiled world 1: relative err {rel(compiled_one):.1e}; compiled Ulysses 2: {rel(out):.1e}; "
          f"rank 0 compiled {watch().compiles - before} frames for the sharded forward")
    assert rel(compiled_one) <= 2e-6 and rel(out) <= 2e-6
    assert watch().compiles > before
    assert all(r["recompiles"] == 0 for r in world.status()["ranks"])


def test_the_watchdog_waits_while_a_rank_compiles():
    """A first compiled step may outlast the collective timeout: while a rank compiles the
    watchdog's clock starts again; once it is done, a real hang is still stopped."""
    import threading
    import time

    from parallel_runtime.world.watchdog import SectionStopped, Watchdog

    compiling = threading.Event()
    compiling.set()
    stopped = []
    dog = Watchdog(lambda: [], lambda reason, hung: stopped.append(time.monotonic()), name="test-watchdog",
                   busy=compiling.is_set)
    try:
        with pytest.raises(SectionStopped):  # a section the watchdog stopped never returns its result
            with dog.guard("forward", 0.3):
                start = time.monotonic()
                time.sleep(1.0)  # three timeouts long, compiling all along
                assert not stopped
                compiling.clear()
                deadline = time.monotonic() + 3
                while not stopped and time.monotonic() < deadline:
                    time.sleep(0.05)
        assert stopped and stopped[0] - start > 1.0
        assert "stalled" in dog.fired
    finally:
        dog.close()


def test_a_worker_on_another_host_compiling_keeps_the_watchdog_waiting():
    """A remote worker has no shared status table: its compile listener sends a "stats" row, which
    rank 0 reads inside a forward only (the only section that compiles)."""
    from parallel_runtime.world import protocol
    from parallel_runtime.config import HostDevices, build_config
    from parallel_runtime.world.world import World

    class Remote:
        host, rank = "gpu-b", 1

        def __init__(self):
            self.stats, self.reads = None, 0
            self.pending = [0.0] * len(protocol.STATUS_FIELDS)
            self.pending[protocol.COMPILE_FIELDS.start] = 1.0  # compiling

        def drain(self):
            self.reads += 1
            self.stats = self.pending
            return [("stats", self.pending)]

    world = World(build_config(ulysses_size=2, host=HostDevices("cpu", cpu_count=2)), comfyui_path=".")
    try:
        remote = Remote()
        world.workers = [remote]
        with world.watchdog.guard("weight send", 60):
            assert not world._compiling() and remote.reads == 0
        with world.watchdog.guard("forward", 60):
            assert world._compiling() and remote.reads >= 1
        remote.pending = [0.0] * len(protocol.STATUS_FIELDS)
        with world.watchdog.guard("forward", 60):
            assert not world._compiling()
    finally:
        world.watchdog.close()


def test_fresh_workers_load_what_earlier_workers_compiled_from_the_cache(runtime, monkeypatch, tmp_path):
    """Workers are new processes after a restart or a config change: with inductor's on-disk caches
    (the default) a fresh worker loads the graphs an earlier one built instead of building them."""
    from conftest import REPO, cpu_world

    sys.path.insert(0, str(REPO / "bench"))
    from scenarios import FluxShape, build_flux

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the workers' cache, empty at first
    model, args, kwargs = build_flux(FluxShape(hidden=128, heads=4, double=1, single=1, image_side=16,
                                               text_tokens=8, context_dim=64, vec_dim=32), seed=7)
    plan = plan_for_family("flux")
    options = {"transformer_options": {}}
    with torch.inference_mode():
        reference = model._forward(*args, **kwargs, **options)
    caches = []
    for _ in range(2):
        runtime.shutdown("fresh workers")
        world = cpu_world(runtime, {"ulysses_size": 2})
        with torch.inference_mode():
            out = world.forward(model, plan, model._forward, args, {**kwargs, **options}, compile=CompileSettings())
        worker = world.status()["ranks"][1]
        assert ((out - reference).abs().max() / reference.abs().max()).item() <= 2e-6
        assert worker["compiles"] > 0
        caches.append(worker["compile_cache"])
    runtime.shutdown("test done")
    print(f"\nworker's inductor cache, first world: {caches[0]}, fresh workers after it: {caches[1]}")
    assert caches[0]["misses"] > 0  # the first worker built its graphs (an empty cache)
    assert caches[1] == {"hits": caches[0]["misses"] + caches[0]["hits"], "misses": 0}


def test_every_family_compiled_under_ulysses_2_equals_one_process(runtime):
    """Every family's exactness case (tests/families.py) with its plan's blocks compiled on both
    ranks of a Ulysses 2 world: equal to the eager single-process run, twice, and the second
    forward compiles nothing on any rank. The aot_eager backend traces and splits the same graphs
    as inductor without generating code (with inductor this test also passes, in 3 minutes instead
    of 1.3); the server tests compile Wan with inductor under every layout."""
    from conftest import check_every_family, cpu_world, single_process_references
    from families import CASES

    world = cpu_world(runtime, {"ulysses_size": 2})
    built = single_process_references(CASES)
    checked = check_every_family(world, built, CASES, 1e-5, compile=CompileSettings(backend="aot_eager"), forwards=2)
    ranks = world.status()["ranks"]
    print(f"\n{checked} families compiled under Ulysses 2; frames compiled per rank "
          f"{[r['compiles'] for r in ranks]}, again {[r['recompiles'] for r in ranks]}")
    assert checked >= 10
    assert all(r["compiles"] > 0 and r["recompiles"] == 0 for r in ranks)
