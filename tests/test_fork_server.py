"""Workers forked from the fork server (parallel_runtime/world/forkserver.py) and the cases where
rank 0 spawns them instead: each world's result against this process alone, in fp32."""
import logging
import os
import signal
import subprocess
import time

import pytest
import torch

from parallel_runtime.config import HostDevices, build_config
from parallel_runtime.plans import find_plan
from parallel_runtime.world import spawn
from parallel_runtime.world.forkserver import TOUCH_CUDA_ENV
from parallel_runtime.world.world import World
from parallel_runtime.world.workers import WorkerFailure
from tiny_models import TinyWan, build_wan_model

pytestmark = pytest.mark.multirank
TEXT_DIM = 64
TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return build_wan_model(TinyWan(dim=512, ffn_dim=256, num_layers=2), seed=0, text_dim=TEXT_DIM)


@pytest.fixture()
def fresh_servers():
    """No fork server from an earlier test (they outlive worlds): each test starts its own."""
    spawn.close_fork_servers()
    yield
    spawn.close_fork_servers()


def world_of(comfyui_path, size=2):
    devices = ",".join(["cpu"] * size)
    return World(build_config(ulysses_size=size, devices=devices, host=HostDevices("cpu", cpu_count=2)),
                 comfyui_path=comfyui_path).start()


def max_error(world, model):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 3, 10, 14, generator=g)
    t = torch.tensor([700.0])
    context = torch.randn(1, 7, TEXT_DIM, generator=g)
    with torch.inference_mode():
        ref = model(x, t, context, transformer_options={})
        out = world.forward(model, find_plan(model), model._forward, (x, t, context), {"transformer_options": {}})
    return (out - ref).abs().max().item()


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_workers_are_forked_from_one_server_and_compute_the_same(comfyui_path, model, fresh_servers):
    world = world_of(comfyui_path, 4)
    try:
        server = spawn._servers[comfyui_path]
        assert all(isinstance(w.proc, spawn.ForkedWorker) for w in world.workers)
        assert {parent_of(w.pid) for w in world.workers} == {server.proc.pid}
        err = max_error(world, model)
        print(f"\nUlysses 4, forked workers: max abs err {err:.2e}")
        assert err <= TOL
    finally:
        world.shutdown("test done")
    assert [w.proc.returncode for w in world.workers] == [0, 0, 0]
    second = world_of(comfyui_path)  # the next world forks from the same server
    try:
        assert parent_of(second.workers[0].pid) == server.proc.pid
        assert max_error(second, model) <= TOL
    finally:
        second.shutdown("test done")


def test_a_killed_forked_worker_is_reported_with_its_signal(comfyui_path, model, fresh_servers):
    world = world_of(comfyui_path)
    try:
        world.workers[0].proc.kill()
        assert world.workers[0].proc.wait(10) == -signal.SIGKILL
        with pytest.raises(WorkerFailure, match=r"rank 1 .* was killed by signal 9"):
            max_error(world, model)
    finally:
        world.shutdown("test done")
    fresh = world_of(comfyui_path)
    try:
        assert isinstance(fresh.workers[0].proc, spawn.ForkedWorker)
        assert max_error(fresh, model) <= TOL
    finally:
        fresh.shutdown("test done")


def test_another_environment_gets_another_fork_server_once_the_old_ones_workers_ended(comfyui_path, model,
                                                                                      fresh_servers, monkeypatch):
    """The fork server imported the runtime under the environment it started with; a worker that
    rank 0 starts under another one must read that one. While the fork server's workers live (it
    cannot be replaced: they would end with it) the answer is to spawn; afterwards, a new fork server."""
    first = world_of(comfyui_path)
    server = spawn._servers[comfyui_path]
    try:
        monkeypatch.setenv("PARALLEL_SOME_SETTING", "1")
        assert spawn.fork_server(comfyui_path) is None  # a worker started now is spawned
        assert server.proc.poll() is None and max_error(first, model) <= TOL
    finally:
        first.shutdown("test done")
    world = world_of(comfyui_path)
    try:
        replaced = spawn._servers[comfyui_path]
        assert replaced is not server and server.proc.poll() is not None
        assert isinstance(world.workers[0].proc, spawn.ForkedWorker)
        with open(f"/proc/{replaced.proc.pid}/environ", "rb") as f:
            assert b"PARALLEL_SOME_SETTING=1" in f.read().split(b"\0")
        assert max_error(world, model) <= TOL
    finally:
        world.shutdown("test done")


def test_a_spawned_worker_joins_a_world_beside_forked_ones(comfyui_path, model, fresh_servers, monkeypatch):
    """The two ways of starting a worker in one world: rank 1 spawned, ranks 2 and 3 forked."""
    started = []
    real = spawn.ForkServer.start

    def first_refused(self, boot, timeout_s):
        started.append(boot["rank"])
        return None if boot["rank"] == 1 else real(self, boot, timeout_s)

    monkeypatch.setattr(spawn.ForkServer, "start", first_refused)
    world = world_of(comfyui_path, 4)
    try:
        assert started == [1, 2, 3]
        assert [type(w.proc).__name__ for w in world.workers] == ["Popen", "ForkedWorker", "ForkedWorker"]
        assert max_error(world, model) <= TOL
    finally:
        world.shutdown("test done")


def test_switched_off_spawns_every_worker(comfyui_path, model, fresh_servers, monkeypatch):
    monkeypatch.setenv(spawn.FORK_SERVER_ENV, "0")
    world = world_of(comfyui_path)
    try:
        assert isinstance(world.workers[0].proc, subprocess.Popen) and not spawn._servers
        assert max_error(world, model) <= TOL
    finally:
        world.shutdown("test done")


def test_a_fork_server_that_touched_cuda_refuses_and_workers_are_spawned(comfyui_path, model, fresh_servers,
                                                                         monkeypatch, caplog):
    """A child forked after the CUDA driver was initialised could not use CUDA: the fork server
    refuses (the switch acts as if its imports had asked the driver for its devices)."""
    monkeypatch.setenv(TOUCH_CUDA_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="parallel"):
        world = world_of(comfyui_path)
    try:
        assert isinstance(world.workers[0].proc, subprocess.Popen)
        assert "fork server refused (the fork server asked the CUDA driver" in caplog.text
        assert spawn._servers[comfyui_path].refused
        assert max_error(world, model) <= TOL
    finally:
        world.shutdown("test done")


def test_the_workers_exit_with_their_fork_server_and_the_next_world_starts_another(comfyui_path, model,
                                                                                    fresh_servers):
    world = world_of(comfyui_path)
    server = spawn._servers[comfyui_path]
    pid = world.workers[0].pid
    try:
        os.kill(server.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while world.workers[0].alive and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not world.workers[0].alive  # it watched its parent, the fork server
        assert not os.path.exists(f"/proc/{pid}") or parent_of(pid) != server.proc.pid
        with pytest.raises(WorkerFailure, match="rank 1"):
            max_error(world, model)
    finally:
        world.shutdown("test done")
    fresh = world_of(comfyui_path)
    try:
        assert spawn._servers[comfyui_path] is not server
        assert isinstance(fresh.workers[0].proc, spawn.ForkedWorker)
        assert max_error(fresh, model) <= TOL
    finally:
        fresh.shutdown("test done")


def test_a_fork_server_that_cannot_start_leaves_the_workers_spawned(comfyui_path, model, fresh_servers,
                                                                   monkeypatch, caplog):
    def cannot_start(*args, **kwargs):
        raise OSError("no sequenced-packet sockets here")

    monkeypatch.setattr(spawn, "ForkServer", cannot_start)
    with caplog.at_level(logging.WARNING, logger="parallel"):
        world = world_of(comfyui_path)
    try:
        assert isinstance(world.workers[0].proc, subprocess.Popen) and not spawn._servers
        assert "could not start the worker fork server (no sequenced-packet sockets here)" in caplog.text
        assert max_error(world, model) <= TOL
    finally:
        world.shutdown("test done")
