#!/usr/bin/env python
"""Where a sharded forward's time goes on every rank, from the ranks' own timelines.

    tools/run.sh python bench/comm_timeline.py --scenario flux_ulysses2 [--forwards 6]

Runs the scenario at its mesh (the real runtime path, as run.py does) with PARALLEL_TRACE_COMM
set, so that every rank logs when it entered and left each blocking collective (comm.TRACE), and a
one-rank forward before each sharded one, as run.py times them in turn. Per forward, medians:

- rank 0's compute: the forward's wall time less the time rank 0 was blocked in collectives;
- the time each rank was blocked, split into the transfer (both ranks inside the same call) and the
  wait for the other rank to arrive (the skew: one rank's compute ran longer than the other's);
- the tail: rank 0's time after its last collective (status figures, the output's reassembly).

Rank 0's compute against half the one-rank forward is the work parallelism adds or saves; the
blocked time is what the exchange costs. Two ranks only (a pair of timelines).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from run import _import_comfy, mesh_config
from scenarios import scenario_call


def read_timelines(folder: Path) -> list[list[tuple[str, float, float]]]:
    """Every process's calls, rank 0 first (the lowest pid: it starts the workers)."""
    files = sorted(folder.glob("*.txt"), key=lambda f: int(f.stem))
    return [[(name, float(a), float(b)) for name, a, b in (line.split() for line in f.read_text().splitlines())]
            for f in files]


def breakdown(windows, rank0, rank1) -> list[dict]:
    """Per forward window (start, end) on rank 0: the figures of the module docstring (ms)."""
    rows = []
    pairs = list(zip(rank0, rank1))  # every rank makes the same calls in the same order
    for start, end in windows:
        calls = [(a, b) for a, b in pairs if a[1] >= start and a[2] <= end]
        blocked0 = sum(a[2] - a[1] for a, _ in calls)
        transfer = sum(max(0.0, min(a[2], b[2]) - max(a[1], b[1])) for a, b in calls)
        rows.append({"wall": end - start, "compute0": end - start - blocked0, "blocked0": blocked0,
                     "blocked1": sum(b[2] - b[1] for _, b in calls), "transfer": transfer,
                     "tail": end - calls[-1][0][2] if calls else 0.0, "calls": len(calls)})
    return [{k: v * 1e3 if k != "calls" else v for k, v in row.items()} for row in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="flux_ulysses2")
    parser.add_argument("--forwards", type=int, default=6)
    opts = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="comm-trace-"))
    os.environ["PARALLEL_CPU_THREADS_PER_RANK"] = "1"
    _import_comfy("cpu")
    import torch

    from parallel_runtime.distributed import comm
    from parallel_runtime.world.runtime import Runtime
    from scenarios import select

    os.environ[comm.TRACE_ENV] = comm.TRACE.folder = str(folder)  # rank 0's tracer and the workers'

    (scenario,) = select("none", [opts.scenario])
    if scenario.world_size != 2:
        parser.error(f"{opts.scenario} has {scenario.world_size} ranks; this reads the timelines of two")
    model, args, kwargs = scenario.build(0, scenario.batch, "cpu")
    plan, method, options = scenario_call(scenario, model)
    torch.set_num_threads(1)
    runtime = Runtime()
    windows, one_rank = [], []
    try:
        world = runtime.world_for(mesh_config(scenario, "cpu"))
        with torch.inference_mode():
            world.forward(model, plan, method, args, {**kwargs, **options})  # sends the weights
            for _ in range(opts.forwards):
                started = time.perf_counter()
                method(*args, **kwargs, **options)
                one_rank.append((time.perf_counter() - started) * 1e3)
                started = time.perf_counter()
                world.forward(model, plan, method, args, {**kwargs, **options})
                windows.append((started, time.perf_counter()))
    finally:
        runtime.shutdown("timeline done")
    rank0, rank1 = read_timelines(folder)[:2]
    rows = breakdown(windows, rank0, rank1)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    half = statistics.median(one_rank) / 2
    print(f"{opts.scenario}: {opts.forwards} forwards, medians (ms); one rank {2 * half:.0f}, half of it {half:.0f}")
    print(f"  forward {med['wall']:.0f} ({2 * half / med['wall']:.2f}x) = rank 0's compute {med['compute0']:.0f} "
          f"(against half the one-rank forward: {med['compute0'] - half:+.0f}) + blocked {med['blocked0']:.0f}")
    print(f"  blocked in {med['calls']:.0f} calls: rank 0 {med['blocked0']:.0f}, rank 1 {med['blocked1']:.0f}; "
          f"both in the call (the transfer) {med['transfer']:.0f}, so waiting for the other rank: rank 0 "
          f"{med['blocked0'] - med['transfer']:.0f}, rank 1 {med['blocked1'] - med['transfer']:.0f}")
    print(f"  rank 0 after its last collective: {med['tail']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
