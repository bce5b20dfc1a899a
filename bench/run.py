#!/usr/bin/env python
"""Benchmark suite: speed, memory and communication of sharded forwards against world size 1.

    tools/run.sh python bench/run.py --suite quick --out bench/results/quick.jsonl
    tools/run.sh python bench/run.py --suite full --out bench/results/full.jsonl --plots bench/results
    tools/run.sh python bench/run.py --device cuda --suite full --out gpu.jsonl   # on a GPU host (NCCL)

Each scenario runs the same model on one rank (this process, ``--threads-per-rank``
threads) and on the scenario's mesh (this process as rank 0 plus worker
processes, the real runtime path), side by side in one run, and writes one JSON
record per line. On the CPU every rank gets ``--threads-per-rank`` threads
(default 1), so world size N against world size 1 mirrors N GPUs against one.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.append(str(REPO))
sys.path.append(str(BENCH))


def _import_comfy(device: str) -> None:
    host = REPO / ".host" / "host.json"
    path = os.environ.get("COMFYUI_PATH") or json.loads(host.read_text())["comfyui_path"]
    sys.path.insert(0, path)
    import comfy.options  # noqa: F401
    import comfy.cli_args

    comfy.cli_args.args.cpu = device == "cpu"
    # PyTorch's scaled_dot_product_attention, what ComfyUI uses on GPUs; on the CPU its
    # default is a slower sub-quadratic kernel that would make every comparison about it.
    comfy.cli_args.args.use_pytorch_cross_attention = True


def machine() -> dict:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), None)
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def run_scenario(scenario, device: str, threads: int, repeat: int | None) -> dict:
    import torch

    from measure import Timer, count_comm_bytes, peak_rss, summary
    from parallel_runtime.config import HostDevices, build_config
    from parallel_runtime.memory import process_memory
    from parallel_runtime.plans import find_plan
    from parallel_runtime.runtime import Runtime

    repeat = repeat or scenario.repeat
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    timer = Timer(dev)
    model, args, kwargs = scenario.build(0, scenario.batch, dev)
    plan = find_plan(model)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    # World size 1: the plain model in this process.
    saved_threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(threads)
    base_samples = []
    with torch.inference_mode():
        reference = model._forward(*args, **kwargs, transformer_options={})  # warm-up, and the reference
        for _ in range(repeat):
            ms, _ = timer.time_ms(lambda: model._forward(*args, **kwargs, transformer_options={}))
            base_samples.append(ms)
    torch.set_num_threads(saved_threads)

    # The mesh: this process is rank 0, the rest are workers.
    sizes = {f"{d}_size": v for d, v in scenario.mesh.items()}
    world_size = scenario.world_size
    if device == "cpu":
        os.environ["PARALLEL_CPU_THREADS_PER_RANK"] = str(threads)
        host = HostDevices("cpu", cpu_count=max(os.cpu_count() or 1, world_size))
        devices = ",".join(["cpu"] * world_size)
    else:
        host = HostDevices("cuda:0", cuda_count=torch.cuda.device_count())
        devices = "auto"
    config = build_config(**sizes, devices=devices, host=host)
    runtime = Runtime()
    try:
        world = runtime.world_for(config)
        forward = lambda: world.forward(model, plan, model._forward, args, {**kwargs, "transformer_options": {}},  # noqa: E731
                                        epoch=1)
        with torch.inference_mode():
            out = forward()  # warm-up: sends the weights
            samples, dispatch = [], []
            for _ in range(repeat):
                ms, out = timer.time_ms(forward)
                samples.append(ms)
                dispatch.append(world.last_dispatch)
            with count_comm_bytes() as comm:
                forward()
        err = (out.float() - reference.float()).abs().max().item()
        status = world.status()
        pids = [r["pid"] for r in status["ranks"]]
        mem = [process_memory(p) for p in pids]
    finally:
        runtime.shutdown("benchmark done")
        os.environ.pop("PARALLEL_CPU_THREADS_PER_RANK", None)

    base = summary(base_samples)
    par = summary(samples)
    speedup = base["median"] / par["median"]
    dispatch_ms = sorted(d["prepare_ms"] + d["weights_check_ms"] + d["send_ms"] for d in dispatch)[len(dispatch) // 2]
    return {
        "scenario": scenario.name, "family": scenario.family, "mode": scenario.mode,
        "mesh": {d: scenario.mesh.get(d, 1) for d in ("cfg", "ring", "ulysses", "tp")},
        "world_size": world_size, "device": device, "threads_per_rank": threads if device == "cpu" else None,
        "tokens": scenario.tokens, "batch": scenario.batch,
        "step_ms_median": round(par["median"], 2), "step_ms_min": round(par["min"], 2),
        "step_ms_max": round(par["max"], 2),
        "world1_ms_median": round(base["median"], 2), "world1_ms_min": round(base["min"], 2),
        "world1_ms_max": round(base["max"], 2),
        "speedup_vs_world1": round(speedup, 3), "parallel_efficiency": round(speedup / world_size, 3),
        "param_bytes_per_rank_max": max(r["param_bytes"] for r in status["ranks"]),
        "param_bytes_model": model_bytes,
        "param_fraction_per_rank_max": round(max(r["param_bytes"] for r in status["ranks"]) / model_bytes, 4),
        "rss_bytes_per_rank_max": max(peak_rss(p) or m["rss_bytes"] or 0 for p, m in zip(pids, mem)),
        "pss_bytes_per_rank": [m["pss_bytes"] for m in mem],
        "comm_bytes_per_step": comm["bytes"], "collective_calls_per_step": comm["calls"],
        "dispatch_overhead_ms": round(dispatch_ms, 3),
        "max_abs_err": err, "repeat": repeat, "notes": scenario.notes,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default="quick", choices=["smoke", "quick", "full"])
    parser.add_argument("--scenario", nargs="*", help="run these scenarios instead of a suite")
    parser.add_argument("--out", required=True, help="JSON-lines file for the records (appended)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--repeat", type=int, help="timed forwards per measurement (default: per scenario)")
    parser.add_argument("--peers", action="store_true", help="also run cache-dit's Ulysses on the same Flux config")
    parser.add_argument("--plots", help="directory for PNG plots of the records in --out")
    opts = parser.parse_args()

    _import_comfy(opts.device)
    from scenarios import select

    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    info = machine()
    for scenario in select(opts.suite, opts.scenario):
        print(f"[bench] {scenario.name}: {scenario.mode} {scenario.mesh} on {opts.device}, {scenario.tokens} tokens",
              file=sys.stderr, flush=True)
        record = run_scenario(scenario, opts.device, opts.threads_per_rank, opts.repeat)
        record["machine"] = info
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"[bench]   {record['step_ms_median']:.1f} ms vs {record['world1_ms_median']:.1f} ms on one rank: "
              f"{record['speedup_vs_world1']:.2f}x, err {record['max_abs_err']:.1e}", file=sys.stderr, flush=True)
    if opts.peers:
        from peers import run_cachedit

        for record in run_cachedit(opts.threads_per_rank, opts.repeat or 3):
            record["machine"] = info
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")
    if opts.plots:
        from plots import plot

        plot(out, Path(opts.plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
