#!/usr/bin/env python
"""Where a sharded step's time goes: torch.profiler on rank 0, one rank against the mesh.

    tools/run.sh python bench/profile_step.py --scenario flux_ulysses2 [--top 15]

Runs the scenario's model on one rank and on its mesh (the real runtime path, as run.py
does), profiles one step of each on rank 0 and prints the operators that take the most
self CPU time in both, side by side. Ideal scaling halves every row at world size 2;
rows that do not shrink (or that only the mesh has: collectives, copies around
attention) are the cost of parallelism.
"""
from __future__ import annotations

import argparse
import os
import sys

from run import _import_comfy, mesh_config, scenario_call


def profile(fn, steps: int = 2):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()  # warm-up outside the profile
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    totals = {}
    for event in prof.key_averages():
        totals[event.key] = event.self_cpu_time_total / 1e3 / steps  # ms per step
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="flux_ulysses2")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    opts = parser.parse_args()

    _import_comfy("cpu")
    import torch

    from parallel_runtime.runtime import Runtime
    from scenarios import select

    (scenario,) = select("none", [opts.scenario])
    model, args, kwargs = scenario.build(0, scenario.batch, "cpu")
    plan, method, options = scenario_call(scenario, model)
    torch.set_num_threads(opts.threads_per_rank)
    with torch.inference_mode():
        single = profile(lambda: method(*args, **kwargs, **options))

    os.environ["PARALLEL_CPU_THREADS_PER_RANK"] = str(opts.threads_per_rank)
    n = scenario.world_size
    config = mesh_config(scenario, "cpu")
    runtime = Runtime()
    try:
        world = runtime.world_for(config)
        with torch.inference_mode():
            sharded = profile(lambda: world.forward(model, plan, method, args, {**kwargs, **options}))
    finally:
        runtime.shutdown("profile done")

    total_single, total_sharded = sum(single.values()), sum(sharded.values())
    print(f"{opts.scenario}: self CPU per step, rank 0: one rank {total_single:.0f} ms, "
          f"world {n} {total_sharded:.0f} ms (ideal {total_single / n:.0f} ms)")
    print(f"{'operator':44s} {'one rank':>10s} {f'world {n}':>10s} {'ratio':>7s}  excess ms")
    keys = sorted(set(single) | set(sharded),
                  key=lambda k: -(sharded.get(k, 0.0) - single.get(k, 0.0) / n))
    for key in keys[:opts.top]:
        a, b = single.get(key, 0.0), sharded.get(key, 0.0)
        ratio = f"{b / a:.2f}" if a else "new"
        print(f"{key[:44]:44s} {a:10.1f} {b:10.1f} {ratio:>7s}  {b - a / n:+9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
