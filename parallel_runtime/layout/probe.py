"""A short measurement of what the ranks can do, taken when a world starts (cost_model reads it).

Every rank runs the same steps in the same order (the links are collectives over the whole
world): compute first (matmul at two sizes, attention, an elementwise pass; every rank at once,
so CPU ranks share the cores as they do in a step), then the links (all-reduce, all-to-all and a
ring of send/recv, each at a small and a large size: latency and bandwidth). It takes a few
hundred milliseconds and is kept per device set for the life of ComfyUI's process.
"""
from __future__ import annotations

import statistics
import time

import psutil
import torch

from ..distributed import comm
from ..parallel.attention import attention_with_lse

# (small, large) sizes per device type: the large ones are in the range a step moves.
MATMUL_SIDES = {"cpu": (128, 512), "cuda": (1024, 4096)}
ATTENTION_TOKENS = {"cpu": 512, "cuda": 4096}
ELEMENTWISE_NUMEL = {"cpu": 1 << 22, "cuda": 1 << 26}
LINK_BYTES = {"cpu": (4096, 4 << 20), "cuda": (4096, 64 << 20)}
REPEATS = 3

_CACHE: dict[tuple, dict] = {}


def probe_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: torch.device, repeats: int = REPEATS) -> float:
    fn()  # warm-up (kernel selection, buffers)
    _sync(device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def model_attention_function():
    """ComfyUI's attention function as its command line chose it (PyTorch's where there is no ComfyUI)."""
    try:
        from comfy.ldm.modules.attention import optimized_attention

        return optimized_attention
    except ImportError:
        def sdpa(q, k, v, heads):
            b, n, width = q.shape
            split = [t.reshape(b, n, heads, width // heads).transpose(1, 2) for t in (q, k, v)]
            return torch.nn.functional.scaled_dot_product_attention(*split).transpose(1, 2).reshape(b, n, width)
        return sdpa


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


def measure_compute(device: torch.device) -> dict:
    """This rank's throughput: op time = overhead + flops / peak, fitted on two matmul sizes."""
    kind = device.type if device.type in MATMUL_SIDES else "cuda"
    dtype = probe_dtype(device)
    times = []
    for side in MATMUL_SIDES[kind]:
        a = torch.randn(side, side, device=device, dtype=dtype)
        b = torch.randn(side, side, device=device, dtype=dtype)
        times.append((2.0 * side ** 3, median_seconds(lambda: torch.mm(a, b), device)))
    (f_small, t_small), (f_large, t_large) = times
    peak = (f_large - f_small) / max(t_large - t_small, 1e-9)
    overhead = max(t_small - f_small / peak, 0.0)
    tokens = ATTENTION_TOKENS[kind]
    q = torch.randn(1, 4, tokens, 64, device=device, dtype=dtype)
    flat = q.transpose(1, 2).reshape(1, tokens, 4 * 64)
    model_attention = model_attention_function()
    # The attention ComfyUI runs (Ulysses and one rank call it) and the kernel of the Ring steps.
    attention_s = median_seconds(lambda: model_attention(flat, flat, flat, 4), device)
    ring_s = median_seconds(lambda: attention_with_lse(q, q, q, 0.125), device)
    x = torch.randn(ELEMENTWISE_NUMEL[kind], device=device, dtype=dtype)
    elementwise_s = median_seconds(lambda: torch.addcmul(x, x, x), device)
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "matmul_flops_per_s": peak,
        "op_overhead_s": overhead,
        "attention_flops_per_s": 4.0 * 4 * tokens * tokens * 64 / attention_s,
        "ring_attention_flops_per_s": 4.0 * 4 * tokens * tokens * 64 / ring_s,
        "memory_bytes_per_s": 3.0 * x.numel() * x.element_size() / elementwise_s,  # two reads, one write
        "free_memory_bytes": _free_memory(device),
    }


RESOLUTION = 0.05  # the larger message must take at least this much longer than the smaller one


def _fit(small: tuple[int, float], large: tuple[int, float]) -> dict:
    """Latency and bandwidth from two message sizes' times. Where the larger message took no
    clearly longer than the smaller (a link too fast for the probe's sizes, or noise), the fit would
    divide by about zero (4e15 B/s was shown): the bandwidth is then the larger message's own rate,
    a lower bound, and ``resolved`` says it was not measured."""
    (b_small, t_small), (b_large, t_large) = small, large
    resolved = t_large - t_small > RESOLUTION * t_large
    bandwidth = (b_large - b_small) / (t_large - t_small) if resolved else b_large / max(t_large, 1e-9)
    return {"latency_s": max(t_small - b_small / bandwidth, 0.0), "bytes_per_s": bandwidth, "resolved": resolved}


def measure_links(device: torch.device, rank: int, world_size: int) -> dict:
    """Latency and bandwidth of the collectives a step uses, over every rank (all take part)."""
    kind = device.type if device.type in LINK_BYTES else "cuda"
    out = {}
    samples: dict[str, list] = {"all_reduce": [], "all_to_all": [], "send_recv": []}
    for nbytes in LINK_BYTES[kind]:
        numel = max(world_size, nbytes // 4 // world_size * world_size)
        t = torch.ones(numel, device=device, dtype=torch.float32)
        received = torch.empty_like(t)
        nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
        ops = {
            "all_reduce": lambda: comm.all_reduce(t),
            "all_to_all": lambda: comm.all_to_all_single(received, t),
            "send_recv": lambda: comm.p2p([("send", t, nxt), ("recv", received, prev)]).wait(),
        }
        for name, fn in ops.items():
            comm.all_reduce(torch.zeros(1, device=device))  # start together
            samples[name].append((numel * 4, median_seconds(fn, device)))
    for name, (small, large) in samples.items():
        out[name] = _fit(small, large)
    return out


def run(device: torch.device, rank: int, world_size: int) -> dict:
    """Every rank calls this at the same point; returns this rank's measurements."""
    started = time.perf_counter()
    result = {"rank": rank, "device": str(device), **measure_compute(device)}
    comm.all_reduce(torch.zeros(1, device=device))  # compute ends everywhere before the links
    result["links"] = measure_links(device, rank, world_size)
    result["seconds"] = time.perf_counter() - started
    return result


def combine(per_rank: list[dict]) -> dict:
    """The world's probe: per rank compute, and the links as rank 0 measured them."""
    per_rank = sorted(per_rank, key=lambda r: r["rank"])
    return {
        "ranks": [{k: v for k, v in r.items() if k != "links"} for r in per_rank],
        "links": per_rank[0]["links"],
        "seconds": max(r["seconds"] for r in per_rank),
    }


def cache_key(config, threads) -> tuple:
    return (config.devices, config.backend, config.hosts, threads)


def cached(key: tuple) -> dict | None:
    return _CACHE.get(key)


def remember(key: tuple, result: dict) -> None:
    _CACHE[key] = result


def describe(result: dict | None) -> str:
    if not result:
        return "not measured"
    slowest = min(r["matmul_flops_per_s"] for r in result["ranks"])
    links = result["links"]
    return (f"matmul {slowest / 1e9:.1f} GFLOP/s on the slowest rank; all-to-all {links['all_to_all']['bytes_per_s'] / 1e9:.2f} "
            f"GB/s, all-reduce {links['all_reduce']['bytes_per_s'] / 1e9:.2f} GB/s, send/recv "
            f"{links['send_recv']['bytes_per_s'] / 1e9:.2f} GB/s; measured in {result['seconds'] * 1e3:.0f} ms")
