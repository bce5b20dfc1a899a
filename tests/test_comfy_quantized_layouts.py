"""Quantized model files through a real ComfyUI server, under every layout, against the unsharded
run of the same file in the same server: the same dequantization on every rank, so fp32 tolerance.
A LoRA sits before and one after Shard Transformer in every graph.

- GGUF (ComfyUI-GGUF's loader, installed in the test host as a user would): Q8_0, Q4_K and Q5_K
  files written by tools/tiny_gguf.py;
- ComfyUI's own scaled-fp8 checkpoints (the ``*_fp8_scaled`` files) through the stock UNETLoader:
  per-tensor float8_e4m3fn with a scale per layer (tools/tiny_models.scaled_fp8_state_dict) of the
  same models. 0.3.75 runs them in its scaled-fp8 layers, 0.33 as QuantizedTensor.
"""
from __future__ import annotations

import pytest

from test_comfy_e2e import TOL, final_latent, status
from workflows import parallel_config_node

pytestmark = pytest.mark.comfy_server

gguf_tools = pytest.importorskip("tiny_gguf", reason="tools/tiny_gguf.py needs the gguf package")

LAYOUTS = {
    "Ulysses 2": {"ulysses_size": 2},
    "Ring 2": {"ring_size": 2},
    "TP 2": {"tp_size": 2},
    "CFG 2": {"cfg_size": 2},  # Wan samples at cfg 2 (cond and uncond on their own rank); Flux at 1
    "Ulysses 2 x TP 2": {"ulysses_size": 2, "tp_size": 2, "devices": "cpu,cpu,cpu,cpu"},
}


def QUICK_TIER(test: str, params: dict) -> bool:
    """The default run (conftest.in_quick_tier): the quantized models under Ulysses 2 x TP 2 (cut weights
    and a split sequence at once) and Ring 2; TP 2's share of the bytes; ``--full``: every layout, TP 4."""
    if test == "test_quantized_models_under_every_layout_equal_the_unsharded_run":
        return params["layout"] in ("Ulysses 2 x TP 2", "Ring 2")
    if test == "test_tp_ranks_hold_their_share_of_the_quantized_bytes":
        return params["tp"] == 2
    return True


def _models() -> tuple[str, ...]:
    from test_comfy_gguf_loaders import flux_heads_detected

    # 0.3.75's detection fixes Flux.1 at 24 heads of 128: no Flux narrower than 3072 loads there.
    return ("wan", "flux") if flux_heads_detected() else ("wan",)


MODELS = _models()
FP8 = "fp8_scaled"
FORMATS = (*gguf_tools.GGUF_QTYPES, FP8)  # per model file: a GGUF type, or ComfyUI's scaled fp8


def fp8_file(model: str) -> str:
    return f"{gguf_tools.MODELS[model][2]}_{FP8}.safetensors"


def loader(model: str, form: str) -> dict:
    if form == FP8:
        return {"class_type": "UNETLoader", "inputs": {"unet_name": fp8_file(model), "weight_dtype": "default"}}
    return {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": gguf_tools.GGUF_FILES[f"{model}_{form.lower()}"]}}
WAN_LATENT = {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 48, "height": 32, "length": 5,
                                                                  "batch_size": 1}}
FLUX_LATENT = {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 48, "batch_size": 1}}
# Layers TP cuts as columns, as rows, and fused (Flux's qkv, the single block's linear1 / linear2);
# Wan's text_embedding.2 is kept in F16 by the file (its patches are merged, not applied per forward).
LORA_TARGETS = {
    "wan": [f"blocks.{i}.{name}" for i in range(2) for name in ("self_attn.q", "self_attn.o", "ffn.0", "ffn.2")]
    + ["text_embedding.2"],
    "flux": ["double_blocks.0.img_attn.qkv", "double_blocks.0.txt_mlp.2", "single_blocks.0.linear1",
             "single_blocks.0.linear2"],
}


def lora_name(model: str, which: str) -> str:
    return f"tiny_gguf_{model}_lora_{which}.safetensors"


@pytest.fixture(scope="module")
def gguf_server(tiny_server):
    """The session's server, with the GGUF files and LoRAs shaped for them."""
    if "UnetLoaderGGUF" not in tiny_server.object_info():
        pytest.fail("ComfyUI-GGUF is not installed in this host: tools/host.py installs it from ../shared/thirdparty")
    from safetensors.torch import save_file

    from tiny_models import lora_state_dict, scaled_fp8_state_dict

    base = tiny_server.base_dir
    gguf_tools.write_tiny_gguf_files(base, only=[f"{m}_{q.lower()}" for m in MODELS for q in gguf_tools.GGUF_QTYPES])
    loras = base / "models" / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    for model in MODELS:
        weights = gguf_tools.MODELS[model][0]()
        fp8 = base / "models" / "diffusion_models" / fp8_file(model)
        if not fp8.exists():
            save_file(scaled_fp8_state_dict(weights), str(fp8))
        shapes = {k: tuple(v.shape) for k, v in weights.items()}
        targets = LORA_TARGETS[model]
        for which, seed, picked in (("before", 61, targets), ("after", 62, targets[::2])):
            path = loras / lora_name(model, which)
            if not path.exists():
                save_file(lora_state_dict(shapes, picked, rank=4, seed=seed), str(path))
    return tiny_server


def quantized_prompt(model: str, form: str, parallel: dict | None, seed: int = 5) -> dict:
    """The file's loader -> LoRA -> (Shard Transformer) -> LoRA -> KSampler (1 step: every forward of
    a sampler's step is the same code) -> SaveLatent."""
    wan = model == "wan"
    prompt = {
        "1": loader(model, form),
        "2": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": lora_name(model, "before"),
                                                              "strength_model": 0.7}},
        "5": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["2", 0], "lora_name": lora_name(model, "after"),
                                                              "strength_model": 0.5}},
        "6": {"class_type": "LoadTrainingDataset",
              "inputs": {"folder_name": "tiny_wan_prompt" if wan else "tiny_family_prompt_pooled"}},
        "7": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["6", 1]}},
        "8": WAN_LATENT if wan else FLUX_LATENT,
        "9": {"class_type": "KSampler", "inputs": {"model": ["5", 0], "positive": ["6", 1], "negative": ["7", 0],
                                                   "latent_image": ["8", 0], "seed": seed, "steps": 1,
                                                   "cfg": 2.0 if wan else 1.0, "sampler_name": "euler",
                                                   "scheduler": "simple", "denoise": 1.0}},
        "10": {"class_type": "SaveLatent", "inputs": {"samples": ["9", 0], "filename_prefix": f"latents/quantized_{model}"}},
    }
    if parallel is not None:
        prompt["3"] = parallel_config_node(**parallel)
        prompt["4"] = {"class_type": "ShardTransformer", "inputs": {"model": ["2", 0], "parallel_config": ["3", 0]}}
        prompt["5"]["inputs"]["model"] = ["4", 0]
    return prompt


_REFERENCES: dict = {}


def reference(server, model: str, form: str):
    key = (model, form)
    if key not in _REFERENCES:
        _REFERENCES[key] = final_latent(server, quantized_prompt(model, form, None))
    return _REFERENCES[key]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_quantized_models_under_every_layout_equal_the_unsharded_run(gguf_server, layout):
    """Each quant type, Wan and Flux, with LoRAs before and after the shard node."""
    errors = {}
    for model in MODELS:
        for qtype in FORMATS:
            ref = reference(gguf_server, model, qtype)
            out = final_latent(gguf_server, quantized_prompt(model, qtype, LAYOUTS[layout]))
            assert out.shape == ref.shape
            scale = ref.abs().max().item()
            assert scale > 0.1  # a real output, not zeros
            errors[(model, qtype)] = ((out - ref).abs().max().item(), (out - ref).abs().max().item() / scale)
    info = status(gguf_server)
    print(f"\n{layout}: max abs / relative err " + ", ".join(f"{m} {q} {a:.1e} / {r:.1e}"
                                                             for (m, q), (a, r) in errors.items()))
    assert len(info["ranks"]) == max(2, LAYOUTS[layout].get("tp_size", 1) * LAYOUTS[layout].get("ulysses_size", 1))
    # Ring merges and TP's all-reduces sum in another order than one process: fp32 rounding,
    # relative to the output's size (the 1024-wide models reach a few units).
    assert max(r for _, r in errors.values()) <= TOL, errors


def tensor_bytes(server, model: str, form: str) -> int:
    """Bytes of the tensors stored in the model's file of that form."""
    if form == FP8:
        from safetensors import safe_open

        with safe_open(str(server.base_dir / "models" / "diffusion_models" / fp8_file(model)), "pt") as f:
            return sum(f.get_tensor(k).nbytes for k in f.keys())
    import gguf

    path = gguf_tools.gguf_path(server.base_dir, f"{model}_{form.lower()}")
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


@pytest.mark.parametrize("tp,limit", [(2, 0.52), (4, 0.27)])
def test_tp_ranks_hold_their_share_of_the_quantized_bytes(gguf_server, tp, limit):
    """Every planned layer is cut as stored, with the LoRAs before and after the node on and off:
    each rank holds its share of the file (a layer dequantized on the way would hold 2-4 times
    its stored bytes; the GGUF layers carry their LoRA patches cut alike and apply them when they
    dequantize). Q8_0 (blocks of 32), Q4_K (super-blocks of 256, the coarsest: Q5_K cuts alike)
    and scaled fp8 (one byte a value; ComfyUI merges the LoRAs into it)."""
    shares = {}
    for qtype in ("Q8_0", "Q4_K", FP8):
        for lora in ("off", "on"):
            prompt = quantized_prompt("wan", qtype, {"tp_size": tp, "devices": ",".join(["cpu"] * tp)})
            if lora == "off":
                for node in ("2", "5"):
                    prompt[node]["inputs"]["strength_model"] = 0.0
            gguf_server.run(prompt, timeout=300)
            ranks = status(gguf_server)["ranks"]
            whole = tensor_bytes(gguf_server, "wan", qtype)
            shares[(qtype, lora)] = [r["param_bytes"] / whole for r in ranks]
            assert len(ranks) == tp and min(shares[(qtype, lora)]) > 0
    print(f"\nTP {tp}: quantized bytes per rank / the file's tensor bytes: "
          + ", ".join(f"{q} LoRA {lora} {max(s):.3f}" for (q, lora), s in shares.items()))
    assert max(max(s) for s in shares.values()) <= limit, shares
