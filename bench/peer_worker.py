"""One rank of a peer benchmark run; launched by ``peers.py`` through ``torch.distributed.run``.

    python -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port PORT \
        bench/peer_worker.py --peer cachedit --case case.pt --threads 1 --repeat 3 --out result.json

At world size 1 it times the plain diffusers model; at larger sizes it applies the
peer's Ulysses (cache-dit's, or diffusers' own context parallelism) first. Every
rank gets the full inputs: both peers split the sequence themselves and gather the
output back on every rank. Rank 0 writes the JSON result; a failure is written there
too, as text, so that the caller can put it in the record.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from measure import faults_during, median_count, nbytes, peak_rss  # bench/ is on the path: torchrun runs this file from there


class CommCounter(TorchDispatchMode):
    """Counts bytes this rank hands to collectives, as our suite does for rank 0.

    Both peers call collectives through torch.distributed's functional API or through
    ProcessGroup methods, by names of their own; every one of those reaches the dispatcher
    as a ``_c10d_functional`` or ``c10d`` op, so counting there sees them all.
    """

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.calls = 0

    # Ops of those namespaces that move no data of their own.
    NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier")
    # c10d's in-place ops take (output, input, ...); the functional ones lead with the input.
    OUTPUT_FIRST = ("alltoall_base_", "alltoall_", "allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_",
                    "reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace = getattr(func, "namespace", "")
        name = func.__name__.split(".")[0]
        if namespace in ("_c10d_functional", "c10d") and name not in self.NOT_COLLECTIVES:
            self.calls += 1
            payload = args[1] if namespace == "c10d" and name in self.OUTPUT_FIRST else args[0]
            self.bytes += nbytes(payload)
        return func(*args, **(kwargs or {}))


def parallelize_cachedit(model, world: int):
    import cache_dit
    from cache_dit import ParallelismConfig

    # No cache_config: cache-dit then only applies parallelism, so the forward stays exact.
    return cache_dit.enable_cache(model, parallelism_config=ParallelismConfig(ulysses_size=world))


def parallelize_diffusers(model, world: int):
    """diffusers' own Ulysses, set up by hand.

    ``ModelMixin.enable_parallelism`` picks its device as ``rank % torch.accelerator.device_count()``,
    which divides by zero on a machine without accelerators. Everything after that works on the
    CPU, so this does the same steps through public pieces with a CPU mesh.
    """
    from diffusers import ContextParallelConfig, ParallelConfig
    from diffusers.hooks.context_parallel import apply_context_parallel

    model.set_attention_backend("native")
    cp = ContextParallelConfig(ulysses_degree=world)
    mesh = dist.device_mesh.init_device_mesh("cpu", cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), mesh=mesh)
    model._parallel_config = config
    # Attention processors read the config to route attention through the all-to-alls.
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = config
    apply_context_parallel(model, cp, model._cp_plan)
    return model


PARALLELIZE = {"cachedit": parallelize_cachedit, "diffusers": parallelize_diffusers}


def sample_dbcache(opts) -> dict:
    """cache-dit's DBCache sampled end to end, the way ``cache_bench.py`` samples Block Cache: a
    flow-matching Euler loop of ``--sample-steps`` steps from the case's noise, uncached and at each of
    ``--thresholds``, the variants taking turns for ``--repeat`` rounds. Each variant gets a fresh model
    (cache-dit's hooks stay on a module once applied) with cache-dit's Ulysses at world size > 1.
    Rank 0 saves each variant's final tokens (``--out`` with ``.<variant>.pt``) and returns each
    variant's end-to-end and per-step times, the steps cache-dit itself counts as cached (their
    0-based indices, and how many) and its change measure at each step it measured."""
    import cache_dit
    from cache_dit import DBCacheConfig, ParallelismConfig
    from diffusers import FluxTransformer2DModel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(opts.threads)
    case = torch.load(opts.case, map_location="cpu")
    inputs, steps = case["inputs"], opts.sample_steps
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    thresholds = [None] + [float(t) for t in opts.thresholds.split(",") if t]

    def build(threshold):
        model = FluxTransformer2DModel(**case["config"]).eval()
        model.load_state_dict(case["state_dict"], strict=True)
        model.set_attention_backend("native")
        cache = None if threshold is None else DBCacheConfig(
            Fn_compute_blocks=opts.fn, Bn_compute_blocks=opts.bn, residual_diff_threshold=threshold,
            max_warmup_steps=opts.warmup, max_continuous_cached_steps=opts.max_continuous,
            num_inference_steps=steps)
        # In place, cache first, then parallelism (cache-dit's order), in two calls: given both at once for
        # a transformer alone, 1.5.3 goes on with the list of block lists the cache step returns.
        if cache is not None:
            cache_dit.enable_cache(model, cache_config=cache)
        if world > 1:
            cache_dit.enable_cache(model, parallelism_config=ParallelismConfig(ulysses_size=world))
        return model

    models = {t: build(t) for t in thresholds}
    times = {t: {"e2e": [], "steps": []} for t in thresholds}
    finals, cached, diffs = {}, {}, {}
    with torch.inference_mode():
        for _ in range(opts.repeat):
            for t in thresholds:
                model = models[t]
                if t is not None:  # a fresh cache context for each sampling run, as a pipeline call starts one
                    cache_dit.refresh_context(model, num_inference_steps=steps)
                if world > 1:
                    dist.barrier()
                finals[t] = euler_sample(model, inputs, sigmas, times[t])
                if t is not None:  # this run's cached steps (each round the same: the context starts afresh)
                    stats = max(cache_dit.summary(model, logging=False), key=lambda s: len(s.cached_steps))
                    cached.setdefault(t, []).append(sorted(stats.cached_steps))
                    diffs[t] = {int(k): float(v) for k, v in stats.residual_diffs.items()}
    variants = [variant_record(opts.out, t, finals[t], times[t], cached.get(t, []), diffs.get(t, {}))
                for t in thresholds]
    return {"peer": opts.peer, "world_size": world, "threads": opts.threads, "steps": steps, "rounds": opts.repeat,
            "cache_dit": cache_dit.__version__, "variants": variants, "failure": None}


def euler_sample(model, inputs: dict, sigmas, times: dict):
    """One sampling run, the flow-matching Euler loop of ``cache_bench.py`` from the case's noise: the final
    tokens; each step's ms goes to ``times["steps"]``, the run's to ``times["e2e"]``."""
    started = time.perf_counter()
    x = inputs["hidden_states"].clone()
    for i in range(len(sigmas) - 1):
        step_started = time.perf_counter()
        timestep = torch.full((x.shape[0],), float(sigmas[i]))
        out = model(**{**inputs, "hidden_states": x, "timestep": timestep}, return_dict=False)[0]
        x = x + (sigmas[i + 1] - sigmas[i]) * out
        times["steps"].append((time.perf_counter() - step_started) * 1e3)
    times["e2e"].append((time.perf_counter() - started) * 1e3)
    return x


def variant_record(out: str, threshold, final, times: dict, cached: list[list[int]], diffs: dict) -> dict:
    """One DBCache variant's result: rank 0 saves its final tokens beside ``out`` (the JSON is too small a
    place for them); its times, the steps cache-dit cached in the last round (every round caches the same:
    the context starts afresh) and cache-dit's change measure at each step it measured then."""
    name = "uncached" if threshold is None else f"t{threshold}"
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(final, f"{out}.{name}.pt")
    return {"threshold": threshold, "file": f"{out}.{name}.pt",
            "e2e_ms_all": [round(v, 1) for v in times["e2e"]],
            "e2e_ms_median": round(statistics.median(times["e2e"]), 1),
            "step_ms_median": round(statistics.median(times["steps"]), 1),
            "cached_steps": len(cached[-1]) if cached else 0, "cached_step_indices": cached[-1] if cached else [],
            "residual_diffs": diffs, "cached_steps_per_round": [len(c) for c in cached]}


def run(opts) -> dict:
    from diffusers import FluxTransformer2DModel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(opts.threads)
    case = torch.load(opts.case, map_location="cpu")
    model = FluxTransformer2DModel(**case["config"]).eval()
    model.load_state_dict(case["state_dict"], strict=True)
    del case["state_dict"]
    inputs = case["inputs"]
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    if world > 1:
        model = PARALLELIZE[opts.peer](model, world)
    else:
        # The baseline is the plain model with the attention kernel the parallel runs use.
        model.set_attention_backend("native")

    def forward():
        return model(**inputs, return_dict=False)[0]

    def timed():
        started, cpu_started = time.perf_counter(), time.process_time()
        out = forward()
        return out, (time.perf_counter() - started) * 1e3, (time.process_time() - cpu_started) * 1e3

    samples, cpu_ms, faults = [], [], []
    with torch.inference_mode():
        out = forward()  # warm-up
        for _ in range(opts.repeat):
            if world > 1:
                dist.barrier()  # all ranks start the step together, as one sampler step would
            (out, ms, cpu), (fault,) = faults_during([os.getpid()], timed)
            samples.append(ms)
            cpu_ms.append(cpu)
            faults.append(fault)
        comm = None
        if world > 1:
            dist.barrier()
            with CommCounter() as comm:
                forward()

    result = {"peer": opts.peer, "world_size": world, "threads": opts.threads, "samples_ms": samples,
              "ms_median": statistics.median(samples), "ms_min": min(samples), "ms_max": max(samples),
              "param_bytes": param_bytes, "failure": None,
              # CPU time over wall time of rank 0's steps: well under threads when other work on the
              # machine took the cores (or the rank waited on its peers), so the timing is suspect.
              "cpu_per_wall": round(sum(cpu_ms) / sum(samples), 3)}
    if comm is not None:
        result.update({"comm_bytes_per_step": comm.bytes, "collective_calls_per_step": comm.calls})
    if opts.save_output:
        torch.save(out, opts.save_output)
    if opts.reference:
        reference = torch.load(opts.reference)
        result["max_abs_err"] = (out.float() - reference.float()).abs().max().item()
    rss, fault = peak_rss(os.getpid()), median_count(faults)
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, (rss, fault))
        rss, fault = [list(column) for column in zip(*every)]
    else:
        rss, fault = [rss], [fault]
    result["rss_bytes_per_rank"] = rss
    result["minor_faults_per_rank_median"] = fault  # each rank's page faults a step (bench/measure.py)
    result["rss_bytes_per_rank_max"] = max((r for r in rss if r is not None), default=None)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", required=True, choices=sorted(PARALLELIZE))
    parser.add_argument("--case", required=True, help="torch.save'd config, state_dict and inputs")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", required=True, help="rank 0 writes its JSON result here")
    parser.add_argument("--save-output", help="rank 0 saves the output tensor here")
    parser.add_argument("--reference", help="output tensor to compare against (max abs difference)")
    parser.add_argument("--sample-steps", type=int, default=0,
                        help="sample end to end with cache-dit's DBCache instead of timing one forward")
    parser.add_argument("--thresholds", default="", help="DBCache residual-diff thresholds, comma-separated")
    parser.add_argument("--fn", type=int, default=1, help="DBCache Fn_compute_blocks")
    parser.add_argument("--bn", type=int, default=0, help="DBCache Bn_compute_blocks")
    parser.add_argument("--warmup", type=int, default=2, help="DBCache max_warmup_steps")
    parser.add_argument("--max-continuous", type=int, default=3, help="DBCache max_continuous_cached_steps")
    opts = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = sample_dbcache(opts) if opts.sample_steps else run(opts)
        code = 0
    except Exception as exc:  # noqa: BLE001 - the caller reports the text
        traceback.print_exc()
        result = {"peer": opts.peer, "world_size": world, "failure": f"{type(exc).__name__}: {exc}"}
        code = 1
    if rank == 0:
        Path(opts.out).write_text(json.dumps(result))
    if world > 1 and code == 0:
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
