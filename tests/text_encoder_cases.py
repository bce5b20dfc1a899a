"""Small configs of ComfyUI's text encoders, built the way ComfyUI builds them (comfy.sd.CLIP with
a ``<name>_model_config`` override), with seeded random weights and hand-made token ids (the
encoders, not the tokenizers, are what gets sharded)."""
from __future__ import annotations

import functools

import torch

ENCODERS = {}


def encoder(name):
    def register(fn):
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
