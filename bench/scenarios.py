"""Benchmark scenarios: model builders and the meshes to run them on.

Models are ComfyUI's own classes with seeded random weights (no downloads). The
Flux-shaped config follows the measurements in ../shared/DESIGN.md section 7:
2 double + 4 single blocks, width 512 (8 heads of 64), 4096 image + 256 text tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


def _seeded(model: torch.nn.Module, seed: int, scale: float = 0.02) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


@dataclass(frozen=True)
class FluxShape:
    hidden: int = 512
    heads: int = 8
    double: int = 2
    single: int = 4
    image_side: int = 128   # latent pixels per side; patch 2 -> (side / 2)^2 image tokens
    text_tokens: int = 256
    context_dim: int = 512
    vec_dim: int = 256

    @property
    def tokens(self) -> int:
        return (self.image_side // 2) ** 2 + self.text_tokens

    @property
    def axes_dim(self) -> list[int]:
        head_dim = self.hidden // self.heads
        side = (head_dim // 3) // 2 * 2
        return [head_dim - 2 * side, side, side]


def build_flux(shape: FluxShape, seed: int = 0, batch: int = 1, device="cpu"):
    """A ComfyUI Flux (``comfy.ldm.flux.model.Flux``) and inputs for its ``_forward``."""
    import comfy.ops
    from comfy.ldm.flux.model import Flux
    from tiny_models import make

    model = make(Flux, image_model="flux", in_channels=16, out_channels=16, vec_in_dim=shape.vec_dim,
                 context_in_dim=shape.context_dim, hidden_size=shape.hidden, mlp_ratio=4.0, num_heads=shape.heads,
                 depth=shape.double, depth_single_blocks=shape.single, axes_dim=shape.axes_dim, theta=10000,
                 patch_size=2, qkv_bias=True, guidance_embed=True, dtype=torch.float32, device="cpu",
                 operations=comfy.ops.disable_weight_init)
    _seeded(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 16, shape.image_side, shape.image_side, generator=gen)
    context = torch.randn(batch, shape.text_tokens, shape.context_dim, generator=gen)
    kwargs = {"y": torch.randn(batch, shape.vec_dim, generator=gen), "guidance": torch.full((batch,), 3.5)}
    t = torch.linspace(0.3, 0.7, batch)
    model.to(device)
    move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return model, (move(x), move(t), move(context)), {k: move(v) for k, v in kwargs.items()}


@dataclass(frozen=True)
class WanShape:
    dim: int = 512
    heads: int = 4
    ffn: int = 1536
    layers: int = 2
    frames: int = 5          # latent frames
    side: int = 64           # latent pixels per side; patch 2 -> (side/2)^2 tokens per frame
    text_tokens: int = 128

    @property
    def tokens(self) -> int:
        return self.frames * (self.side // 2) ** 2


def build_wan(shape: WanShape, seed: int = 0, batch: int = 1, device="cpu"):
    import comfy.ldm.wan.model
    import comfy.ops

    model = comfy.ldm.wan.model.WanModel(model_type="t2v", patch_size=(1, 2, 2), dim=shape.dim, ffn_dim=shape.ffn,
                                         num_heads=shape.heads, num_layers=shape.layers, in_dim=16, out_dim=16,
                                         text_dim=256, operations=comfy.ops.disable_weight_init)
    _seeded(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 16, shape.frames, shape.side, shape.side, generator=gen)
    context = torch.randn(batch, shape.text_tokens, 256, generator=gen)
    t = torch.linspace(300.0, 700.0, batch)
    model.to(device)
    return model, (x.to(device), t.to(device), context.to(device)), {}


def build_kl_vae(latent_side: int, seed: int = 0, batch: int = 1, device="cpu"):
    """A Flux.1-style KL autoencoder (16 latent channels, SD widths) and a latent to decode."""
    import comfy.ldm.models.autoencoder

    ddconfig = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    model = comfy.ldm.models.autoencoder.AutoencodingEngine(
        regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
        encoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Encoder", "params": ddconfig},
        decoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Decoder", "params": ddconfig})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 / max(1, p[0].numel()) ** 0.5) if p.ndim > 1
                    else (1.0 if "norm" in name and name.endswith("weight") else 0.0) + 0.02 * torch.randn(p.shape, generator=gen))
    model.eval().to(device)
    z = torch.randn(batch, 16, latent_side, latent_side, generator=gen).to(device)
    return model, (z,), {}


@dataclass(frozen=True)
class Scenario:
    name: str
    family: str
    mode: str                        # ulysses, ring, usp, cfg, ...
    mesh: dict[str, int]             # sizes of cfg / ring / ulysses / tp
    build: Callable                  # (seed, batch, device) -> (model, args, kwargs)
    tokens: int
    batch: int = 1
    repeat: int = 3
    notes: str = ""
    suites: tuple[str, ...] = ("quick", "full")
    extra: dict = field(default_factory=dict)
    method: str = "_forward"  # the model method a step runs ("decode" for a VAE)

    @property
    def world_size(self) -> int:
        n = 1
        for v in self.mesh.values():
            n *= v
        return n


FLUX = FluxShape()
FLUX_SMOKE = FluxShape(hidden=128, heads=2, double=1, single=1, image_side=16, text_tokens=8, context_dim=64,
                       vec_dim=32)
WAN = WanShape()
# Wan-shaped with 1.2 GB of fp32 weights and few tokens: weights, not activations or each process's
# torch and ComfyUI runtime, dominate its memory (the shared-memory measurement).
WAN_BIG = WanShape(dim=1536, heads=12, ffn=8960, layers=6, frames=1, side=32, text_tokens=32)
# Its GGUF counterpart for the same measurement: 0.8 GB of Q8_0 blocks (about 770M parameters).
WAN_GGUF_BIG = WanShape(dim=2048, heads=16, ffn=8192, layers=12, frames=1, side=32, text_tokens=32)


def build_wan_gguf(shape: WanShape, qtype: str, seed: int = 0, batch: int = 1, device="cpu"):
    """``build_wan`` with every block Linear in ComfyUI-GGUF's layer holding ``qtype`` blocks
    (tools/tiny_gguf.py's quantizers), as UnetLoaderGGUF loads a GGUF file of that model."""
    from tiny_gguf import import_gguf_nodes, quantize_linears

    from parallel_runtime.comfyui_location import comfyui_path

    model, args, kwargs = build_wan(shape, seed, batch, "cpu")
    quantize_linears(model, qtype, import_gguf_nodes(comfyui_path("run the benchmark with tools/run.sh")),
                     prefix="blocks.")
    return model.to(device), tuple(a.to(device) for a in args), kwargs


def wan_gguf(shape, qtype):
    return lambda seed, batch, device: build_wan_gguf(shape, qtype, seed, batch, device)


def flux(shape):
    return lambda seed, batch, device: build_flux(shape, seed, batch, device)


def wan(shape):
    return lambda seed, batch, device: build_wan(shape, seed, batch, device)


SCENARIOS = [
    # The smallest scenario: a valid record in seconds (tests run it).
    Scenario("smoke_flux_ulysses2", "flux", "ulysses", {"ulysses": 2}, flux(FLUX_SMOKE), FLUX_SMOKE.tokens,
             repeat=2, suites=("smoke",)),
    Scenario("flux_ulysses2", "flux", "ulysses", {"ulysses": 2}, flux(FLUX), FLUX.tokens),
    Scenario("flux_ring2", "flux", "ring", {"ring": 2}, flux(FLUX), FLUX.tokens),
    Scenario("flux_cfg2", "flux", "cfg", {"cfg": 2}, flux(FLUX), FLUX.tokens, batch=2, suites=("full",),
             notes="batch 2 = cond + uncond, as ComfyUI batches them"),
    Scenario("flux_usp2x2", "flux", "usp", {"ring": 2, "ulysses": 2}, flux(FLUX), FLUX.tokens, suites=("full",),
             notes="4 ranks: on a 2-core machine this oversubscribes the cores; correctness, not speed"),
    Scenario("flux_tp2", "flux", "tp", {"tp": 2}, flux(FLUX), FLUX.tokens),
    Scenario("flux_tp1", "flux", "tp", {}, flux(FLUX), FLUX.tokens, suites=("full",),
             notes="one rank through the runtime: the memory baseline for the TP records"),
    Scenario("flux_tp4", "flux", "tp", {"tp": 4}, flux(FLUX), FLUX.tokens, suites=("full",),
             notes="4 ranks: on a 2-core machine this oversubscribes the cores; memory, not speed"),
    Scenario("flux_ulysses2_tp2", "flux", "hybrid", {"ulysses": 2, "tp": 2}, flux(FLUX), FLUX.tokens,
             suites=("full",), notes="4 ranks: on a 2-core machine this oversubscribes the cores; memory, not speed"),
    Scenario("wan_ulysses2", "wan", "ulysses", {"ulysses": 2}, wan(WAN), WAN.tokens, suites=("full",)),
    # VAE decode of a 512 x 512 image (64 x 64 latent): activations, not weights, dominate.
    *[Scenario(f"vae_decode_{n}ranks", "vae_kl", "vae", {"tp": n} if n > 1 else {},
               lambda seed, batch, device: build_kl_vae(64, seed, batch, device), 64 * 64, repeat=1,
               suites=("full", "vae"), method="decode") for n in (1, 2, 4)],
    Scenario("wan_ring2", "wan", "ring", {"ring": 2}, wan(WAN), WAN.tokens, suites=("full",)),
    # GGUF (ComfyUI-GGUF's layers, blocks quantized) against the same Wan in fp32: step time,
    # weights per rank, and the shared-memory measurement on quantized weights.
    Scenario("wan_fp32_tp2", "wan", "tp", {"tp": 2}, wan(WAN), WAN.tokens, suites=("gguf",),
             notes="the fp32 baseline of the GGUF TP rows"),
    *[Scenario(f"wan_gguf_{q.lower()}_{mode}2", "wan", mode, {mode: 2}, wan_gguf(WAN, q), WAN.tokens, suites=("gguf",),
               notes=f"blocks in {q}") for q in ("Q8_0", "Q4_K") for mode in ("ulysses", "tp")],
    Scenario("wan_big_gguf_q8_0_ulysses2_memory", "wan", "ulysses", {"ulysses": 2}, wan_gguf(WAN_GGUF_BIG, "Q8_0"),
             WAN_GGUF_BIG.tokens, repeat=2, suites=("gguf", "memory"),
             notes="0.8 GB of Q8_0 blocks: summed PSS of both ranks against one process"),
    # Compiled (TorchCompileModel under Shard Transformer) against eager, at world size 1 and 2.
    *[Scenario(f"{name}_compiled", fam, mode, {mode: 2}, build, tokens, suites=("compile",), repeat=5,
               extra={"compile": True}, notes="eager and compiled, world size 1 and 2, timed in turn")
      for name, fam, mode, build, tokens in (("flux_ulysses2", "flux", "ulysses", flux(FLUX), FLUX.tokens),
                                             ("flux_tp2", "flux", "tp", flux(FLUX), FLUX.tokens),
                                             ("wan_ulysses2", "wan", "ulysses", wan(WAN), WAN.tokens))],
    # The same comparison on a model small enough for the suite (tests/test_gpu_check.py runs it).
    Scenario("flux_smoke_ulysses2_compiled", "flux", "ulysses", {"ulysses": 2}, flux(FLUX_SMOKE), FLUX_SMOKE.tokens,
             suites=(), repeat=1, extra={"compile": True}, notes="the compiled comparison's smoke run"),
    Scenario("wan_big_ulysses2_memory", "wan", "ulysses", {"ulysses": 2}, wan(WAN_BIG), WAN_BIG.tokens, repeat=2,
             suites=("full", "memory"), notes="1.2 GB of weights: summed PSS of both ranks against one process"),
]


# layout auto against every manual layout of 2 ranks (bench/auto_bench.py).
SCENARIOS += [
    Scenario("flux_auto2", "flux", "auto", {"ring": 2}, flux(FLUX), FLUX.tokens, suites=("auto",), extra={"auto": True}),
    Scenario("flux_cfg_auto2", "flux", "auto", {"ring": 2}, flux(FLUX), FLUX.tokens, batch=2, suites=("auto",),
             extra={"auto": True}, notes="batch 2 = cond + uncond"),
    Scenario("wan_auto2", "wan", "auto", {"ring": 2}, wan(WAN), WAN.tokens, suites=("auto",), extra={"auto": True}),
    Scenario("flux_small_auto2", "flux", "auto", {"ring": 2}, flux(FluxShape(image_side=64, text_tokens=64)),
             FluxShape(image_side=64, text_tokens=64).tokens, suites=("auto",), extra={"auto": True},
             notes="1088 tokens: weights and communication weigh more"),
    # bench/profile_step.py --overlap on a model small enough for the suite (8 heads: 4 per rank).
    Scenario("flux_small_ulysses2", "flux", "ulysses", {"ulysses": 2}, flux(FluxShape(image_side=32, text_tokens=16)),
             FluxShape(image_side=32, text_tokens=16).tokens, suites=()),
]


# A weighted token split against the even one with rank 1 made twice as slow (bench/weighted_bench.py).
SCENARIOS += [
    Scenario(f"{name}_weighted", fam, "weighted", mesh, build, tokens, suites=("weighted",), repeat=3,
             extra={"weighted": True}, notes="PARALLEL_TEST_SLOW_RANK=1:2")
    for name, fam, mesh, build, tokens in (
        ("flux_ulysses2", "flux", {"ulysses": 2}, flux(FLUX), FLUX.tokens),
        ("flux_ring2", "flux", {"ring": 2}, flux(FLUX), FLUX.tokens),
        ("wan_ulysses2", "wan", {"ulysses": 2}, wan(WAN), WAN.tokens))
] + [
    Scenario("vae_decode2_weighted", "vae_kl", "weighted", {"tp": 2},
             lambda seed, batch, device: build_kl_vae(48, seed, batch, device), 48 * 48, suites=("weighted",),
             repeat=3, method="decode", extra={"weighted": True},
             notes="PARALLEL_TEST_SLOW_RANK=1:2; row bands in proportion")
]


def select(suite: str, names: list[str] | None = None) -> list[Scenario]:
    if names:
        known = {s.name: s for s in SCENARIOS}
        missing = [n for n in names if n not in known]
        if missing:
            raise SystemExit(f"unknown scenarios {missing}; known: {', '.join(known)}")
        return [known[n] for n in names]
    return [s for s in SCENARIOS if suite in s.suites]


def scenario_call(scenario, model):
    """The model's plan, the method the scenario times, and the keyword arguments it needs."""
    from parallel_runtime.plans import find_plan, find_vae_plan

    method = getattr(type(model), scenario.method).__get__(model)
    options = {"transformer_options": {}} if scenario.method == "_forward" else {}  # VAEs take none
    return find_plan(model) or find_vae_plan(model), method, options


# Block Cache against no cache, unsharded and under Ulysses 2, sampled end to end (bench/cache_bench.py):
# the Flux and Wan shapes at sizes that sample a run in seconds on one CPU thread. Thresholds per model:
# with random weights the Flux-shaped model's first-block residual changes by 0.37-0.42 from step to
# step (its timestep embedding weighs every sinusoid alike; a trained model's changes far less), the
# Wan-shaped one's by less.
FLUX_CACHE = FluxShape(image_side=64, text_tokens=64)
WAN_CACHE = WanShape(layers=4, frames=3, side=32, text_tokens=64)
SCENARIOS += [
    Scenario("flux_cache_ulysses2", "flux", "cache", {"ulysses": 2}, flux(FLUX_CACHE), FLUX_CACHE.tokens,
             suites=("cache",), repeat=3,
             extra={"cache": True, "steps": 12, "thresholds": (0.39, 0.42, 0.6), "latent_format": "Flux",
                    "dbcache_shape": FLUX_CACHE},  # beside cache-dit's DBCache on the same network (CPU)
             notes="2 double + 4 single blocks; Block Cache Fn 1, Bn 0, warm-up 2, at most 3 cached in a row"),
    Scenario("wan_cache_ulysses2", "wan", "cache", {"ulysses": 2}, wan(WAN_CACHE), WAN_CACHE.tokens,
             suites=("cache",), repeat=3,
             extra={"cache": True, "steps": 12, "thresholds": (0.07, 0.1, 0.2), "latent_format": "Wan21",
                    "timestep_scale": 1000.0},
             notes="4 blocks; Block Cache Fn 1, Bn 0, warm-up 2, at most 3 cached in a row"),
]


# One sampling step with a Flux ControlNet, three ways in one run (bench/controlnet_bench.py): unsharded,
# the ControlNet on rank 0 only with the transformer under Ulysses 2, and both under Ulysses 2. The
# ControlNet has the transformer's width and 1 double + 1 single block: next to the transformer's 2 + 4
# that is InstantX's proportion (5 + 10 next to Flux.1's 19 + 38; XLabs' 2 + 0 is lighter). XLabs'
# layout runs an image hint through convolutions at 8x the latent's size every step (on every rank,
# before the tokens are cut): at width 512 that is a large part of the ControlNet, at Flux's 3072 a
# small one. InstantX's layout takes the VAE-encoded hint (a linear on its patches).
SCENARIOS += [
    Scenario("flux_controlnet_ulysses2", "flux", "controlnet", {"ulysses": 2}, flux(FLUX), FLUX.tokens,
             suites=("controlnet",), repeat=3,
             extra={"controlnet": True, "shape": FLUX, "double": 1, "single": 1, "strength": 0.8},
             notes="ControlNetFlux (XLabs layout, image hint 1024 x 1024), 1 double + 1 single block, width 512"),
    Scenario("flux_controlnet_instantx_ulysses2", "flux", "controlnet", {"ulysses": 2}, flux(FLUX), FLUX.tokens,
             suites=("controlnet",), repeat=3,
             extra={"controlnet": True, "shape": FLUX, "double": 1, "single": 1, "strength": 0.8,
                    "latent_input": True},
             notes="ControlNetFlux (InstantX layout, latent hint 16 x 128 x 128), 1 double + 1 single block, width 512"),
]
