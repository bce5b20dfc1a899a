"""What a World reads from the environment: its timeouts and its knobs, in one place.

Read when the module is imported (the timeouts) or at every use (the knobs), on rank 0, except
``IDLE_TRIM_S``, which the CPU workers read. Tests that shorten a timeout set it here.
"""
from __future__ import annotations

import os

from ..config import available_cores


def _env_seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


STARTUP_TIMEOUT_S = _env_seconds("PARALLEL_STARTUP_TIMEOUT_S", 180)


# How long a guarded section (a forward, a decode) may go without any rank completing a
# collective before the watchdog takes it for a hang: not the length of the section, which may be
# anything while the ranks progress.
COLLECTIVE_TIMEOUT_S = _env_seconds("PARALLEL_COLLECTIVE_TIMEOUT_S", 300)


# The backends' own timeout for one collective: later than the watchdog's, which names the rank that hung.
BACKEND_TIMEOUT_S = COLLECTIVE_TIMEOUT_S + 60


# A CPU worker hands its freed heap back to the OS (malloc_trim) once it has waited this long for
# its next command (a prompt is over), not after every forward: the page faults that refill a
# trimmed heap cost the next forward 4-6 % on flux_ulysses2 at world size 2, and between the
# forwards of a run the heap is reused anyway (bench/results/ulysses2_breakdown_2026-11-27.md).
# Longer than the gaps inside a prompt: a sampler step's own work, a one-rank forward in a benchmark.
IDLE_TRIM_S = 10.0

SHUTDOWN_GRACE_S = 15.0  # for workers to unmap their weights and exit when told to


PROBE_ENV = "PARALLEL_PROBE"  # "0": no link and compute probe at world start (unless layout is auto)


# Pure Ulysses exchanges the heads in this many groups, each group's all-to-all overlapping the
# attention of the others (read on rank 0 at every forward; 1, the default: one exchange).
ULYSSES_CHUNKS_ENV = "PARALLEL_ULYSSES_CHUNKS"


def ulysses_chunks_setting() -> int:
    raw = os.environ.get(ULYSSES_CHUNKS_ENV, "1").strip() or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{ULYSSES_CHUNKS_ENV}={raw!r}: give a whole number of head groups, 1 or more "
                         "(1: one all-to-all per attention, no overlap)")
    return int(raw)


# Pure Ulysses returns the other ranks' query rows first and attends the rank's own rows while they
# travel (attention.attend_and_gather): an early rank computes instead of waiting. That pays where
# each rank computes on its own device or cores; where CPU ranks share cores, the early rank's work
# takes a core from a late one (flux_ulysses2_tp2, 4 ranks on 2 cores: 1.60-1.82x against
# 1.77-1.86x in lockstep). "auto" (default): on unless CPU ranks' threads outnumber the cores;
# "1" / "0": always / never (read on rank 0 at every forward, sent to every rank with it).
ULYSSES_OVERLAP_ENV = "PARALLEL_ULYSSES_OVERLAP"


def ulysses_overlap_setting(devices: tuple[str, ...]) -> bool:
    raw = os.environ.get(ULYSSES_OVERLAP_ENV, "auto").strip().lower() or "auto"
    if raw in ("0", "1"):
        return raw == "1"
    if raw != "auto":
        raise ValueError(f"{ULYSSES_OVERLAP_ENV}={raw!r}: give auto (the default), 1 (always overlap Ulysses' "
                         "return exchange with the rank's own attention) or 0 (never)")
    cpu_ranks = sum(1 for d in devices if str(d) == "cpu")
    return cpu_ranks * cpu_threads_per_rank(len(devices)) <= len(available_cores()) if cpu_ranks else True


def mirrored_comfy_args(device_type: str) -> dict:
    """ComfyUI's command-line settings, for the workers to start with the same ones (attention
    backend, precision flags): every rank must compute the same way. Only plain values travel."""
    out = {}
    try:
        import comfy.cli_args

        for key, value in vars(comfy.cli_args.args).items():
            if value is None or isinstance(value, (bool, int, float, str)):
                out[key] = value
    except ImportError:
        pass
    out["cpu"] = device_type == "cpu"
    out.pop("cuda_device", None)  # each worker has its own device
    return out


def cpu_threads_per_rank(world_size: int) -> int:
    """CPU ranks share the cores: one share each, unless PARALLEL_CPU_THREADS_PER_RANK says otherwise."""
    env = os.environ.get("PARALLEL_CPU_THREADS_PER_RANK")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, len(available_cores()) // world_size)
