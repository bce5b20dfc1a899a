#!/usr/bin/env python
"""Benchmark suite: speed, memory and communication of sharded forwards against world size 1.

    tools/run.sh python bench/run.py --suite quick --out bench/results/quick.jsonl
    tools/run.sh python bench/run.py --suite full --out bench/results/full.jsonl --plots bench/results
    tools/run.sh python bench/run.py --device cuda --suite full --out gpu.jsonl   # on a GPU host (NCCL)
    tools/run.sh python bench/run.py --suite controlnet --out bench/results/controlnet.jsonl --plots bench/results

Each scenario runs the same model on one rank (this process, ``--threads-per-rank``
threads) and on the scenario's mesh (this process as rank 0 plus worker
processes, the real runtime path), alternating step by step, and writes one JSON
record per line. On the CPU every rank gets ``--threads-per-rank`` threads
(default 1), so world size N against world size 1 mirrors N GPUs against one.
With ``--peers`` each scenario is also timed the way the peers' harness times them, each
world size's steps back to back (the record's ``consecutive``): the figures to compare their
steps with.
"""
from __future__ import annotations

import argparse
import importlib
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
sys.path.append(str(REPO / "tools"))  # tiny_models: builders that fit the installed ComfyUI


def _import_comfy(device: str) -> None:
    from parallel_runtime.comfyui_location import comfyui_path

    sys.path.insert(0, comfyui_path("run the benchmarks with tools/run.sh (it sets up the host)"))
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


def activation_peaks(pids: list[int], fn) -> list[int | None]:
    """Peak memory each process reaches while ``fn`` runs, above its resident size before:
    the kernel's high-water mark (VmHWM) is reset through /proc/<pid>/clear_refs first."""
    from measure import peak_rss
    from parallel_runtime.world.memory import process_memory

    before = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        before.append(process_memory(pid)["rss_bytes"])
    fn()
    return [None if b is None or peak_rss(p) is None else max(0, peak_rss(p) - b) for p, b in zip(pids, before)]


def activation_peak(pid: int, fn) -> int | None:
    return activation_peaks([pid], fn)[0]


def mesh_config(scenario, device: str):
    """The scenario's mesh: one CPU rank per slot, or this host's GPUs."""
    import torch

    from parallel_runtime.config import HostDevices, build_config, share_devices_requested

    sizes = {f"{d}_size": v for d, v in scenario.mesh.items()}
    if device == "cpu":
        n = scenario.world_size
        return build_config(**sizes, devices=",".join(["cpu"] * n),
                            host=HostDevices("cpu", cpu_count=max(os.cpu_count() or 1, n)))
    # PARALLEL_SHARE_DEVICE=1 (the GPU check on one GPU): the ranks wrap around the GPUs there are.
    return build_config(**sizes, devices="auto", host=HostDevices("cuda:0", cuda_count=torch.cuda.device_count(),
                                                                  share_devices=share_devices_requested()))


def run_scenario(scenario, device: str, threads: int, repeat: int | None, consecutive: bool = False) -> dict:
    """World size 1 and the scenario's mesh, timed in turn. ``consecutive`` (``--peers``): then also
    ``repeat`` one-rank steps in a row and ``repeat`` mesh steps in a row, the way the peers'
    harness times each world size (``bench/peer_worker.py``: a world's steps back to back, its ranks
    never idle between them): the figures a step is compared with theirs by."""
    import torch

    from measure import Timer, count_comm_bytes, faults_during, median_count, peak_rss, summary
    from scenarios import scenario_call
    from parallel_runtime.world.memory import process_memory, release_free_heap
    from parallel_runtime.world.runtime import Runtime

    repeat = repeat or scenario.repeat
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    timer = Timer(dev)
    model, args, kwargs = scenario.build(0, scenario.batch, dev)
    plan, method, options = scenario_call(scenario, model)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    # World size 1: the plain model in this process, on one rank's threads.
    saved_threads = torch.get_num_threads()
    one_rank_threads = threads if device == "cpu" else saved_threads

    def one_rank():
        torch.set_num_threads(one_rank_threads)
        try:
            return method(*args, **kwargs, **options)
        finally:
            torch.set_num_threads(saved_threads)

    with torch.inference_mode():
        base_activation = activation_peak(os.getpid(), one_rank)
        reference = one_rank()  # warm-up, and the reference
    release_free_heap()
    world1 = process_memory(os.getpid())  # one process holding the model, after a step
    world1_pss = world1["pss_bytes"]

    # The mesh: this process is rank 0, the rest are workers.
    world_size = scenario.world_size
    if device == "cpu":
        os.environ["PARALLEL_CPU_THREADS_PER_RANK"] = str(threads)
    config = mesh_config(scenario, device)
    runtime = Runtime()
    try:
        world = runtime.world_for(config)
        forward = lambda: world.forward(model, plan, method, args, {**kwargs, **options})  # noqa: E731
        with torch.inference_mode():
            out = forward()  # warm-up: sends the weights
            pids = [r["pid"] for r in world.status()["ranks"]]
            activation = activation_peaks(pids, forward)
            # One rank and the mesh in turn (the workers idle during the former), so that a shared
            # machine's slow moments fall on both alike.
            # Each step's page faults too, per process (read outside the timed call): the one-rank
            # step's depend on the heap's state (bench/results/ulysses2_breakdown_*, seventh session).
            base_samples, samples, dispatch, base_faults, faults = [], [], [], [], []
            for _ in range(repeat):
                (ms, _), (fault,) = faults_during([os.getpid()], lambda: timer.time_ms(one_rank))
                base_samples.append(ms)
                base_faults.append(fault)
                (ms, out), per_rank = faults_during(pids, lambda: timer.time_ms(forward))
                samples.append(ms)
                faults.append(per_rank)
                dispatch.append(world.last_dispatch)
            together = {}
            if consecutive:
                timed = [faults_during([os.getpid()], lambda: timer.time_ms(one_rank)) for _ in range(repeat)]
                world1_ms = summary([ms for (ms, _), _ in timed])["median"]
                step_ms = summary([timer.time_ms(forward)[0] for _ in range(repeat)])["median"]
                together = {"world1_ms_median": round(world1_ms, 2), "step_ms_median": round(step_ms, 2),
                            "speedup_vs_world1": round(world1_ms / step_ms, 3),
                            "world1_minor_faults_median": median_count([f for _, (f,) in timed])}
            with count_comm_bytes() as comm:
                forward()
        err = (out.float() - reference.float()).abs().max().item()
        status = world.status()
        pids = [r["pid"] for r in status["ranks"]]
        world.release_free_heap()  # every rank's freed heap back, as between prompts
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
        "uss_bytes_per_rank": [m.get("uss_bytes") for m in mem],
        "pss_bytes_world1": world1_pss,
        "uss_bytes_world1": world1.get("uss_bytes"),
        "pss_sum_over_world1": (round(sum(m["pss_bytes"] for m in mem) / world1_pss, 3)
                                if world1_pss and all(m["pss_bytes"] for m in mem) else None),
        "comm_bytes_per_step": comm["bytes"], "collective_calls_per_step": comm["calls"],
        "dispatch_overhead_ms": round(dispatch_ms, 3),
        "activation_peak_bytes_per_rank": activation, "activation_peak_bytes_world1": base_activation,
        "max_abs_err": err, "repeat": repeat, "notes": scenario.notes,
        "world1_minor_faults_median": median_count(base_faults),
        "minor_faults_per_rank_median": [median_count(column) for column in zip(*faults)],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **({"consecutive": together} if together else {}),
    }


def run_compiled_scenario(scenario, device: str, threads: int, repeat: int | None) -> dict:
    """Eager and compiled (the plan's blocks, as Shard Transformer compiles them under
    TorchCompileModel), at world size 1 and at the scenario's mesh, timed in turn in one run:
    the speedup compiling gives at world size 2 against the one it gives at world size 1."""
    import torch

    from measure import Timer, summary
    from scenarios import scenario_call
    from parallel_runtime.parallel.compile_regions import CompileSettings, compiled_regions
    from parallel_runtime.world.runtime import Runtime

    repeat = repeat or scenario.repeat
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    timer = Timer(dev)
    model, args, kwargs = scenario.build(0, scenario.batch, dev)
    plan, method, options = scenario_call(scenario, model)
    settings = CompileSettings(backend=scenario.extra.get("backend", "inductor"))
    # Rank 0 runs the blocks at world size 1 and at the mesh's sizes in one process: without this
    # torch would make the sizes that differ dynamic (slower kernels) where a user's ComfyUI, which
    # runs one layout, keeps static ones. The workers see one size only.
    torch._dynamo.config.automatic_dynamic_shapes = False
    saved_threads = torch.get_num_threads()

    def one_rank(compiled: bool):
        torch.set_num_threads(threads if device == "cpu" else saved_threads)
        try:
            with compiled_regions(model, plan, settings if compiled else None):
                return method(*args, **kwargs, **options)
        finally:
            torch.set_num_threads(saved_threads)

    compile_s = {}
    with torch.inference_mode():
        reference = one_rank(False)
        t0 = time.perf_counter()
        one_rank(True)  # compiles
        compile_s["world1"] = round(time.perf_counter() - t0, 1)
    if device == "cpu":
        os.environ["PARALLEL_CPU_THREADS_PER_RANK"] = str(threads)
    runtime = Runtime()
    try:
        world = runtime.world_for(mesh_config(scenario, device))
        call = {False: lambda: world.forward(model, plan, method, args, {**kwargs, **options}),
                True: lambda: world.forward(model, plan, method, args, {**kwargs, **options}, compile=settings)}
        with torch.inference_mode():
            call[False]()  # sends the weights
            t0 = time.perf_counter()
            call[True]()  # compiles on every rank
            compile_s["world2"] = round(time.perf_counter() - t0, 1)
            samples = {k: [] for k in ("eager1", "compiled1", "eager2", "compiled2")}
            for _ in range(repeat):  # in turn, so that a shared machine's slow moments fall on all alike
                samples["eager1"].append(timer.time_ms(lambda: one_rank(False))[0])
                samples["compiled1"].append(timer.time_ms(lambda: one_rank(True))[0])
                samples["eager2"].append(timer.time_ms(call[False])[0])
                ms, out = timer.time_ms(call[True])
                samples["compiled2"].append(ms)
        status = world.status()
    finally:
        runtime.shutdown("benchmark done")
        os.environ.pop("PARALLEL_CPU_THREADS_PER_RANK", None)
    med = {k: summary(v)["median"] for k, v in samples.items()}
    gain1, gain2 = med["eager1"] / med["compiled1"], med["eager2"] / med["compiled2"]
    return {
        "scenario": scenario.name, "family": scenario.family, "mode": scenario.mode,
        "mesh": {d: scenario.mesh.get(d, 1) for d in ("cfg", "ring", "ulysses", "tp")},
        "world_size": scenario.world_size, "device": device, "threads_per_rank": threads if device == "cpu" else None,
        "tokens": scenario.tokens, "batch": scenario.batch, "backend": settings.backend,
        **{f"{k}_ms_median": round(v, 2) for k, v in med.items()},
        "step_ms_median": round(med["compiled2"], 2), "world1_ms_median": round(med["eager1"], 2),
        "speedup_vs_world1": round(med["eager1"] / med["compiled2"], 3),
        "compile_speedup_world1": round(gain1, 3), "compile_speedup_world2": round(gain2, 3),
        "compile_speedup_ratio": round(gain2 / gain1, 3),
        "first_compiled_step_s": compile_s,
        "compiles_per_rank": [r["compiles"] for r in status["ranks"]],
        "recompiles_per_rank": [r["recompiles"] for r in status["ranks"]],
        "max_abs_err": (out.float() - reference.float()).abs().max().item(),
        "max_rel_err": ((out.float() - reference.float()).abs().max() / reference.float().abs().max()).item(),
        "dtype": str(reference.dtype).removeprefix("torch."),  # what the comparison's tolerance is for
        "notes": scenario.notes, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _report_auto(record: dict) -> list[str]:
    return [f"auto picked {record['auto_pick']} ({record['auto_over_best']:.3f} x the best, {record['best_manual']}): "
            + ", ".join(f"{k} predicted {v['predicted_ms']:.0f} / measured {v['measured_ms']:.0f} ms"
                        for k, v in record["layouts"].items())]


def _report_weighted(record: dict) -> list[str]:
    return [f"rank 1 {record['slow_factor']}x slower: even {record['even_ms_median']:.0f} ms, weighted "
            f"{record['weighted_ms_median']:.0f} ms ({record['weighted_gain'] * 100:+.0f} %), err {record['max_abs_err']:.1e}"]


def _report_cache(record: dict) -> list[str]:
    return [f"{r['where']} threshold {r['threshold']}: end to end {r['e2e_ms_median']:.0f} ms "
            f"({r['speedup_vs_uncached']:.2f}x its uncached twin), cached {r['cached_steps']}/{record['steps']}, "
            f"PSNR {r['image_psnr_db']}" for r in record["cache_variants"]]


def _report_controlnet(record: dict) -> list[str]:
    return [f"{w['way']}: step {w['step_ms_median']:.0f} ms (ControlNet {w['controlnet_ms_median']:.0f} + transformer "
            f"{w['transformer_ms_median']:.0f}), err {w['max_abs_err_vs_unsharded']:.1e}" for w in record["controlnet_ways"]] \
        + [f"sharded ControlNet over rank 0 only: {record['speedup_sharded_over_rank0']:.3f}x"]


# Scenario flag -> (module, runner, report lines) of the suites with a runner of their own.
SUITE_RUNNERS = {"auto": ("auto_bench", "run_auto_scenario", _report_auto),
                 "weighted": ("weighted_bench", "run_weighted_scenario", _report_weighted),
                 "cache": ("cache_bench", "run_cache_scenario", _report_cache),
                 "controlnet": ("controlnet_bench", "run_controlnet_scenario", _report_controlnet)}


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default="quick",
                        choices=["smoke", "quick", "full", "vae", "memory", "gguf", "compile", "auto", "weighted",
                                 "cache", "controlnet", "load", "none"],
                        help="scenarios to run; 'none' with --peers runs only the peer comparison")
    parser.add_argument("--scenario", nargs="*", help="run these scenarios instead of a suite")
    parser.add_argument("--out", required=True, help="JSON-lines file for the records (appended)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--repeat", type=int, help="timed forwards per measurement (default: per scenario)")
    parser.add_argument("--peers", action="store_true", help="also run cache-dit's and diffusers' Ulysses on the same Flux config and weights")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the scenarios (and peers) this many times in turn, so that a shared machine's "
                             "load falls on all of them alike; records carry their round")
    parser.add_argument("--plots", help="directory for PNG plots of the records in --out")
    return parser.parse_args()


def run_one(scenario, opts) -> tuple[dict, list[str]]:
    """The scenario's record and the lines that report it."""
    special = next((key for key in SUITE_RUNNERS if scenario.extra.get(key)), None)
    if special is not None:  # a suite with its own runner, imported only when it runs
        module, function, report = SUITE_RUNNERS[special]
        record = getattr(importlib.import_module(module), function)(scenario, opts.device, opts.threads_per_rank,
                                                                     opts.repeat)
        return record, report(record)
    run = run_compiled_scenario if scenario.extra.get("compile") else run_scenario
    extra = {"consecutive": True} if opts.peers and run is run_scenario else {}
    record = run(scenario, opts.device, opts.threads_per_rank, opts.repeat, **extra)
    lines = [f"{record['step_ms_median']:.1f} ms vs {record['world1_ms_median']:.1f} ms on one rank: "
             f"{record['speedup_vs_world1']:.2f}x, err {record['max_abs_err']:.1e}"]
    if record.get("world1_minor_faults_median") is not None:
        lines.append(f"page faults a step: {record['world1_minor_faults_median']} on one rank, "
                     f"{record['minor_faults_per_rank_median']} per rank")
    if "consecutive" in record:
        c = record["consecutive"]
        lines.append(f"back to back, as the peers are timed: {c['step_ms_median']:.1f} ms vs "
                     f"{c['world1_ms_median']:.1f} ms on one rank: {c['speedup_vs_world1']:.2f}x")
    return record, lines


def main() -> int:
    opts = parse_arguments()
    _import_comfy(opts.device)
    from scenarios import select

    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    info = machine()

    def write(record: dict, round_: int) -> None:
        record["machine"] = info
        if opts.rounds > 1:
            record["round"] = round_
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")

    for round_ in range(1, opts.rounds + 1):
        if opts.suite == "load":  # real ComfyUI servers, one per case (bench/load.py): one record a run
            import load

            record = load.benchmark(load.comfyui_path(""))
            write(record, round_)
            print(f"[bench] load: {len(record['rows'])} cases in {record['run_s']:.0f} s", file=sys.stderr)
            continue
        for scenario in select(opts.suite, opts.scenario):
            print(f"[bench] {scenario.name}: {scenario.mode} {scenario.mesh} on {opts.device}, {scenario.tokens} tokens",
                  file=sys.stderr, flush=True)
            record, lines = run_one(scenario, opts)
            write(record, round_)
            for line in lines:
                print(f"[bench]   {line}", file=sys.stderr, flush=True)
        if opts.peers:
            from peers import run_peers

            for record in run_peers(opts.threads_per_rank, opts.repeat or 3):
                write(record, round_)
    if opts.plots:
        from plots import plot

        plot([out], Path(opts.plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
