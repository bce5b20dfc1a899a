"""Branches a GPU takes that CPU ranks never would, made to run here by fakes and switches
(issue 29): the weight transport under ComfyUI's cudaMallocAsync allocator, a watchdog that
fired, a long forward that keeps progressing, shared process groups, NCCL's error handling."""
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO

from parallel_runtime.distributed import comm
from parallel_runtime.weights import model_copies, stream as weight_stream
from parallel_runtime.world.watchdog import NCCL_ERROR_HANDLING, SectionStopped, Watchdog, prepare_nccl_environment


def cuda_config(**kw):
    return SimpleNamespace(**{"multi_host": False, "device_type": "cuda", "backend": "gloo",
                              "devices": ("cuda:0", "cuda:0"), **kw})


# ---------------------------------------------------------------- transport choice
def test_cuda_malloc_async_never_gets_ipc_handles(monkeypatch):
    """ComfyUI's cuda_malloc.py selects cudaMallocAsync, which cannot export IPC handles: the weights
    must take the process-group stream, and the status must say why."""
    monkeypatch.delenv(model_copies.TRANSPORT_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    monkeypatch.setattr(model_copies, "trial_export", lambda device: None)  # would work, were it asked
    transport, why = model_copies.choose_transport(cuda_config(), torch.device("cuda:0"))
    assert transport == "process_group"
    assert "cudaMallocAsync" in why and "--disable-cuda-malloc" in why
    monkeypatch.setenv(model_copies.TRANSPORT_ENV, "handles")
    with pytest.raises(ValueError, match="cannot work here.*cudaMallocAsync"):
        model_copies.choose_transport(cuda_config(), torch.device("cuda:0"))


def test_handles_need_a_trial_export_that_works(monkeypatch):
    monkeypatch.delenv(model_copies.TRANSPORT_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr(model_copies, "trial_export", lambda device: "RuntimeError: invalid device context")
    transport, why = model_copies.choose_transport(cuda_config(), torch.device("cuda:0"))
    assert transport == "process_group" and "trial export" in why and "invalid device context" in why
    monkeypatch.setattr(model_copies, "trial_export", lambda device: None)
    assert model_copies.choose_transport(cuda_config(), torch.device("cuda:0"))[0] == "handles"
    assert model_copies.choose_transport(cuda_config(backend="nccl"), torch.device("cuda:0"))[0] == "process_group"
    cpu = cuda_config(device_type="cpu", devices=("cpu", "cpu"))
    assert model_copies.choose_transport(cpu, torch.device("cpu"))[0] == "shared"


def test_the_allocator_setting_comfyui_makes_is_read(tmp_path):
    """Not faked: a process started with ComfyUI's setting (as a worker inherits it) reads it,
    and on this machine the trial export fails too (no GPU): never handles."""
    code = ("import torch, types; from parallel_runtime.weights import model_copies as m; "
            "c = types.SimpleNamespace(multi_host=False, device_type='cuda', backend='gloo', devices=('cuda:0',)*2); "
            "print(m.allocator_backend()); print(m.choose_transport(c, torch.device('cuda:0')))")
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "PYTHONPATH": str(REPO)}
    env.pop(model_copies.TRANSPORT_ENV, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    backend, choice = out.stdout.strip().splitlines()[-2:]
    assert backend == "cudaMallocAsync" and "'process_group'" in choice and "cudaMallocAsync" in choice


# ---------------------------------------------------------------- watchdog
def test_a_section_the_watchdog_stopped_never_returns_its_result():
    """With NCCL an aborted collective may return normally: a fired watchdog must fail the section
    even when its body returned (the output of aborted collectives is never used)."""
    dead, stopped = [], []
    dog = Watchdog(lambda: list(dead), lambda reason, hung: stopped.append(reason), name="test-watchdog")
    try:
        with pytest.raises(SectionStopped, match="rank 1 died during the decode"):
            with dog.guard("decode", 60):
                dead.append(1)
                deadline = time.monotonic() + 3
                while not stopped and time.monotonic() < deadline:
                    time.sleep(0.02)
                result = "an image computed from aborted collectives"  # noqa: F841  (returned normally)
        assert stopped
        dead.clear()
        with dog.guard("decode", 60):  # the next section is judged afresh
            pass
    finally:
        dog.close()


def test_a_long_section_that_progresses_is_not_stopped():
    """Liveness is judged by progress, not by the section's length: ten timeouts long, progressing
    all along, it completes; the same without progress is stopped as a hang."""
    count, stopped = [0], []
    dog = Watchdog(lambda: [], lambda reason, hung: stopped.append(hung), name="test-watchdog",
                   progress=lambda: count[0])
    try:
        with dog.guard("forward", 0.3):
            end = time.monotonic() + 3.0
            while time.monotonic() < end:
                count[0] += 1  # a collective completed somewhere
                time.sleep(0.05)
        assert not stopped
        with pytest.raises(SectionStopped, match="stalled.*a rank hung"):
            with dog.guard("forward", 0.3):
                deadline = time.monotonic() + 3
                while not stopped and time.monotonic() < deadline:
                    time.sleep(0.05)
        assert stopped == [True]
    finally:
        dog.close()


def test_collectives_count_as_progress_and_a_fake_abort_behaves_as_nccl(monkeypatch):
    """comm.PROGRESS grows with every completed collective; under the test fake of NCCL
    (PARALLEL_TEST_NCCL_ABORT) a failing collective waits for the abort and then returns
    as if it had completed, as NCCL's aborted kernels do."""
    calls = []

    @comm._blocking
    def collective(fail):
        calls.append(fail)
        if fail:
            raise RuntimeError("Connection closed by peer")

    before = comm.PROGRESS.count
    collective(False)
    assert comm.PROGRESS.count == before + 1
    with pytest.raises(RuntimeError):
        collective(True)  # gloo as it is: the error surfaces
    monkeypatch.setenv(comm.FAKE_ABORT_ENV, "1")
    try:
        timer = threading.Timer(0.3, comm.abort_collectives, args=("gloo",))
        timer.start()
        started = time.monotonic()
        assert collective(True) is None  # waited for the abort, then "completed"
        assert time.monotonic() - started >= 0.25
        collective(False)
        assert calls[-1] is True  # after the abort nothing runs any more
    finally:
        comm.reset_abort()


# ---------------------------------------------------------------- NCCL settings, groups, weight stream
def test_the_watchdog_is_the_one_owner_of_nccl_aborts(monkeypatch, caplog):
    name, value = NCCL_ERROR_HANDLING
    assert value == "0"  # NCCL never aborts (or ends ComfyUI) on its own
    monkeypatch.setenv(name, "3")
    with caplog.at_level("WARNING", logger="parallel"):
        prepare_nccl_environment()
    assert os.environ[name] == "0" and "owns that" in caplog.text


def test_identical_rank_sets_share_one_process_group(monkeypatch):
    import torch.distributed as dist

    from parallel_runtime.distributed.mesh import MeshLayout, ProcessMesh

    made = []
    monkeypatch.setattr(dist, "new_group", lambda ranks: made.append(tuple(ranks)) or f"group{tuple(ranks)}")
    known = {}
    cfg_ulysses = MeshLayout.from_sizes({"cfg": 2, "ulysses": 2})
    mesh = ProcessMesh(cfg_ulysses, 0, known)
    assert mesh.group("ulysses") is mesh.group("sp")  # ring 1: the same ranks, one communicator
    assert sorted(made) == [(0, 1), (0, 2), (1, 3), (2, 3)]
    # Another layout of the same world: its TP pairs are the Ulysses pairs above.
    other = ProcessMesh(MeshLayout.from_sizes({"cfg": 2, "tp": 2}), 0, known)
    assert other.group("tp") is mesh.group("ulysses") and other.group("cfg") is mesh.group("cfg")
    assert len(made) == len(set(made)) == 4


def test_a_worker_says_loaded_only_after_its_copies_are_done(monkeypatch):
    synced = []
    monkeypatch.setattr(comm, "synchronize", lambda device: synced.append(("sync", str(device))))

    class Channel:
        shares_buckets = False

        def recv_broadcast(self, nbytes, device):
            return torch.arange(nbytes, dtype=torch.uint8)

        def received(self):
            synced.append("bucket")

    entries = [weight_stream.Entry((4,), torch.float32), weight_stream.Entry((2,), torch.float16)]
    slots = weight_stream.allocate(entries, 1, "cpu")
    weight_stream.receive(entries, slots, Channel(), torch.device("cpu"), 1)
    assert synced[-1] == ("sync", "cpu") and "bucket" in synced[:-1]


# ---------------------------------------------------------------- with real ranks
@pytest.mark.multirank
def test_a_decode_longer_than_the_collective_timeout_completes_while_the_ranks_progress(runtime, monkeypatch):
    """A long video decode or a 14B step on gloo outlasts any fixed timeout: with the timeout at
    1 s, a decode of several seconds whose ranks keep completing collectives finishes, exact."""
    from conftest import cpu_world
    from parallel_runtime.world import settings as world_module
    from parallel_runtime.plans import check_vae
    from vae_cases import VAES

    monkeypatch.setattr(world_module, "COLLECTIVE_TIMEOUT_S", 1.0)
    world = cpu_world(runtime, {"ulysses_size": 2})
    vae, z, _ = VAES["kl_sd"]()
    with torch.inference_mode():
        ref = vae.decode(z)
        world.forward(vae, check_vae(vae), vae.decode, (z,), {})  # the weights reach rank 1 first
    # Rank 0 (this process) then takes 0.15 s per convolution: many timeouts in all, never one
    # without a collective completing.
    convs = [m for m in vae.modules() if isinstance(m, torch.nn.Conv2d)]
    handles = [m.register_forward_hook(lambda *a: time.sleep(0.15)) for m in convs]
    try:
        started = time.monotonic()
        with torch.inference_mode():
            out = world.forward(vae, check_vae(vae), vae.decode, (z,), {})
        took = time.monotonic() - started
    finally:
        for h in handles:
            h.remove()
    print(f"\na decode of {took:.1f} s under a 1 s collective timeout: completed")
    assert took > 3.0 and world.healthy
    assert (out - ref).abs().max().item() <= 1e-4
