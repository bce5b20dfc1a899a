#!/usr/bin/env python
"""The pack on a real GPU, through a real ComfyUI started on it (no --cpu), in parts that each fit
one 10-minute command of a lent GPU machine (under 8 minutes on an H100, estimated from the work
each does; see docs/gpu_check.md).

Several ranks share the one GPU through gloo (PARALLEL_SHARE_DEVICE=1, a test-only switch:
NCCL refuses two ranks on one device). Parts (``--part NAME|NUMBER[,...]``, ``--list`` names them
and their cases):

1. ``tiny``: every tiny case through the HTTP API against its unsharded twin in the same server,
   with bf16 tolerances (ComfyUI runs these models in bf16 on a GPU): Wan Ulysses 2, Ring 2,
   CFG 2, TP 2, USP 2x2, TP after Ulysses on the same model, a LoRA strength change, two sharded
   models, Shard VAE 2 (in fp32 and in bf16, its bf16 tolerance derived from the rounding measured
   between the two), Shard Text Encoder 2, a killed worker and an interrupt; ComfyUI on its
   default allocator (``cudaMallocAsync`` on most NVIDIA set-ups, which cannot export CUDA IPC
   handles).
2. ``tiny-no-cuda-malloc``: the same cases, ComfyUI started with ``--disable-cuda-malloc``
   (PyTorch's native allocator, which can).
3. ``big``: a Flux.1-dev-sized model (11.9B parameters, bf16, 4096 image + 512 text tokens): the
   first sharded forward, rank 0's host memory growth and each rank's weights and GPU memory, for
   Ulysses 2 and TP 2, against issue 15's targets.
4. ``features``: what came after the tiny cases, on the tiny families of tools/tiny_families.py
   (with the tests' extension nodes): Block Cache on Wan under Ulysses 2 and TP 2 (the same steps
   cached as unsharded), the stock Flux ControlNet (ComfyUI 0.33: 0.3.75 loads no narrow Flux
   ControlNet) and Qwen-Image's DiffSynth model patch under Ulysses 2.
5. ``compile``: torch.compile against eager (issue 18): bench/run.py's compiled scenario, eager
   and compiled at one rank and at two ranks sharing the device, timed in turn, in a process of
   its own; compiled slower than eager fails.

Run by ``tools/gpu_check.sh`` (which picks the ComfyUI host: ``--host 0.3.75|0.33.0``). Each case
prints one ``PASS`` / ``FAIL`` line with its figure, each part one ``SUMMARY | ... |`` line in the
form of a row of the README's GPU table. ``--cpu`` runs the same parts on CPU ranks with fp32
tolerances (the tests run every part that way, so this script cannot rot); ``--big tiny`` puts a
one-block Flux at 64x64 pixels in place of the Flux.1-dev-sized one (the CPU default);
``--compile`` names the benchmark scenario of the compiled comparison. Writes ``results.json``
(and ComfyUI's logs) under ``--out``; the model files go under ``--work``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(TOOLS))
sys.path.append(str(REPO))  # after ComfyUI's root: its nodes.py must win over our nodes/

from comfy_server import ComfyServer, PromptFailed  # noqa: E402
from parallel_runtime.comfyui_location import comfyui_path  # noqa: E402
from parallel_runtime.config import CONFIG_INPUTS, world_size_of  # noqa: E402
from workflows import (edited, find_nodes, load, parallel_config_node, remove_passthrough,  # noqa: E402
                       text_encoder_prompt, two_model_prompt, ui_to_api, with_shard_vae)

WORKFLOW = REPO / "example_workflows" / "tiny_wan_ulysses2_demo.json"
GIB = 2**30
# The tests' ComfyUI extensions the feature cases need: tiny files that state their own config, and the
# nodes that load tiny patch models and make control images.
EXTENSIONS = [REPO / "tests" / "comfy_extensions" / name
              for name in ("tiny_config_from_metadata", "tiny_model_patches", "dtype_loaders")]
# Issue 15's targets for the Flux.1-dev-sized model on 2 ranks.
TARGETS = {"first_forward_s": 5.0, "rss_growth_gib": 1.0, "tp2_largest_weights": 0.55}
# Relative L2 error allowed between two results of one model in fp32 on CPU ranks. On a GPU every
# tolerance is derived_tolerance's: fp32's fixed one, bf16's a multiple of the measured bf16 rounding.
CPU_REL_TOL = 1e-5


@dataclass
class Row:
    case: str
    ok: bool
    max_abs: float | None = None
    rel_l2: float | None = None
    note: str = ""
    data: dict = field(default_factory=dict)
    part: str = ""
    figure: str = ""  # the case's figure for its PASS / FAIL line; default: the errors

    def figure_text(self) -> str:
        if self.figure:
            return self.figure
        if self.rel_l2 is not None:
            return f"rel L2 {self.rel_l2:.1e}, max abs {self.max_abs:.1e}"
        return "-"


class Check:
    def __init__(self, server: ComfyServer, gpu: bool):
        self.server = server
        self.gpu = gpu
        self.prompt = ui_to_api(load(WORKFLOW), server.object_info())
        self._rounding = None  # the tiny Wan's bf16 rounding, measured on first use (see rel_tol)
        self._cache_ref = None  # part features: the unsharded Block Cache run and its uncached twin

    # ------------------------------------------------------------ helpers
    @property
    def rel_tol(self) -> float:
        """The relative L2 error a sharded run may differ by: fp32's on CPU ranks; on a GPU (bf16)
        BF16_ROUNDING_MULTIPLE times the rounding of the tiny Wan's unsharded bf16 run against fp32,
        measured on first use, once per part (docs/gpu_check.md#tolerances)."""
        if not self.gpu:
            return CPU_REL_TOL
        return derived_tolerance("bfloat16", self.bf16_rounding())

    def bf16_rounding(self) -> float:
        """Relative L2 error of the tiny Wan graph, unsharded, with its model in bf16 against fp32
        (the tests' UNETLoaderDtype); measured once per Check, i.e. per part."""
        if self._rounding is None:
            latents = {}
            for dtype in ("float32", "bfloat16"):
                graph = remove_passthrough(edited(self.prompt, KSampler={"seed": 100}), "ShardTransformer", "model")
                (loader,) = find_nodes(graph, "UNETLoader")
                graph[loader] = {"class_type": "UNETLoaderDtype",
                                 "inputs": {"unet_name": graph[loader]["inputs"]["unet_name"], "dtype": dtype}}
                latents[dtype] = self.latent(graph)
            self._rounding = self.errors(latents["bfloat16"], latents["float32"])[1]
        return self._rounding

    def parallel(self, **sizes) -> dict:
        """Parallel Config inputs: ``sizes``, the rest at the node's defaults, one CPU device per rank
        off the GPU."""
        inputs = parallel_config_node(**sizes)["inputs"]
        n = world_size_of(inputs[spec.name] for spec in CONFIG_INPUTS if spec.kind == "int")
        return {**inputs, "devices": "auto" if self.gpu else ",".join(["cpu"] * n)}

    def latent(self, prompt: dict, kind: str = "latents"):
        from safetensors.torch import load_file

        entry = self.server.run(prompt, timeout=600)
        (path,) = self.server.outputs(entry, kind)
        return load_file(str(path))["latent_tensor"]

    def status(self) -> dict:
        return self.server.get("/parallel/status")

    @staticmethod
    def errors(out, ref) -> tuple[float, float]:
        diff = (out.float() - ref.float())
        return diff.abs().max().item(), (diff.norm() / ref.float().norm().clamp_min(1e-12)).item()

    def compare(self, case: str, out, ref, note: str = "", **data) -> Row:
        max_abs, rel = self.errors(out, ref)
        return Row(case, out.shape == ref.shape and rel <= self.rel_tol, max_abs, rel, note, data)

    def layout(self, case: str, seed: int, **sizes) -> Row:
        prompt = edited(self.prompt, ParallelConfig=self.parallel(**sizes), KSampler={"seed": seed})
        ref = self.latent(remove_passthrough(prompt, "ShardTransformer", "model"))
        out = self.latent(prompt)
        ranks = self.status()["ranks"]
        return self.compare(case, out, ref, f"{len(ranks)} ranks, {min(r['forwards'] for r in ranks)}+ forwards each")

    def wait_forwards(self, rank: int, count: int, timeout: float = 120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ranks = self.status()["ranks"]
            if len(ranks) > rank and (ranks[rank].get("forwards") or 0) >= count:
                return ranks[rank]
            time.sleep(0.05)
        raise TimeoutError(f"rank {rank} did not reach {count} forwards")

    # ------------------------------------------------------------ cases
    def case_ulysses2(self):
        return self.layout("Wan Ulysses 2", 101, ulysses_size=2)

    def case_ring2(self):
        return self.layout("Wan Ring 2", 102, ring_size=2)

    def case_cfg2(self):
        return self.layout("Wan CFG 2", 103, cfg_size=2)

    def case_tp2(self):
        return self.layout("Wan TP 2", 104, tp_size=2)

    def case_usp2x2(self):
        return self.layout("Wan USP 2x2 (4 ranks)", 105, ulysses_size=2, ring_size=2)

    def case_tp_after_ulysses(self):
        self.layout("(Ulysses 2 first)", 106, ulysses_size=2)
        row = self.layout("Wan TP 2 after Ulysses 2, same model", 106, tp_size=2)
        return row

    def case_lora_change(self):
        results = []
        for strengths in ((0.8, 0.6), (0.3, 1.2)):
            prompt = edited(self.prompt, ParallelConfig=self.parallel(tp_size=2), KSampler={"seed": 107})
            before, after = find_nodes(prompt, "LoraLoaderModelOnly")
            prompt[before]["inputs"]["strength_model"], prompt[after]["inputs"]["strength_model"] = strengths
            results.append((self.latent(remove_passthrough(prompt, "ShardTransformer", "model")), self.latent(prompt)))
        (ref_a, out_a), (ref_b, out_b) = results
        row = self.compare("Wan TP 2, LoRA strength changed", out_b, ref_b)
        changed = self.errors(out_b - out_a, ref_b - ref_a)[1]
        row.ok = row.ok and self.errors(out_a, ref_a)[1] <= self.rel_tol and changed <= 2 * self.rel_tol
        row.note = f"the change of output matches to {changed:.1e} (relative)"
        return row

    def case_two_models(self):
        prompt = two_model_prompt(self.prompt, self.parallel(ulysses_size=2), self.parallel(ulysses_size=2))
        ref = self.latent(remove_passthrough(prompt, "ShardTransformer", "model"))
        return self.compare("two sharded models (Wan 2.2 style)", self.latent(prompt), ref)

    def vae_outputs(self, prompt: dict):
        """(the decoded images as int16 arrays, the re-encoded latent) of a Shard VAE graph."""
        import numpy as np
        from PIL import Image
        from safetensors.torch import load_file

        entry = self.server.run(prompt, timeout=600)
        images = [np.asarray(Image.open(p)).astype(np.int16) for p in self.server.outputs(entry, "images")]
        (latent,) = self.server.outputs(entry, "latents")
        return images, load_file(str(latent))["latent_tensor"]

    def vae_pair(self, dtype: str) -> tuple:
        """(unsharded, sharded) outputs of the Shard VAE graph with the VAE loaded in ``dtype``
        (the tests' VAELoaderDtype), the sampling before it unsharded and the same in both."""
        sharded = with_shard_vae(edited(self.prompt, KSampler={"seed": 108}), self.parallel(ulysses_size=2))
        (loader,) = find_nodes(sharded, "VAELoader")
        sharded[loader] = {"class_type": "VAELoaderDtype", "inputs": {**sharded[loader]["inputs"], "dtype": dtype}}
        return self.vae_outputs(remove_passthrough(sharded, "ShardVAE", "vae")), self.vae_outputs(sharded)

    def case_vae2(self):
        """Shard VAE in fp32 and in bf16, each against its unsharded twin. fp32: within the fp32
        tolerance. bf16: within BF16_ROUNDING_MULTIPLE times the rounding measured here, the
        unsharded bf16 run against the unsharded fp32 one (docs/gpu_check.md#tolerances)."""
        (images32_ref, ref32), (images32, out32) = self.vae_pair("float32")
        (images16_ref, ref16), (images16, out16) = self.vae_pair("bfloat16")
        rounding = self.errors(ref16, ref32)[1]
        tol16 = derived_tolerance("bfloat16", rounding) if rounding > 0 else 0.0
        fp32_rel = self.errors(out32, ref32)[1]
        fp32_tol = derived_tolerance("float32") if self.gpu else CPU_REL_TOL
        pixels = {name: max((int(abs(a - b).max()) for a, b in zip(out, ref)), default=-1)
                  for name, out, ref in (("fp32", images32, images32_ref), ("bf16", images16, images16_ref))}
        max_abs, rel = self.errors(out16, ref16)
        row = Row("Shard VAE 2 (decode, encode)", False, max_abs, rel,
                  f"bf16 {rel:.1e} against {tol16:.1e} (derived from the bf16 rounding {rounding:.1e}), "
                  f"images {pixels['bf16']}/255 at most; fp32 {fp32_rel:.1e} against {fp32_tol:.0e}, images "
                  f"{pixels['fp32']}/255 at most",
                  data={"bf16_rounding": rounding, "bf16_tolerance": tol16, "fp32_rel_l2": fp32_rel,
                        "fp32_tolerance": fp32_tol, "pixels": pixels},
                  figure=f"bf16 rel L2 {rel:.1e} (tolerance {tol16:.1e}), fp32 {fp32_rel:.1e}")
        row.ok = (out16.shape == ref16.shape and out32.shape == ref32.shape and rounding > 0 and rel <= tol16
                  and fp32_rel <= fp32_tol and len(images16) == len(images16_ref) > 0
                  and 0 <= pixels["bf16"] <= 8 and 0 <= pixels["fp32"] <= 1)
        return row

    def case_bf16_rounding(self):
        """The tiny Wan's measured bf16 rounding and the tolerance derived from it (a GPU's; on CPU
        ranks the cases compare in fp32). A figure, not a comparison: no rel L2 of its own."""
        rounding = self.bf16_rounding()
        tolerance = derived_tolerance("bfloat16", rounding) if rounding > 0 else 0.0
        return Row("bf16 rounding (Wan unsharded, bf16 against fp32)", 0 < rounding < 0.2,
                   note=f"the bf16 tolerance of the comparisons on a GPU: {tolerance:.1e}, derived from {rounding:.1e}",
                   data={"bf16_rounding": rounding, "bf16_tolerance": tolerance},
                   figure=f"rounding {rounding:.1e}, bf16 tolerance {tolerance:.1e}")

    def case_text_encoder2(self):
        import torch

        from tiny_models import saved_dataset

        text = "a lighthouse on a cliff in a storm, waves crashing, oil painting"

        def conditioning(graph, folder):
            self.server.run(graph, timeout=600)
            shard = torch.load(saved_dataset(self.server.base_dir, folder) / "shard_0000.pkl", weights_only=True)
            return shard["conditioning"][0][0][0]

        sharded = text_encoder_prompt(text, "gpu_te_sharded", self.parallel(ulysses_size=2))
        ref = conditioning(remove_passthrough(text_encoder_prompt(text, "gpu_te_ref"), "ShardTextEncoder", "clip"),
                           "gpu_te_ref")
        return self.compare("Shard Text Encoder 2 (T5)", conditioning(sharded, "gpu_te_sharded"), ref)

    def case_killed_worker(self):
        prompt = edited(self.prompt, ParallelConfig=self.parallel(ulysses_size=2))
        ref = self.latent(remove_passthrough(edited(prompt, KSampler={"seed": 109}), "ShardTransformer", "model"))
        self.server.run(edited(prompt, KSampler={"seed": 110, "steps": 2}), timeout=600)  # workers up
        start = self.status()["ranks"][1]["forwards"]
        prompt_id = self.server.queue(edited(prompt, KSampler={"steps": 400, "seed": 111}))
        victim = self.wait_forwards(1, start + 2)
        os.kill(victim["pid"], signal.SIGKILL)
        killed = time.monotonic()
        try:
            self.server.wait(prompt_id, timeout=120)
            return Row("killed worker", False, note="the prompt finished although rank 1 was killed")
        except PromptFailed as exc:
            message, took = str(exc), time.monotonic() - killed
        again = self.latent(edited(prompt, KSampler={"seed": 109}))
        row = self.compare("killed worker, then the next prompt", again, ref,
                           f"error after {took:.1f} s naming rank 1; next prompt on fresh workers")
        row.ok = row.ok and "rank 1" in message and took < 60 and self.status()["ranks"][1]["pid"] != victim["pid"]
        row.figure = f"error after {took:.1f} s, next prompt rel L2 {row.rel_l2:.1e}"
        row.data["error_after_s"] = round(took, 1)
        return row

    def case_interrupt(self):
        prompt = edited(self.prompt, ParallelConfig=self.parallel(ulysses_size=2))
        self.server.run(edited(prompt, KSampler={"seed": 112, "steps": 2}), timeout=600)
        pids = [r["pid"] for r in self.status()["ranks"]]
        start = self.status()["ranks"][1]["forwards"]
        prompt_id = self.server.queue(edited(prompt, KSampler={"steps": 400, "seed": 113}))
        self.wait_forwards(1, start + 3)
        self.server.interrupt()
        cancelled = time.monotonic()
        try:
            self.server.wait(prompt_id, timeout=60)
        except PromptFailed:
            pass
        previous = None
        while True:
            counts = [r["forwards"] for r in self.status()["ranks"]]
            if counts == previous:
                break
            previous = counts
            time.sleep(0.3)
        idle = time.monotonic() - cancelled
        self.server.run(edited(prompt, KSampler={"seed": 114, "steps": 2}), timeout=600)
        same = [r["pid"] for r in self.status()["ranks"]] == pids
        return Row("interrupt", idle < 5 and same, note=f"every rank idle {idle:.1f} s after Cancel; "
                                                        f"workers kept: {same}",
                   figure=f"idle {idle:.1f} s after Cancel", data={"idle_s": round(idle, 1)})

    # ------------------------------------------------------------ features since the tiny cases (part 4)
    # The tiny families' files (tools/tiny_families.py) and the test extension's nodes; each against the
    # same graph unsharded in the same server.
    BLOCK_CACHE = dict(front_blocks=1, back_blocks=0, threshold=0.3, warmup_steps=2, max_cached_steps=3,
                       taylor_order=0)  # tests/test_block_cache.py's Wan settings: 4 of 10 steps cached in fp32

    def cached_run(self, prompt: dict):
        """(final latent, the status route's Block Cache row of the prompt)."""
        from safetensors.torch import load_file

        prompt_id = self.server.queue(prompt)
        entry = self.server.wait(prompt_id, timeout=600)
        (path,) = self.server.outputs(entry, "latents")
        rows = [r for r in self.status().get("block_cache", []) if r["prompt_id"] == prompt_id]
        return load_file(str(path))["latent_tensor"], (rows[0] if rows else {})

    def block_cache(self, case: str, **sizes) -> Row:
        from tiny_families import cached_prompt

        if self._cache_ref is None:
            self._cache_ref = (self.cached_run(cached_prompt("wan", None, None, 10))[0],
                               *self.cached_run(cached_prompt("wan", None, self.BLOCK_CACHE, 10)))
        plain, ref, ref_row = self._cache_ref
        out, row = self.cached_run(cached_prompt("wan", self.parallel(**sizes), self.BLOCK_CACHE, 10))
        counts = (row.get("computed"), row.get("cached"))
        result = self.compare(case, out, ref, f"computed/cached {counts[0]}/{counts[1]}, unsharded "
                                              f"{ref_row.get('computed')}/{ref_row.get('cached')}; the cache "
                                              f"moves the result by {self.errors(ref, plain)[1]:.1e} (rel L2)",
                              measures=row.get("measures"), reference_measures=ref_row.get("measures"))
        result.ok = result.ok and counts == (ref_row.get("computed"), ref_row.get("cached")) and bool(ref_row.get("cached"))
        return result

    def case_block_cache_ulysses2(self):
        return self.block_cache("Block Cache, Wan Ulysses 2", ulysses_size=2)

    def case_block_cache_tp2(self):
        return self.block_cache("Block Cache, Wan TP 2", tp_size=2)

    def with_and_without(self, case: str, build, plain: dict, what: str, **sizes) -> Row:
        """``build(parallel)``'s graph sharded against unsharded; ``plain``: the graph without the
        feature, which must move the result by more than 3x the tolerance (else the check proves nothing)."""
        ref = self.latent(build(None))
        row = self.compare(case, self.latent(build(self.parallel(**sizes))), ref)
        moved = self.errors(self.latent(plain), ref)[1]
        row.note = f"the {what} moves the result by {moved:.1e} (rel L2)"
        row.ok = row.ok and moved > 3 * self.rel_tol
        return row

    def case_flux_controlnet_ulysses2(self):
        from tiny_families import controlnet_prompt, family_prompt

        return self.with_and_without("Flux stock ControlNet, Ulysses 2", controlnet_prompt, family_prompt("flux", None),
                                     "ControlNet", ulysses_size=2)

    def case_qwen_patch_ulysses2(self):
        from tiny_families import family_prompt, patched_prompt

        return self.with_and_without("Qwen-Image DiffSynth patch, Ulysses 2",
                                     lambda parallel: patched_prompt("qwen_image", parallel),
                                     family_prompt("qwen_image", None), "patch", ulysses_size=2)

    FEATURE_CASES = ("block_cache_ulysses2", "block_cache_tp2", "flux_controlnet_ulysses2", "qwen_patch_ulysses2")

    TINY_CASES = ("ulysses2", "ring2", "cfg2", "tp2", "usp2x2", "tp_after_ulysses", "lora_change", "two_models",
                  "vae2", "text_encoder2", "killed_worker", "interrupt", "bf16_rounding")


def derived_tolerance(dtype: str, rounding: float | None = None) -> float:
    """The relative L2 error a GPU comparison in ``dtype`` allows: the first-step check's rule, the one
    place it is stated (fp32 fixed; bf16 BF16_ROUNDING_MULTIPLE times the measured bf16 rounding
    ``rounding``, docs/gpu_check.md#tolerances). Imported here, as torch is, so that --list needs
    neither."""
    from parallel_runtime.comfyui_glue.first_step_check import tolerance

    return tolerance(dtype, rounding)


# ---------------------------------------------------------------- the big model
@dataclass(frozen=True)
class BigSize:
    label: str
    file: str
    depths: tuple[int, int]  # double, single blocks
    side: int  # image pixels per side (Flux: (side / 16)^2 image tokens)
    text_tokens: int


BIG_SIZES = {
    # 11.9B parameters, 4096 image + 512 text tokens: what issue 15's targets are for.
    "dev": BigSize("Flux.1-dev-sized (11.9B, bf16)", "flux_dev_sized.safetensors", (19, 38), 1024, 512),
    # The smallest Flux UNETLoader detects (0.5B), on 16 + 16 tokens: the CPU subset of the part.
    "tiny": BigSize("one-block Flux (bf16)", "flux_one_block.safetensors", (1, 1), 64, 16),
}
BIG_CASES = ("ulysses2", "tp2")
BIG_MODES = {"ulysses2": ("Ulysses 2", {"ulysses_size": 2}), "tp2": ("TP 2", {"tp_size": 2})}


def big_prompt(unet: str, parallel: dict | None, size: BigSize) -> dict:
    """UNETLoader -> (Shard Transformer) -> KSampler, one step (4096 image tokens at 1024x1024,
    512 text tokens from a stored conditioning for the dev size), cfg 1: one forward per step."""
    p = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        "2": {"class_type": "LoadTrainingDataset", "inputs": {"folder_name": f"big_prompt_{size.text_tokens}"}},
        "3": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["2", 1]}},
        "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": size.side, "height": size.side,
                                                               "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "seed": 5, "steps": 1, "cfg": 1.0,
                                                   "sampler_name": "euler", "scheduler": "simple", "positive": ["2", 1],
                                                   "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": "latents/big"}},
    }
    if parallel:
        p["7"] = {"class_type": "ParallelConfig", "inputs": parallel}
        p["8"] = {"class_type": "ShardTransformer", "inputs": {"model": ["1", 0], "parallel_config": ["7", 0]}}
        p["5"]["inputs"]["model"] = ["8", 0]
    return p


def write_big_files(base: Path, size: BigSize, device: str) -> tuple[str, int]:
    """The Flux file (drawn on ``device``) and a T5-XXL-wide prompt with a CLIP-L pooled vector."""
    import torch
    from safetensors.torch import save_file

    from tiny_models import flux1_state_dict, saved_dataset, write_conditioning_dataset

    path = base / "models" / "diffusion_models" / size.file
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        sd = flux1_state_dict(seed=21, depth=size.depths[0], depth_single=size.depths[1], text_dim=4096,
                              pooled_dim=768, dtype=torch.bfloat16, device=device)
        save_file(sd, str(path.with_suffix(".partial")))
        del sd
        if device == "cuda":  # this driver's cached blocks would count against the ranks' memory
            torch.cuda.empty_cache()
        os.replace(path.with_suffix(".partial"), path)
        print(f"[gpu_check] wrote {path.name} in {time.monotonic() - started:.0f} s", flush=True)
    dataset = f"big_prompt_{size.text_tokens}"
    try:
        saved_dataset(base, dataset)
    except FileNotFoundError:
        gen = torch.Generator().manual_seed(22)
        write_conditioning_dataset(base, dataset, torch.randn(1, size.text_tokens, 4096, generator=gen) * 0.5,
                                   extra={"pooled_output": torch.randn(1, 768, generator=gen), "guidance": 3.5})
    return size.file, tensor_bytes(path)


def tensor_bytes(path: Path) -> int:
    """Bytes of all tensors in a safetensors file, from its header."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(end - start for key, info in header.items() if key != "__metadata__"
               for start, end in [info["data_offsets"]])


def big_model(check: Check, size_name: str, cases=BIG_CASES) -> list[Row]:
    """First sharded forward, rank 0's host memory growth, each rank's GPU memory: Ulysses 2 and TP 2."""
    size = BIG_SIZES[size_name]
    unet, model_bytes = write_big_files(check.server.base_dir, size, "cuda" if check.gpu else "cpu")
    rows = []
    ref = check.latent(big_prompt(unet, None, size))
    rss_before = check.status()["ranks"][0]["rss_bytes"]
    for name in cases:
        mode, sizes = BIG_MODES[name]
        t0 = time.monotonic()
        out = check.latent(big_prompt(unet, check.parallel(**sizes), size))
        info = check.status()
        ranks = info["ranks"]
        growth = (ranks[0]["rss_bytes"] - rss_before) / GIB
        sent = info.get("last_weight_send") or {}
        first, send = sent.get("forward_s"), sent.get("seconds")  # the forward that carried the weights
        after_ready = (info.get("first_forward") or {}).get("after_ready_s")  # since the workers were ready
        weights = [r["param_bytes"] / model_bytes for r in ranks]
        gpu = [r.get("gpu_allocated_bytes") for r in ranks]
        note = (f"first sharded forward {first} s ({after_ready} s after the workers were ready), weights sent by "
                f"{info.get('transport')} ({info.get('transport_reason', '-')}) in {send} s; rank 0 RSS "
                f"{growth:+.2f} GiB; weights per rank {', '.join(f'{w:.3f}' for w in weights)} of the model; "
                f"GPU allocated per rank {', '.join('-' if g is None else f'{g / GIB:.1f} GiB' for g in gpu)}")
        row = check.compare(f"{size.label}: {mode}", out, ref, note, first_forward_s=first, weight_send_s=send,
                            rss_growth_gib=growth, weights_per_rank=weights, gpu_allocated=gpu,
                            transport=info.get("transport"), first_forward_after_ready_s=after_ready)
        row.figure = (f"first sharded forward {first} s, rank 0 RSS {growth:+.2f} GiB, largest rank "
                      f"{max(weights):.3f} of the model, rel L2 {row.rel_l2:.1e}")
        if size_name == "dev":  # the targets are for the real size
            row.ok = row.ok and first is not None and first <= TARGETS["first_forward_s"] and \
                growth <= TARGETS["rss_growth_gib"]
            if name == "tp2":
                row.ok = row.ok and max(weights) <= TARGETS["tp2_largest_weights"]
        row.data["seconds"] = round(time.monotonic() - t0, 1)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- compiled against eager
COMPILE_TIMEOUT_S = 420  # the part's budget (8 minutes) less ComfyUI-free start-up and the report


def compiled_comparison(scenario: str, out: Path, gpu: bool) -> list[Row]:
    """bench/run.py's compiled scenario on this device (two ranks share one GPU through gloo): the
    gain compiling gives at world size 2 against the one it gives at world size 1 (issue 18's
    criterion: at least 0.95), compiled no slower than eager, every rank without recompiles,
    compiled + sharded equal to eager on one rank (:func:`compile_misses`). A process of its own:
    it runs ComfyUI's model code on the device."""
    label = f"compiled against eager: {scenario}"
    out.mkdir(parents=True, exist_ok=True)
    records = out / "compile.jsonl"
    records.unlink(missing_ok=True)
    env = dict(os.environ, PARALLEL_SHARE_DEVICE="1") if gpu else dict(os.environ)
    cmd = [sys.executable, "-u", str(REPO / "bench" / "run.py"), "--scenario", scenario,
           "--device", "cuda" if gpu else "cpu", "--out", str(records)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [Row(label, False, note=f"bench/run.py ran past {COMPILE_TIMEOUT_S} s", figure="timed out")]
    if proc.returncode != 0 or not records.exists():
        return [Row(label, False, note=f"bench/run.py failed ({proc.returncode}): {proc.stderr.strip()[-300:]}",
                    figure=f"exit {proc.returncode}")]
    return [compile_row(r, compile_tolerance(r, gpu)) for r in map(json.loads, records.read_text().splitlines())]


def compile_tolerance(r: dict, gpu: bool) -> float:
    """The error a compiled-against-eager record may show: the dtype the bench computed in (its
    record's ``dtype``; records without one predate it and were fp32: the bench builds its models
    in fp32) judged by :func:`derived_tolerance` on a GPU, CPU_REL_TOL on CPU ranks."""
    return derived_tolerance(r.get("dtype", "float32")) if gpu else CPU_REL_TOL


COMPILE_GAIN_RATIO = 0.95  # issue 18: compiling gains at 2 ranks at least 0.95 of what it gains at 1


def compile_misses(r: dict, tol: float) -> list[str]:
    """What a compiled-against-eager record misses, in words; empty: it passes. Speed is part of
    the verdict: a compiled run slower than eager, or a gain at 2 ranks below 0.95 of the gain at
    1, is a miss like a wrong result (a compiled model that is slower is no success)."""
    misses = []
    if r["max_rel_err"] > tol:
        misses.append(f"max rel err {r['max_rel_err']:.1e} over {tol:.0e}")
    if any(r["recompiles_per_rank"]):
        misses.append(f"recompiles per rank {r['recompiles_per_rank']}")
    for world in (1, 2):
        if r[f"compiled{world}_ms_median"] > r[f"eager{world}_ms_median"]:
            misses.append(f"compiled slower than eager at {world} rank{'s' if world > 1 else ''} "
                          f"({r[f'compiled{world}_ms_median']:.1f} vs {r[f'eager{world}_ms_median']:.1f} ms)")
    if r["compile_speedup_ratio"] < COMPILE_GAIN_RATIO:
        misses.append(f"gain 2 ranks / 1 rank {r['compile_speedup_ratio']:.2f} below {COMPILE_GAIN_RATIO}")
    return misses


def compile_row(r: dict, tol: float) -> Row:
    """One record of bench/run.py's compiled scenario as a row: failed, with its misses as the
    figure, when :func:`compile_misses` names any."""
    ratio = r["compile_speedup_ratio"]
    misses = compile_misses(r, tol)
    note = (f"eager / compiled ms: 1 rank {r['eager1_ms_median']:.1f} / {r['compiled1_ms_median']:.1f} "
            f"(gain {r['compile_speedup_world1']:.2f}), 2 ranks {r['eager2_ms_median']:.1f} / "
            f"{r['compiled2_ms_median']:.1f} (gain {r['compile_speedup_world2']:.2f}); gain 2 / gain 1 "
            f"{ratio:.2f} (target {COMPILE_GAIN_RATIO}); first compiled step {r['first_compiled_step_s']} s; "
            f"recompiles per rank {r['recompiles_per_rank']}; max rel err {r['max_rel_err']:.1e}")
    figure = "; ".join(misses) if misses else (f"gain 2 ranks / 1 rank {ratio:.2f}, recompiles 0, "
                                               f"max rel err {r['max_rel_err']:.1e}")
    return Row(f"compiled against eager: {r['scenario']}", not misses, r["max_abs_err"], None, note, data=r,
               figure=figure)


# ---------------------------------------------------------------- the parts
@dataclass(frozen=True)
class Part:
    number: int
    name: str
    title: str
    # Estimated on an H100 from the work each part does (not yet measured: no session had a GPU
    # since the split): ComfyUI's start and every rank's included, the machine's own start not.
    minutes: float
    server_args: tuple[str, ...] | None  # ComfyUI's flags; None: the part starts no ComfyUI
    cases: tuple[str, ...]


PARTS = (
    Part(1, "tiny", "tiny cases, ComfyUI's default allocator", 4, (), Check.TINY_CASES),
    Part(2, "tiny-no-cuda-malloc", "tiny cases, ComfyUI started with --disable-cuda-malloc", 4,
         ("--disable-cuda-malloc",), Check.TINY_CASES),
    Part(3, "big", "Flux.1-dev-sized targets (Ulysses 2, TP 2)", 5, (), BIG_CASES),
    Part(4, "features", "Block Cache, the stock Flux ControlNet and a model patch (tiny families)", 2, (),
         Check.FEATURE_CASES),
    Part(5, "compile", "compiled against eager", 4, None, ("flux_ulysses2_compiled",)),
)
PART_LIMIT_S = 8 * 60  # each part must fit one 10-minute command of a lent GPU machine, with room


def part_by_key(key: str) -> Part:
    for part in PARTS:
        if key.strip() in (part.name, str(part.number)):
            return part
    raise KeyError(key)


def parse_parts(spec: str) -> list[Part]:
    """``all`` or a comma-separated list of part names or numbers, run in their order (1 to 5)."""
    if spec.strip() == "all":
        return list(PARTS)
    chosen = {part_by_key(key).number for key in spec.split(",") if key.strip()}
    return [part for part in PARTS if part.number in chosen]


def parse_cases(specs: list[str], parts: list[Part]) -> dict[str, tuple[str, ...]]:
    """``--cases [PART=]CASE,CASE``: without a part, for every part with tiny cases (1 and 2)."""
    chosen: dict[str, tuple[str, ...]] = {}
    for spec in specs:
        target, _, names = spec.rpartition("=")
        if target:
            targets = [part_by_key(target)]
        else:
            targets = [p for p in PARTS if p.cases == Check.TINY_CASES]
        names = tuple(c for c in names.split(",") if c)
        for part in targets:
            if part.name == "compile":
                raise ValueError("part compile runs one benchmark scenario: name it with --compile")
            unknown = [c for c in names if c not in part.cases]
            if unknown:
                raise ValueError(f"unknown cases {unknown} for part {part.name}; choose from {', '.join(part.cases)}")
            chosen[part.name] = names
    return {part.name: chosen.get(part.name, part.cases) for part in parts}


def list_parts() -> str:
    lines = []
    for part in PARTS:
        lines.append(f"part {part.number} {part.name}: {part.title} (about {part.minutes:g} min on an H100)")
        lines.append(f"  cases: {', '.join(part.cases)}")
    return "\n".join(lines)


# ---------------------------------------------------------------- main
def device_name(gpu: bool) -> str:
    if not gpu:
        return f"CPU ({os.cpu_count()} cores, {platform.machine()})"
    import torch

    props = torch.cuda.get_device_properties(0)
    return f"{props.name} ({props.total_memory / GIB:.0f} GiB), torch {torch.__version__}"


def host_version(comfyui: str) -> str:
    try:
        text = (Path(comfyui) / "comfyui_version.py").read_text()
        return text.split("__version__", 1)[1].split('"')[1]
    except (OSError, IndexError):
        return "unknown"


def allocator(log_path: Path) -> str:
    """What ComfyUI says it computes on ("Device: cuda:0 NVIDIA H100 ... : cudaMallocAsync")."""
    try:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if "Device: " in line]
    except OSError:
        return "unknown"
    if not lines:
        return "unknown"
    device = lines[-1].split("Device: ", 1)[1].strip()
    return device.rsplit(" : ", 1)[1] or "default" if " : " in device else device


def table(rows: list[Row]) -> str:
    lines = ["| part | case | result | max abs err | rel L2 err | notes |", "|---|---|---|---|---|---|"]
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.1e}"  # noqa: E731
        lines.append(f"| {r.part} | {r.case} | {'pass' if r.ok else 'FAIL'} | {fmt(r.max_abs)} | {fmt(r.rel_l2)} | "
                     f"{r.note} |")
    return "\n".join(lines)


def key_figures(part: Part, rows: list[Row], alloc: str | None) -> str:
    figures = []
    if alloc:
        figures.append(f"allocator {alloc}")
    if part.server_args is not None and part.name != "big":
        compared = [r for r in rows if r.rel_l2 is not None]
        if compared:
            worst = max(compared, key=lambda r: r.rel_l2)
            figures.append(f"worst rel L2 {worst.rel_l2:.1e} ({worst.case})")
        transports = sorted({str(r.data["transport"]) for r in rows if r.data.get("transport")})
        if transports:
            figures.append(f"weights by {', '.join(transports)}")
        figures += [f"{r.case}: {r.figure_text()}" for r in rows if r.case in ("interrupt",)
                    or r.case.startswith("killed worker")]
    else:
        figures += [f"{r.case}: {r.figure_text()}" for r in rows]
    figures += [f"FAIL {r.case}" for r in rows if not r.ok and f"{r.case}:" not in "; ".join(figures)]
    return "; ".join(figures)


def summary_row(report: dict, part: Part, rows: list[Row], seconds: float, alloc: str | None) -> str:
    """One row of the README's GPU table: | date | device | what | result |."""
    passed = sum(r.ok for r in rows)
    what = f"ComfyUI {report['host']}, `tools/gpu_check.sh --part {part.name}` ({part.title})"
    over = f", over the {PART_LIMIT_S // 60}-minute budget" if seconds > PART_LIMIT_S else ""
    result = f"{passed}/{len(rows)} passed in {seconds:.0f} s{over}; {key_figures(part, rows, alloc)}"
    return f"| {report['date']} | {report['device']} | {what} | {result} |"


def save(out: Path, report: dict, rows: list[Row], started: float) -> None:
    """results.json, after every case: a command stopped at the device's 10-minute limit still leaves
    what ran."""
    report["seconds"] = round(time.monotonic() - started)
    report["rows"] = [asdict(r) for r in rows]
    (out / "results.json").write_text(json.dumps(report, indent=1))


def print_row(row: Row) -> None:
    print(f"{'PASS' if row.ok else 'FAIL'} [{row.part}] {row.case}: {row.figure_text()} "
          f"({row.data.get('seconds', '-')} s){' ' + row.note if row.note else ''}", flush=True)


def run_case(row_of, part: Part, label: str) -> Row:
    t0 = time.monotonic()
    try:
        row = row_of()
    except Exception as exc:  # one case's failure is a row, not the end of the check
        row = Row(label, False, note=f"{type(exc).__name__}: {str(exc)[:300]}", figure=type(exc).__name__)
        traceback.print_exc()
    row.part = part.name
    row.data.setdefault("seconds", round(time.monotonic() - t0, 1))
    print_row(row)
    return row


def parse_arguments():
    """(options, parts to run, cases per part, big model size, compile scenario) from the command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="all",
                        help="comma-separated part names or numbers, or all: "
                             + ", ".join(f"{p.number} {p.name}" for p in PARTS))
    parser.add_argument("--list", action="store_true", help="list the parts and their cases, and exit")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks and fp32 tolerances (a dry run of this script)")
    parser.add_argument("--cases", action="append", default=[],
                        help=f"[PART=]CASE,CASE (repeatable); without PART for both tiny parts, of: "
                             f"{', '.join(Check.TINY_CASES)}; big: {', '.join(BIG_CASES)}")
    parser.add_argument("--big", choices=("dev", "tiny", "none"), default=None,
                        help="part big's model: Flux.1-dev-sized (default on a GPU), one block at 64x64 (default on "
                             "the CPU), or none (leaves the part out)")
    parser.add_argument("--compile", default=None,
                        help="the benchmark scenario of part compile (default on a GPU: flux_ulysses2_compiled; on "
                             "the CPU: flux_smoke_ulysses2_compiled); none leaves the part out")
    parser.add_argument("--out", default=str(REPO / "out" / "gpu_check"), help="results.json and the logs")
    parser.add_argument("--work", default=None, help="ComfyUI's base directory with the model files "
                                                     "(default: OUT/base; the dev-sized Flux takes 24 GB)")
    opts = parser.parse_args()
    if opts.list:
        return opts, [], {}, None, None
    try:
        parts = parse_parts(opts.part)
        cases = parse_cases(opts.cases, parts)
    except KeyError as exc:
        parser.error(f"unknown part {exc}; choose from {', '.join(f'{p.number} {p.name}' for p in PARTS)} or all")
    except ValueError as exc:
        parser.error(str(exc))
    big = opts.big or ("tiny" if opts.cpu else "dev")
    scenario = opts.compile or ("flux_smoke_ulysses2_compiled" if opts.cpu else "flux_ulysses2_compiled")
    parts = [p for p in parts if not (p.name == "big" and big == "none")
             and not (p.name == "compile" and scenario == "none")]
    return opts, parts, cases, big, scenario


def run_server_part(check: "Check", part, cases: list[str], big: str, out: Path, report: dict,
                    rows: list, started: float) -> list:
    """The rows of one part that runs through a ComfyUI server (saved after every case)."""
    if part.name != "big":
        part_rows = []
        for name in cases:
            part_rows.append(run_case(getattr(check, f"case_{name}"), part, name))
            try:  # how the weights travelled (the status route names the channel)
                part_rows[-1].data.setdefault("transport", check.status().get("transport"))
            except Exception:
                pass
            save(out, report, rows + part_rows, started)
        return part_rows
    rows_t0 = time.monotonic()
    try:
        part_rows = big_model(check, big, cases)
    except Exception as exc:
        part_rows = [Row(f"{BIG_SIZES[big].label}", False, figure=type(exc).__name__,
                         note=f"{type(exc).__name__}: {str(exc)[:300]}",
                         data={"seconds": round(time.monotonic() - rows_t0, 1)})]
        traceback.print_exc()
    for row in part_rows:
        row.part = part.name
        print_row(row)
    return part_rows


def run_compile_part(part, scenario: str, out: Path, gpu: bool) -> list:
    t0 = time.monotonic()
    part_rows = compiled_comparison(scenario, out, gpu)
    for row in part_rows:
        row.part = part.name
        row.data.setdefault("seconds", round(time.monotonic() - t0, 1))
        print_row(row)
    return part_rows


def server_for(part, parts, servers: dict, comfyui: str, base: Path, out: Path, gpu: bool) -> "ComfyServer":
    """The ComfyUI server of a part's arguments, started (and the tiny files written) on first use."""
    from tiny_families import write_family_files
    from tiny_models import DEMO_FILES, write_tiny_wan_files

    args = part.server_args
    if args not in servers:
        # On a GPU every server part needs the tiny Wan: its bf16 rounding is what the tolerances derive from.
        if not servers and (gpu or any(p.cases in (Check.TINY_CASES, Check.FEATURE_CASES) for p in parts)):
            write_tiny_wan_files(base, only=(*DEMO_FILES, "unet_4heads", "t5_base"))
        if not servers and any(p.cases == Check.FEATURE_CASES for p in parts):
            write_family_files(base)
        log_name = "comfyui" + "".join(a.replace("--", "_") for a in args) + ".log"
        env = {"PARALLEL_SHARE_DEVICE": "1"} if gpu else {}
        servers[args] = ComfyServer(comfyui, base, python=sys.executable, cpu=not gpu, env=env,
                                    extra_args=args, log_path=out / log_name,
                                    extra_custom_nodes=EXTENSIONS).start(timeout=300)
    return servers[args]


def main() -> int:
    opts, parts, cases, big, scenario = parse_arguments()
    if opts.list:
        print(list_parts())
        return 0
    gpu = not opts.cpu
    out = Path(opts.out)
    base = Path(opts.work) if opts.work else out / "base"
    out.mkdir(parents=True, exist_ok=True)
    comfyui = comfyui_path("run the check with tools/gpu_check.sh (it finds or sets up the host)")
    sys.path.insert(0, comfyui)
    import comfy.options  # noqa: F401
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # this driver only writes files; ComfyUI runs in its own process
    report = {"date": time.strftime("%Y-%m-%d"), "device": device_name(gpu), "host": host_version(comfyui),
              "targets": TARGETS, "parts": [], "rows": []}
    print(f"[gpu_check] ComfyUI {report['host']} at {comfyui}; {report['device']}; parts "
          f"{', '.join(p.name for p in parts)}", flush=True)
    started = time.monotonic()
    servers: dict[tuple[str, ...], ComfyServer] = {}
    rows: list[Row] = []
    try:
        for index, part in enumerate(parts):
            t_part, alloc = time.monotonic(), None
            if part.server_args is not None:
                server = server_for(part, parts, servers, comfyui, base, out, gpu)
                part_rows = run_server_part(Check(server, gpu), part, cases[part.name], big, out, report, rows,
                                            started)
                alloc = allocator(server.log_path)
                if not any(part.server_args == p.server_args for p in parts[index + 1:]):  # its last part
                    servers.pop(part.server_args).stop()  # frees the device
            else:  # after the servers of earlier parts: their ranks no longer hold the device
                for args in list(servers):
                    servers.pop(args).stop()
                part_rows = run_compile_part(part, scenario, out, gpu)
            seconds = time.monotonic() - t_part
            line = summary_row(report, part, part_rows, seconds, alloc)
            print(f"SUMMARY {line}", flush=True)
            report["parts"].append({"part": part.name, "number": part.number, "seconds": round(seconds),
                                    "passed": sum(r.ok for r in part_rows), "total": len(part_rows),
                                    "allocator": alloc, "comfyui_args": None if part.server_args is None
                                    else list(part.server_args), "summary": line})
            rows += part_rows
            save(out, report, rows, started)
    finally:
        for server in servers.values():
            server.stop()
    save(out, report, rows, started)
    print(f"\n{report['date']}, {report['device']}, ComfyUI {report['host']}, {report['seconds']} s\n")
    print(table(rows))
    failed = [r.case for r in rows if not r.ok]
    print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed")
    for entry in report["parts"]:
        print(f"SUMMARY {entry['summary']}")
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
