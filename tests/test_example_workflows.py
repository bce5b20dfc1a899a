"""Every example workflow through the HTTP API with its model files swapped for tiny generated ones.

Every file becomes a seeded random one of the same family, loaded by the same stock loader: Flux.1
and Qwen-Image at the widths ComfyUI's detection fixes (one block each); FLUX.2, T5-XXL, CLIP-L,
UMT5-XXL and Qwen2.5-VL at small configs that each file states in its metadata for the test
server's extension (tests/comfy_extensions; tools/tiny_models.py, tools/tiny_text_encoders.py),
with the real tokenizers. Mistral 3 Small (FLUX.2's encoder) is the one exception: ComfyUI 0.3.75's
Mistral tokenizer does not run under transformers 5, so the tiny T5-base stands in, loaded as
itself; Shard Text Encoder still splits it over the example's 4 ranks. Only file names, that one
loader type, sizes and step counts change: the graphs, nodes and links are as shipped.

The LTX-2, HunyuanVideo 1.5 and Z-Image Fun ControlNet examples have no tiny stand-ins yet
(LTX-2's checkpoint holds the transformer, both VAEs and Gemma's projection; HunyuanVideo 1.5 needs
its transformer, VAE and two encoders; ModelPatchLoader builds the Fun ControlNet at Z-Image's full
width, so no small file loads through it, and Qwen3-4B has no tiny file): ComfyUI's own /prompt
validation checks them against the live node registry instead, with empty files of the official
names (and a small control image for LoadImage), and the run must get as far as a loader. Their
nodes are ComfyUI 0.33's: on 0.3.75 those tests skip. The Z-Image example's wiring (the ControlNet
before Shard Transformer, Shard VAE encoding its control image, one Parallel Config for all four
parts) is checked on the file itself.
"""
import copy

import pytest

from comfy_server import PromptFailed, PromptRejected
from conftest import REPO
from workflows import load, ui_to_api

pytestmark = pytest.mark.comfy_server
WORKFLOWS = REPO / "example_workflows"
MODEL_SWAPS = {
    "wan2.1_t2v_1.3B_fp16.safetensors": "tiny_wan21_t2v.safetensors",
    "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors": "tiny_wan21_t2v.safetensors",
    "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors": "tiny_wan21_t2v_4heads.safetensors",
    "flux1-dev.safetensors": "tiny_flux1.safetensors",
    "qwen_image_fp8_e4m3fn.safetensors": "tiny_qwen_image.safetensors",
    "flux2_dev_fp8mixed.safetensors": "tiny_flux2.safetensors",
    "wan_2.1_vae.safetensors": "tiny_wan21_vae.safetensors",
    "qwen_image_vae.safetensors": "tiny_wan21_vae.safetensors",
    "ae.safetensors": "tiny_flux_ae.safetensors",
    "flux2-vae.safetensors": "tiny_flux2_vae.safetensors",
    "umt5_xxl_fp8_e4m3fn_scaled.safetensors": "tiny_umt5_xxl.safetensors",
    "t5xxl_fp16.safetensors": "tiny_t5_xxl.safetensors",
    "clip_l.safetensors": "tiny_clip_l.safetensors",
    "qwen_2.5_vl_7b_fp8_scaled.safetensors": "tiny_qwen25_vl_7b.safetensors",
    "mistral_3_small_flux2_bf16.safetensors": "tiny_t5_base.safetensors",
}
# Mistral 3 has no small stand-in the stock loader builds (see above): T5-base is loaded as what it is.
TYPE_SWAPS = {"tiny_t5_base.safetensors": "stable_audio"}
FILE_INPUTS = ("unet_name", "vae_name", "clip_name", "clip_name1", "clip_name2")
Z_IMAGE_CONTROLNET = "z_image_turbo_fun_controlnet_ulysses2_shard_te_vae.json"
REGISTRY_ONLY = ("ltx2_t2v_audio_ulysses2_tp2_shard_te_vae.json", "hunyuan_video15_t2v_ulysses2_shard_vae.json",
                 Z_IMAGE_CONTROLNET)
MODEL_FOLDERS = {"unet_name": "diffusion_models", "vae_name": "vae", "clip_name": "text_encoders",
                 "clip_name1": "text_encoders", "clip_name2": "text_encoders", "text_encoder": "text_encoders",
                 "ckpt_name": "checkpoints"}
NODE_FOLDERS = {("ModelPatchLoader", "name"): "model_patches"}  # an input name too common to map for every node
LOADERS = {"CheckpointLoaderSimple", "LTXAVTextEncoderLoader", "LTXVAudioVAELoader", "UNETLoader", "CLIPLoader",
           "DualCLIPLoader", "VAELoader", "ModelPatchLoader"}


@pytest.fixture(scope="module")
def large_files(tiny_base):
    from tiny_models import LARGE_FILES, write_tiny_wan_files

    write_tiny_wan_files(tiny_base, only=LARGE_FILES)


def tiny_version(prompt: dict) -> dict:
    p = copy.deepcopy(prompt)
    for node in p.values():
        for name in FILE_INPUTS:
            if name in node["inputs"]:
                node["inputs"][name] = MODEL_SWAPS.get(node["inputs"][name], node["inputs"][name])
                if node["inputs"][name] in TYPE_SWAPS:
                    node["inputs"]["type"] = TYPE_SWAPS[node["inputs"][name]]
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


@pytest.mark.parametrize("name", sorted(p.name for p in WORKFLOWS.glob("*.json") if p.name not in REGISTRY_ONLY))
def test_example_workflow_runs_with_tiny_models(name, tiny_server, large_files):
    prompt = ui_to_api(load(WORKFLOWS / name), tiny_server.object_info())
    notes = [n for n in load(WORKFLOWS / name)["nodes"] if n["type"] in ("Note", "MarkdownNote")]
    assert notes and len(notes[0]["widgets_values"][0]) > 80  # each explains its choices
    shard_nodes = [k for k, n in prompt.items() if n["class_type"] in ("ShardTransformer", "ShardVAE")]
    assert shard_nodes
    tiny = tiny_version(prompt)
    assert {k: n["class_type"] for k, n in tiny.items()} == {k: n["class_type"] for k, n in prompt.items()}
    entry = tiny_server.run(tiny, timeout=900)
    assert entry["status"]["status_str"] == "success"
    ranks = tiny_server.get("/parallel/status")["ranks"]
    configs = [n["inputs"] for n in tiny.values() if n["class_type"] == "ParallelConfig"]
    world = max(c["ulysses_size"] * c["ring_size"] * c["tp_size"] * c["cfg_size"] for c in configs)
    print(f"\n{name}: ran on {len(ranks)} ranks, steps per rank {[r['forwards'] for r in ranks]}")
    assert len(ranks) == world and all(r["forwards"] > 0 for r in ranks)


def test_template_browser_lists_and_serves_every_example(tiny_server):
    from comfy_server import PACK_NAME

    listed = tiny_server.get("/workflow_templates")[PACK_NAME]
    shipped = sorted(p.stem for p in WORKFLOWS.glob("*.json"))
    assert sorted(listed) == shipped
    for name in shipped:
        assert tiny_server.get(f"/api/workflow_templates/{PACK_NAME}/{name}.json") == load(WORKFLOWS / f"{name}.json")


def _placeholder_files(prompt: dict, base) -> list:
    """An empty file under each model name the prompt loads, and a small image under each name LoadImage
    loads (only those not there already)."""
    from PIL import Image

    made = []
    for node in prompt.values():
        folders = {**MODEL_FOLDERS, **{name: f for (kind, name), f in NODE_FOLDERS.items() if kind == node["class_type"]}}
        for name, folder in folders.items():
            value = node["inputs"].get(name)
            path = base / "models" / folder / value if isinstance(value, str) else None
            if path is not None and not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
                made.append(path)
        image = node["inputs"].get("image") if node["class_type"] == "LoadImage" else None
        if isinstance(image, str) and not (base / "input" / image).exists():
            (base / "input").mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (64, 64), (128, 128, 128)).save(base / "input" / image)
            made.append(base / "input" / image)
    return made


@pytest.mark.parametrize("name", REGISTRY_ONLY)
def test_example_workflow_passes_comfyui_validation(name, tiny_server, tiny_base):
    info = tiny_server.object_info()
    workflow = load(WORKFLOWS / name)
    notes = [n for n in workflow["nodes"] if n["type"] in ("Note", "MarkdownNote")]
    assert notes and ".safetensors" in notes[0]["widgets_values"][0]  # the official file names
    missing = sorted({n["type"] for n in workflow["nodes"]} - set(info) - {"Note", "MarkdownNote"})
    if missing:
        pytest.skip(f"this ComfyUI has no {', '.join(missing)} (ComfyUI 0.33 nodes)")
    prompt = tiny_version(ui_to_api(workflow, info))
    assert {"ParallelConfig", "ShardTransformer", "ShardVAE"} <= {n["class_type"] for n in prompt.values()}
    made = _placeholder_files(prompt, tiny_base)
    try:
        bad = copy.deepcopy(prompt)  # the validation is real: an unknown file is refused
        loader = next(n for n in bad.values() if n["class_type"] in LOADERS)
        loader["inputs"].update({k: "no_such_file.safetensors" for k in MODEL_FOLDERS if k in loader["inputs"]})
        with pytest.raises(PromptRejected, match="no_such_file"):
            tiny_server.queue(bad)
        prompt_id = tiny_server.queue(prompt)  # PromptRejected names every input ComfyUI refuses
        with pytest.raises(PromptFailed) as failed:  # then the run reaches a loader, which cannot read an empty file
            tiny_server.wait(prompt_id, timeout=300)
    finally:
        for path in made:
            path.unlink()
    print(f"\n{name}: accepted by ComfyUI; the run stopped at {failed.value.error.get('node_type')} (empty file)")
    assert failed.value.error.get("node_type") in LOADERS


def test_z_image_controlnet_example_is_wired_for_five_parallel_parts():
    """Z-Image Fun ControlNet 2.1 (cache-dit's "5D" case): Shard Transformer shards the model the ControlNet
    patched, Shard VAE both encodes the control image (scaled to the latent's size, which the sharded
    forward requires) and decodes, Shard Text Encoder feeds the prompt, all from one Ulysses-2 Parallel Config;
    the note names every official file with its folder."""
    workflow = load(WORKFLOWS / Z_IMAGE_CONTROLNET)
    nodes = {n["id"]: n for n in workflow["nodes"]}
    links = {link[0]: link for link in workflow["links"]}

    def source(node, socket):
        (link,) = [links[s["link"]] for s in node["inputs"] if s["name"] == socket and s["link"] is not None]
        return nodes[link[1]]

    def one(kind):
        (node,) = [n for n in nodes.values() if n["type"] == kind]
        return node

    shard, controlnet, decode = one("ShardTransformer"), one("ZImageFunControlnet"), one("VAEDecode")
    assert source(shard, "model") is controlnet and source(controlnet, "model")["type"] == "UNETLoader"
    assert source(controlnet, "model_patch")["widgets_values"] == ["Z-Image-Turbo-Fun-Controlnet-Union-2.1.safetensors"]
    assert source(controlnet, "vae") is one("ShardVAE") is source(decode, "vae")
    assert source(one("CLIPTextEncode"), "clip") is one("ShardTextEncoder")
    assert source(one("ShardTextEncoder"), "clip")["widgets_values"][:2] == ["qwen_3_4b.safetensors", "lumina2"]
    assert source(one("KSampler"), "model") is shard
    scale, latent = source(controlnet, "image"), one("EmptySD3LatentImage")
    assert scale["type"] == "ImageScale" and scale["widgets_values"][1:3] == latent["widgets_values"][:2]
    assert source(scale, "image")["type"] == "LoadImage"
    config = one("ParallelConfig")
    assert config["widgets_values"][:4] == [2, 1, 1, 1]  # ulysses 2, ring 1, tp 1, cfg 1: 2 GPUs
    assert all(source(nodes[i], "parallel_config") is config for i in (shard["id"], one("ShardTextEncoder")["id"],
                                                                      one("ShardVAE")["id"]))
    steps, cfg = one("KSampler")["widgets_values"][2:4]
    assert 8 <= steps <= 9 and cfg == 1.0  # Z-Image Turbo
    note = one("Note")["widgets_values"][0]
    for path in ("diffusion_models/z_image_turbo_bf16.safetensors", "text_encoders/qwen_3_4b.safetensors",
                 "vae/ae.safetensors", "model_patches/Z-Image-Turbo-Fun-Controlnet-Union-2.1.safetensors"):
        assert path in note
    assert "5D" in note and "every rank" in note
