"""layout: auto against every manual layout of the same ranks, timed in turn in one run.

One world of the scenario's size with ``layout: auto``: the model's first forward picks a layout
(cost_model over the probe); then every layout the cost model could run is timed on its own copy
of the model (a copy per layout: switching one model's layout would re-send its weights), and
the record holds each layout's predicted and measured step, auto's pick and the best manual one.
"""
from __future__ import annotations

import copy
import os
import time


def run_auto_scenario(scenario, device: str, threads: int, repeat: int | None) -> dict:
    import torch

    from measure import Timer, summary
    from parallel_runtime.layout.auto import describe_sizes
    from parallel_runtime.config import HostDevices, build_config
    from parallel_runtime.distributed.mesh import MeshLayout
    from parallel_runtime.world.runtime import Runtime
    from scenarios import scenario_call

    repeat = repeat or scenario.repeat
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    timer = Timer(dev)
    model, args, kwargs = scenario.build(0, scenario.batch, dev)
    plan, method, options = scenario_call(scenario, model)
    n = scenario.world_size
    if device == "cpu":
        os.environ["PARALLEL_CPU_THREADS_PER_RANK"] = str(threads)
        config = build_config(devices=",".join(["cpu"] * n), layout="auto",
                              host=HostDevices("cpu", cpu_count=max(os.cpu_count() or 1, n)))
    else:
        config = build_config(ulysses_size=n, layout="auto",
                              host=HostDevices("cuda:0", cuda_count=torch.cuda.device_count()))
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads if device == "cpu" else saved_threads)
    with torch.inference_mode():
        reference = method(*args, **kwargs, **options)
    torch.set_num_threads(saved_threads)
    runtime = Runtime()
    try:
        world = runtime.world_for(config)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = world.forward(model, plan, method, args, {**kwargs, **options})  # auto picks, sends the weights
            first_s = time.perf_counter() - t0
        choice = world.status()["layouts"][0]
        layouts = [alt["sizes"] for alt in choice["alternatives"]]
        models = {describe_sizes(s): copy.deepcopy(model) for s in layouts}

        def call(sizes):
            m = models[describe_sizes(sizes)]
            return world.forward(m, plan, getattr(type(m), scenario.method).__get__(m), args, {**kwargs, **options},
                                 layout=MeshLayout.from_sizes(sizes))

        samples = {describe_sizes(s): [] for s in layouts}
        errors = {}
        with torch.inference_mode():
            for sizes in layouts:
                result = call(sizes)  # sends this copy's weights in its layout
                errors[describe_sizes(sizes)] = (result.float() - reference.float()).abs().max().item()
            for _ in range(repeat):  # in turn, so that a shared machine's slow moments fall on all alike
                for sizes in layouts:
                    samples[describe_sizes(sizes)].append(timer.time_ms(lambda: call(sizes))[0])
        status = world.status()
    finally:
        runtime.shutdown("benchmark done")
        os.environ.pop("PARALLEL_CPU_THREADS_PER_RANK", None)
    measured = {k: summary(v)["median"] for k, v in samples.items()}
    predicted = {describe_sizes(a["sizes"]): a["step_ms"] for a in choice["alternatives"]}
    parts = {describe_sizes(a["sizes"]): a["parts_ms"] for a in choice["alternatives"]}
    pick = describe_sizes(choice["layout"])
    best = min(measured, key=measured.get)
    return {
        "scenario": scenario.name, "family": scenario.family, "mode": "auto", "world_size": n, "device": device,
        "threads_per_rank": threads if device == "cpu" else None, "tokens": choice["tokens"], "batch": choice["batch"],
        "auto_pick": pick, "best_manual": best,
        "auto_over_best": round(measured[pick] / measured[best], 3),
        "layouts": {k: {"predicted_ms": round(predicted[k], 1), "measured_ms": round(measured[k], 1),
                        "error": round(predicted[k] / measured[k] - 1, 3), "max_abs_err": errors[k],
                        "predicted_parts_ms": parts[k]}
                    for k in measured},
        "refused": choice["refused"], "probe": status["probe"], "first_forward_s": round(first_s, 2),
        "max_abs_err": (out.float() - reference.float()).abs().max().item(),
        "step_ms_median": round(measured[pick], 2), "world1_ms_median": None, "speedup_vs_world1": None,
        "repeat": repeat, "notes": scenario.notes, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
