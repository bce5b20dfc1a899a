"""The cost model on paper: published multi-GPU results of other projects, predicted from the
published hardware figures (bench/published_peers.json, every figure with its source).

Method, per source and GPU type: the model's shape comes from the published architecture
(Flux.1-dev, HunyuanVideo: width 3072, 24 heads, 19 + 38 or 20 + 40 blocks, MLP ratio 4). One
number is fitted: the compute efficiency (the fraction of the GPU's dense bf16 rate the
software reaches), from that source's own one-GPU time. The multi-GPU times are then predicted
from the published link bandwidth per direction (NVLink or PCIe) and a latency of 20 us
(NVLink) or 30 us (PCIe): nothing else is fitted. Published totals include the text encoder and
the VAE, which the fit counts as compute that parallelises: a source of optimism.

    python bench/paper_check.py            # the table, as in the README
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parallel_runtime.layout import cost_model  # noqa: E402

PEERS = Path(__file__).resolve().parent / "published_peers.json"
LATENCY_S = {"NVLink": 20e-6, "PCIe": 30e-6}
HBM_BYTES_PER_S = 2e12  # elementwise passes: a small term; one figure for every GPU here


def mmdit_shape(tokens: int, text: int, double: int, single: int, hidden=3072, heads=24) -> cost_model.ModelShape:
    """A Flux-style MMDiT at bf16: per token a double block (own stream's linears) and a single
    block both make 113.2 M multiply-adds (qkv, out, MLP 4x); modulation runs once per sample."""
    per_token = hidden * 3 * hidden + hidden * hidden + 2 * hidden * 4 * hidden  # = single block's linear1 + linear2
    blocks = double + single
    total = tokens + text
    return cost_model.ModelShape(
        tokens=total, batch=1, hidden=hidden, heads=heads, blocks=blocks, attention_sites=blocks,
        token_macs_split=blocks * per_token * total, token_macs_whole=0.0,
        sample_macs_split=0.0, sample_macs_whole=double * 2 * hidden * 6 * hidden + single * hidden * 3 * hidden,
        linear_calls=double * 10 + single * 3, row_parallel=(hidden,) * (2 * double + single),
        split_norms=0, weight_bytes_split=int(blocks * per_token * 2), weight_bytes_whole=0, element_bytes=2,
        input_bytes=tokens * 64 * 2, output_bytes=tokens * 64 * 2)


MODELS = {
    # 1024 x 1024: a 128 x 128 latent, patch 2 -> 4096 image tokens, 512 text tokens.
    "FLUX.1-dev 1024": (mmdit_shape(4096, 512, 19, 38), 28),
    # 1280 x 720, 129 frames: 33 latent frames x 45 x 80 patches; 256 text tokens.
    "HunyuanVideo 720p": (mmdit_shape(33 * 45 * 80, 256, 20, 40), 50),
    "FLUX.1-dev 1024, one step": (mmdit_shape(4096, 512, 19, 38), 1),  # published as seconds per iteration
}

# (label, model, gpu, link kind, match on the published point)
POINTS = [
    ("xDiT Flux H100, eager", "FLUX.1-dev 1024", "H100 SXM5 80GB", "NVLink",
     lambda p: p["model"] == "FLUX.1-dev" and "xDiT USP" in p["method"] and p["compile"] is False),
    ("xDiT Flux H100, compiled", "FLUX.1-dev 1024", "H100 SXM5 80GB", "NVLink",
     lambda p: p["model"] == "FLUX.1-dev" and "xDiT USP" in p["method"] and p["compile"] is True),
    ("cache-dit Flux L20", "FLUX.1-dev 1024", "L20 48GB", "PCIe",
     lambda p: p["model"] == "FLUX.1-dev" and str(p["gpu"]).startswith("L20") and "cache-dit" in p["method"]
     and "compile" not in p["method"] and p["single_gpu_latency_s"] == 23.56),
    ("xDiT HunyuanVideo H100", "HunyuanVideo 720p", "H100 SXM5 80GB", "NVLink",
     lambda p: str(p["model"]).startswith("HunyuanVideo (official") and p["gpu"] == "H100"),
    ("xDiT HunyuanVideo H20", "HunyuanVideo 720p", "H20 96GB", "NVLink",
     lambda p: str(p["model"]).startswith("HunyuanVideo (official") and p["gpu"] == "H20"),
    ("xDiT HunyuanVideo L20", "HunyuanVideo 720p", "L20 48GB", "PCIe",
     lambda p: p["model"] == "HunyuanVideo (diffusers impl.)" and p["gpu"] == "L20"),
    ("raylight Flux (fp8 weights) 2 x RTX 2000 Ada, PCIe 4.0 x8", "FLUX.1-dev 1024, one step",
     "RTX 2000 Ada 16GB (raylight test card)", "PCIe",
     lambda p: str(p["model"]).startswith("FLUX (ComfyUI native)") and "raylight" in p["method"]),
]
# Only the product efficiency x peak is fitted: where no dense bf16 figure is published, any
# nominal peak gives the same predictions.
NOMINAL_TFLOPS = 100.0


def rates_for(gpu: dict, link: str, efficiency: float) -> cost_model.Rates:
    peak = (gpu["bf16_dense_tflops"] or NOMINAL_TFLOPS) * 1e12 * efficiency
    bandwidth = gpu["link_gbytes_per_s_per_direction"] * 1e9
    links = {kind: {"latency_s": LATENCY_S[link], "bytes_per_s": bandwidth}
             for kind in ("all_to_all", "send_recv", "all_reduce")}
    return cost_model.Rates(matmul_flops_per_s=peak, op_overhead_s=0.0, attention_flops_per_s=peak,
                            ring_attention_flops_per_s=peak, memory_bytes_per_s=HBM_BYTES_PER_S,
                            free_memory_bytes=1 << 50, links=links)


def sizes_of(point: dict) -> dict[str, int]:
    d = point["degrees"]
    return {"cfg": d.get("cfg", 1), "ring": d.get("ring", 1), "ulysses": d.get("ulysses", 1), "tp": d.get("tp", 1)}


def rows() -> list[dict]:
    peers = json.loads(PEERS.read_text())
    gpus = {h["gpu"]: h for h in peers["hardware"]}
    out = []
    for label, model, gpu_name, link, match in POINTS:
        shape, steps = MODELS[model]
        gpu = gpus[gpu_name]
        points = [p for p in peers["points"] if match(p)]
        if not points:
            continue
        one = points[0]["single_gpu_latency_s"]
        unit = cost_model.predict(shape, {"cfg": 1, "ring": 1, "ulysses": 1, "tp": 1}, rates_for(gpu, link, 1.0))
        efficiency = unit.step_s * steps / one  # the one fitted number
        rates = rates_for(gpu, link, efficiency)
        for p in points:
            predicted = cost_model.predict(shape, sizes_of(p), rates).step_s * steps
            out.append({"source": label, "method": p["method"], "gpus": p["gpu_count"], "one_gpu_s": one,
                        "published_s": p["latency_s"], "predicted_s": round(predicted, 2),
                        "error": round(predicted / p["latency_s"] - 1, 3), "efficiency": round(efficiency, 3)})
    return out


def consumer_pcie() -> list[dict]:
    """2 x RTX 4090 over PCIe 4.0 (no P2P on GeForce: staged through the host, so half the
    x16 figure), Flux.1-dev 1024 at the H100-eager software efficiency scaled to its peak."""
    peers = json.loads(PEERS.read_text())
    gpu = dict(next(h for h in peers["hardware"] if h["gpu"].startswith("RTX 4090")))
    gpu["link_gbytes_per_s_per_direction"] /= 2
    shape, steps = MODELS["FLUX.1-dev 1024"]
    rates = rates_for(gpu, "PCIe", 0.4)
    out = []
    for sizes in cost_model.layouts(2):
        if sizes["cfg"] > 1:
            continue  # Flux.1-dev is guidance-distilled: batch 1
        p = cost_model.predict(shape, sizes, rates)
        out.append({"layout": sizes, "step_s": round(p.step_s, 3), "comm_s": round(p.comm_s, 3)})
    one = cost_model.predict(shape, {"cfg": 1, "ring": 1, "ulysses": 1, "tp": 1}, rates).step_s
    for r in out:
        r["speedup"] = round(one / r["step_s"], 2)
    return sorted(out, key=lambda r: r["step_s"])


def main() -> int:
    table = rows()
    print("| source | method | GPUs | 1 GPU s | published s | predicted s | error |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['source']} (efficiency {r['efficiency']:.2f}) | {r['method']} | {r['gpus']} | {r['one_gpu_s']} | "
              f"{r['published_s']} | {r['predicted_s']} | {r['error'] * 100:+.0f} % |")
    within = sum(abs(r["error"]) <= 0.2 for r in table)
    print(f"\n{within} of {len(table)} published multi-GPU results within 20 %")
    print("\n2 x RTX 4090 over PCIe, Flux.1-dev 1024 (per step):")
    for r in consumer_pcie():
        print(f"  {r['layout']}: {r['step_s'] * 1e3:.0f} ms (communication {r['comm_s'] * 1e3:.0f} ms), "
              f"{r['speedup']:.2f}x one GPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
