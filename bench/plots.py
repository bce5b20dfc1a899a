"""Pictures and a Markdown table from benchmark records (JSON lines).

    tools/run.sh python bench/plots.py bench/results bench/results/latest.jsonl [more.jsonl ...]

Writes speedup.png (speedup against world size, per mode, with the ideal line),
memory.png (weights and peak RSS of the largest rank, per scenario), table.md and
comparison.md (this pack against the peers, per round) from the records of all the files;
cache.md and cache.png from the ``cache`` suite's records (bench/cache_bench.py); controlnet.md from
the ``controlnet`` suite's (bench/controlnet_bench.py); <file>.png from the ``load`` suite's record in
<file>.json (bench/load.py) or <file>.jsonl (run.py --suite load).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import median


def load(path: Path) -> list[dict]:
    """The records of a JSON-lines file, or of a .json file holding one record (bench/load.py's) or a list."""
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        return data if isinstance(data, list) else [data]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mb(b) -> str:
    return "-" if b in (None, 0) else f"{b / 2**20:.0f} MB"


def step_peak(record: dict) -> str:
    """Memory one step adds on the largest rank, above what the rank held before it (and the same
    for the model on one rank): activations and workspace, measured by the kernel's high-water mark."""
    peaks = [p for p in record.get("activation_peak_bytes_per_rank") or [] if p is not None]
    if not peaks:
        return "-"
    return f"{_mb(max(peaks))} ({_mb(record.get('activation_peak_bytes_world1'))})"


def table(records: list[dict]) -> str:
    head = ("| scenario | mode | mesh | world | tokens | step ms (min-max) | one rank ms | speedup | efficiency | "
            "weights/rank | peak RSS/rank | step peak/rank (one rank) | comm/step | max abs err |")
    rule = "|" + "---|" * 14
    rows = [head, rule]
    for r in records:
        name = r["scenario"] + (f" (round {r['round']})" if r.get("round") else "")
        mesh = " x ".join(f"{k}{v}" for k, v in (r.get("mesh") or {}).items() if v and v > 1) or "-"
        if r.get("failure"):
            rows.append(f"| {name} | {r['mode']} | {mesh} | {r.get('world_size')} | {r.get('tokens')} | "
                        f"failed: {' '.join(r['failure'].split())[:100]} | | | | | | | | |")
            continue
        mb = _mb
        rows.append(
            f"| {name} | {r['mode']} | {mesh} | {r['world_size']} | {r['tokens']} | "
            f"{r['step_ms_median']:.0f} ({r['step_ms_min']:.0f}-{r['step_ms_max']:.0f}) | "
            f"{r['world1_ms_median']:.0f} | {r['speedup_vs_world1']:.2f}x | {r.get('parallel_efficiency', 0):.2f} | "
            f"{mb(r.get('param_bytes_per_rank_max'))} | {mb(r.get('rss_bytes_per_rank_max'))} | "
            f"{step_peak(r)} | {mb(r.get('comm_bytes_per_step'))} | {r['max_abs_err']:.1e} |")
    return "\n".join(rows)


def comparison(records: list[dict]) -> str:
    """Ours against the peers on the same Flux config: speedup per round and the median, and the
    sharded step itself (each side's world size 1 is its own model, so the speedups have
    different denominators)."""
    ours = "flux_ulysses2"
    runs: dict[str, dict] = {}
    for r in records:
        if (r["scenario"] == ours or r.get("peer")) and not r.get("failure"):
            name = r.get("peer") or "this pack"
            runs.setdefault(name, {})[r.get("round", 1)] = r
    if "this pack" not in runs:
        return "(no flux_ulysses2 record)"
    rounds = sorted({k for v in runs.values() for k in v})

    def med(by_round, key):
        return median([r[key] for r in by_round.values()])

    def faults(by_round):  # the world-1 step's page faults, round by round (records before 11-27 lack them)
        counts = [by_round[k].get("world1_minor_faults_median") if k in by_round else None for k in rounds]
        return " / ".join("?" if c is None else str(c) for c in counts)

    mine = med(runs["this pack"], "speedup_vs_world1")
    rows = ["| Ulysses 2, world size 2 vs 1 | " + " | ".join(f"round {k}" for k in rounds)
            + " | median speedup | ours / theirs | median world-1 step | median world-2 step "
            "| world-1 page faults a step, by round |",
            "|---|" + "---|" * (len(rounds) + 5)]
    for name, by_round in runs.items():
        speedup = med(by_round, "speedup_vs_world1")
        cells = " | ".join(f"{by_round[k]['speedup_vs_world1']:.2f}x" if k in by_round else "failed" for k in rounds)
        ratio = "" if name == "this pack" else f"{mine / speedup:.3f}"
        rows.append(f"| {name} | {cells} | {speedup:.2f}x | {ratio} | {med(by_round, 'world1_ms_median'):.0f} ms "
                    f"| {med(by_round, 'step_ms_median'):.0f} ms | {faults(by_round)} |")
    return "\n".join(rows)


def _suites_of_their_own(paths: list[Path], out_dir: Path) -> list[list[dict]]:
    """controlnet.md from the ``controlnet`` suite's records (a table only: no matplotlib needed),
    cache.md and cache.png from the ``cache`` suite's and, from the ``load`` suite's, a picture named
    after its file (one run a record: the file's last one stays); the other records of each file."""
    files = [load(path) for path in paths]
    controlnet = [r for records in files for r in records if r.get("controlnet_ways")]
    if controlnet:
        from controlnet_bench import controlnet_table

        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "controlnet.md").write_text(controlnet_table(controlnet))
    cached = [r for records in files for r in records if r.get("cache_variants")]
    if cached:
        plot_cache(cached, out_dir)
    for path, records in zip(paths, files):
        for record in [r for r in records if r.get("suite") == "load"]:
            plot_load(record, out_dir / f"{path.stem}.png")
    return [[r for r in records if not (r.get("controlnet_ways") or r.get("cache_variants") or r.get("suite") == "load")]
            for records in files]


def plot(records_paths: list[Path], out_dir: Path) -> None:
    files = _suites_of_their_own(records_paths, out_dir)
    if not any(files):
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = [r for records in files for r in records]
    records = [r for r in every if not r.get("failure")]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.md").write_text(table(every) + "\n")

    # Only files with peer records: a suite run's flux_ulysses2 was not measured beside the peers.
    side_by_side = [r for records in files if any(x.get("peer") for x in records) for r in records]
    (out_dir / "comparison.md").write_text(comparison(side_by_side) + "\n")

    fig, ax = plt.subplots(figsize=(6, 4))
    by_mode: dict[str, dict[int, list]] = {}
    for r in records:
        if r["world_size"] > 1:
            label = f"{r['family']} {r['mode']}" + (f" ({r['peer']})" if r.get("peer") else "")
            by_mode.setdefault(label, {}).setdefault(r["world_size"], []).append(r["speedup_vs_world1"])
    top = max([r["world_size"] for r in records] + [2])
    ax.plot([1, top], [1, top], "k--", linewidth=1, label="ideal")
    for label, by_world in sorted(by_mode.items()):
        points = [(1, 1.0)] + sorted((w, median(s)) for w, s in by_world.items())
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("speedup over one rank")
    ax.set_title("Sharded step against the same model on one rank")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "speedup.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    records = list({r["scenario"]: r for r in records}.values())  # memory barely varies: one per scenario
    names = [r["scenario"] for r in records]
    weights = [r.get("param_bytes_per_rank_max", 0) / 2**20 for r in records]
    rss = [(r.get("rss_bytes_per_rank_max") or 0) / 2**20 for r in records]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], weights, width=0.4, label="weights of the largest rank")
    ax.bar([x + 0.2 for x in xs], rss, width=0.4, label="peak RSS of the largest rank")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=40, ha="right", fontsize=7)
    ax.set_ylabel("MB")
    ax.set_title("Memory per rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "memory.png", dpi=120)
    plt.close(fig)


def plot_cache(records: list[dict], out_dir: Path) -> None:
    """cache.md (bench/cache_bench.py's table) and cache.png: end-to-end time per layout and threshold,
    with each cached run's PSNR against its uncached twin, one panel per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from cache_bench import cache_table, dbcache_table

    out_dir.mkdir(parents=True, exist_ok=True)
    beside = dbcache_table(records)
    (out_dir / "cache.md").write_text(cache_table(records) + "\n" + (
        "\nBlock Cache beside cache-dit's DBCache (same Flux, weights, noise, Fn / Bn / warm-up / cap and "
        "threshold; each against its own uncached run; cache-dit in processes of its own, in the same "
        "benchmark run):\n\n" + beside + "\n" if beside else ""))
    fig, axes = plt.subplots(1, len(records), figsize=(5.5 * len(records), 4), squeeze=False)
    for ax, rec in zip(axes[0], records):
        rows = rec["cache_variants"]
        labels = [f"{'1 rank' if r['where'] == 'world1' else 'Ulysses 2'}\n"
                  f"{'no cache' if not r['cached'] else r['threshold']}" for r in rows]
        bars = ax.bar(range(len(rows)), [r["e2e_ms_median"] / 1e3 for r in rows],
                      color=["tab:gray" if r["where"] == "world1" else "tab:blue" for r in rows])
        for bar, r in zip(bars, rows):
            if r["cached"]:
                ax.annotate(f"{r['image_psnr_db']:.0f} dB", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("end to end, s (median)")
        ax.set_title(f"{rec['scenario']}: {rec['steps']} steps", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "cache.png", dpi=120)
    plt.close(fig)


def _case_label(row: dict) -> str:
    layout = {"unsharded": "unsharded", "tp2": "TP 2", "ulysses2": "Ulysses 2", "ulysses2_tp2": "U2 x TP 2"}
    return "\n".join([layout.get(row["layout"], row["layout"])]
                     + (["stream"] if row.get("transport") == "process_group" else [])
                     + (["cold"] if row.get("cache") == "cold" else []))


def _load_times(ax, result: dict) -> None:
    rows, reads = result["rows"], result.get("reference_reads") or {}
    xs = range(len(rows))
    first = [r["first_step_s"] or 0 for r in rows]
    comfy = [min(r.get("comfyui_load_s") or 0, f) for r, f in zip(rows, first)]
    ax.bar(xs, comfy, color="tab:gray", label="ComfyUI loads the file (its UNETLoader)")
    ax.bar(xs, [f - c for f, c in zip(first, comfy)], bottom=comfy, color="tab:blue", label="then to the first step done")
    ax.bar(xs, [r["seconds"] - f for r, f in zip(rows, first)], bottom=first, color="tab:blue", alpha=0.35,
           label="rest of the prompt (the second step)")
    for key, style in (("warm_s", ":"), ("cold_s", "--")):
        if reads.get(key):
            ax.axhline(reads[key], color="k", linestyle=style, linewidth=1,
                       label=f"reading the file once, {key[:4]} ({reads[key]:.2f} s)")
    ax.set_ylabel("s from queueing the prompt")
    ax.set_title("First prompt on the model (2 steps)", fontsize=9)


def _load_memory(ax, result: dict) -> None:
    rows = result["rows"]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["growth"] / 1e9 for r in rows], width=0.4, label="after the prompt")
    ax.bar([x + 0.2 for x in xs], [r["peak_growth"] / 1e9 for r in rows], width=0.4, label="peak during it")
    ax.axhline(result["model_bytes"] / 1e9, color="k", linestyle=":", linewidth=1, label="the model file")
    ax.set_ylabel("GB")
    ax.set_title("Summed PSS growth of ComfyUI's process tree", fontsize=9)


def _load_bytes(ax, result: dict) -> None:
    rows = result["rows"]
    xs = range(len(rows))
    read = [sum(r["file_read_bytes"] or 0 for r in row["ranks"][1:]) / 1e9 for row in rows]
    got = [sum(r.get("received_bytes") or 0 for r in row["ranks"][1:]) / 1e9 for row in rows]
    stream = [row.get("transport") != "shared" for row in rows]
    ax.bar(xs, read, color="tab:green", label="read from the file by the workers")
    ax.bar(xs, [g if s else 0 for g, s in zip(got, stream)], bottom=read, color="tab:orange",
           label="received over the stream")
    ax.bar(xs, [0 if s else g for g, s in zip(got, stream)], bottom=read, color="tab:gray", hatch="//",
           label="mapped from rank 0's shared pages (no copy)")
    ax.set_ylim(0, max([r + g for r, g in zip(read, got)] + [0]) * 1.4 or 1)  # room for the legend
    ax.set_ylabel("GB, all workers")
    ax.set_title("How the workers got the weights", fontsize=9)


def _load_follow_ups(ax, result: dict) -> None:
    rows = [r for r in result["rows"] if r.get("lora")]
    names = ["two models, 1st", "two models, 2nd", f"LoRA {rows[0]['lora'][0]['strength'] if rows else ''}",
             f"LoRA to {rows[0]['lora'][1]['strength'] if rows else ''}"]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        runs = [(r["two_models"] + r["lora"])[i] for r in rows]
        bars = ax.bar([x + (i - 1.5) * width for x in range(len(rows))], [f["seconds"] for f in runs], width=width,
                      label=name)
        for bar, f in zip(bars, runs):
            ax.annotate(str(f["weight_sends"]), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=6)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([_case_label(r) for r in rows], fontsize=7)
    ax.set_ylabel("s (weight sends on top)")
    ax.set_title("Later prompts: two models in turn, a LoRA", fontsize=9)


def plot_load(result: dict, path: Path) -> None:
    """bench/load.py's record as a picture: the first prompt's times against reading the file once,
    the host memory growth, how the workers got their bytes, and the later prompts (with follow-ups)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    follow = any(r.get("lora") for r in result["rows"])
    fig, axes = plt.subplots(2, 2, figsize=(12, 8)) if follow else plt.subplots(1, 3, figsize=(15, 4))
    panels = [_load_times, _load_memory, _load_bytes] + ([_load_follow_ups] if follow else [])
    for ax, draw in zip(axes.flat, panels):
        draw(ax, result)
        if draw is not _load_follow_ups:
            ax.set_xticks(range(len(result["rows"])))
            ax.set_xticklabels([_case_label(r) for r in result["rows"]], fontsize=7)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"bench/load.py: a {result['model_bytes'] / 1e9:.1f} GB Wan-shaped model, ComfyUI "
                 f"{result.get('comfyui')}, load average {result['load_average_start'][0]} to "
                 f"{result['load_average_end'][0]}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    plot([Path(a) for a in sys.argv[2:]], Path(sys.argv[1]))
