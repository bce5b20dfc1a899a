#!/usr/bin/env python
"""Write the UI-format files in example_workflows/ from the compact graphs below.

Sockets, types and widget order come from a live ComfyUI's /object_info, so the
files match what the front end itself would save. Run it (through
``tools/run.sh python tools/build_example_workflows.py [NAME.json ...]``: all, or the named ones)
after changing a graph. The LTX-2 and HunyuanVideo 1.5 examples use nodes ComfyUI 0.3.75 lacks:
build them on the 0.33 host (``PARALLEL_COMFYUI_VERSION=0.33.0``).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.append(str(REPO))  # after ComfyUI's root: its nodes.py must win over our nodes/

from comfy_server import ComfyServer  # noqa: E402
from parallel_runtime.comfyui_location import comfyui_path  # noqa: E402
from workflows import _input_order, _is_widget  # noqa: E402

OUT = REPO / "example_workflows"


class Graph:
    def __init__(self, object_info: dict):
        self.info = object_info
        self.nodes: list[dict] = []
        self.links: list[list] = []

    def add(self, node_id: int, kind: str, widgets: dict | None = None, *, col: int, row: int, title=None,
            size=(320, 130)) -> int:
        widgets = widgets or {}
        node = {"id": node_id, "type": kind, "pos": [40 + col * 360, 40 + row * 200], "size": list(size),
                "flags": {}, "order": len(self.nodes), "mode": 0, "properties": {"Node name for S&R": kind}}
        if title:
            node["title"] = title
        if kind in ("Note", "MarkdownNote"):
            node.update(inputs=[], outputs=[], widgets_values=[widgets["text"]])
            node["color"], node["bgcolor"] = "#432", "#653"
            self.nodes.append(node)
            return node_id
        info = self.info[kind]
        inputs, values = [], []
        for name, spec in _input_order(info):
            if _is_widget(spec):
                default = spec[1].get("default") if len(spec) > 1 and isinstance(spec[1], dict) else None
                options = spec[0] if isinstance(spec[0], list) else (spec[1].get("options") if len(spec) > 1 else None)
                if default is None and options:
                    default = options[0]  # a combo: the first choice, as the front end shows it
                values.append(widgets.pop(name, default))
                if len(spec) > 1 and isinstance(spec[1], dict) and spec[1].get("control_after_generate"):
                    values.append("fixed")
            else:
                inputs.append({"name": name, "type": spec[0], "link": None})
        if widgets:
            raise KeyError(f"{kind} has no widget inputs {sorted(widgets)}")
        outputs = [{"name": name, "type": kind_, "links": [], "slot_index": i}
                   for i, (name, kind_) in enumerate(zip(info.get("output_name", info["output"]), info["output"]))]
        node.update(inputs=inputs, outputs=outputs, widgets_values=values)
        self.nodes.append(node)
        return node_id

    def connect(self, src: int, src_slot: int, dst: int, input_name: str) -> None:
        link_id = len(self.links) + 1
        s = next(n for n in self.nodes if n["id"] == src)
        d = next(n for n in self.nodes if n["id"] == dst)
        kind = s["outputs"][src_slot]["type"]
        socket = next(i for i in d["inputs"] if i["name"] == input_name)
        socket["link"] = link_id
        s["outputs"][src_slot]["links"].append(link_id)
        self.links.append([link_id, src, src_slot, dst, d["inputs"].index(socket), kind])

    def to_json(self) -> dict:
        return {"last_node_id": max(n["id"] for n in self.nodes), "last_link_id": len(self.links),
                "nodes": self.nodes, "links": self.links, "groups": [], "config": {},
                "extra": {"ds": {"scale": 0.8, "offset": [0, 0]}}, "version": 0.4}


TINY_NOTE = """Tiny Wan 2.1 demo for Hybrid Parallel (runs on the CPU in seconds).

The model files are generated with random weights by tools/demo.py, so the picture is noise: what matters
is that the sharded run (Parallel Config ulysses_size 2: two ranks) gives the same latents as one rank.
The text embedding comes from a file through Load Training Dataset because the real Wan text encoder
(UMT5-XXL) is far too large to generate. One LoRA sits before Shard Transformer and one after it:
both reach every rank."""

WAN_NOTE = """Wan 2.1 text-to-video on 2 GPUs with Hybrid Parallel.

Parallel Config: ulysses_size 2 splits the video tokens over two GPUs (context parallelism); each GPU
holds the whole transformer and computes half of every step, and the result equals the single-GPU run.
Wan 2.1 1.3B has 12 attention heads, so ulysses_size may be 1, 2, 3, 4, 6 or 12 (14B: 40 heads).
devices 'auto' takes ComfyUI's GPU first and then the next ones.

Models (official ComfyUI repackage, Comfy-Org/Wan_2.1_ComfyUI_repackaged):
  diffusion_models/wan2.1_t2v_1.3B_fp16.safetensors
  text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors
  vae/wan_2.1_vae.safetensors
LoRA loaders may go before or after Shard Transformer."""


def tiny_wan(info: dict) -> dict:
    g = Graph(info)
    g.add(1, "UNETLoader", {"unet_name": "tiny_wan21_t2v.safetensors", "weight_dtype": "default"}, col=0, row=0)
    g.add(2, "LoraLoaderModelOnly", {"lora_name": "tiny_wan21_lora_a.safetensors", "strength_model": 0.8},
          col=1, row=0, title="LoRA before the shard node")
    g.add(3, "ParallelConfig", {"ulysses_size": 2}, col=1, row=1, size=(320, 210))
    g.add(4, "ShardTransformer", col=2, row=0)
    g.add(5, "LoraLoaderModelOnly", {"lora_name": "tiny_wan21_lora_b.safetensors", "strength_model": 0.6},
          col=3, row=0, title="LoRA after the shard node")
    g.add(6, "LoadTrainingDataset", {"folder_name": "tiny_wan_prompt"}, col=0, row=2, title="Prompt embedding")
    g.add(7, "ConditioningZeroOut", col=1, row=3, title="Negative (zeros)")
    g.add(8, "EmptyHunyuanLatentVideo", {"width": 80, "height": 48, "length": 9, "batch_size": 1}, col=2, row=2)
    g.add(9, "KSampler", {"seed": 42, "steps": 3, "cfg": 3.0, "sampler_name": "euler", "scheduler": "simple",
                          "denoise": 1.0}, col=4, row=0, size=(320, 262))
    g.add(10, "SaveLatent", {"filename_prefix": "latents/tiny_wan"}, col=5, row=0)
    g.add(11, "VAELoader", {"vae_name": "tiny_wan21_vae.safetensors"}, col=4, row=2)
    g.add(12, "VAEDecode", col=5, row=1)
    g.add(13, "SaveImage", {"filename_prefix": "tiny_wan"}, col=6, row=1, size=(320, 300))
    g.add(14, "Note", {"text": TINY_NOTE}, col=0, row=4, size=(700, 180))
    g.connect(1, 0, 2, "model")
    g.connect(2, 0, 4, "model")
    g.connect(3, 0, 4, "parallel_config")
    g.connect(4, 0, 5, "model")
    g.connect(5, 0, 9, "model")
    g.connect(6, 1, 9, "positive")
    g.connect(6, 1, 7, "conditioning")
    g.connect(7, 0, 9, "negative")
    g.connect(8, 0, 9, "latent_image")
    g.connect(9, 0, 10, "samples")
    g.connect(9, 0, 12, "samples")
    g.connect(11, 0, 12, "vae")
    g.connect(12, 0, 13, "images")
    return g.to_json()


def wan21_t2v(info: dict) -> dict:
    g = Graph(info)
    g.add(1, "UNETLoader", {"unet_name": "wan2.1_t2v_1.3B_fp16.safetensors", "weight_dtype": "default"},
          col=0, row=0)
    g.add(2, "ModelSamplingSD3", {"shift": 8.0}, col=1, row=0)
    g.add(3, "ParallelConfig", {"ulysses_size": 2}, col=1, row=1, size=(320, 210))
    g.add(4, "ShardTransformer", col=2, row=0)
    g.add(5, "CLIPLoader", {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan"}, col=0, row=2)
    g.add(6, "CLIPTextEncode", {"text": "a red fox running through fresh snow at sunrise, cinematic"},
          col=1, row=2, title="Positive", size=(400, 160))
    g.add(7, "CLIPTextEncode", {"text": "blurry, low quality, static, distorted"}, col=1, row=3,
          title="Negative", size=(400, 160))
    g.add(8, "EmptyHunyuanLatentVideo", {"width": 832, "height": 480, "length": 33, "batch_size": 1}, col=2, row=2)
    g.add(9, "KSampler", {"seed": 42, "steps": 30, "cfg": 6.0, "sampler_name": "uni_pc", "scheduler": "simple",
                          "denoise": 1.0}, col=3, row=0, size=(320, 262))
    g.add(10, "VAELoader", {"vae_name": "wan_2.1_vae.safetensors"}, col=3, row=2)
    g.add(11, "VAEDecode", col=4, row=0)
    g.add(12, "SaveAnimatedWEBP", {"filename_prefix": "wan21_t2v_ulysses2", "fps": 16.0}, col=5, row=0,
          size=(360, 360))
    g.add(13, "Note", {"text": WAN_NOTE}, col=0, row=4, size=(700, 240))
    g.connect(1, 0, 2, "model")
    g.connect(2, 0, 4, "model")
    g.connect(3, 0, 4, "parallel_config")
    g.connect(4, 0, 9, "model")
    g.connect(5, 0, 6, "clip")
    g.connect(5, 0, 7, "clip")
    g.connect(6, 0, 9, "positive")
    g.connect(7, 0, 9, "negative")
    g.connect(8, 0, 9, "latent_image")
    g.connect(9, 0, 11, "samples")
    g.connect(10, 0, 11, "vae")
    g.connect(11, 0, 12, "images")
    return g.to_json()


FLUX1_NOTE = """Flux.1 dev on 2 GPUs with Hybrid Parallel: Ulysses 2.

Each GPU holds the whole transformer and computes half of the image tokens (and half of the text
tokens) in every step; attention exchanges heads with one all-to-all. Flux.1 has 24 heads, so
ulysses_size may be 1, 2, 3, 4, 6, 8, 12 or 24. The result equals the single-GPU image.

Models (Comfy-Org / black-forest-labs):
  diffusion_models/flux1-dev.safetensors
  text_encoders/clip_l.safetensors, text_encoders/t5xxl_fp16.safetensors
  vae/ae.safetensors"""

FLUX2_NOTE = """FLUX.2 dev on 4 GPUs: Ulysses 2 x tensor parallel 2, and the Mistral text encoder sharded.

FLUX.2 does not fit one 48 GB card. tp_size 2 gives each GPU half of every large layer (pairs of
neighbouring GPUs, the fastest links); ulysses_size 2 splits the tokens between the two pairs.
Shard Text Encoder splits the 24B Mistral encoder over all 4 GPUs for the prompt, with the same
Parallel Config. cache-dit measured Ulysses-4 x TP-2 faster than TP-8 on 8 cards.

Models (Comfy-Org/flux2-dev):
  diffusion_models/flux2_dev_fp8mixed.safetensors
  text_encoders/mistral_3_small_flux2_bf16.safetensors
  vae/flux2-vae.safetensors

ComfyUI 0.3.75's Mistral tokenizer needs transformers 4.x: with transformers 5 CLIPLoader fails
("MistralConverter ... 'vocab_file'"); see the pack's README, Troubleshooting."""

WAN22_NOTE = """Wan 2.2 T2V 14B on 4 GPUs: high-noise and low-noise experts, each sharded.

Both experts go through Shard Transformer with the same Parallel Config: ulysses_size 2 splits the
video tokens over two GPUs, cfg_size 2 runs the conditional and unconditional passes on the two
pairs. The experts stay loaded on their ranks between prompts. Shard VAE decodes the video on all
4 GPUs, each a band of rows, with the exact (untiled) result.

Models (Comfy-Org/Wan_2.2_ComfyUI_Repackaged):
  diffusion_models/wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors
  diffusion_models/wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors
  text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors
  vae/wan_2.1_vae.safetensors"""

QWEN_NOTE = """Qwen-Image on 2 GPUs with tensor parallelism: each GPU holds half of every large layer.

tp_size must divide the 24 heads and the MLP width: 1, 2, 3, 4, 6, 8, 12 or 24. Use it when the
20B transformer does not fit one card; add ulysses_size for speed when it does.

Models (Comfy-Org/Qwen-Image_ComfyUI):
  diffusion_models/qwen_image_fp8_e4m3fn.safetensors
  text_encoders/qwen_2.5_vl_7b_fp8_scaled.safetensors
  vae/qwen_image_vae.safetensors"""


def flux1_dev(info: dict) -> dict:
    g = Graph(info)
    g.add(1, "UNETLoader", {"unet_name": "flux1-dev.safetensors", "weight_dtype": "default"}, col=0, row=0)
    g.add(2, "ParallelConfig", {"ulysses_size": 2}, col=0, row=1, size=(320, 260))
    g.add(3, "ShardTransformer", col=1, row=0)
    g.add(4, "DualCLIPLoader", {"clip_name1": "clip_l.safetensors", "clip_name2": "t5xxl_fp16.safetensors",
                                "type": "flux"}, col=0, row=2)
    g.add(5, "CLIPTextEncode", {"text": "a cozy cabin in a snowy forest at dusk, warm light in the windows"},
          col=1, row=2, title="Prompt", size=(400, 160))
    g.add(6, "FluxGuidance", {"guidance": 3.5}, col=2, row=2)
    g.add(7, "ConditioningZeroOut", col=2, row=3, title="Negative (unused at CFG 1)")
    g.add(8, "EmptySD3LatentImage", {"width": 1024, "height": 1024, "batch_size": 1}, col=2, row=1)
    g.add(9, "KSampler", {"seed": 42, "steps": 20, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
                          "denoise": 1.0}, col=3, row=0, size=(320, 262))
    g.add(10, "VAELoader", {"vae_name": "ae.safetensors"}, col=3, row=2)
    g.add(11, "VAEDecode", col=4, row=0)
    g.add(12, "SaveImage", {"filename_prefix": "flux1_dev_ulysses2"}, col=5, row=0, size=(360, 360))
    g.add(13, "Note", {"text": FLUX1_NOTE}, col=0, row=4, size=(700, 220))
    for a, slot, b, name in ((1, 0, 3, "model"), (2, 0, 3, "parallel_config"), (4, 0, 5, "clip"), (5, 0, 6, "conditioning"),
                             (6, 0, 9, "positive"), (5, 0, 7, "conditioning"), (7, 0, 9, "negative"),
                             (3, 0, 9, "model"), (8, 0, 9, "latent_image"), (9, 0, 11, "samples"),
                             (10, 0, 11, "vae"), (11, 0, 12, "images")):
        g.connect(a, slot, b, name)
    return g.to_json()


def flux2_dev(info: dict) -> dict:
    g = Graph(info)
    g.add(1, "UNETLoader", {"unet_name": "flux2_dev_fp8mixed.safetensors", "weight_dtype": "default"}, col=0, row=0)
    g.add(2, "ParallelConfig", {"ulysses_size": 2, "tp_size": 2}, col=0, row=1, size=(320, 260))
    g.add(3, "ShardTransformer", col=1, row=0)
    g.add(4, "CLIPLoader", {"clip_name": "mistral_3_small_flux2_bf16.safetensors", "type": "flux2"}, col=0, row=2)
    g.add(5, "ShardTextEncoder", col=1, row=2)
    g.add(6, "CLIPTextEncode", {"text": "a glass greenhouse full of orchids, morning fog, 35mm photo"},
          col=2, row=2, title="Prompt", size=(400, 160))
    g.add(7, "FluxGuidance", {"guidance": 4.0}, col=3, row=2)
    g.add(8, "BasicGuider", col=3, row=1)
    g.add(9, "RandomNoise", {"noise_seed": 42}, col=2, row=0)
    g.add(10, "KSamplerSelect", {"sampler_name": "euler"}, col=2, row=1)
    g.add(11, "EmptyFlux2LatentImage", {"width": 1024, "height": 1024, "batch_size": 1}, col=3, row=3)
    g.add(12, "Flux2Scheduler", {"steps": 20, "width": 1024, "height": 1024}, col=4, row=3)
    g.add(13, "SamplerCustomAdvanced", col=4, row=0, size=(320, 200))
    g.add(14, "VAELoader", {"vae_name": "flux2-vae.safetensors"}, col=4, row=2)
    g.add(15, "VAEDecode", col=5, row=0)
    g.add(16, "SaveImage", {"filename_prefix": "flux2_dev_ulysses2_tp2"}, col=6, row=0, size=(360, 360))
    g.add(17, "Note", {"text": FLUX2_NOTE}, col=0, row=4, size=(700, 240))
    for a, slot, b, name in ((1, 0, 3, "model"), (2, 0, 3, "parallel_config"), (4, 0, 5, "clip"),
                             (2, 0, 5, "parallel_config"), (5, 0, 6, "clip"), (6, 0, 7, "conditioning"),
                             (3, 0, 8, "model"), (7, 0, 8, "conditioning"), (9, 0, 13, "noise"), (8, 0, 13, "guider"),
                             (10, 0, 13, "sampler"), (12, 0, 13, "sigmas"), (11, 0, 13, "latent_image"),
                             (13, 0, 15, "samples"), (14, 0, 15, "vae"), (15, 0, 16, "images")):
        g.connect(a, slot, b, name)
    return g.to_json()


def wan22_t2v(info: dict) -> dict:
    g = Graph(info)
    g.add(1, "UNETLoader", {"unet_name": "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", "weight_dtype": "default"},
          col=0, row=0, title="High-noise expert")
    g.add(2, "UNETLoader", {"unet_name": "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors", "weight_dtype": "default"},
          col=0, row=1, title="Low-noise expert")
    g.add(3, "ParallelConfig", {"ulysses_size": 2, "cfg_size": 2}, col=0, row=2, size=(320, 260))
    g.add(4, "ModelSamplingSD3", {"shift": 8.0}, col=1, row=0)
    g.add(5, "ModelSamplingSD3", {"shift": 8.0}, col=1, row=1)
    g.add(6, "ShardTransformer", col=2, row=0)
    g.add(7, "ShardTransformer", col=2, row=1)
    g.add(8, "CLIPLoader", {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan"}, col=0, row=3)
    g.add(9, "CLIPTextEncode", {"text": "a paper boat drifting down a rainy city gutter, macro, cinematic"},
          col=1, row=3, title="Positive", size=(400, 160))
    g.add(10, "CLIPTextEncode", {"text": "blurry, low quality, static, distorted"}, col=1, row=4, title="Negative",
          size=(400, 160))
    g.add(11, "EmptyHunyuanLatentVideo", {"width": 1280, "height": 704, "length": 81, "batch_size": 1}, col=2, row=2)
    g.add(12, "KSamplerAdvanced", {"add_noise": "enable", "noise_seed": 42, "steps": 20, "cfg": 3.5,
                                   "sampler_name": "euler", "scheduler": "simple", "start_at_step": 0,
                                   "end_at_step": 10, "return_with_leftover_noise": "enable"},
          col=3, row=0, size=(320, 330), title="High noise: steps 0-10")
    g.add(13, "KSamplerAdvanced", {"add_noise": "disable", "noise_seed": 42, "steps": 20, "cfg": 3.5,
                                   "sampler_name": "euler", "scheduler": "simple", "start_at_step": 10,
                                   "end_at_step": 20, "return_with_leftover_noise": "disable"},
          col=4, row=0, size=(320, 330), title="Low noise: steps 10-20")
    g.add(14, "VAELoader", {"vae_name": "wan_2.1_vae.safetensors"}, col=3, row=3)
    g.add(15, "ShardVAE", col=4, row=3)
    g.add(16, "VAEDecode", col=5, row=0)
    g.add(17, "SaveAnimatedWEBP", {"filename_prefix": "wan22_t2v_cp", "fps": 16.0}, col=6, row=0, size=(360, 360))
    g.add(18, "Note", {"text": WAN22_NOTE}, col=0, row=5, size=(700, 240))
    for a, slot, b, name in ((1, 0, 4, "model"), (2, 0, 5, "model"), (4, 0, 6, "model"), (5, 0, 7, "model"),
                             (3, 0, 6, "parallel_config"), (3, 0, 7, "parallel_config"), (8, 0, 9, "clip"),
                             (8, 0, 10, "clip"), (6, 0, 12, "model"), (9, 0, 12, "positive"), (10, 0, 12, "negative"),
                             (11, 0, 12, "latent_image"), (7, 0, 13, "model"), (9, 0, 13, "positive"),
                             (10, 0, 13, "negative"), (12, 0, 13, "latent_image"), (14, 0, 15, "vae"),
                             (3, 0, 15, "parallel_config"), (13, 0, 16, "samples"), (15, 0, 16, "vae"),
                             (16, 0, 17, "images")):
        g.connect(a, slot, b, name)
    return g.to_json()


def qwen_image(info: dict) -> dict:
    g = Graph(info)
    g.add(1, "UNETLoader", {"unet_name": "qwen_image_fp8_e4m3fn.safetensors", "weight_dtype": "default"}, col=0, row=0)
    g.add(2, "ModelSamplingAuraFlow", {"shift": 3.1}, col=1, row=0)
    g.add(3, "ParallelConfig", {"tp_size": 2}, col=0, row=1, size=(320, 260))
    g.add(4, "ShardTransformer", col=2, row=0)
    g.add(5, "CLIPLoader", {"clip_name": "qwen_2.5_vl_7b_fp8_scaled.safetensors", "type": "qwen_image"}, col=0, row=2)
    g.add(6, "CLIPTextEncode", {"text": "a hand-painted sign that says \"OPEN\" on a bakery door, warm afternoon"},
          col=1, row=2, title="Positive", size=(400, 160))
    g.add(7, "CLIPTextEncode", {"text": ""}, col=1, row=3, title="Negative", size=(400, 160))
    g.add(8, "EmptySD3LatentImage", {"width": 1328, "height": 1328, "batch_size": 1}, col=2, row=1)
    g.add(9, "KSampler", {"seed": 42, "steps": 20, "cfg": 2.5, "sampler_name": "euler", "scheduler": "simple",
                          "denoise": 1.0}, col=3, row=0, size=(320, 262))
    g.add(10, "VAELoader", {"vae_name": "qwen_image_vae.safetensors"}, col=3, row=2)
    g.add(11, "VAEDecode", col=4, row=0)
    g.add(12, "SaveImage", {"filename_prefix": "qwen_image_tp2"}, col=5, row=0, size=(360, 360))
    g.add(13, "Note", {"text": QWEN_NOTE}, col=0, row=4, size=(700, 200))
    for a, slot, b, name in ((1, 0, 2, "model"), (2, 0, 4, "model"), (3, 0, 4, "parallel_config"), (5, 0, 6, "clip"),
                             (5, 0, 7, "clip"), (4, 0, 9, "model"), (6, 0, 9, "positive"), (7, 0, 9, "negative"),
                             (8, 0, 9, "latent_image"), (9, 0, 11, "samples"), (10, 0, 11, "vae"),
                             (11, 0, 12, "images")):
        g.connect(a, slot, b, name)
    return g.to_json()


LTX2_NOTE = """LTX-2 19B text-to-video with sound on 4 GPUs: Ulysses 2 x tensor parallel 2, Gemma sharded, Shard VAE.

The graph is ComfyUI's LTX-2 T2V template (its first stage, at full size): one latent holds the video
and the audio (LTXVConcatAVLatent), one sampler denoises both, LTXVSeparateAVLatent splits them for
the video VAE and the audio VAE. tp_size 2 gives each GPU of a pair half of every large layer of the
transformer; ulysses_size 2 splits the video and the audio tokens between the two pairs. Shard Text
Encoder splits Gemma 3 12B over all 4 GPUs; Shard VAE decodes the video in 4 bands of rows, exactly
(so VAE Decode, not the template's tiled decode). Frame rate: the same in all three places.
Video and sound are saved as two files (Create Video + Save Video mux them, as in the template).

Models (official names, ComfyUI's LTX-2 template and Comfy-Org/ltx-2):
  checkpoints/ltx-2-19b-dev-fp8.safetensors    (Lightricks/LTX-2: transformer, video VAE, audio VAE,
                                                the text projection; or ltx-2-19b-dev.safetensors)
  text_encoders/gemma_3_12B_it.safetensors     (Comfy-Org/ltx-2 split_files; the template loads the
                                                smaller gemma_3_12B_it_fp4_mixed.safetensors)"""

HV15_NOTE = """HunyuanVideo 1.5 text-to-video 720p on 2 GPUs: Ulysses 2 and Shard VAE.

The graph is ComfyUI's HunyuanVideo 1.5 720p T2V template (without its optional EasyCache and 1080p
super-resolution stage). ulysses_size 2 splits the video tokens over the two GPUs (16 heads: 1, 2, 4,
8 or 16 fit); each GPU holds the whole transformer. cfg_size 2 is the other exact choice at CFG 6.
Shard VAE decodes the video in 2 bands of rows, the same result as the untiled single-GPU decode
(this VAE from ComfyUI 0.33 on; older releases build it from other layers, which Shard VAE refuses).

Models (official ComfyUI repackage, Comfy-Org/HunyuanVideo_1.5_repackaged):
  diffusion_models/hunyuanvideo1.5_720p_t2v_fp16.safetensors
  text_encoders/qwen_2.5_vl_7b_fp8_scaled.safetensors
  text_encoders/byt5_small_glyphxl_fp16.safetensors
  vae/hunyuanvideo15_vae_fp16.safetensors"""


def _ltx2_prompt_nodes(g: Graph) -> None:
    """Gemma through Shard Text Encoder, both prompts, LTXVConditioning (nodes 4-8)."""
    g.add(4, "LTXAVTextEncoderLoader", {"text_encoder": "gemma_3_12B_it.safetensors",
                                        "ckpt_name": "ltx-2-19b-dev-fp8.safetensors", "device": "default"},
          col=0, row=2)
    g.add(5, "ShardTextEncoder", col=1, row=2)
    g.add(6, "CLIPTextEncode", {"text": "A lighthouse keeper climbs a spiral staircase during a storm, rain lashing "
                                        "the windows, thunder rolling, the old iron steps creaking under his boots."},
          col=2, row=2, title="Positive", size=(400, 160))
    g.add(7, "CLIPTextEncode", {"text": "blurry, low quality, still frame, frames, watermark, overlay, titles, "
                                        "has blurbox, has subtitles"}, col=2, row=3, title="Negative", size=(400, 160))
    g.add(8, "LTXVConditioning", {"frame_rate": 24.0}, col=3, row=2)


def ltx2_t2v(info: dict) -> dict:
    g = Graph(info)
    g.add(1, "CheckpointLoaderSimple", {"ckpt_name": "ltx-2-19b-dev-fp8.safetensors"}, col=0, row=0)
    g.add(2, "ParallelConfig", {"ulysses_size": 2, "tp_size": 2}, col=0, row=1, size=(320, 260))
    g.add(3, "ShardTransformer", col=1, row=0)
    _ltx2_prompt_nodes(g)
    g.add(9, "CFGGuider", {"cfg": 4.0}, col=4, row=1)
    g.add(10, "EmptyLTXVLatentVideo", {"width": 1280, "height": 704, "length": 121, "batch_size": 1}, col=1, row=4)
    g.add(11, "LTXVAudioVAELoader", {"ckpt_name": "ltx-2-19b-dev-fp8.safetensors"}, col=0, row=5)
    g.add(12, "PrimitiveFloat", {"value": 24.0}, col=0, row=4, title="Frame rate")
    g.add(13, "LTXVEmptyLatentAudio", {"frames_number": 121, "batch_size": 1}, col=1, row=5)
    g.add(14, "LTXVConcatAVLatent", col=2, row=4)
    g.add(15, "LTXVScheduler", {"steps": 20, "max_shift": 2.05, "base_shift": 0.95, "stretch": True, "terminal": 0.1},
          col=3, row=4)
    g.add(16, "RandomNoise", {"noise_seed": 42}, col=3, row=0)
    g.add(17, "KSamplerSelect", {"sampler_name": "euler_ancestral"}, col=4, row=0)
    g.add(18, "SamplerCustomAdvanced", col=5, row=0, size=(320, 200))
    g.add(19, "LTXVSeparateAVLatent", col=6, row=0)
    g.add(20, "ShardVAE", col=5, row=2)
    g.add(21, "VAEDecode", col=7, row=0)
    g.add(22, "LTXVAudioVAEDecode", col=7, row=1)
    g.add(23, "SaveAnimatedWEBP", {"filename_prefix": "ltx2_t2v_ulysses2_tp2", "fps": 24.0}, col=8, row=0,
          size=(360, 360))
    g.add(24, "SaveAudio", {"filename_prefix": "audio/ltx2_t2v_ulysses2_tp2"}, col=8, row=2)
    g.add(25, "Note", {"text": LTX2_NOTE}, col=0, row=6, size=(760, 320))
    for a, slot, b, name in ((1, 0, 3, "model"), (2, 0, 3, "parallel_config"), (4, 0, 5, "clip"),
                             (2, 0, 5, "parallel_config"), (5, 0, 6, "clip"), (5, 0, 7, "clip"), (6, 0, 8, "positive"),
                             (7, 0, 8, "negative"), (3, 0, 9, "model"), (8, 0, 9, "positive"), (8, 1, 9, "negative"),
                             (12, 0, 13, "frame_rate"), (11, 0, 13, "audio_vae"), (10, 0, 14, "video_latent"),
                             (13, 0, 14, "audio_latent"), (14, 0, 15, "latent"), (16, 0, 18, "noise"),
                             (9, 0, 18, "guider"), (17, 0, 18, "sampler"), (15, 0, 18, "sigmas"),
                             (14, 0, 18, "latent_image"), (18, 0, 19, "av_latent"), (1, 2, 20, "vae"),
                             (2, 0, 20, "parallel_config"), (19, 0, 21, "samples"), (20, 0, 21, "vae"),
                             (19, 1, 22, "samples"), (11, 0, 22, "audio_vae"), (21, 0, 23, "images"),
                             (22, 0, 24, "audio")):
        g.connect(a, slot, b, name)
    return g.to_json()


def hunyuan_video15_t2v(info: dict) -> dict:
    g = Graph(info)
    g.add(1, "UNETLoader", {"unet_name": "hunyuanvideo1.5_720p_t2v_fp16.safetensors", "weight_dtype": "default"},
          col=0, row=0)
    g.add(2, "ModelSamplingSD3", {"shift": 7.0}, col=1, row=0)
    g.add(3, "ParallelConfig", {"ulysses_size": 2}, col=1, row=1, size=(320, 260))
    g.add(4, "ShardTransformer", col=2, row=0)
    g.add(5, "DualCLIPLoader", {"clip_name1": "qwen_2.5_vl_7b_fp8_scaled.safetensors",
                                "clip_name2": "byt5_small_glyphxl_fp16.safetensors", "type": "hunyuan_video_15",
                                "device": "default"}, col=0, row=2)
    g.add(6, "CLIPTextEncode", {"text": "A paper airplane released from the top of a skyscraper glides through the "
                                        "city, over traffic and between buildings; the camera follows it."},
          col=1, row=2, title="Positive", size=(400, 160))
    g.add(7, "CLIPTextEncode", {"text": ""}, col=1, row=3, title="Negative", size=(400, 160))
    g.add(8, "CFGGuider", {"cfg": 6.0}, col=3, row=1)
    g.add(9, "BasicScheduler", {"scheduler": "simple", "steps": 20, "denoise": 1.0}, col=3, row=2)
    g.add(10, "RandomNoise", {"noise_seed": 42}, col=3, row=0)
    g.add(11, "KSamplerSelect", {"sampler_name": "euler"}, col=3, row=3)
    g.add(12, "EmptyHunyuanVideo15Latent", {"width": 1280, "height": 720, "length": 121, "batch_size": 1},
          col=2, row=3)
    g.add(13, "SamplerCustomAdvanced", col=4, row=0, size=(320, 200))
    g.add(14, "VAELoader", {"vae_name": "hunyuanvideo15_vae_fp16.safetensors"}, col=4, row=2)
    g.add(15, "ShardVAE", col=4, row=3)
    g.add(16, "VAEDecode", col=5, row=0)
    g.add(17, "SaveAnimatedWEBP", {"filename_prefix": "hunyuan_video15_t2v_ulysses2", "fps": 24.0}, col=6, row=0,
          size=(360, 360))
    g.add(18, "Note", {"text": HV15_NOTE}, col=0, row=4, size=(700, 240))
    for a, slot, b, name in ((1, 0, 2, "model"), (2, 0, 4, "model"), (3, 0, 4, "parallel_config"), (5, 0, 6, "clip"),
                             (5, 0, 7, "clip"), (4, 0, 8, "model"), (6, 0, 8, "positive"), (7, 0, 8, "negative"),
                             (4, 0, 9, "model"), (10, 0, 13, "noise"), (8, 0, 13, "guider"), (11, 0, 13, "sampler"),
                             (9, 0, 13, "sigmas"), (12, 0, 13, "latent_image"), (14, 0, 15, "vae"),
                             (3, 0, 15, "parallel_config"), (13, 0, 16, "samples"), (15, 0, 16, "vae"),
                             (16, 0, 17, "images")):
        g.connect(a, slot, b, name)
    return g.to_json()


WORKFLOWS = {
    "tiny_wan_ulysses2_demo.json": tiny_wan,
    "wan21_t2v_ulysses2.json": wan21_t2v,
    "flux1_dev_ulysses2.json": flux1_dev,
    "flux2_dev_ulysses2_tp2_text_encoder.json": flux2_dev,
    "wan22_t2v_14B_cp_shard_vae.json": wan22_t2v,
    "qwen_image_tp2.json": qwen_image,
    # Nodes of ComfyUI 0.33 (LTX-2's audio + video latents, HunyuanVideo 1.5): built from its /object_info.
    "ltx2_t2v_audio_ulysses2_tp2_shard_te_vae.json": ltx2_t2v,
    "hunyuan_video15_t2v_ulysses2_shard_vae.json": hunyuan_video15_t2v,
}


def main(names: list[str]) -> None:
    unknown = sorted(set(names) - set(WORKFLOWS))
    if unknown:
        raise SystemExit(f"no such example: {', '.join(unknown)} (known: {', '.join(WORKFLOWS)})")
    root = comfyui_path("run python3 tools/host.py first")
    with tempfile.TemporaryDirectory() as tmp, ComfyServer(root, tmp) as server:
        info = server.object_info()
    OUT.mkdir(exist_ok=True)
    for name, build in WORKFLOWS.items():
        if names and name not in names:
            continue
        (OUT / name).write_text(json.dumps(build(info), indent=1) + "\n")
        print("wrote", OUT / name)


if __name__ == "__main__":
    main(sys.argv[1:])
