"""The rank-0 runtime's lifecycle: lazy start, reuse across runs, restart on a new config
or after a failure."""
import pytest

from parallel_runtime.config import HostDevices, build_config
from parallel_runtime.runtime import Runtime

pytestmark = pytest.mark.multirank
CPU = HostDevices("cpu", cpu_count=2)


@pytest.fixture()
def runtime(comfyui_path):
    rt = Runtime()
    rt.comfyui_path = comfyui_path
    yield rt
    rt.shutdown("test done")


def test_nothing_starts_until_a_world_is_needed(runtime):
    status = runtime.status()
    assert runtime.world is None and status["state"] == "idle" and len(status["ranks"]) == 1


def test_same_config_reuses_the_workers_and_a_new_config_replaces_them(runtime):
    two = build_config(ulysses_size=2, host=CPU)
    first = runtime.world_for(two)
    pids = [w.proc.pid for w in first.workers]
    assert runtime.world_for(build_config(ulysses_size=2, devices="cpu,cpu", host=CPU)) is first

    four = build_config(ulysses_size=4, devices="cpu,cpu,cpu,cpu", host=CPU)
    second = runtime.world_for(four)
    assert second is not first and first.state == "stopped"
    assert all(not w.alive for w in first.workers)
    assert len(second.workers) == 3 and all(w.alive for w in second.workers)
    assert not set(pids) & {w.proc.pid for w in second.workers}
    assert [r["rank"] for r in runtime.status()["ranks"]] == [0, 1, 2, 3]


def test_a_dead_worker_is_replaced_on_the_next_run(runtime):
    config = build_config(ulysses_size=2, host=CPU)
    world = runtime.world_for(config)
    world.workers[0].proc.kill()
    world.workers[0].proc.wait()
    fresh = runtime.world_for(config)
    assert fresh is not world and fresh.healthy
