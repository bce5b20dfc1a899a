"""Small configs of ComfyUI's text encoders, built the way ComfyUI builds them (comfy.sd.CLIP with
a ``<name>_model_config`` override), with seeded random weights and hand-made token ids (the
encoders, not the tokenizers, are what gets sharded). Encoders newer than ComfyUI 0.3.75 (Gemma 3
4B Vision, LTX-2's Gemma 3 12B, FLUX.2 klein's Qwen3 8B / 4B, Anima's Qwen3 0.6B, ERNIE-Image's
Ministral 3 3B, Krea 2's and JoyImage's Qwen3-VL) are registered only where ComfyUI has their classes."""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util

import torch

ENCODERS = {}


def available(needs: str | None) -> bool:
    """Whether this ComfyUI has ``needs`` ("package.module.attribute"): encoders newer than 0.3.75
    are only registered where their classes exist (there is nothing to shard elsewhere)."""
    if needs is None:
        return True
    module, _, attribute = needs.rpartition(".")
    try:
        if importlib.util.find_spec(module) is None:
            return False
    except ModuleNotFoundError:  # its parent package is missing too
        return False
    return hasattr(importlib.import_module(module), attribute)


def encoder(name, needs: str | None = None):
    def register(fn):
        if available(needs):
            ENCODERS[name] = fn
        return fn
    return register


class NoTokenizer:
    """Stands in for tokenizers that need files from a full checkpoint (Gemma, Mistral)."""

    def __init__(self, embedding_directory=None, tokenizer_data={}):
        pass


def build_clip(te_class, name: str, config: dict, seed: int):
    import comfy.sd
    import comfy.supported_models_base

    target = comfy.supported_models_base.ClipTarget(NoTokenizer, te_class)
    clip = comfy.sd.CLIP(target, model_options={f"{name}_model_config": config, "dtype": torch.float32})
    gen = torch.Generator().manual_seed(seed)
    # Gemma's norms scale by (1 + weight): around zero there, around one elsewhere.
    offset_norms = {f"{n}.weight" for n, m in clip.cond_stage_model.named_modules() if getattr(m, "add", False) is True}
    with torch.no_grad():
        for name, p in sorted(clip.cond_stage_model.named_parameters()):
            if p.ndim == 1 and p.dtype.is_floating_point:
                p.copy_((0.0 if name in offset_norms else 1.0) + 0.05 * torch.randn(p.shape, generator=gen))
            elif p.dtype.is_floating_point:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return clip


def tokens(name: str, count: int, vocab: int, seed: int, batch: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, min(vocab, 30000), (batch, count), generator=gen).tolist()
    return {name: [[(int(i), 1.0) for i in row] for row in ids]}


T5_SMALL = {"d_model": 64, "d_ff": 128, "num_layers": 2, "num_heads": 4, "d_kv": 16}
# Three layers: some wrappers read the hidden state of layer -2.
LLAMA_SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
               "num_key_value_heads": 2}


@encoder("t5xxl")
def t5xxl():
    import comfy.text_encoders.sd3_clip

    clip = build_clip(comfy.text_encoders.sd3_clip.sd3_clip(clip_l=False, clip_g=False, t5=True), "t5xxl",
                      T5_SMALL, seed=1)
    return clip, {"l": [], "g": [], **tokens("t5xxl", 13, 32128, seed=2)}  # SD3 without its CLIP-L/G


@encoder("umt5xxl")
def umt5xxl():
    import comfy.text_encoders.wan

    return build_clip(comfy.text_encoders.wan.te(), "umt5xxl", T5_SMALL, seed=3), tokens("umt5xxl", 11, 256384, 4)


@encoder("qwen3_4b")
def qwen3():
    import comfy.text_encoders.z_image

    clip = build_clip(comfy.text_encoders.z_image.te(), "qwen3_4b", LLAMA_SMALL, seed=5)
    return clip, tokens("qwen3_4b", 9, 151936, 6)


@encoder("qwen25_7b_vl")
def qwen25_vl():
    import comfy.text_encoders.llama
    import comfy.text_encoders.qwen_image
    import comfy.text_encoders.qwen_vl

    # The vision tower stays whole on every rank; a one-layer one keeps the test small.
    original = comfy.text_encoders.qwen_vl.Qwen2VLVisionTransformer
    comfy.text_encoders.llama.qwen_vl.Qwen2VLVisionTransformer = functools.partial(original, num_layers=1,
                                                                                   intermediate_size=64)
    try:
        clip = build_clip(comfy.text_encoders.qwen_image.te(), "qwen25_7b", LLAMA_SMALL, seed=7)
    finally:
        comfy.text_encoders.llama.qwen_vl.Qwen2VLVisionTransformer = original
    return clip, tokens("qwen25_7b", 10, 152064, 8)


@encoder("gemma2_2b")
def gemma2():
    import comfy.text_encoders.lumina2

    clip = build_clip(comfy.text_encoders.lumina2.te(model_type="gemma2_2b"), "gemma2_2b", LLAMA_SMALL, seed=9)
    return clip, tokens("gemma2_2b", 8, 256000, 10)


@encoder("gemma3_4b")
def gemma3():
    import comfy.text_encoders.lumina2

    clip = build_clip(comfy.text_encoders.lumina2.te(model_type="gemma3_4b"), "gemma3_4b", LLAMA_SMALL, seed=11)
    return clip, tokens("gemma3_4b", 8, 262208, 12)


@encoder("mistral3_24b")
def mistral3():
    import comfy.text_encoders.flux

    # Flux.2 reads hidden states after layers 10, 20 and 30: a 31-layer narrow model.
    config = {**LLAMA_SMALL, "num_hidden_layers": 31}
    clip = build_clip(comfy.text_encoders.flux.flux2_te(), "mistral3_24b", config, seed=13)
    return clip, tokens("mistral3_24b", 9, 131072, 14)


# ComfyUI's GEMMA3_VISION_CONFIG (Gemma 3's SigLIP tower) narrowed to one layer: 2 x 2 patches
# pooled into 4 image tokens. The tower stays whole; rank 0 runs it (ComfyUI calls preprocess_embed
# before the sharded forward), and LTX-2's text-only prompts leave it unused.
GEMMA3_VISION_SMALL = {"num_channels": 3, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 32, "image_size": 28,
                       "intermediate_size": 64, "model_type": "siglip_vision_model", "num_attention_heads": 2,
                       "num_hidden_layers": 1, "patch_size": 14}


@contextlib.contextmanager
def small_gemma3_vision(config_class):
    """``vision_config`` is a class attribute of ComfyUI's Gemma 3 configs, not a field a
    ``<name>_model_config`` override can set: swapped for the build only."""
    saved = config_class.vision_config, config_class.mm_tokens_per_image
    config_class.vision_config, config_class.mm_tokens_per_image = GEMMA3_VISION_SMALL, 4
    try:
        yield
    finally:
        config_class.vision_config, config_class.mm_tokens_per_image = saved


@encoder("gemma3_4b_vision", needs="comfy.text_encoders.llama.Gemma3_4B_Vision")
def gemma3_vision():
    import comfy.text_encoders.llama
    import comfy.text_encoders.lumina2

    with small_gemma3_vision(comfy.text_encoders.llama.Gemma3_4B_Vision_Config):
        clip = build_clip(comfy.text_encoders.lumina2.te(model_type="gemma3_4b_vision"), "gemma3_4b_vision",
                          LLAMA_SMALL, seed=15)
    # One image, as Gemma3_4BTokenizer puts it in place of <image_soft_token>: the whole tower on
    # rank 0 turns it into 4 embeddings that the sharded decoder then reads.
    toks = tokens("gemma3_4b_vision", 8, 262208, 16)
    image = torch.rand(1, 28, 28, 3, generator=torch.Generator().manual_seed(19))
    toks["gemma3_4b_vision"][0][3] = ({"type": "image", "data": image}, 1.0)
    return clip, toks


@encoder("ltx2_gemma3_12b", needs="comfy.text_encoders.llama.Gemma3_12B")
def ltx2_gemma3_12b():
    import comfy.text_encoders.llama
    import comfy.text_encoders.lt

    # LTX-2's encoder as comfy.sd builds it (ltxav_te): Gemma 3 12B's hidden states of every layer,
    # normalized and projected by text_embedding_projection (on rank 0, outside the sharded Gemma).
    # LTXAVTEModel builds its Gemma without a model_name, so the override is read as "_model_config".
    te = comfy.text_encoders.lt.ltxav_te(video_projection_dim=96)
    with small_gemma3_vision(comfy.text_encoders.llama.Gemma3_12B_Config):
        clip = build_clip(te, "", LLAMA_SMALL, seed=17)
    # Left padding as Gemma3_12BTokenizer pads (pad id 0): the wrapper keeps the last
    # sum(attention_mask) tokens.
    toks = tokens("gemma3_12b", 9, 262208, 18)
    toks["gemma3_12b"][0][:0] = [(0, 1.0)] * 3
    return clip, toks


# ComfyUI 0.33's Qwen3 / Ministral 3 / Qwen3-VL encoders (issue 32). head_dim is a class constant
# of ComfyUI's configs (128), so the narrow models keep it.


@encoder("flux2_klein_qwen3_8b", needs="comfy.text_encoders.llama.Qwen3_8B")
def flux2_klein_qwen3_8b():
    import comfy.text_encoders.flux

    # FLUX.2 klein 9B's encoder (comfy.sd for a Qwen3-8B CLIP of type flux2): hidden states after
    # layers 9, 18 and 27 stacked, so 28 layers; Qwen3_8B keeps its (generation-only) lm_head.
    config = {**LLAMA_SMALL, "num_hidden_layers": 28}
    clip = build_clip(comfy.text_encoders.flux.klein_te(model_type="qwen3_8b"), "qwen3_8b", config, seed=21)
    return clip, tokens("qwen3_8b", 9, 151936, 22)


# One KV head: under TP 2 the ranks share it (replicated KV heads). A wider MLP keeps rank 0's share
# of the layer weights under the test's limits though the KV projections are whole on each rank.
LLAMA_ONE_KV = {**LLAMA_SMALL, "num_key_value_heads": 1, "intermediate_size": 1024}


@encoder("flux2_klein_qwen3_4b", needs="comfy.text_encoders.flux.klein_te")
def flux2_klein_qwen3_4b():
    import comfy.text_encoders.flux

    # FLUX.2 klein 4B's encoder: Qwen3_4B with the 9 / 18 / 27 layer taps.
    config = {**LLAMA_ONE_KV, "num_hidden_layers": 28}
    clip = build_clip(comfy.text_encoders.flux.klein_te(model_type="qwen3_4b"), "qwen3_4b", config, seed=23)
    return clip, tokens("qwen3_4b", 9, 151936, 24)


@encoder("anima_qwen3_06b", needs="comfy.text_encoders.llama.Qwen3_06B")
def anima_qwen3_06b():
    import comfy.text_encoders.anima

    # Anima's CLIP: Qwen3-0.6B's last hidden state; the T5 token ids only ride along in the extras.
    clip = build_clip(comfy.text_encoders.anima.te(), "qwen3_06b", LLAMA_SMALL, seed=25)
    return clip, {**tokens("qwen3_06b", 9, 151936, 26), **tokens("t5xxl", 7, 32128, 27)}


@encoder("ernie_ministral3_3b", needs="comfy.text_encoders.llama.Ministral3_3B")
def ernie_ministral3_3b():
    import comfy.text_encoders.ernie

    # ERNIE-Image's CLIP: Ministral 3 3B's hidden state of layer -2 (no q/k norms).
    clip = build_clip(comfy.text_encoders.ernie.te(), "ministral3_3b", LLAMA_SMALL, seed=29)
    return clip, tokens("ministral3_3b", 9, 131072, 30)


@contextlib.contextmanager
def small_qwen3vl_vision():
    """Qwen3-VL's vision tower (with its DeepStack mergers) narrowed for the build: the module dicts
    ``Qwen3VL.__init__`` reads."""
    import comfy.text_encoders.qwen3vl as qwen3vl

    saved = dict(qwen3vl.QWEN3VL_VISION_COMMON), {k: dict(v) for k, v in qwen3vl.QWEN3VL_VISION.items()}
    qwen3vl.QWEN3VL_VISION_COMMON.update(num_heads=2, num_position_embeddings=64)
    for value in qwen3vl.QWEN3VL_VISION.values():
        value.update(hidden_size=32, intermediate_size=64, depth=3, deepstack_visual_indexes=[0, 1, 2])
    try:
        yield
    finally:
        qwen3vl.QWEN3VL_VISION_COMMON.clear()
        qwen3vl.QWEN3VL_VISION_COMMON.update(saved[0])
        for key, value in saved[1].items():
            qwen3vl.QWEN3VL_VISION[key].clear()
            qwen3vl.QWEN3VL_VISION[key].update(value)


@encoder("krea2_qwen3vl_4b", needs="comfy.text_encoders.krea2.te")
def krea2_qwen3vl_4b():
    import comfy.text_encoders.krea2

    # Krea 2's CLIP: Qwen3-VL-4B, hidden states of 12 layers up to layer 35 (36 layers). One image:
    # rank 0's tower turns it into 4 embeddings, and its 3 DeepStack features are added to the
    # first 3 layers' hidden states at those positions on every rank (multimodal RoPE positions).
    config = {**LLAMA_SMALL, "num_hidden_layers": 36}
    with small_qwen3vl_vision():
        clip = build_clip(comfy.text_encoders.krea2.te(), "qwen3vl_4b", config, seed=31)
    # The template's first two <|im_start|> (151644), then "user" "\n": Krea 2 strips up to there.
    toks = tokens("qwen3vl_4b", 12, 151936, 32)
    toks["qwen3vl_4b"][0][:0] = [(151644, 1.0), (8948, 1.0), (198, 1.0), (151644, 1.0), (872, 1.0), (198, 1.0)]
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(33))
    toks["qwen3vl_4b"][0][8] = ({"type": "image", "data": image, "original_type": "image"}, 1.0)
    return clip, toks


@encoder("joyimage_qwen3vl_8b", needs="comfy.text_encoders.joyimage.te")
def joyimage_qwen3vl_8b():
    import comfy.text_encoders.joyimage

    # JoyImage's CLIP: Qwen3-VL-8B's last layer before the final norm; it drops the first 34 tokens
    # (the template's system prompt), so the prompt is longer than that.
    with small_qwen3vl_vision():
        clip = build_clip(comfy.text_encoders.joyimage.te(), "qwen3vl_8b", LLAMA_SMALL, seed=35)
    return clip, tokens("qwen3vl_8b", 40, 151936, 36)
