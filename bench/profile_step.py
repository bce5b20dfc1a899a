#!/usr/bin/env python
"""Where a sharded step's time goes: torch.profiler on rank 0, one rank against the mesh.

    tools/run.sh python bench/profile_step.py --scenario flux_ulysses2 [--top 15]

Runs the scenario's model on one rank and on its mesh (the real runtime path, as run.py
does), profiles one step of each on rank 0 and prints the operators that take the most
self CPU time in both, side by side. Ideal scaling halves every row at world size 2;
rows that do not shrink (or that only the mesh has: collectives, copies around
attention) are the cost of parallelism.

    tools/run.sh python bench/profile_step.py --scenario flux_ulysses2 --overlap 2 [--rounds 5]

measures instead how much of a step's communication overlaps computation: the mesh's step
with the Ulysses exchange in one piece and in N head groups (PARALLEL_ULYSSES_CHUNKS), in
turn, and for each the time rank 0 is blocked in communication (comm.CLOCK: collective calls
and waits for transfers in flight). Exposed communication that falls with N groups was hidden
behind the attention of the other groups.
"""
from __future__ import annotations

import argparse
import os
import sys

from run import _import_comfy, mesh_config
from scenarios import scenario_call


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


def overlap(step, chunks: int, rounds: int) -> int:
    """Step time and rank 0's time blocked in communication, one exchange against ``chunks``
    head groups, timed in turn (medians)."""
    import statistics
    import time

    from parallel_runtime.distributed import comm

    step(1)  # sends the weights
    step(chunks)
    samples = {1: ([], []), chunks: ([], [])}
    for _ in range(rounds):
        for c in (1, chunks):
            with comm.CLOCK.measuring() as clock:
                t0 = time.perf_counter()
                step(c)
                elapsed = time.perf_counter() - t0
            samples[c][0].append(elapsed * 1e3)
            samples[c][1].append(clock.seconds * 1e3)
    med = {c: (statistics.median(t), statistics.median(w)) for c, (t, w) in samples.items()}
    print(f"rank 0 per step (medians of {rounds}): step ms | blocked in communication ms")
    for c, (t, w) in med.items():
        print(f"  Ulysses exchange in {c} head group(s): {t:8.1f} | {w:7.1f}")
    (t1, w1), (tn, wn) = med[1], med[chunks]
    hidden = (1 - wn / w1) * 100 if w1 else 0.0
    print(f"  {chunks} groups: step {(t1 / tn - 1) * 100:+.1f} %, communication waited for {hidden:+.0f} % less")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="flux_ulysses2")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--overlap", type=int, metavar="N",
                        help="instead of the profile: one Ulysses exchange against N head groups (see above)")
    parser.add_argument("--rounds", type=int, default=5, help="with --overlap: steps of each, in turn")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="with --overlap: the ranks' devices (cuda: one rank per GPU; on CUDA the clock "
                             "sees host-side waits only, the step time is the measure)")
    opts = parser.parse_args()
    if opts.device == "cuda" and not opts.overlap:
        parser.error("--device cuda needs --overlap (the operator profile is a CPU one)")

    _import_comfy(opts.device)
    import torch

    from parallel_runtime.world.runtime import Runtime
    from scenarios import select

    (scenario,) = select("none", [opts.scenario])
    model, args, kwargs = scenario.build(0, scenario.batch, "cuda:0" if opts.device == "cuda" else "cpu")
    plan, method, options = scenario_call(scenario, model)
    torch.set_num_threads(opts.threads_per_rank)
    if opts.overlap:
        os.environ["PARALLEL_CPU_THREADS_PER_RANK"] = str(opts.threads_per_rank)
        runtime = Runtime()
        try:
            world = runtime.world_for(mesh_config(scenario, opts.device))

            def step(chunks):  # world.forward synchronizes a CUDA device before it returns
                with torch.inference_mode():
                    world.forward(model, plan, method, args, {**kwargs, **options}, ulysses_chunks=chunks)
            print(f"{opts.scenario}: {scenario.mesh}, {scenario.tokens} tokens on {opts.device}")
            return overlap(step, opts.overlap, opts.rounds)
        finally:
            runtime.shutdown("profile done")
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
