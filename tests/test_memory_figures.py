"""Per-rank memory figures, in-process: the staging pool's bound and its pinned bytes (comm._HostBuffers,
pinning faked on the CPU), the peaks of the last prompt (memory.PeakMemory, the CUDA branch faked)
and how the status route shows them (World.status with a worker that reports by message)."""
import mmap
import multiprocessing
import types

import pytest
import torch

from parallel_runtime.distributed import comm, messages
from parallel_runtime.world import memory, protocol
from parallel_runtime.config import HostDevices, build_config
from parallel_runtime.world.world import World
from parallel_runtime.world.workers import _Worker

MB = 2**20


def fake_pool(cap_mb: float) -> comm._HostBuffers:
    """A pool whose every buffer goes through its pin function, as on a GPU rank (plain memory here)."""
    return comm._HostBuffers(cap_bytes=int(cap_mb * MB), pin=comm.plain_host, pin_cpu=True)


def cycle(pool, nbytes: int) -> None:
    pool.release(pool.acquire(torch.empty(nbytes, dtype=torch.uint8)))


def test_the_pool_keeps_at_most_its_cap_and_counts_what_is_pinned():
    pool = fake_pool(4)
    held = [pool.acquire(torch.empty(MB, dtype=torch.uint8)) for _ in range(3)]
    assert pool.pinned_bytes == 3 * MB and pool.kept_bytes == 0  # in use: pinned, not kept
    for buf in held:
        pool.release(buf)
    assert pool.kept_bytes == 3 * MB
    del held, buf
    for n in (2, 3, 5):  # new sizes: the oldest released go first
        cycle(pool, n * 100_000)
        assert pool.kept_bytes <= 4 * MB
    assert pool.kept_bytes <= 4 * MB and pool.pinned_bytes == pool.kept_bytes  # evicted buffers are unpinned
    cycle(pool, 5 * MB)  # larger than the cap: never kept
    assert pool.kept_bytes <= 4 * MB and pool.pinned_bytes == pool.kept_bytes
    assert pool.pinned_total >= 8 * MB
    pool.clear()
    assert pool.kept_bytes == 0 and pool.pinned_bytes == 0


def test_a_kept_buffer_is_reused_and_cpu_buffers_are_not_pinned_without_the_switch():
    pool = fake_pool(4)
    cycle(pool, 1000)
    first = pool.pinned_total
    cycle(pool, 1000)
    assert pool.pinned_total == first  # reused, not allocated again
    plain = comm._HostBuffers(cap_bytes=4 * MB, pin=comm.plain_host, pin_cpu=False)
    cycle(plain, 1000)
    assert plain.pinned_total == 0 and plain.kept_bytes == 1000


def test_a_worker_releasing_its_models_empties_its_pool(monkeypatch):
    from parallel_runtime.world.worker import _Server

    pool = fake_pool(64)
    monkeypatch.setattr(comm, "HOST", pool)
    cycle(pool, MB)
    assert pool.pinned_bytes == MB
    sent = []
    server = types.SimpleNamespace(models={}, read_slots={}, status_table=None, send=sent.append, rank=1,
                                   stop_progress=lambda: None)
    _Server.release(server)
    assert sent == [messages.Released(1)] and pool.pinned_bytes == 0 and pool.kept_bytes == 0


def test_cpu_exchange_buffers_are_reused_apart_from_the_staging_figures(monkeypatch):
    """Ulysses' exchange buffers on CPU ranks: the same storage again for the same size, kept in a
    pool of their own (the status's host_* figures stay staging's), emptied when a worker releases."""
    from parallel_runtime.world.worker import _Server

    pool = comm._HostBuffers(cap_bytes=64 * MB, pin=comm.plain_host, pin_cpu=False)
    monkeypatch.setattr(comm, "EXCHANGE", pool)
    like = torch.zeros(1)
    first = comm.exchange_buffer((2, 3, 4), like)
    assert first.shape == (2, 3, 4) and first.dtype == torch.float32
    comm.release_exchange_buffer(first)
    again = comm.exchange_buffer((2, 3, 4), like)
    assert again.data_ptr() == first.data_ptr()  # reused: no fresh pages to fault in
    other = comm.exchange_buffer((4, 3, 2), like)  # in use at the same time: another buffer
    assert other.data_ptr() != again.data_ptr()
    comm.release_exchange_buffer(again)
    comm.release_exchange_buffer(other)
    assert pool.kept_bytes == 2 * 24 * 4 and comm.HOST.kept_bytes == 0 and pool.pinned_total == 0
    server = types.SimpleNamespace(models={}, read_slots={}, status_table=None, send=lambda m: None, rank=1,
                                   stop_progress=lambda: None)
    _Server.release(server)
    assert pool.kept_bytes == 0


# ---------------------------------------------------------------- peaks
class FakeCuda:
    """torch.cuda's memory counters, for a device this machine does not have."""

    def __init__(self):
        self.allocated, self.reserved, self.peak_allocated, self.peak_reserved = 100, 200, 100, 200
        self.resets = 0

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak_allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak_reserved)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        return self

    def use(self, allocated, reserved):
        self.allocated, self.reserved = allocated, reserved
        self.peak_allocated = max(self.peak_allocated, allocated)
        self.peak_reserved = max(self.peak_reserved, reserved)

    def reset(self, device=None):
        self.resets += 1
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


def test_cuda_peaks_are_of_the_last_prompt(monkeypatch):
    cuda = FakeCuda().install(monkeypatch)
    device = torch.device("cuda:1")
    peaks = memory.PeakMemory()
    assert peaks.begin("p1", device) and cuda.resets == 1
    cuda.use(5000, 8000)
    cuda.use(1000, 8000)
    assert not peaks.begin("p1", device)  # the same prompt's next forward: no reset
    figures = peaks.figures(device)
    assert figures["gpu_peak_allocated_bytes"] == 5000 and figures["gpu_peak_reserved_bytes"] == 8000
    assert peaks.begin("p2", device) and cuda.resets == 2
    cuda.use(2000, 8000)
    assert peaks.figures(device)["gpu_peak_allocated_bytes"] == 2000
    assert peaks.figures(device)["uss_peak_bytes"] is None  # no smaps reads on accelerator ranks


def test_a_cuda_workers_row_carries_its_peaks_and_its_pool(monkeypatch):
    """The worker's own report (_Server._send_stats) on a CUDA rank, as rank 0 reads it back."""
    from parallel_runtime.world.worker import _Server

    cuda = FakeCuda().install(monkeypatch)
    monkeypatch.setattr(memory, "PEAKS", memory.PeakMemory())
    pool = fake_pool(64)
    monkeypatch.setattr(comm, "HOST", pool)
    memory.PEAKS.begin("p1", "cuda:1")
    cuda.use(7000, 9000)
    cuda.use(3000, 9000)
    cycle(pool, 4096)
    server = types.SimpleNamespace(device=torch.device("cuda:1"), rank=1, remote=False,
                                   status_table=torch.zeros(2, len(protocol.STATUS_FIELDS), dtype=torch.float64))
    _Server._send_stats(server)
    row = server.status_table[1].tolist()
    assert row[4:6] == [3000, 9000]  # current
    figures = memory.figures_from_row(row)
    assert figures["gpu_peak_allocated_bytes"] == 7000 and figures["gpu_peak_reserved_bytes"] == 9000
    assert figures["rss_peak_bytes"] > 0 and figures["uss_peak_bytes"] is None
    assert figures["host_pinned_bytes"] == 4096 and figures["host_kept_bytes"] == 4096


def test_cpu_peaks_follow_the_prompt(monkeypatch):
    uss = iter([300, 900, 400, 100, 250])
    peaks = memory.PeakMemory(uss=lambda: next(uss))
    peaks.begin("p1", "cpu")
    for _ in range(3):
        peaks.sample("cpu")
    assert peaks.figures("cpu")["uss_peak_bytes"] == 900
    assert peaks.figures("cpu")["gpu_peak_allocated_bytes"] is None
    peaks.begin("p2", "cpu")
    peaks.sample("cpu")
    peaks.sample("cpu")
    assert peaks.figures("cpu")["uss_peak_bytes"] == 250 and peaks.prompt_id == "p2"


def test_the_rss_peak_is_reset_at_a_new_prompt():
    if not memory.reset_rss_peak():
        pytest.fail("this Linux does not let a process reset its peak RSS (/proc/self/clear_refs)")
    peaks = memory.PeakMemory(uss=lambda: None)
    peaks.begin("p1", "cpu")
    big = mmap.mmap(-1, 64 * MB)  # its own mapping (freed memory from malloc may stay resident)
    big.write(b"x" * (64 * MB))
    high = memory.rss_peak_bytes()
    big.close()
    peaks.begin("p2", "cpu")
    assert memory.rss_peak_bytes() <= high - 32 * MB


# ---------------------------------------------------------------- the status route
@pytest.fixture()
def remote_world():
    mine, theirs = multiprocessing.Pipe()
    worker = _Worker(1, "cuda:1", None, host="gpu-b")
    worker.conn = mine
    world = World(build_config(ulysses_size=2, host=HostDevices("cpu", cpu_count=2)), comfyui_path=".")
    world.workers = [worker]
    try:
        yield world, theirs
    finally:
        world.watchdog.close()
        mine.close()
        theirs.close()


def test_status_shows_every_ranks_current_and_peak_memory(remote_world, monkeypatch):
    world, theirs = remote_world
    monkeypatch.setattr(memory, "PEAKS", memory.PeakMemory())
    memory.PEAKS.begin("prompt-7", world.device)
    memory.PEAKS.sample(world.device)
    row = [0.0] * len(protocol.STATUS_FIELDS)
    row[4], row[5] = 3e9, 4e9
    row[protocol.MEMORY_FIELDS] = [5e9, 6e9, 2e9, -1, 64 * MB, 0]
    theirs.send(messages.wire(messages.Stats(row + [1.5e9])))  # a worker on another host: its row, then its RSS
    status = world.status()
    assert status["peaks_prompt"] == "prompt-7"
    zero, one = status["ranks"]
    for key in ("gpu_peak_allocated_bytes", "gpu_peak_reserved_bytes", "rss_peak_bytes", "uss_peak_bytes",
                "host_pinned_bytes", "host_kept_bytes", "rss_bytes", "gpu_allocated_bytes"):
        assert key in zero and key in one, key
    assert zero["rss_peak_bytes"] >= zero["rss_bytes"] > 0
    assert zero["uss_peak_bytes"] >= zero["uss_bytes"] > 0
    assert zero["gpu_peak_allocated_bytes"] is None  # a CPU rank
    assert zero["host_pinned_bytes"] == comm.HOST.pinned_bytes
    assert one["gpu_allocated_bytes"] == 3e9 and one["gpu_peak_allocated_bytes"] == 5e9
    assert one["gpu_peak_reserved_bytes"] == 6e9 and one["rss_peak_bytes"] == 2e9 >= one["rss_bytes"]
    assert one["uss_peak_bytes"] is None and one["host_pinned_bytes"] == 64 * MB and one["host_kept_bytes"] == 0


def test_a_cpu_worker_shows_no_gpu_figures_before_its_first_report(remote_world):
    """A local CPU worker's row of the shared table is zeros until its first full report (during its
    first load it writes only its progress): the route says no GPU, not a GPU holding 0 bytes."""
    import torch

    world, _ = remote_world
    worker = world.workers[0]
    worker.host, worker.device = None, "cpu"
    world._status_table = torch.zeros(2, len(protocol.STATUS_FIELDS), dtype=torch.float64)
    one = world.status()["ranks"][1]
    assert one["gpu_allocated_bytes"] is None and one["gpu_reserved_bytes"] is None


def test_the_headless_client_summarises_every_rank():
    from headless import rank_summary

    status = {"world_size": 2, "state": "ready", "ranks": [
        {"rank": 0, "device": "cuda:0", "alive": True, "gpu_allocated_bytes": 3 * 2**30,
         "gpu_peak_allocated_bytes": 5 * 2**30, "gpu_reserved_bytes": 6 * 2**30, "gpu_peak_reserved_bytes": 7 * 2**30,
         "rss_bytes": 900 * MB, "rss_peak_bytes": 1200 * MB, "uss_bytes": None, "uss_peak_bytes": None,
         "host_pinned_bytes": 64 * MB, "param_bytes": 2**30, "forwards": 20},
        {"rank": 1, "device": "cpu", "alive": False, "rss_bytes": None, "param_bytes": 0, "forwards": 0}]}
    head, zero, one = rank_summary(status)
    assert head.startswith("ranks: world size 2")
    assert zero == ("  rank 0 cuda:0: GPU allocated 3072 MB (peak 5120 MB), reserved 6144 MB (peak 7168 MB), "
                    "RSS 900 MB (peak 1200 MB), pinned 64 MB, weights 1024 MB, 20 steps")
    assert one == "  rank 1 cpu (exited): weights 0 MB, 0 steps"


KEPT_HEAP = r"""
import sys, torch
sys.path.insert(0, sys.argv[2])
from parallel_runtime.world.memory import keep_freed_heap, release_free_heap
kept = keep_freed_heap() if sys.argv[1] == "1" else False
def faults():
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])
def step():  # a forward's temporaries: one over glibc's 32 MiB mmap ceiling, one under it
    a, b = torch.ones(48 * 2**20 // 4), torch.ones(8 * 2**20 // 4)
    del a, b
step(); step()  # the heap's layout settles in two
per_step = []
for _ in range(6):
    before = faults()
    step()
    per_step.append(faults() - before)
release_free_heap(collect=False)
before = faults()
step()
print(kept, min(per_step), faults() - before)
"""


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/stat"), reason="needs /proc")
def test_a_kept_heap_faults_no_page_in_again_and_the_idle_trim_still_returns_it():
    """memory.keep_freed_heap, as CPU workers call it at start: the next forward's temporaries reuse
    the pages the last one freed. Without it glibc maps and unmaps the large one every time."""
    import subprocess
    import sys
    from conftest import REPO
    runs = {}
    for on in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", KEPT_HEAP, on, str(REPO)], capture_output=True, text=True,
                             timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
        assert out.returncode == 0, out.stderr
        kept, fewest, after_trim = out.stdout.split()
        runs[on] = (kept == "True", int(fewest), int(after_trim))
    pages = 48 * MB // 4096
    # glibc's default: every step faulted the 48 MiB in again. Kept: steps that fault nothing in
    # (not every one on this VM, whose host reclaims idle pages now and then).
    assert runs["0"][0] is False and runs["0"][1] >= pages * 0.9
    assert runs["1"][0] is True and runs["1"][1] < pages // 10
    assert runs["1"][2] >= pages * 0.9  # after the trim the memory was the OS's again
