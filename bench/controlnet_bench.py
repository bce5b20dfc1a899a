"""One sampling step of a Flux-shaped model with a Flux ControlNet, three ways side by side in one run.

A scenario of the ``controlnet`` suite times one step (the ControlNet's forward, then the
transformer's ``_forward`` with the ControlNet's residuals as ``control``) in three ways:

1. ``unsharded``: both models in this process, on one rank's threads;
2. ``rank0_controlnet``: what the pack did before the ControlNet had a plan: the ControlNet computed
   unsharded on rank 0 (one rank's threads) while the other ranks wait, then the transformer sharded
   under the scenario's mesh, the residuals passed whole as ``control`` (the Flux plan cuts them);
3. ``sharded_controlnet``: the ControlNet itself run through ``world.forward`` with
   ``plans.flux.CONTROLNET`` under the same mesh (its residuals come back whole on rank 0), then the
   transformer as in 2.

The ControlNet is ComfyUI's ``ControlNetFlux`` in XLabs' layout (an image hint through its conv
block, which runs whole on every rank: it comes before the plan cuts the tokens) or InstantX's (a
latent hint), called as ``ControlNet.get_control`` calls it (``x, hint, timesteps, context, y, guidance``
by keyword), and its output goes through ComfyUI's own ``ControlBase.control_merge`` (strength
applied once per shared tensor; lists of 19 ``input`` and 38 ``output`` residuals, the ControlNet's
few blocks repeated) before it reaches the transformer, as in a ComfyUI run. One world serves both
sharded ways; the ways take turns, round after round, so that a shared machine's slow moments fall
on all of them alike. Each way's step output is compared with the unsharded one (fp32, max abs).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time

WAYS = ("unsharded", "rank0_controlnet", "sharded_controlnet")
WAY_TITLES = {"unsharded": "1. unsharded (one process)",
              "rank0_controlnet": "2. ControlNet on rank 0 only, transformer sharded",
              "sharded_controlnet": "3. ControlNet sharded, transformer sharded"}


def build_flux_controlnet(shape, double: int, single: int, latent_input: bool = False, seed: int = 41, device="cpu"):
    """ComfyUI's ``ControlNetFlux`` of the transformer's width, heads and embedders, with ``double`` +
    ``single`` blocks (tools/tiny_families.py's builder, larger), no union modes. XLabs' layout (an image
    hint through its conv block, every step), or with ``latent_input`` InstantX's as
    ``load_controlnet_flux_instantx`` builds it (a 16-channel latent hint: a linear on its patches)."""
    import torch

    import comfy.ldm.flux.controlnet
    import comfy.ldm.flux.model
    import comfy.ops
    from scenarios import _seeded
    from tiny_models import make

    config = dict(in_channels=16, out_channels=16, vec_in_dim=shape.vec_dim, context_in_dim=shape.context_dim,
                  hidden_size=shape.hidden, mlp_ratio=4.0, num_heads=shape.heads, depth=double,
                  depth_single_blocks=single, axes_dim=shape.axes_dim, theta=10000, qkv_bias=True,
                  guidance_embed=True, patch_size=2)
    if "txt_ids_dims" in {f.name for f in dataclasses.fields(comfy.ldm.flux.model.FluxParams)}:  # 0.33 on
        config["txt_ids_dims"] = []
    if latent_input:
        config.update(latent_input=True, control_latent_channels=16)
    model = make(comfy.ldm.flux.controlnet.ControlNetFlux, image_model="flux", dtype=torch.float32, device="cpu",
                 operations=comfy.ops.disable_weight_init, **config)
    return _seeded(model, seed).to(device)


def _tensors(control: dict) -> list:
    return [t for key in ("input", "middle", "output") for t in control.get(key) or () if t is not None]


def control_error(control, reference) -> float:
    """Max abs over every residual of two merged controls (same structure)."""
    errs = [(a.float() - b.float()).abs().max().item()
            for key in ("input", "middle", "output")
            for a, b in zip(control.get(key) or (), reference.get(key) or ()) if a is not None]
    return max(errs) if errs else 0.0


def run_controlnet_scenario(scenario, device: str, threads: int, repeat: int | None) -> dict:
    import torch

    import comfy.controlnet
    from measure import Timer, count_comm_bytes
    from parallel_runtime import plans
    from parallel_runtime.world.runtime import Runtime
    from run import mesh_config
    from scenarios import scenario_call

    started_run = time.perf_counter()
    load_start = os.getloadavg()
    extra = scenario.extra
    rounds = repeat or scenario.repeat
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    timer = Timer(dev)
    model, args, kwargs = scenario.build(0, scenario.batch, dev)
    plan, method, _ = scenario_call(scenario, model)
    shape = extra["shape"]
    latent_input = extra.get("latent_input", False)
    control_model = build_flux_controlnet(shape, extra["double"], extra["single"], latent_input, device=dev)
    control_plan = plans.flux.CONTROLNET
    x, t, context = args
    gen = torch.Generator().manual_seed(7)
    if latent_input:  # InstantX: the control image VAE-encoded once (compression_ratio 1), a latent like x
        hint = torch.randn(x.shape, generator=gen).to(dev)
    else:  # XLabs: the control image at the latent's 8x (compression_ratio 8), in [0, 1] as ComfyUI's images
        hint = torch.rand(x.shape[0], 3, x.shape[2] * 8, x.shape[3] * 8, generator=gen).to(dev)
    control_kwargs = {"x": x, "hint": hint, "timesteps": t, "context": context, **kwargs}  # y, guidance
    control_forward = type(control_model).forward.__get__(control_model)
    saved_threads = torch.get_num_threads()

    def merged(control: dict) -> dict:
        # ComfyUI's own merge: strength once per shared tensor, dict of lists (input / middle / output).
        merger = comfy.controlnet.ControlBase()
        merger.strength = extra["strength"]
        return merger.control_merge(control, None, None)

    def on_one_rank(fn):
        torch.set_num_threads(threads if device == "cpu" else saved_threads)
        try:
            return fn()
        finally:
            torch.set_num_threads(saved_threads)

    def controlnet_here():  # ways 1 and 2: the ControlNet in this process, on one rank's threads
        return merged(on_one_rank(lambda: control_model(**control_kwargs)))

    def transformer_here(control):
        return on_one_rank(lambda: method(*args, **kwargs, control=control, transformer_options={}))

    if device == "cpu":
        os.environ["PARALLEL_CPU_THREADS_PER_RANK"] = str(threads)
    runtime = Runtime()
    samples = {w: {"step": [], "controlnet": [], "transformer": []} for w in WAYS}
    # rank 0's input broadcast of each sharded forward (the flat copy of the inputs and its send)
    broadcast = {w: {"controlnet": [], "transformer": []} for w in WAYS}
    outputs, controls, comm = {}, {}, {}
    try:
        world = runtime.world_for(mesh_config(scenario, device))

        def controlnet_sharded():
            return merged(world.forward(control_model, control_plan, control_forward, (), dict(control_kwargs)))

        def transformer_sharded(control):
            return world.forward(model, plan, method, args, {**kwargs, "control": control, "transformer_options": {}})

        steps = {"unsharded": (controlnet_here, transformer_here),
                 "rank0_controlnet": (controlnet_here, transformer_sharded),
                 "sharded_controlnet": (controlnet_sharded, transformer_sharded)}
        with torch.inference_mode():
            # Warm-up: every way once (the sharded ones send both models' weights), and the transformer
            # without control, to show that the ControlNet changes the step.
            for way in WAYS:
                cn, tr = steps[way]
                tr(cn())
            without_control = transformer_here(None)
            for _ in range(rounds):
                for way in WAYS:
                    cn, tr = steps[way]
                    with count_comm_bytes() as cn_comm:
                        cn_ms, control = timer.time_ms(cn)
                    if cn is controlnet_sharded:
                        broadcast[way]["controlnet"].append(world.last_dispatch["broadcast_ms"])
                    with count_comm_bytes() as tr_comm:
                        tr_ms, out = timer.time_ms(lambda: tr(control))
                    if tr is transformer_sharded:
                        broadcast[way]["transformer"].append(world.last_dispatch["broadcast_ms"])
                    samples[way]["controlnet"].append(cn_ms)
                    samples[way]["transformer"].append(tr_ms)
                    samples[way]["step"].append(cn_ms + tr_ms)
                    outputs[way], controls[way] = out.float().cpu(), control
                    comm[way] = {"controlnet": dict(cn_comm), "transformer": dict(tr_comm)}
        status = world.status()
    finally:
        runtime.shutdown("benchmark done")
        os.environ.pop("PARALLEL_CPU_THREADS_PER_RANK", None)

    reference = outputs["unsharded"]
    med = {w: {k: statistics.median(v) for k, v in s.items()} for w, s in samples.items()}
    ways = []
    for way in WAYS:
        ways.append({
            "way": way, "title": WAY_TITLES[way], "world_size": 1 if way == "unsharded" else scenario.world_size,
            "step_ms_median": round(med[way]["step"], 1),
            "controlnet_ms_median": round(med[way]["controlnet"], 1),
            "transformer_ms_median": round(med[way]["transformer"], 1),
            "step_ms_all": [round(v, 1) for v in samples[way]["step"]],
            "controlnet_ms_all": [round(v, 1) for v in samples[way]["controlnet"]],
            "transformer_ms_all": [round(v, 1) for v in samples[way]["transformer"]],
            "max_abs_err_vs_unsharded": (outputs[way] - reference).abs().max().item(),
            "residual_max_abs_err_vs_unsharded": control_error(controls[way], controls["unsharded"]),
            "input_broadcast_ms_median": {part: round(statistics.median(v), 1) if v else None
                                          for part, v in broadcast[way].items()},
            "comm_bytes_rank0": {part: c["bytes"] for part, c in comm[way].items()},
            "collective_calls_rank0": {part: c["calls"] for part, c in comm[way].items()},
        })
    by = {w["way"]: w for w in ways}
    control = controls["unsharded"]
    residuals = _tensors(control)
    unique = {id(r): r for r in residuals}.values()
    return {
        "scenario": scenario.name, "family": scenario.family, "mode": "controlnet",
        "mesh": {d: scenario.mesh.get(d, 1) for d in ("cfg", "ring", "ulysses", "tp")},
        "world_size": scenario.world_size, "device": device, "threads_per_rank": threads if device == "cpu" else None,
        "tokens": scenario.tokens, "batch": scenario.batch, "rounds": rounds,
        "transformer_shape": {**dataclasses.asdict(shape), "params": sum(p.numel() for p in model.parameters())},
        "controlnet_shape": {"class": "comfy.ldm.flux.controlnet.ControlNetFlux", "layout": "InstantX layout, latent hint" if latent_input else "XLabs layout, image hint",
                             "double": extra["double"], "single": extra["single"], "hidden": shape.hidden,
                             "heads": shape.heads, "hint": list(hint.shape), "strength": extra["strength"],
                             "params": sum(p.numel() for p in control_model.parameters())},
        "controlnet_ways": ways,
        "speedup_sharded_over_rank0": round(med["rank0_controlnet"]["step"] / med["sharded_controlnet"]["step"], 3),
        "controlnet_speedup_sharded_over_rank0": round(
            med["rank0_controlnet"]["controlnet"] / med["sharded_controlnet"]["controlnet"], 3),
        "controlnet_share_unsharded": round(med["unsharded"]["controlnet"] / med["unsharded"]["step"], 3),
        # How much the residuals move the step (unsharded, with against without control): the scale of the errors.
        "control_effect_max_abs": (reference - without_control.float().cpu()).abs().max().item(),
        "output_max_abs": reference.abs().max().item(),
        # The merged control as the transformer receives it: list entries, and distinct tensors among them.
        "control_entries": {k: len(control.get(k) or ()) for k in ("input", "middle", "output")},
        "control_bytes_entries": sum(r.numel() * r.element_size() for r in residuals),
        "control_bytes_distinct": sum(r.numel() * r.element_size() for r in unique),
        "forwards_per_rank": [r["forwards"] for r in status["ranks"]],
        "param_bytes_per_rank": [r["param_bytes"] for r in status["ranks"]],
        "comfyui": _comfyui_version(),
        "load_average_start": [round(v, 2) for v in load_start],
        "load_average_end": [round(v, 2) for v in os.getloadavg()],
        "run_s": round(time.perf_counter() - started_run, 1),
        "notes": scenario.notes, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "step_ms_median": by["sharded_controlnet"]["step_ms_median"],
    }


def _comfyui_version() -> str | None:
    try:
        import comfyui_version

        return comfyui_version.__version__
    except ImportError:
        return None


def host(rec: dict) -> str:
    """The machine in words: its cores, and whether other work loaded them (1-minute load average at the
    start or the end of the run at least half the cores)."""
    m = rec.get("machine") or {}
    n = m.get("cpu_count") or 0
    start, end = (rec.get("load_average_start") or [0])[0], (rec.get("load_average_end") or [0])[0]
    loaded = max(start, end) >= n / 2
    gpus = f" of an {', '.join(m['gpus'])} machine (GPU unused)" if m.get("gpus") else ""
    return (f"{n} {'shared cores, loaded' if loaded else 'cores, otherwise idle'}{gpus}, load {start:.1f} to "
            f"{end:.1f}, torch {m.get('torch', '?').split('+')[0]}")


def _ms(w: dict) -> str:
    return (f"{w['step_ms_median']:.0f} ({w['controlnet_ms_median']:.0f} + {w['transformer_ms_median']:.0f})")


def controlnet_table(records: list[dict]) -> str:
    """Markdown: what every record shares, then one row per record (run and scenario): each way's median
    step (ControlNet + transformer), the speedup of 3 over 2, the errors."""
    first = records[0]
    tr = first["transformer_shape"]
    out = [
        f"One sampling step (ControlNet forward + transformer forward), {first['threads_per_rank']} thread per rank, "
        f"ComfyUI {first.get('comfyui') or '?'}, medians of {first['rounds']} rounds taken in turn; ms as step "
        f"(ControlNet + transformer), each part's own median. Transformer: Flux-shaped, {tr['double']} double + "
        f"{tr['single']} single blocks, width {tr['hidden']}, {first['tokens']} tokens. ControlNet: ControlNetFlux, "
        f"{first['controlnet_shape']['double']} double + {first['controlnet_shape']['single']} single blocks of the "
        f"same width. 1: unsharded; 2: the ControlNet on rank 0 only, the transformer under Ulysses 2; 3: both "
        f"under Ulysses 2. Errors: the step's output against 1 (fp32).",
        "",
        "| date | machine | ControlNet | 1. unsharded | 2. rank 0 only | 3. sharded | **3 over 2** | ControlNet part, "
        "3 over 2 | ControlNet share of 1 | err 2 / 3 | input broadcast of the transformer, 2 / 3 |",
        "|" + "---|" * 11,
    ]
    for rec in records:
        by = {w["way"]: w for w in rec["controlnet_ways"]}
        one, two, three = by["unsharded"], by["rank0_controlnet"], by["sharded_controlnet"]
        casts = [(w.get("input_broadcast_ms_median") or {}).get("transformer") for w in (two, three)]
        cast = "-" if None in casts else f"{casts[0]:.0f} / {casts[1]:.0f} ms"
        out.append(
            f"| {rec['time'][:10]} {rec['time'][11:16]} | {host(rec)} | {rec['controlnet_shape']['layout']} | "
            f"{_ms(one)} | {_ms(two)} | {_ms(three)} | **{rec['speedup_sharded_over_rank0']:.3f}x** | "
            f"{rec['controlnet_speedup_sharded_over_rank0']:.2f}x | {rec['controlnet_share_unsharded'] * 100:.0f} % | "
            f"{two['max_abs_err_vs_unsharded']:.1e} / {three['max_abs_err_vs_unsharded']:.1e} | {cast} |")
    out += ["", f"The residuals move the unsharded step's output by up to {first['control_effect_max_abs']:.2g} (its "
            f"max abs {first['output_max_abs']:.2g}). The sharded ControlNet's residuals equal the unsharded ones to "
            f"{max(max(w['residual_max_abs_err_vs_unsharded'] for w in r['controlnet_ways']) for r in records):.1e}. "
            f"The transformer's sharded forward receives the control dict's {sum(first['control_entries'].values())} "
            f"entries ({first['control_bytes_entries'] / 2**20:.0f} MiB; {first['control_bytes_distinct'] / 2**20:.0f} "
            f"MiB of distinct tensors) in rank 0's input broadcast."]
    return "\n".join(out) + "\n"
