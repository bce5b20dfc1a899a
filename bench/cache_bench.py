"""Block Cache against no cache, unsharded and under the scenario's mesh, side by side in one run.

A scenario of the ``cache`` suite samples its model end to end (a flow-matching Euler loop of
``steps`` steps from the same noise, then ComfyUI's latent-to-RGB preview decode) in four ways:
unsharded uncached, unsharded with Block Cache at each of ``thresholds``, on the mesh uncached, and
on the mesh with Block Cache at each threshold. One world serves every sharded run; the runs take
turns, round after round (``repeat`` rounds), so that a shared machine's slow moments fall on all of
them alike. Each cached run is compared with its uncached twin (same world size): max abs of the
final latent and of the decoded image, and the image's PSNR (peak 1). The record holds the medians
over the rounds.

Block Cache runs as in ComfyUI: its settings in ``transformer_options`` with the step's ``sigmas``
and the run's ``sample_sigmas``; unsharded under ``parallel.block_cache.cached_blocks``, sharded in
every rank's forward (``parallel.execution``).
"""
from __future__ import annotations

import math
import os
import statistics
import time


def preview_decode(latent, factors, bias):
    """ComfyUI's latent-to-RGB preview (``Latent2RGBPreviewer``): channels -> RGB by the latent format's
    linear factors, mapped from [-1, 1] to [0, 1]. Video latents: every frame."""
    import torch

    f = torch.tensor(factors, dtype=latent.dtype)
    b = torch.tensor(bias, dtype=latent.dtype) if bias is not None else torch.zeros(3, dtype=latent.dtype)
    rgb = torch.einsum("bc...,cr->br...", latent, f) + b.view(1, 3, *([1] * (latent.ndim - 2)))
    return ((rgb + 1.0) / 2.0).clamp(0.0, 1.0)


def decode(latent, fmt):
    """``preview_decode`` with the latent format's factors."""
    return preview_decode(latent, fmt.latent_rgb_factors, getattr(fmt, "latent_rgb_factors_bias", None))


def psnr(image, reference) -> float:
    mse = (image.double() - reference.double()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10.0 * math.log10(1.0 / mse)


def run_cache_scenario(scenario, device: str, threads: int, repeat: int | None) -> dict:
    import torch

    import comfy.latent_formats
    from measure import Timer
    from parallel_runtime.parallel import block_cache
    from parallel_runtime.parallel.block_cache import OPTION, BlockCacheSettings, cached_blocks
    from parallel_runtime.world.runtime import Runtime
    from run import mesh_config
    from scenarios import scenario_call

    extra = scenario.extra
    rounds = repeat or scenario.repeat
    steps, thresholds = extra["steps"], tuple(extra["thresholds"])
    base = dict(front_blocks=extra.get("front_blocks", 1), back_blocks=extra.get("back_blocks", 0),
                warmup_steps=extra.get("warmup_steps", 2), max_cached_steps=extra.get("max_cached_steps", 3))
    settings = {t: BlockCacheSettings(threshold=t, **base).as_option() for t in thresholds}
    fmt = getattr(comfy.latent_formats, extra["latent_format"])()
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    timer = Timer(dev)
    model, args, kwargs = scenario.build(0, scenario.batch, dev)
    plan, method, _ = scenario_call(scenario, model)
    noise, _, context = args
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    scale = extra.get("timestep_scale", 1.0)  # the model's timestep per sigma (Flux 1, Wan 1000)
    saved_threads = torch.get_num_threads()

    def sample(forward, option) -> tuple[torch.Tensor, list[float], int]:
        """The final latent, each step's ms and the steps Block Cache cached (rank 0's outcome of each
        forward: every rank follows rank 0's decision)."""
        x, step_ms, cached = noise.clone(), [], 0
        for i in range(steps):
            options = {"sigmas": sigmas[i:i + 1].to(dev), "sample_sigmas": sigmas.to(dev)}
            if option is not None:
                options[OPTION] = option
            t = torch.full((noise.shape[0],), float(sigmas[i]) * scale, device=dev)
            ms, out = timer.time_ms(lambda: forward((x, t, context), {**kwargs, "transformer_options": options}))
            step_ms.append(ms)
            cached += bool(block_cache.last_outcome().get("cached"))
            x = x + (sigmas[i + 1] - sigmas[i]).to(dev) * out.to(x.dtype)
        return x, step_ms, cached

    def one_rank(call_args, call_kwargs):
        torch.set_num_threads(threads if device == "cpu" else saved_threads)
        try:
            with cached_blocks(model, plan, call_kwargs["transformer_options"]):
                return method(*call_args, **call_kwargs)
        finally:
            torch.set_num_threads(saved_threads)

    variants = [("world1", None)] + [("world1", t) for t in thresholds] + [("mesh", None)] + \
               [("mesh", t) for t in thresholds]
    if device == "cpu":
        os.environ["PARALLEL_CPU_THREADS_PER_RANK"] = str(threads)
    runtime = Runtime()
    samples = {v: {"e2e": [], "steps": []} for v in variants}
    outputs, cached_counts = {}, {}
    try:
        world = runtime.world_for(mesh_config(scenario, device))
        runners = {"world1": one_rank,
                   "mesh": lambda a, k: world.forward(model, plan, method, a, k)}
        with torch.inference_mode():
            runners["mesh"](args, {**kwargs, "transformer_options": {}})  # sends the weights
            for _ in range(rounds):
                for where, threshold in variants:
                    started = time.perf_counter()
                    block_cache.last_outcome()
                    latent, step_ms, cached = sample(runners[where], settings.get(threshold))
                    image = decode(latent.float().cpu(), fmt)
                    samples[where, threshold]["e2e"].append((time.perf_counter() - started) * 1e3)
                    samples[where, threshold]["steps"].extend(step_ms)
                    outputs[where, threshold] = latent.float().cpu(), image
                    cached_counts[where, threshold] = cached
        status = world.status()
    finally:
        runtime.shutdown("benchmark done")
        os.environ.pop("PARALLEL_CPU_THREADS_PER_RANK", None)

    rows = []
    for where, threshold in variants:
        s = samples[where, threshold]
        latent, image = outputs[where, threshold]
        twin_latent, twin_image = outputs[where, None]
        rows.append({
            "where": where, "world_size": 1 if where == "world1" else scenario.world_size,
            "threshold": threshold, "cached": threshold is not None,
            "e2e_ms_median": round(statistics.median(s["e2e"]), 1), "e2e_ms_all": [round(v, 1) for v in s["e2e"]],
            "step_ms_median": round(statistics.median(s["steps"]), 1),
            "step_ms_mean": round(statistics.fmean(s["steps"]), 1),
            "cached_steps": cached_counts[where, threshold] if threshold is not None else 0,
            "latent_max_abs_err": (latent - twin_latent).abs().max().item(),
            "image_max_abs_err": (image - twin_image).abs().max().item(),
            "image_psnr_db": None if threshold is None else round(psnr(image, twin_image), 2),
        })
    by = {(r["where"], r["threshold"]): r for r in rows}
    for r in rows:
        twin = by[r["where"], None]
        r["speedup_vs_uncached"] = round(twin["e2e_ms_median"] / r["e2e_ms_median"], 3)
        r["speedup_vs_world1_uncached"] = round(by["world1", None]["e2e_ms_median"] / r["e2e_ms_median"], 3)
        # the sharded run against the unsharded one with the same cache settings (exactness)
        r["max_abs_err_vs_world1"] = (outputs[r["where"], r["threshold"]][0]
                                      - outputs["world1", r["threshold"]][0]).abs().max().item()
    model_part = (outputs["world1", None][0] - noise.float().cpu()).abs().max().item()
    dbcache = dbcache_rows(scenario, base, thresholds, steps, threads, rounds, outputs, fmt) \
        if extra.get("dbcache_shape") is not None and device == "cpu" else None
    return {
        "scenario": scenario.name, "family": scenario.family, "mode": "cache",
        "mesh": {d: scenario.mesh.get(d, 1) for d in ("cfg", "ring", "ulysses", "tp")},
        "world_size": scenario.world_size, "device": device, "threads_per_rank": threads if device == "cpu" else None,
        "tokens": scenario.tokens, "batch": scenario.batch, "steps": steps, "rounds": rounds,
        "cache_settings": base, "latent_format": extra["latent_format"],
        "denoised_max_abs": model_part,  # how far sampling moved the latent from its noise (the scale of the errors)
        "cache_variants": rows, "forwards_per_rank": [r["forwards"] for r in status["ranks"]],
        "dbcache": dbcache,
        "notes": scenario.notes, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def dbcache_rows(scenario, base: dict, thresholds, steps: int, threads: int, rounds: int, outputs: dict,
                 fmt) -> dict:
    """cache-dit's DBCache beside Block Cache: the same Flux (converted to diffusers' model, as
    ``--peers`` does), the same Fn / Bn / warm-up / cap and thresholds, sampled the same way at world
    size 1 and with cache-dit's Ulysses on the scenario's world size, in processes of its own after
    this scenario's runs. Per variant: times, cache-dit's cached count, PSNR and max abs of the preview
    image against its own uncached twin, and its latent against this pack's at the same threshold."""
    import peers

    world = scenario.world_size
    result = peers.run_dbcache(scenario.extra["dbcache_shape"], thresholds, steps, threads, rounds,
                               fn=base["front_blocks"], bn=base["back_blocks"], warmup=base["warmup_steps"],
                               max_continuous=base["max_cached_steps"], world=world)
    if result.get("failure"):
        return {"failure": result["failure"]}
    rows = []
    for where in ("world1", "mesh"):
        variants = result[where]["variants"]
        twin = variants[0]
        twin_image = decode(twin["latent"], fmt)
        for v in variants:
            image = decode(v["latent"], fmt)
            ours = outputs[where, v["threshold"]][0]
            rows.append({
                "where": where, "world_size": 1 if where == "world1" else world, "threshold": v["threshold"],
                "cached": v["threshold"] is not None, "cached_steps": v["cached_steps"],
                "e2e_ms_median": v["e2e_ms_median"], "e2e_ms_all": v["e2e_ms_all"], "step_ms_median": v["step_ms_median"],
                "speedup_vs_uncached": round(twin["e2e_ms_median"] / v["e2e_ms_median"], 3),
                "latent_max_abs_err": (v["latent"] - twin["latent"]).abs().max().item(),
                "image_max_abs_err": (image - twin_image).abs().max().item(),
                "image_psnr_db": None if v["threshold"] is None else round(psnr(image, twin_image), 2),
                # the same network in both systems: uncached, the latents agree to rounding; cached, they
                # differ where the two take different decisions
                "latent_max_abs_vs_pack": (v["latent"] - ours).abs().max().item(),
            })
    return {"system": f"cache-dit {result['cache_dit']}", "conversion_max_abs_err": result["conversion_max_abs_err"],
            "variants": rows}


def cache_table(records: list[dict]) -> str:
    """Markdown: one row per model, layout and threshold."""
    head = ("| scenario | layout | threshold | cached steps | step ms (median) | end to end ms (median) | "
            "vs uncached, same layout | vs unsharded uncached | image PSNR vs uncached | image max abs | "
            "latent max abs | vs unsharded, same cache |")
    rows = [head, "|" + "---|" * 12]
    for rec in records:
        for r in rec["cache_variants"]:
            layout = "unsharded" if r["where"] == "world1" else " x ".join(
                f"{k} {v}" for k, v in rec["mesh"].items() if v > 1)
            psnr_cell = "-" if r["image_psnr_db"] is None else f"{r['image_psnr_db']:.1f} dB"
            rows.append(
                f"| {rec['scenario']} | {layout} | {r['threshold'] if r['cached'] else 'no cache'} | "
                f"{r['cached_steps']}/{rec['steps']} | {r['step_ms_median']:.0f} | {r['e2e_ms_median']:.0f} | "
                f"{r['speedup_vs_uncached']:.2f}x | {r['speedup_vs_world1_uncached']:.2f}x | {psnr_cell} | "
                f"{r['image_max_abs_err']:.1e} | {r['latent_max_abs_err']:.1e} | {r['max_abs_err_vs_world1']:.1e} |")
    return "\n".join(rows)


def dbcache_table(records: list[dict]) -> str:
    """Markdown: Block Cache and cache-dit's DBCache side by side, per model, layout and threshold (the
    records that ran the comparison)."""
    head = ("| scenario | layout | threshold | Block Cache: cached, end to end ms, vs uncached, PSNR | "
            "DBCache: cached, end to end ms, vs uncached, PSNR | DBCache's end to end / Block Cache's | "
            "latents apart (max abs) |")
    rows = [head, "|" + "---|" * 7]
    for rec in records:
        theirs = rec.get("dbcache") or {}
        if not theirs.get("variants"):
            continue
        ours = {(r["where"], r["threshold"]): r for r in rec["cache_variants"]}
        for t in theirs["variants"]:
            r = ours[t["where"], t["threshold"]]
            layout = "unsharded" if t["where"] == "world1" else " x ".join(
                f"{k} {v}" for k, v in rec["mesh"].items() if v > 1)

            def cell(x):
                psnr_text = "-" if x["image_psnr_db"] is None else f"{x['image_psnr_db']:.1f} dB"
                return (f"{x['cached_steps']}/{rec['steps']}, {x['e2e_ms_median']:.0f}, "
                        f"{x['speedup_vs_uncached']:.2f}x, {psnr_text}")
            rows.append(f"| {rec['scenario']} | {layout} | {t['threshold'] if t['cached'] else 'no cache'} | "
                        f"{cell(r)} | {cell(t)} | {t['e2e_ms_median'] / r['e2e_ms_median']:.2f}x | "
                        f"{t['latent_max_abs_vs_pack']:.1e} |")
    return "\n".join(rows) if len(rows) > 2 else ""
