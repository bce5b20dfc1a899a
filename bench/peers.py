"""Peer benchmark: cache-dit's and diffusers' Ulysses on the same Flux as ``flux_ulysses2``.

    bash bench/setup_peers.sh          # once: diffusers 0.42.x, cache-dit 1.5.3, einops, matplotlib
    tools/run.sh python bench/run.py --scenario flux_ulysses2 --peers --repeat 3 --out /tmp/peers.jsonl

The peers run diffusers' ``FluxTransformer2DModel``, not ComfyUI's Flux, so the
comparison is only fair if it is the same network with the same weights: this
module converts the scenario's ComfyUI weights to diffusers' layout (ComfyUI's own
``flux_to_diffusers`` key map, read backwards), checks on one process that both
models give the same output, and then times each peer at world size 1 and 2 in
fresh processes (``torch.distributed.run`` on ``peer_worker.py``, gloo over
loopback), so that neither peer shares a process, a thread pool or an allocator
with our runtime or with the other peer.

The records follow ``run.run_scenario``'s schema, plus ``peer``,
``conversion_max_abs_err`` and ``failure`` (the error text when a peer could not
run here; its timing fields are then null).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import scenarios  # bench/, beside this file
import torch

BENCH = Path(__file__).resolve().parent
WORKER = BENCH / "peer_worker.py"
BASE_SCENARIO = "flux_ulysses2"
WORLD_SIZE = 2
# A forward is about 6 s on one core; a hung collective should not hang the suite.
RUN_TIMEOUT_S = 1800
# Both are fp32 and compute the same ops in the same order up to kernel choice: ~1e-6 is expected.
CONVERSION_TOL = 1e-4


def _version(dist_name: str) -> str:
    try:
        return version(dist_name)
    except PackageNotFoundError:
        return "not installed"


PEERS = {
    # key: (scenario name, label); the worker knows how to parallelize each key.
    "cachedit": ("peer_cachedit_flux_ulysses2", f"cache-dit {_version('cache-dit')}"),
    "diffusers": ("peer_diffusers_flux_ulysses2", f"diffusers {_version('diffusers')}"),
}


# --- conversion -------------------------------------------------------------------------------

def diffusers_config(shape) -> dict:
    """``FluxTransformer2DModel`` kwargs for the network ``scenarios.build_flux(shape)`` builds."""
    return {
        # ComfyUI patchifies inside the model (2x2 patches of 16 channels); diffusers expects
        # the pipeline to have packed them already, so its patch size is 1 on 64 channels.
        "patch_size": 1, "in_channels": 16 * 2 * 2, "out_channels": None,
        "num_layers": shape.double, "num_single_layers": shape.single,
        "attention_head_dim": shape.hidden // shape.heads, "num_attention_heads": shape.heads,
        "joint_attention_dim": shape.context_dim, "pooled_projection_dim": shape.vec_dim,
        "guidance_embeds": True, "axes_dims_rope": tuple(shape.axes_dim),
    }


def comfy_to_diffusers(comfy_sd: dict[str, torch.Tensor], shape, diffusers_keys=None) -> dict[str, torch.Tensor]:
    """ComfyUI Flux weights -> diffusers ``FluxTransformer2DModel`` weights.

    ``comfy.utils.flux_to_diffusers`` maps each diffusers key to where ComfyUI keeps it:
    a key, a ``(key, (dim, start, length))`` slice of a fused qkv(+mlp) tensor, or
    ``(key, None, fn)`` for tensors stored in another order (``swap_scale_shift``, its own
    inverse). Entries for modules this model does not have (the ControlNet input) are skipped, and
    so, given ``diffusers_keys`` (the target model's keys), are the map's other names for a key
    (ComfyUI 0.33.0 also maps LyCoris' ``ff.linear_in`` and Flux 2's ``attn.to_qkv_mlp_proj`` to
    Flux 1's tensors); the caller's strict ``load_state_dict`` catches anything the map misses.
    """
    import comfy.utils

    key_map = comfy.utils.flux_to_diffusers(
        {"depth": shape.double, "depth_single_blocks": shape.single, "hidden_size": shape.hidden})
    out, used = {}, set()
    for diffusers_key, source in key_map.items():
        comfy_key = source if isinstance(source, str) else source[0]
        if comfy_key not in comfy_sd or (diffusers_keys is not None and diffusers_key not in diffusers_keys):
            continue
        tensor = comfy_sd[comfy_key]
        if isinstance(source, tuple) and source[1] is not None:
            dim, start, length = source[1]
            tensor = tensor.narrow(dim, start, length)
        elif isinstance(source, tuple) and len(source) > 2:
            tensor = source[2](tensor)
        out[diffusers_key] = tensor.detach().clone().contiguous()
        used.add(comfy_key)
    unused = sorted(set(comfy_sd) - used)
    if unused:
        raise ValueError(f"ComfyUI weights with no diffusers counterpart: {unused}")
    return out


def pack_latents(x: torch.Tensor, patch: int = 2) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/p * W/p, C*p*p), the token order of ComfyUI's ``process_img``."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


def unpack_latents(tokens: torch.Tensor, h: int, w: int, patch: int = 2) -> torch.Tensor:
    b, _, cpp = tokens.shape
    c = cpp // (patch * patch)
    x = tokens.reshape(b, h // patch, w // patch, c, patch, patch)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


def diffusers_inputs(x, t, context, y, guidance, axes: int = 3) -> dict:
    """The scenario's ``_forward`` inputs as ``FluxTransformer2DModel.forward`` kwargs.

    Position ids as ComfyUI builds them for a single image: axis 0 (the image index) 0,
    axis 1 the token's row, axis 2 its column; text ids all zero. diffusers wants them 2-D
    (one set for the whole batch). Both models scale timestep and guidance by 1000 inside.
    """
    _, _, h, w = x.shape
    rows, cols = h // 2, w // 2
    img_ids = torch.zeros(rows, cols, axes)
    img_ids[..., 1] = torch.arange(rows, dtype=torch.float32)[:, None]
    img_ids[..., 2] = torch.arange(cols, dtype=torch.float32)[None, :]
    return {
        "hidden_states": pack_latents(x), "encoder_hidden_states": context, "pooled_projections": y,
        "timestep": t, "img_ids": img_ids.reshape(rows * cols, axes),
        "txt_ids": torch.zeros(context.shape[1], axes), "guidance": guidance,
    }


def prepare_case(path: Path, seed: int = 0, shape=None) -> dict:
    """Build the scenario's model (``shape``: the Flux shape, ``scenarios.FLUX`` by default), convert
    it, check the conversion, save what workers need.

    Returns the conversion error and the model's parameter bytes, with ``failure`` set (and
    nothing saved) when the two models disagree.
    """
    from diffusers import FluxTransformer2DModel

    shape = shape or scenarios.FLUX
    comfy_model, (x, t, context), kwargs = scenarios.build_flux(shape, seed=seed, batch=1, device="cpu")
    config = diffusers_config(shape)
    model = FluxTransformer2DModel(**config).eval()
    model.load_state_dict(comfy_to_diffusers(comfy_model.state_dict(), shape, set(model.state_dict())),
                          strict=True)
    inputs = diffusers_inputs(x, t, context, kwargs["y"], kwargs["guidance"], axes=len(shape.axes_dim))

    with torch.inference_mode():
        want = comfy_model._forward(x, t, context, **kwargs, transformer_options={})
        got = model(**inputs, return_dict=False)[0]
    got = unpack_latents(got, x.shape[2], x.shape[3])
    err = (got - want).abs().max().item()
    facts = {"conversion_max_abs_err": err,
             "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    if not err <= CONVERSION_TOL:  # also catches NaN
        # Timing a network that is not ours would compare nothing.
        return {**facts, "failure": f"conversion: diffusers' output differs from ComfyUI's by {err:.3g} "
                                    f"(max abs, tolerance {CONVERSION_TOL})"}
    torch.save({"config": config, "state_dict": model.state_dict(), "inputs": inputs}, path)
    return facts


# --- launching --------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(peer: str, world: int, case: Path, threads: int, repeat: int, out: Path,
            save_output: Path | None = None, reference: Path | None = None, extra=()) -> dict:
    """Run ``peer_worker.py`` on ``world`` ranks; its rank-0 JSON, or ``{"failure": text}``."""
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(port),
           str(WORKER), "--peer", peer, "--case", str(case), "--threads", str(threads),
           "--repeat", str(repeat), "--out", str(out)]
    if save_output:
        cmd += ["--save-output", str(save_output)]
    if reference:
        cmd += ["--reference", str(reference)]
    cmd += list(extra)
    env = dict(os.environ)
    # torchrun would otherwise pin every rank to one thread; gloo stays on loopback.
    env.update({"OMP_NUM_THREADS": str(threads), "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
                "PYTHONPATH": os.pathsep.join(p for p in [str(BENCH), env.get("PYTHONPATH", "")] if p)})
    print(f"[peers]   {peer}: world size {world}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"failure": f"{peer} at world size {world}: no result after {RUN_TIMEOUT_S} s"}
    result = json.loads(out.read_text()) if out.exists() else {}
    if result.get("failure") or (result and proc.returncode == 0):
        return result
    if result:
        # Rank 0 finished measuring and wrote its result, then the run died on the way out
        # (seen with cache-dit on gloo: "terminate called without an active exception", SIGABRT).
        # The numbers stand; the record says what happened.
        result["exit_note"] = f"torchrun exited with code {proc.returncode} after rank 0 wrote its result"
        return result
    # No usable JSON: the worker died before writing one; its stderr is the best evidence, minus
    # torchrun's own failure summary (which only says that a rank exited).
    lines = (proc.stderr or "").strip().splitlines()
    summary = next((i for i, line in enumerate(lines) if line.startswith("Traceback") and i and
                    any("torch/distributed/run.py" in rest for rest in lines[i:i + 8])), len(lines))
    tail = "\n".join(lines[:summary][-25:])
    return {"failure": f"{peer} at world size {world}: exit code {proc.returncode}\n{tail}"}


def _record(peer: str, case: dict, threads: int, repeat: int, base: dict, par: dict) -> dict:
    scenario, label = PEERS[peer]
    failure = base.get("failure") or par.get("failure")
    record = {
        "scenario": scenario, "family": "flux", "mode": "ulysses",
        "mesh": {"cfg": 1, "ring": 1, "ulysses": WORLD_SIZE, "tp": 1},
        "world_size": WORLD_SIZE, "device": "cpu", "threads_per_rank": threads,
        "tokens": scenarios.FLUX.tokens, "batch": 1,
        "step_ms_median": None, "step_ms_min": None, "step_ms_max": None,
        "world1_ms_median": None, "world1_ms_min": None, "world1_ms_max": None,
        "speedup_vs_world1": None, "parallel_efficiency": None,
        "param_bytes_per_rank_max": case.get("param_bytes"),
        "rss_bytes_per_rank_max": None, "comm_bytes_per_step": None, "collective_calls_per_step": None,
        "max_abs_err": None, "repeat": repeat,
        "peer": label, "conversion_max_abs_err": case.get("conversion_max_abs_err"), "failure": failure,
        "notes": (f"same weights and inputs as {BASE_SCENARIO}, converted to diffusers' FluxTransformer2DModel; "
                  "world size 1 is the plain diffusers model (native attention) in its own process; "
                  "ranks launched by torch.distributed.run, gloo on loopback"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if failure:
        return record
    speedup = base["ms_median"] / par["ms_median"]
    record.update({
        "step_ms_median": round(par["ms_median"], 2), "step_ms_min": round(par["ms_min"], 2),
        "step_ms_max": round(par["ms_max"], 2),
        "world1_ms_median": round(base["ms_median"], 2), "world1_ms_min": round(base["ms_min"], 2),
        "world1_ms_max": round(base["ms_max"], 2),
        "speedup_vs_world1": round(speedup, 3), "parallel_efficiency": round(speedup / WORLD_SIZE, 3),
        "rss_bytes_per_rank_max": par.get("rss_bytes_per_rank_max"),
        "comm_bytes_per_step": par.get("comm_bytes_per_step"),
        "collective_calls_per_step": par.get("collective_calls_per_step"),
        "max_abs_err": par.get("max_abs_err"),
        "world1_minor_faults_median": (base.get("minor_faults_per_rank_median") or [None])[0],
        "minor_faults_per_rank_median": par.get("minor_faults_per_rank_median"),
    })
    notes = [n for n in (base.get("exit_note"), par.get("exit_note")) if n]
    if notes:
        record["exit_note"] = "; ".join(notes)
    return record


def run_peers(threads_per_rank: int, repeat: int, peers=tuple(PEERS)) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="peers_") as tmp:
        tmp = Path(tmp)
        case_path = tmp / "case.pt"
        print("[peers] converting the flux_ulysses2 model to diffusers and checking it", file=sys.stderr, flush=True)
        try:
            case = prepare_case(case_path)
        except Exception as exc:  # noqa: BLE001 - a record that says why beats a crashed suite
            case = {"failure": f"conversion: {type(exc).__name__}: {exc}"}
        print(f"[peers]   conversion max abs err {case.get('conversion_max_abs_err')}"
              + (f"; {case['failure']}" if case.get("failure") else ""), file=sys.stderr, flush=True)

        records = []
        for peer in peers:
            if case.get("failure"):
                records.append(_record(peer, case, threads_per_rank, repeat, case, case))
                continue
            load_before = os.getloadavg()[0]
            ref = tmp / f"{peer}_world1_out.pt"
            base = _launch(peer, 1, case_path, threads_per_rank, repeat, tmp / f"{peer}_1.json", save_output=ref)
            par = (_launch(peer, WORLD_SIZE, case_path, threads_per_rank, repeat, tmp / f"{peer}_{WORLD_SIZE}.json",
                           reference=ref) if not base.get("failure") else {})
            record = _record(peer, case, threads_per_rank, repeat, base, par)
            # The machine may be shared: a 1-minute load above the ranks' threads means the numbers
            # include someone else's work.
            record["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            record["cpu_per_wall"] = {"world1": base.get("cpu_per_wall"), f"world{WORLD_SIZE}": par.get("cpu_per_wall")}
            if record["failure"]:
                print(f"[peers]   {record['peer']} failed: {record['failure']}", file=sys.stderr, flush=True)
            else:
                print(f"[peers]   {record['peer']}: {record['step_ms_median']:.1f} ms vs {record['world1_ms_median']:.1f}"
                      f" ms on one rank: {record['speedup_vs_world1']:.2f}x, err {record['max_abs_err']:.1e}",
                      file=sys.stderr, flush=True)
            records.append(record)
        return records


# --- cache-dit's DBCache beside Block Cache (bench/cache_bench.py) -------------------------------

def run_dbcache(shape, thresholds, steps: int, threads: int, rounds: int, fn: int, bn: int, warmup: int,
                max_continuous: int, world: int = WORLD_SIZE) -> dict:
    """cache-dit's DBCache on the same Flux (``shape``, seed 0: the weights and inputs of the cache
    scenario) with the same Fn / Bn / warm-up / cap, sampled end to end at world size 1 and ``world``
    (cache-dit's Ulysses; ``world`` 1: only the unsharded run). ``{"world1": ..., "mesh": ...}``: per
    variant (uncached, each threshold) the worker's times, cached steps and ``latent``, its final latent
    (B, 16, H, W); or ``failure``."""
    extra = ["--sample-steps", str(steps), "--thresholds", ",".join(str(t) for t in thresholds), "--fn", str(fn),
             "--bn", str(bn), "--warmup", str(warmup), "--max-continuous", str(max_continuous)]
    with tempfile.TemporaryDirectory(prefix="dbcache_") as tmp:
        tmp = Path(tmp)
        case_path = tmp / "case.pt"
        try:
            case = prepare_case(case_path, shape=shape)
        except Exception as exc:  # noqa: BLE001 - a record that says why beats a crashed suite
            case = {"failure": f"conversion: {type(exc).__name__}: {exc}"}
        if case.get("failure"):
            return {"failure": case["failure"]}
        side = shape.image_side
        out = {"conversion_max_abs_err": case["conversion_max_abs_err"], "cache_dit": _version("cache-dit")}
        for where, size in (("world1", 1), ("mesh", world))[:1 if world == 1 else 2]:
            result = _launch("cachedit", size, case_path, threads, rounds, tmp / f"dbcache_{size}.json", extra=extra)
            if result.get("failure"):
                return {"failure": result["failure"]}
            for variant in result["variants"]:
                variant["latent"] = unpack_latents(torch.load(variant.pop("file")), side, side).float()
            out[where] = result
        return out
