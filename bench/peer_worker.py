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

from measure import nbytes, peak_rss  # bench/ is on the path: torchrun runs this file from there


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

    samples, cpu_ms = [], []
    with torch.inference_mode():
        out = forward()  # warm-up
        for _ in range(opts.repeat):
            if world > 1:
                dist.barrier()  # all ranks start the step together, as one sampler step would
            started, cpu_started = time.perf_counter(), time.process_time()
            out = forward()
            samples.append((time.perf_counter() - started) * 1e3)
            cpu_ms.append((time.process_time() - cpu_started) * 1e3)
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
    rss = peak_rss(os.getpid())
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, rss)
        rss = every
    else:
        rss = [rss]
    result["rss_bytes_per_rank"] = rss
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
    opts = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = run(opts)
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
