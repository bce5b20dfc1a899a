"""The rank-0 runtime's lifecycle: lazy start, reuse across runs, restart on a new config
or after a failure."""
import pytest

from parallel_runtime.config import HostDevices, build_config
from parallel_runtime.world.runtime import Runtime

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


def test_a_worker_killed_between_two_forwards_of_a_prompt_fails_that_prompt(runtime, monkeypatch):
    """Between two forwards of one ComfyUI prompt a dead worker is not replaced silently (that
    would hide the OOM killer or a crash); the next prompt starts fresh workers."""
    import torch

    from parallel_runtime.plans import find_plan
    from parallel_runtime.world import dispatch, memory, runtime as runtime_module
    from parallel_runtime.world.workers import WorkerFailure
    from tiny_models import TinyWan, build_wan_model

    prompt = ["p1"]
    monkeypatch.setattr(memory, "current_prompt", lambda: prompt[0])
    monkeypatch.setattr(runtime_module, "current_prompt", lambda: prompt[0])
    model = build_wan_model(TinyWan(), text_dim=64)
    x, t, c = torch.randn(1, 16, 3, 10, 14), torch.tensor([1.0]), torch.randn(1, 7, 64)

    def forward():
        world = runtime.world_for(build_config(ulysses_size=2, host=CPU))
        with torch.inference_mode():
            return world, world.forward(model, find_plan(model), model._forward, (x, t, c), {"transformer_options": {}})

    world, first = forward()
    assert dispatch.memory is memory and world.last_prompt == "p1"
    world.workers[0].proc.kill()
    world.workers[0].proc.wait()
    with pytest.raises(WorkerFailure, match=r"rank 1 \(cpu, pid \d+\) was killed by signal 9"):
        forward()
    assert world.state == "stopped" and runtime.world is None
    assert "killed by signal 9" in runtime.status()["last_failure"]["message"]
    prompt[0] = "p2"
    fresh, again = forward()
    assert fresh is not world and fresh.healthy
    assert (again - first).abs().max().item() == 0


def test_shared_weights_are_released_after_worlds_end_even_when_a_worker_was_killed(runtime, monkeypatch):
    """Every worker maps the weights' shared-memory files; a worker killed with SIGKILL
    never unmaps them. Once the model is gone on rank 0, no file may be left behind."""
    monkeypatch.setenv("PARALLEL_WEIGHT_TRANSPORT", "shared")  # the CPU ranks' transport, whatever the caller chose
    import gc
    import glob
    import os

    import torch

    from parallel_runtime.plans import find_plan
    from tiny_models import TinyWan, build_wan_model

    def our_files():
        return glob.glob(f"/dev/shm/torch_{os.getpid()}_*")

    before = set(our_files())
    model = build_wan_model(TinyWan(), text_dim=64)
    x, t, c = torch.randn(2, 16, 3, 10, 14), torch.tensor([1.0, 2.0]), torch.randn(2, 7, 64)

    def forward(world):
        with torch.inference_mode():
            return world.forward(model, find_plan(model), model._forward, (x, t, c), {"transformer_options": {}})

    forward(runtime.world_for(build_config(ulysses_size=2, host=CPU)))
    world = runtime.world_for(build_config(ring_size=2, ulysses_size=2, devices="cpu,cpu,cpu,cpu", host=CPU))
    forward(world)
    world.workers[1].proc.kill()
    world.workers[1].proc.wait()
    with pytest.raises(Exception, match="rank 2"):
        forward(world)
    forward(runtime.world_for(build_config(ulysses_size=2, host=CPU)))
    assert len(set(our_files()) - before) > 10  # the weights live in shared memory while in use
    runtime.shutdown("test")
    del model, world
    gc.collect()
    assert set(our_files()) - before == set()


class _FakeProc:
    def __init__(self, code, pid):
        self.code, self.pid = code, pid

    def poll(self):
        return self.code


class _FakeWorker:
    """What World._explain_failure reads from a worker: liveness, its report, its output."""

    def __init__(self, rank, code=None, error=None):
        self.rank, self.device, self.host = rank, "cpu", None
        self.proc = _FakeProc(code, 1000 + rank)
        self.reported_error, self.output = error, ["last words"]

    @property
    def alive(self):
        return self.proc.poll() is None

    def drain(self):
        return []


def test_a_silently_killed_rank_is_blamed_rather_than_the_peer_whose_collective_broke():
    """When rank 2 is SIGKILLed, rank 1 reports "connection reset" first; the user must be told
    about rank 2, the cause, not about rank 1's symptom."""
    from parallel_runtime.world.world import World

    world = World.__new__(World)
    world.workers = [_FakeWorker(1, code=3, error="RuntimeError: Connection reset by peer"), _FakeWorker(2, code=-9)]
    message = world._explain_failure(RuntimeError("collective failed"))
    assert message.startswith("rank 2 (cpu, pid 1002) was killed by signal 9"), message
    assert "rank 1" not in message

    world.workers = [_FakeWorker(1, code=3, error="ValueError: bad shape"), _FakeWorker(2)]
    assert world._explain_failure(RuntimeError("x")).startswith("rank 1 (cpu) raised an error:\nValueError: bad shape")
