"""Timing, memory and communication measurements for the benchmarks.

Times are wall-clock on the CPU and CUDA events on a GPU (so that asynchronous
kernels are counted where they run). Memory per rank: peak RSS (VmHWM) and PSS
read from /proc by rank 0 for every rank's pid. Communication: bytes that rank 0
hands to collectives, counted by wrapping the torch.distributed calls the
runtime uses.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist

COLLECTIVES = ("all_to_all_single", "broadcast", "all_gather_into_tensor", "all_gather_single", "all_reduce",
               "reduce_scatter_tensor", "batch_isend_irecv")


class Timer:
    def __init__(self, device: torch.device):
        self.device = device

    def time_ms(self, fn) -> tuple[float, object]:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end), out
        started = time.perf_counter()
        out = fn()
        return (time.perf_counter() - started) * 1e3, out


def summary(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(o) for o in obj)
    tensor = getattr(obj, "tensor", None)  # dist.P2POp
    op = getattr(obj, "op", None)
    if isinstance(tensor, torch.Tensor):
        return nbytes(tensor) if op is dist.isend else 0
    return 0


@contextlib.contextmanager
def count_comm_bytes():
    """Count bytes rank 0 sends into collectives while the block runs (sends only for p2p)."""
    counter = {"bytes": 0, "calls": 0}
    saved = {}
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            counter["calls"] += 1
            if _name == "all_to_all_single":
                counter["bytes"] += nbytes(args[1] if len(args) > 1 else kwargs["input"])
            elif _name in ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor"):
                counter["bytes"] += nbytes(args[1] if len(args) > 1 else kwargs.get("input_tensor"))
            else:
                counter["bytes"] += nbytes(args[0] if args else next(iter(kwargs.values())))
            return _fn(*args, **kwargs)
        setattr(dist, name, wrapped)
    try:
        yield counter
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def peak_rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def minor_faults(pid: int) -> int | None:
    """Minor page faults of process ``pid`` since it started (Linux ``/proc/<pid>/stat``, every
    thread's), or None where that cannot be read. A step's count is the difference around it: a
    page a heap hands out afresh is faulted in one at a time (bench/results/ulysses2_breakdown_*:
    120-158k a one-rank ``flux_ulysses2`` step under glibc's default heap, about 4 % of it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        return int(after_name[7])  # state, ppid, pgrp, session, tty_nr, tpgid, flags, minflt
    except (OSError, IndexError, ValueError):
        return None


def faults_during(pids: list[int], fn):
    """``fn()``'s result and each process's minor faults while it ran (None where unreadable)."""
    before = [minor_faults(p) for p in pids]
    out = fn()
    after = [minor_faults(p) for p in pids]
    return out, [None if a is None or b is None else a - b for b, a in zip(before, after)]


def median_count(counts: list[int | None]) -> int | None:
    """The median of per-step counts, None when any was unreadable."""
    return None if not counts or any(c is None for c in counts) else int(statistics.median(counts))
