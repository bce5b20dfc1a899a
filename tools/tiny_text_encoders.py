"""Tiny text-encoder files for the example workflows' tests, in the layout of the real ones.

ComfyUI's CLIPLoader and DualCLIPLoader build T5-XXL, UMT5-XXL, CLIP-L and Qwen2.5-VL 7B at
their full, fixed sizes. Each tiny file here holds ComfyUI's own encoder class at a small config
and states that config (and which encoder it is) in its safetensors metadata, under
``config`` -> ``text_encoder``; the test server's extension (tests/comfy_extensions) hands it to
the stock loader as the ``<name>_model_config`` model option ComfyUI already supports. The
tokenizers are the real ones: ComfyUI's bundled T5, CLIP and Qwen2.5 tokenizers, and for UMT5
(whose real file carries its SentencePiece model) a small SentencePiece model trained here.

Widths follow what the tiny diffusion models read: Wan's text input is fixed at 4096, so UMT5
keeps d_model 4096 with narrow heads and feed-forward; Flux.1 and Qwen-Image read theirs from
the file (or its metadata) and take 64.
"""
from __future__ import annotations

import io

import torch

from tiny_weights import _random_state_dict, comfy_json_config, stating_config

TEXT_DIM = 64  # T5-XXL, CLIP-L and Qwen2.5-VL stand-ins (Flux.1's txt_in and vector_in, Qwen-Image's joint dim)


def _file(module_factory, seed: int, text_encoder: dict, extra: dict | None = None):
    """(state dict with seeded weights, metadata stating the encoder)."""
    sd = _random_state_dict(module_factory, seed, dtype=torch.float32)
    sd.update(extra or {})
    return stating_config(sd, "text_encoder", text_encoder)


def _ops():
    import comfy.ops

    return comfy.ops.disable_weight_init


def sentencepiece_model(vocab_size: int = 320) -> bytes:
    """A small byte-fallback SentencePiece model (pad 0, eos 1, unk 2: T5's ids): any text tokenizes."""
    import sentencepiece

    corpus = ["a lighthouse on a cliff in a storm, waves crashing, oil painting",
              "a red fox running through fresh snow at dawn, cinematic",
              "worst quality, low quality, blurry, static, text, watermark",
              "a glass greenhouse full of orchids, morning fog, 35mm photo"] * 10
    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=out, vocab_size=vocab_size, model_type="bpe",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, byte_fallback=True, character_coverage=1.0,
        minloglevel=2, num_threads=1)
    return out.getvalue()


def umt5_xxl(seed: int = 21):
    """Wan's UMT5-XXL at d_model 4096 with 2 heads of 16, feed-forward 64, 2 layers."""
    import comfy.text_encoders.t5

    spiece = sentencepiece_model()
    config = {"d_ff": 64, "d_kv": 16, "num_heads": 2, "num_layers": 2, "vocab_size": 320}
    full = comfy_json_config(comfy.text_encoders.t5, "umt5_config_xxl.json", config)
    return _file(lambda: comfy.text_encoders.t5.T5(full, torch.float32, None, _ops()), seed,
                 {"te_model": "T5_XXL", "model_options": {"umt5xxl_model_config": config}},
                 extra={"spiece_model": torch.frombuffer(bytearray(spiece), dtype=torch.uint8)})


def t5_xxl(seed: int = 22):
    """Flux.1's T5-XXL at width 64 (its bundled tokenizer's 32128 ids), 2 layers."""
    import comfy.text_encoders.t5

    config = {"d_model": TEXT_DIM, "d_ff": 128, "d_kv": 16, "num_heads": 4, "num_layers": 2}
    full = comfy_json_config(comfy.text_encoders.t5, "t5_config_xxl.json", config)
    return _file(lambda: comfy.text_encoders.t5.T5(full, torch.float32, None, _ops()), seed,
                 {"te_model": "T5_XXL", "model_options": {"t5xxl_model_config": config}})


def clip_l(seed: int = 23):
    """CLIP-L at width 64 (its bundled tokenizer's 49408 ids), 2 layers: Flux.1's pooled vector."""
    import comfy.clip_model
    import comfy.sd1_clip

    config = {"hidden_size": TEXT_DIM, "intermediate_size": 128, "num_attention_heads": 2, "num_hidden_layers": 2,
              "projection_dim": TEXT_DIM}
    full = comfy_json_config(comfy.sd1_clip, "sd1_clip_config.json", config)
    return _file(lambda: comfy.clip_model.CLIPTextModel(full, torch.float32, None, _ops()), seed,
                 # ComfyUI's long-CLIP check rewrites clip_l_model_config from "model_config" for
                 # every CLIP-L file it loads, so the config goes there.
                 {"te_model": "CLIP_L", "model_options": {"model_config": config}})


def qwen25_vl_7b(seed: int = 24):
    """Qwen-Image's Qwen2.5-VL 7B language model at width 64, 2 layers (the vision tower, unused
    for text, is left out of the file as ComfyUI allows)."""
    import comfy.text_encoders.llama

    config = {"hidden_size": TEXT_DIM, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 2}

    def language_model():
        return comfy.text_encoders.llama.Llama2_(comfy.text_encoders.llama.Qwen25_7BVLI_Config(**config),
                                                 device=None, dtype=torch.float32, ops=_ops())

    sd, metadata = _file(language_model, seed,
                         {"te_model": "QWEN25_7B", "model_options": {"qwen25_7b_model_config": config}})
    return {f"model.{k}": v for k, v in sd.items()}, metadata
