"""The tiny GGUF files (tools/tiny_gguf.py) through the third-party ComfyUI-GGUF nodes, unchanged,
as tools/host.py installs them: UnetLoaderGGUF detects the model ComfyUI builds (class, config,
blocks kept quantized), and CLIPLoaderGGUF's UMT5 through Shard Text Encoder TP 2 equals the
unsharded encoder. Fails where the host has no ComfyUI-GGUF (tools/host.py installs it)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiny_models import saved_dataset
from workflows import parallel_config_node

pytestmark = pytest.mark.comfy_server
tiny_gguf = pytest.importorskip("tiny_gguf", reason="tools/tiny_gguf.py needs the gguf package")


@pytest.fixture(scope="module")
def gguf_nodes_dir(comfyui_path) -> Path:
    folder = Path(comfyui_path) / "custom_nodes" / "ComfyUI-GGUF"
    if not (folder / "nodes.py").is_file():
        pytest.fail(f"ComfyUI-GGUF is not installed in {folder}: tools/host.py copies it from ../shared/thirdparty")
    return folder


@pytest.fixture(scope="module")
def gguf_server(tiny_server, gguf_nodes_dir):
    """The session's server, with all the tiny GGUF files and their prompt datasets."""
    assert "UnetLoaderGGUF" in tiny_server.object_info(), "the session's server did not load ComfyUI-GGUF"
    tiny_gguf.write_tiny_gguf_files(tiny_server.base_dir)
    tiny_gguf.write_prompt_datasets(tiny_server.base_dir)
    return tiny_server


@pytest.fixture(scope="module")
def gguf_base(gguf_server) -> Path:
    return gguf_server.base_dir


@pytest.fixture(scope="module")
def gguf_module(gguf_nodes_dir, gguf_base, comfyui_path):
    """ComfyUI-GGUF imported in this process the way ComfyUI imports a custom node (a package),
    with the tiny files' folder among ComfyUI's model folders."""
    import folder_paths

    module = tiny_gguf.import_gguf_nodes(comfyui_path)
    folder_paths.add_model_folder_path("diffusion_models", str(gguf_base / "models" / "diffusion_models"))
    return module


def flux_heads_detected() -> bool:
    """ComfyUI 0.33 derives Flux.1's heads from its width (hidden // 128); 0.3.75 fixes 24."""
    import comfy.model_detection

    shapes = {"double_blocks.0.img_attn.norm.key_norm.scale": (128,), "img_in.weight": (1024, 64),
              "txt_in.weight": (1024, 64), "vector_in.in_layer.weight": (1024, 64)}
    config = comfy.model_detection.detect_unet_config({k: torch.empty(v, device="meta") for k, v in shapes.items()}, "")
    return config["num_heads"] == 1024 // 128


NARROW_FLUX = "this ComfyUI's detection fixes Flux.1 at 24 heads of 128 (width 3072): no narrower Flux.1 loads"


IMAGE_FILES = [n for n, (model, _) in tiny_gguf.GGUF_SPECS.items() if model != "umt5"]
EXPECTED = {
    "wan": ("comfy.ldm.wan.model.WanModel",
            {"dim": 1024, "num_heads": 8, "ffn_dim": 2048, "num_layers": 2, "in_dim": 16, "out_dim": 16,
             "model_type": "t2v"}),
    "flux": ("comfy.ldm.flux.model.Flux",
             {"hidden_size": 1024, "num_heads": 8, "mlp_ratio": 4.0, "context_in_dim": 64, "vec_in_dim": 64,
              "guidance_embed": True, "depth": 1, "depth_single_blocks": 1, "in_channels": 16}),
}


def test_nodes_are_there(gguf_server):
    info = gguf_server.object_info()
    for node in ("UnetLoaderGGUF", "CLIPLoaderGGUF", "DualCLIPLoaderGGUF"):
        assert node in info, node
    assert set(IMAGE_FILES) and {tiny_gguf.GGUF_FILES[n] for n in IMAGE_FILES} <= set(
        info["UnetLoaderGGUF"]["input"]["required"]["unet_name"][0])
    assert tiny_gguf.GGUF_FILES["umt5_q8_0"] in info["CLIPLoaderGGUF"]["input"]["required"]["clip_name"][0]


@pytest.mark.parametrize("name", IMAGE_FILES)
def test_loader_detects_the_model(name, gguf_module):
    """What UnetLoaderGGUF builds: ComfyUI's class at the file's config, the block weights kept
    quantized (GGMLTensor, raw blocks as (rows, bytes per row) uint8)."""
    kind, qtype = tiny_gguf.GGUF_SPECS[name]
    if kind == "flux" and not flux_heads_detected():
        pytest.skip(NARROW_FLUX)
    model = gguf_module.nodes.UnetLoaderGGUF().load_unet(tiny_gguf.GGUF_FILES[name])[0]
    dm = model.model.diffusion_model
    cls, config = EXPECTED[kind]
    assert f"{type(dm).__module__}.{type(dm).__name__}" == cls
    detected = model.model.model_config.unet_config
    assert {k: detected[k] for k in config} == config
    weight = dm.blocks[0].self_attn.q.weight if kind == "wan" else dm.double_blocks[0].img_attn.qkv.weight
    assert weight.tensor_type.name == qtype and weight.dtype == torch.uint8
    block_values, block_bytes = tiny_gguf.BLOCK_VALUES[qtype], tiny_gguf.BLOCK_BYTES[qtype]
    assert tuple(weight.data.shape) == (weight.shape[0], weight.shape[1] // block_values * block_bytes)


def encoded(server, prompt, folder):
    server.run(prompt, timeout=600)
    shard = torch.load(saved_dataset(server.base_dir, folder) / "shard_0000.pkl", weights_only=True)
    (((cond, _extra),),) = shard["conditioning"]
    return cond


def test_umt5_through_shard_text_encoder_tp2_equals_the_unsharded_encoder(gguf_server):
    """CLIPLoaderGGUF (type wan: UMT5-XXL, Q4_K) -> Shard Text Encoder (2 ranks, every planned layer
    cut from the GGUF blocks) -> CLIPTextEncode equals the same graph without the shard node. The
    sampling of every image file is in test_comfy_quantized_layouts.py."""
    text = "a red fox running through fresh snow"
    plain = tiny_gguf.text_encoder_prompt("umt5_q4_k", text, "gguf_umt5_ref")
    sharded = tiny_gguf.text_encoder_prompt("umt5_q4_k", text, "gguf_umt5_tp2")
    sharded["p"] = parallel_config_node(tp_size=2)
    sharded["s"] = {"class_type": "ShardTextEncoder", "inputs": {"clip": ["t1", 0], "parallel_config": ["p", 0]}}
    sharded["t2"]["inputs"]["clip"] = ["s", 0]
    ref = encoded(gguf_server, plain, "gguf_umt5_ref")
    out = encoded(gguf_server, sharded, "gguf_umt5_tp2")
    assert tuple(ref.shape) == (1, 512, 4096) and torch.isfinite(ref).all() and ref.abs().max() > 0
    err = (out - ref).abs().max().item()
    rel = err / ref.abs().max().item()
    ranks = gguf_server.get("/parallel/status")["ranks"]
    print(f"\nGGUF UMT5 Q4_K, Shard Text Encoder 2 ranks: max abs err {err:.1e}, relative {rel:.1e}; "
          f"weights per rank {[r['param_bytes'] for r in ranks]}")
    assert len(ranks) == 2 and rel <= 1e-5
