"""Ulysses for any head count (issue 50): what padding the heads costs, predicted and timed.

Two parts, written to one JSON file (``--out``) and printed as a table:

- **Prediction**: the cost model's step time of Ulysses N where N does not divide the heads (the
  heads padded to ``ceil(H / N)`` per rank, parallel_runtime/parallel/heads.py), against Ring N
  and the USP layouts over the same N GPUs, for a 24-head model (Flux.1-dev at 1024 x 1024) and
  a 40-head one (a Wan 2.1 14B-sized stand-in at 720p: width 5120, 40 blocks), on 3 and 6 GPUs.
  The hardware is paper_check's: H100 SXM (NVLink, 450 GB/s per direction as published) at a
  compute efficiency of 0.4 (a stated figure, not fitted). These are model outputs, not runs.
- **Timing**: one process, this machine, PyTorch's attention on the largest uneven share against
  the even one at a reduced length (three ranks on two cores would measure nothing): the padded
  share costs what the prediction charges, attention time in proportion to the heads.

    python bench/uneven_heads.py --out bench/results/uneven_heads_<date>.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from paper_check import PEERS, mmdit_shape, rates_for  # noqa: E402
from parallel_runtime.layout import cost_model  # noqa: E402
from parallel_runtime.parallel.heads import head_share  # noqa: E402

EFFICIENCY = 0.4
MODELS = {
    "Flux.1-dev 1024 (24 heads)": mmdit_shape(4096, 512, 19, 38),
    "Wan 14B-sized 720p (40 heads)": mmdit_shape(21 * 45 * 80, 512, 0, 40, hidden=5120, heads=40),
}


def predictions(gpus: int) -> list[dict]:
    """Every layout of ``gpus`` ranks without cfg or TP, per model, fastest first."""
    hardware = {h["gpu"]: h for h in json.loads(PEERS.read_text())["hardware"]}
    rates = rates_for(hardware["H100 SXM5 80GB"], "NVLink", EFFICIENCY)
    out = []
    for name, shape in MODELS.items():
        one = cost_model.predict(shape, {}, rates).step_s
        for sizes in cost_model.layouts(gpus):
            if sizes["cfg"] > 1 or sizes["tp"] > 1:
                continue
            p = cost_model.predict(shape, sizes, rates)
            out.append({"model": name, "gpus": gpus, "layout": cost_model_name(sizes),
                        "heads_per_rank": head_share(shape.heads, sizes["ulysses"]),
                        "even_share": round(shape.heads / sizes["ulysses"], 2),
                        "step_ms": round(p.step_s * 1e3, 1), "attention_ms": round(p.parts["attention"] * 1e3, 1),
                        "comm_ms": round(p.comm_s * 1e3, 1), "speedup": round(one / p.step_s, 2)})
    return sorted(out, key=lambda r: (r["model"], r["step_ms"]))


def cost_model_name(sizes: dict) -> str:
    return " x ".join(f"{d}{sizes[d]}" for d in ("ring", "ulysses") if sizes[d] > 1) or "single"


def attention_seconds(heads: int, tokens: int, head_dim: int = 128, repeats: int = 5) -> float:
    q = torch.randn(1, heads, tokens, head_dim)
    torch.nn.functional.scaled_dot_product_attention(q, q, q)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timings(tokens: int) -> list[dict]:
    """Per model and GPU count where the heads do not divide: the padded share against the even
    share's floor (the nearest whole even share measurable), timed side by side."""
    out = []
    for name, shape in MODELS.items():
        for gpus in (3, 5, 6, 7):
            if shape.heads % gpus == 0:
                continue
            share, floor = head_share(shape.heads, gpus), shape.heads // gpus
            t_share, t_floor = attention_seconds(share, tokens), attention_seconds(floor, tokens)
            out.append({"model": name, "gpus": gpus, "tokens": tokens, "padded_share": share, "floor_share": floor,
                        "padded_ms": round(t_share * 1e3, 2), "floor_ms": round(t_floor * 1e3, 2),
                        "time_ratio": round(t_share / t_floor, 3), "head_ratio": round(share / floor, 3),
                        "predicted_over_even": round(share * gpus / shape.heads, 3)})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tokens", type=int, default=2048, help="sequence length of the timed attention")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    result = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "threads": 1, "efficiency": EFFICIENCY,
              "predictions": predictions(3) + predictions(5) + predictions(6), "timings": timings(opts.tokens)}
    for r in result["predictions"]:
        print(f"{r['model']:32} {r['gpus']} GPUs {r['layout']:18} heads/rank {r['heads_per_rank']:>2} "
              f"(even {r['even_share']:>5}) step {r['step_ms']:8.1f} ms, {r['speedup']:.2f}x")
    for r in result["timings"]:
        print(f"{r['model']:32} {r['gpus']} GPUs: {r['padded_share']} heads {r['padded_ms']} ms against "
              f"{r['floor_share']} heads {r['floor_ms']} ms: x{r['time_ratio']} (heads x{r['head_ratio']})")
    if opts.out:
        opts.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
