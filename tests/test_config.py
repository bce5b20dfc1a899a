"""Parallel Config validation: every refusal names the node, the value and what would be valid."""
import pytest

from parallel_runtime.config import ConfigError, HostDevices, build_config

CPU2 = HostDevices(main_device="cpu", cuda_count=0, cpu_count=2)
GPU4 = HostDevices(main_device="cuda:0", cuda_count=4, cpu_count=32)


def refused(**kw) -> str:
    host = kw.pop("host", CPU2)
    with pytest.raises(ConfigError) as info:
        build_config(host=host, **kw)
    msg = str(info.value)
    assert msg.startswith("Parallel Config: "), msg
    return msg


def test_default_is_a_single_rank():
    cfg = build_config(host=CPU2)
    assert cfg.world_size == 1 and cfg.devices == ("cpu",) and cfg.backend == "gloo"


def test_ulysses_on_cpu_resolves_devices_and_backend():
    cfg = build_config(ulysses_size=2, host=CPU2)
    assert cfg.world_size == 2
    assert cfg.devices == ("cpu", "cpu")
    assert cfg.backend == "gloo"
    assert cfg.mesh_sizes == {"cfg": 1, "ring": 1, "ulysses": 2, "tp": 1}


@pytest.mark.parametrize("name", ["ulysses_size", "ring_size", "tp_size", "cfg_size"])
def test_sizes_below_one_are_refused(name):
    msg = refused(**{name: 0})
    assert f"{name}=0" in msg and "from 1 to 1024" in msg


def test_context_parallel_meshes_combine():
    cfg = build_config(cfg_size=2, ring_size=2, ulysses_size=2, devices=",".join(["cpu"] * 8), host=CPU2)
    assert cfg.world_size == 8 and cfg.mesh_sizes == {"cfg": 2, "ring": 2, "ulysses": 2, "tp": 1}


def test_more_ranks_than_cpu_cores_is_refused_with_the_way_out():
    msg = refused(ulysses_size=4, devices="cpu")
    assert "devices='cpu'" in msg and "4" in msg and "2 cores" in msg and "cpu,cpu,cpu,cpu" in msg


def test_auto_on_a_two_core_machine_allows_two_ranks_only():
    assert build_config(ulysses_size=2, devices="auto", host=CPU2).world_size == 2
    refused(ulysses_size=3, devices="auto")


def test_explicit_cpu_list_may_oversubscribe():
    cfg = build_config(ulysses_size=4, devices="cpu,cpu,cpu,cpu", host=CPU2)
    assert cfg.devices == ("cpu",) * 4


def test_device_list_must_match_the_world_size():
    msg = refused(ulysses_size=2, devices="cpu,cpu,cpu")
    assert "3 devices" in msg and "world size of 2" in msg


@pytest.mark.parametrize("spec", ["", "gpu0,gpu1", "0,,1", "cuda:x", "cpu,0"])
def test_malformed_devices_are_refused(spec):
    msg = refused(ulysses_size=2, devices=spec)
    assert "devices=" in msg


def test_cuda_devices_on_a_cpu_host_are_refused():
    msg = refused(ulysses_size=2, devices="0,1")
    assert "CPU" in msg


def test_cuda_auto_takes_comfyui_device_first():
    host = HostDevices(main_device="cuda:2", cuda_count=4, cpu_count=32)
    cfg = build_config(ulysses_size=4, host=host)
    assert cfg.devices == ("cuda:2", "cuda:0", "cuda:1", "cuda:3")
    assert cfg.backend == "nccl"


def test_cuda_more_ranks_than_gpus_is_refused():
    msg = refused(ulysses_size=8, host=GPU4)
    assert "4 CUDA devices" in msg


def test_cuda_missing_and_duplicate_devices_are_refused():
    assert "not present" in refused(ulysses_size=2, devices="0,7", host=GPU4)
    assert "once" in refused(ulysses_size=2, devices="0,0", host=GPU4)


def test_rank0_must_be_comfyui_device():
    msg = refused(ulysses_size=2, devices="1,2", host=GPU4)
    assert "rank 0" in msg and "cuda:0" in msg


NO_NCCL_GPU2 = HostDevices(main_device="cuda:0", cuda_count=2, cpu_count=32, nccl=False)  # native Windows
ONE_GPU_SHARED = HostDevices(main_device="cuda:0", cuda_count=1, cpu_count=32, share_devices=True)


@pytest.mark.parametrize("backend,host,expected", [("nccl", CPU2, "NCCL needs CUDA"),
                                                   ("nccl", NO_NCCL_GPU2, "has no NCCL"),
                                                   ("mpi", CPU2, "auto, nccl, gloo")])
def test_backend_mismatches_are_refused(backend, host, expected):
    msg = refused(ulysses_size=2, backend=backend, host=host)
    assert f"backend={backend!r}" in msg and expected in msg


def test_gloo_is_accepted_for_cuda_devices_and_says_it_is_slower():
    cfg = build_config(ulysses_size=2, backend="gloo", host=GPU4)
    assert cfg.backend == "gloo" and cfg.devices == ("cuda:0", "cuda:1")
    assert "slower than NCCL" in cfg.describe()
    assert "slower" not in build_config(ulysses_size=2, host=GPU4).describe()


def test_auto_picks_nccl_only_where_torch_has_it():
    assert build_config(ulysses_size=2, host=GPU4).backend == "nccl"
    assert build_config(ulysses_size=2, host=NO_NCCL_GPU2).backend == "gloo"


def test_ranks_share_one_gpu_only_with_the_test_switch_and_then_through_gloo():
    assert "has 1 CUDA devices" in refused(ulysses_size=2, host=HostDevices("cuda:0", cuda_count=1))
    cfg = build_config(ulysses_size=2, tp_size=2, host=ONE_GPU_SHARED)
    assert cfg.devices == ("cuda:0",) * 4 and cfg.backend == "gloo"
    assert build_config(ulysses_size=2, devices="0,0", host=ONE_GPU_SHARED).backend == "gloo"
    assert "refuses two ranks on one GPU" in refused(ulysses_size=2, backend="nccl", host=ONE_GPU_SHARED)
    assert "once" in refused(ulysses_size=2, devices="0,0", host=GPU4)


def test_hosts_place_ranks_in_order_and_keep_tp_inside_a_host(monkeypatch):
    monkeypatch.setenv("PARALLEL_CLUSTER_KEY", "k" * 16)
    cfg = build_config(ulysses_size=2, tp_size=2, hosts="local:2,gpu-b:2", rendezvous="10.0.0.1:29600", host=CPU2)
    assert cfg.devices == ("cpu", "cpu", "@gpu-b", "@gpu-b") and cfg.multi_host
    assert [cfg.host_of(r) for r in range(4)] == [None, None, "gpu-b", "gpu-b"]
    assert "tensor-parallel groups stay inside a host" in refused(tp_size=2, ulysses_size=2, hosts="local:1,b:3",
                                                                  rendezvous="10.0.0.1:1")
    assert "world size of 2" in refused(ulysses_size=2, hosts="local:1,b:2", rendezvous="10.0.0.1:1")
    assert "rendezvous=" in refused(ulysses_size=2, hosts="local:1,b:1")
    assert "'name:ranks'" in refused(ulysses_size=2, hosts="local,b:1", rendezvous="10.0.0.1:1")


# One list of the Parallel Config inputs (config.CONFIG_INPUTS) and one world-size formula.

def test_build_config_takes_exactly_the_listed_inputs():
    import inspect

    from parallel_runtime.config import CONFIG_INPUTS

    params = [p for p in inspect.signature(build_config).parameters if p not in ("host", "node")]
    assert sorted(params) == sorted(spec.name for spec in CONFIG_INPUTS)


def test_read_inputs_fills_defaults_ignores_unknown_names_and_leaves_links_to_the_run():
    from parallel_runtime.config import CONFIG_INPUTS, config_from_inputs, read_inputs

    assert read_inputs({}) == {spec.name: spec.default for spec in CONFIG_INPUTS}
    inputs = read_inputs({"ulysses_size": "2", "ring_size": 2.0, "control_after_generate": "fixed"})
    assert inputs["ulysses_size"] == 2 and inputs["ring_size"] == 2 and "control_after_generate" not in inputs
    assert read_inputs({"ulysses_size": None}) is None          # linked, while ComfyUI validates
    assert read_inputs({"weights": ["5", 0]}) is None           # linked, in a prompt
    assert config_from_inputs({"layout": "auto", "devices": "cpu,cpu"}, CPU2).world_size == 2
    msg = refused(ulysses_size=2.5)
    assert "ulysses_size=2.5" in msg and "whole numbers" in msg


def test_the_world_size_is_the_product_of_the_sizes_or_the_auto_rank_count():
    from parallel_runtime.config import world_size_of

    assert world_size_of([2, 1, 3, 2]) == 12
    assert build_config(cfg_size=2, ulysses_size=2, tp_size=2, devices=",".join(["cpu"] * 8), host=CPU2).world_size == 8
    auto = build_config(layout="auto", devices="cpu,cpu,cpu", host=CPU2)
    assert auto.world_size == 3 and auto.ring_size == 3


def test_no_other_module_lists_the_size_inputs():
    """The nodes, the runtime and the canvas read CONFIG_INPUTS; none spells the inputs out."""
    import re

    from conftest import REPO

    pattern = re.compile(r"""["'](ulysses|ring|tp|cfg)_size["']""")
    files = [*REPO.glob("nodes/*.py"), *REPO.glob("parallel_runtime/**/*.py"), *REPO.glob("web/*.js")]
    found = [f"{path.relative_to(REPO)}: {line.strip()}" for path in files if path.name != "config.py"
             for line in path.read_text().splitlines() if pattern.search(line)]
    assert not found, found


def test_the_readme_table_lists_every_input_with_its_default():
    import re

    from conftest import REPO
    from parallel_runtime.config import CONFIG_INPUTS

    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("**Parallel Config** (`ParallelConfig`"):]
    table = table[table.index("\n|"):]
    rows = re.findall(r"^\| `(\w+)`( \(optional\))? \| ([^|]+) \|", table[:table.index("\n\n")], re.M)
    assert [name for name, _, _ in rows] == [spec.name for spec in CONFIG_INPUTS]
    for (name, optional, default), spec in zip(rows, CONFIG_INPUTS):
        shown = "empty" if spec.default == "" else str(spec.default) if spec.kind == "int" else f"`{spec.default}`"
        assert (default.strip(), bool(optional)) == (shown, spec.optional), name


def test_cpu_ranks_share_the_cores_this_process_may_run_on(monkeypatch):
    """Under ``taskset`` or a cpuset the threads per rank follow the cores left, not the machine's."""
    from parallel_runtime import config
    from parallel_runtime.world import settings

    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: {5, 3, 8, 9})
    monkeypatch.delenv("PARALLEL_CPU_THREADS_PER_RANK", raising=False)
    assert config.available_cores() == [3, 5, 8, 9]
    assert HostDevices("cpu").cpu_count == 4
    assert settings.cpu_threads_per_rank(2) == 2
    assert settings.cpu_threads_per_rank(8) == 1
    monkeypatch.setenv("PARALLEL_CPU_THREADS_PER_RANK", "3")
    assert settings.cpu_threads_per_rank(2) == 3
