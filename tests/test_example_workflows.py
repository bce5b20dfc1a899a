"""Every example workflow through the HTTP API with its model files swapped for tiny generated ones.

The diffusion models and VAEs become seeded random files of the same families (Flux.1 and
Qwen-Image at the widths ComfyUI's detection fixes, one block each; FLUX.2 at width 256, which
its file's metadata states for the test server's extension, see tests/comfy_extensions).
Text: FLUX.2's example shards its encoder with Shard Text Encoder, so its text path stays whole,
with the tiny T5-base (the smallest encoder the stock CLIPLoader builds) in place of Mistral 3
Small 24B, whose config ComfyUI fixes and whose tokenizer needs transformers 4. The other
examples' text encoders (T5-XXL with CLIP-L, UMT5-XXL, Qwen2.5-VL 7B) are stock nodes at fixed
billion-parameter sizes outside the pack, so their prompts come from stored embeddings. Every node
of the pack in a shipped graph runs. Sizes and step counts shrink so that a CPU runs each in
seconds; the graphs are otherwise as shipped.
"""
import copy

import pytest

from conftest import REPO
from workflows import find_nodes, load, ui_to_api

pytestmark = pytest.mark.comfy_server
WORKFLOWS = REPO / "example_workflows"
MODEL_SWAPS = {
    "wan2.1_t2v_1.3B_fp16.safetensors": "tiny_wan21_t2v.safetensors",
    "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors": "tiny_wan21_t2v.safetensors",
    "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors": "tiny_wan21_t2v_4heads.safetensors",
    "flux1-dev.safetensors": "tiny_flux1.safetensors",
    "qwen_image_fp8_e4m3fn.safetensors": "tiny_qwen_image.safetensors",
    "wan_2.1_vae.safetensors": "tiny_wan21_vae.safetensors",
    "qwen_image_vae.safetensors": "tiny_wan21_vae.safetensors",
    "ae.safetensors": "tiny_flux_ae.safetensors",
    "flux2_dev_fp8mixed.safetensors": "tiny_flux2.safetensors",
    "flux2-vae.safetensors": "tiny_flux2_vae.safetensors",
}
PROMPT_EMBEDDINGS = {
    "umt5_xxl_fp8_e4m3fn_scaled.safetensors": "tiny_wan_prompt",
    "t5xxl_fp16.safetensors": "tiny_flux_prompt",
    "qwen_2.5_vl_7b_fp8_scaled.safetensors": "tiny_qwen_prompt",
}
TEXT_ENCODER_SWAPS = {  # file -> (tiny file, the CLIPLoader type that builds it)
    "mistral_3_small_flux2_bf16.safetensors": ("tiny_t5_base.safetensors", "stable_audio"),
}
TEXT_NODES = ("CLIPLoader", "DualCLIPLoader", "ShardTextEncoder")
PACK_NODES = ("ParallelConfig", "ShardTransformer", "ShardTextEncoder", "ShardVAE")


@pytest.fixture(scope="module")
def large_files(tiny_base):
    from tiny_models import LARGE_FILES, write_tiny_wan_files

    write_tiny_wan_files(tiny_base, only=LARGE_FILES)


def _source(prompt, ref):
    """Follow a link back through Shard Text Encoder to the loader node."""
    node_id = ref[0]
    while prompt[node_id]["class_type"] == "ShardTextEncoder":
        node_id = prompt[node_id]["inputs"]["clip"][0]
    return node_id


def _consumers(prompt, node_id):
    return [k for k, n in prompt.items() if any(isinstance(v, list) and v[:1] == [node_id] for v in n["inputs"].values())]


def tiny_version(prompt: dict) -> dict:
    p = copy.deepcopy(prompt)
    for node in p.values():
        for name in ("unet_name", "vae_name"):
            if name in node["inputs"]:
                node["inputs"][name] = MODEL_SWAPS.get(node["inputs"][name], node["inputs"][name])
    for node in p.values():
        if node["class_type"] == "CLIPLoader" and node["inputs"]["clip_name"] in TEXT_ENCODER_SWAPS:
            node["inputs"]["clip_name"], node["inputs"]["type"] = TEXT_ENCODER_SWAPS[node["inputs"]["clip_name"]]
    for node_id in find_nodes(p, "CLIPTextEncode"):
        loader = p[_source(p, p[node_id]["inputs"]["clip"])]["inputs"]
        text_file = loader.get("clip_name2") or loader["clip_name"]
        if text_file not in PROMPT_EMBEDDINGS:
            continue
        p[node_id] = {"class_type": "LoadTrainingDataset", "inputs": {"folder_name": PROMPT_EMBEDDINGS[text_file]}}
        for node in p.values():  # LoadTrainingDataset's conditioning is its second output
            for name, value in node["inputs"].items():
                if value == [node_id, 0]:
                    node["inputs"][name] = [node_id, 1]
    while unused := [k for k, n in p.items() if n["class_type"] in TEXT_NODES and not _consumers(p, k)]:
        for node_id in unused:
            del p[node_id]
    for node in p.values():
        inputs, kind = node["inputs"], node["class_type"]
        if kind in ("EmptySD3LatentImage", "EmptyFlux2LatentImage", "Flux2Scheduler"):
            inputs.update(width=64, height=64)
        elif kind == "EmptyHunyuanLatentVideo":
            inputs.update(width=80, height=48, length=9)
        if kind in ("KSampler", "Flux2Scheduler"):
            inputs["steps"] = 2
        elif kind == "KSamplerAdvanced":
            first = inputs["start_at_step"] == 0
            inputs.update(steps=4, start_at_step=0 if first else 2, end_at_step=2 if first else 4)
        elif kind == "ParallelConfig":
            world = inputs["ulysses_size"] * inputs["ring_size"] * inputs["tp_size"] * inputs["cfg_size"]
            inputs["devices"] = ",".join(["cpu"] * world)  # this 2-core machine oversubscribes on purpose
    return p


@pytest.mark.parametrize("name", sorted(p.name for p in WORKFLOWS.glob("*.json")))
def test_example_workflow_runs_with_tiny_models(name, tiny_server, large_files):
    prompt = ui_to_api(load(WORKFLOWS / name), tiny_server.object_info())
    notes = [n for n in load(WORKFLOWS / name)["nodes"] if n["type"] in ("Note", "MarkdownNote")]
    assert notes and len(notes[0]["widgets_values"][0]) > 80  # each explains its choices
    shard_nodes = [k for k, n in prompt.items() if n["class_type"] in ("ShardTransformer", "ShardVAE")]
    assert shard_nodes
    tiny = tiny_version(prompt)
    pack_nodes = {k for k, n in prompt.items() if n["class_type"] in PACK_NODES}
    assert pack_nodes <= tiny.keys()  # the pack's part of the graph runs as shipped
    entry = tiny_server.run(tiny, timeout=900)
    assert entry["status"]["status_str"] == "success"
    ranks = tiny_server.get("/parallel/status")["ranks"]
    configs = [n["inputs"] for n in tiny.values() if n["class_type"] == "ParallelConfig"]
    world = max(c["ulysses_size"] * c["ring_size"] * c["tp_size"] * c["cfg_size"] for c in configs)
    print(f"\n{name}: ran on {len(ranks)} ranks, steps per rank {[r['forwards'] for r in ranks]}")
    assert len(ranks) == world and all(r["forwards"] > 0 for r in ranks)
