"""A weighted token split against the even one, with one rank made slower on purpose.

PARALLEL_TEST_SLOW_RANK="1:<factor>" (parallel_runtime/world/worker.py) makes rank 1 that many times slower. One world
of the scenario's mesh runs the model with the even split and with tokens in proportion to the
speeds (1 : 1/factor), timed in turn on two copies of the model; the record holds both medians,
the gain, and both results' error against one process.
"""
from __future__ import annotations

import copy
import os
import time

SLOW_FACTOR = 2.0


def run_weighted_scenario(scenario, device: str, threads: int, repeat: int | None) -> dict:
    import torch

    from measure import Timer, summary
    from parallel_runtime.config import HostDevices, build_config
    from parallel_runtime.world.runtime import Runtime
    from scenarios import scenario_call

    repeat = repeat or scenario.repeat
    timer = Timer(torch.device("cpu"))
    model, args, kwargs = scenario.build(0, scenario.batch, "cpu")
    plan, method, options = scenario_call(scenario, model)
    n = scenario.world_size
    weights = (1.0,) + (1.0 / SLOW_FACTOR,) + (1.0,) * (n - 2)
    torch.set_num_threads(threads)
    with torch.inference_mode():
        reference = method(*args, **kwargs, **options)
    os.environ["PARALLEL_CPU_THREADS_PER_RANK"] = str(threads)
    os.environ["PARALLEL_TEST_SLOW_RANK"] = f"1:{SLOW_FACTOR}"
    runtime = Runtime()
    try:
        sizes = {f"{d}_size": v for d, v in scenario.mesh.items()}
        world = runtime.world_for(build_config(**sizes, devices=",".join(["cpu"] * n),
                                               host=HostDevices("cpu", cpu_count=max(os.cpu_count() or 1, n))))
        models = {"even": model, "weighted": copy.deepcopy(model)}
        split = {"even": (), "weighted": weights}

        def call(kind):
            m = models[kind]
            return world.forward(m, plan, getattr(type(m), scenario.method).__get__(m), args, {**kwargs, **options},
                                 weights=split[kind])

        errors, samples = {}, {k: [] for k in models}
        with torch.inference_mode():
            for kind in models:
                errors[kind] = (call(kind).float() - reference.float()).abs().max().item()
            for _ in range(repeat):
                for kind in models:
                    samples[kind].append(timer.time_ms(lambda: call(kind))[0])
    finally:
        runtime.shutdown("benchmark done")
        os.environ.pop("PARALLEL_CPU_THREADS_PER_RANK", None)
        os.environ.pop("PARALLEL_TEST_SLOW_RANK", None)
    med = {k: summary(v)["median"] for k, v in samples.items()}
    return {
        "scenario": scenario.name, "family": scenario.family, "mode": "weighted",
        "mesh": {d: scenario.mesh.get(d, 1) for d in ("cfg", "ring", "ulysses", "tp")}, "world_size": n,
        "device": "cpu", "threads_per_rank": threads, "tokens": scenario.tokens, "batch": scenario.batch,
        "slow_rank": 1, "slow_factor": SLOW_FACTOR, "weights": list(weights),
        "even_ms_median": round(med["even"], 1), "weighted_ms_median": round(med["weighted"], 1),
        "weighted_gain": round(med["even"] / med["weighted"] - 1, 3),
        "max_abs_err_even": errors["even"], "max_abs_err": errors["weighted"],
        "step_ms_median": round(med["weighted"], 1), "world1_ms_median": None, "speedup_vs_world1": None,
        "repeat": repeat, "notes": scenario.notes, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
