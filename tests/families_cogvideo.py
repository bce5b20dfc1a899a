"""Small CogVideoX configs (ComfyUI 0.33 on), in the conventions of ``families.py``: each case
returns (model, args, kwargs) for ``model._forward``, batch 2 for cond + uncond, fp32, and
7 text tokens next to 105 video tokens (neither divides by 2 or 4).
"""
from __future__ import annotations

import torch

from families import OPS, randn, seeded


def cogvideox_model(heads=2, head_dim=None, seed=150, **variant):
    """A two-block CogVideoX of width 256 (two heads of 128 or four of 64) over a 64-wide text.
    Weights at scale 0.1: at the default 0.05 the gated attention branch moves the output by
    only ~2e-4 (relative), too little for the local-attention check to tell a broken split."""
    from comfy.ldm.cogvideo.model import CogVideoXTransformer3DModel

    head_dim = head_dim or 256 // heads
    return seeded(CogVideoXTransformer3DModel(num_attention_heads=heads, attention_head_dim=head_dim, out_channels=16,
                                              time_embed_dim=128, text_embed_dim=64, num_layers=2, patch_size=2,
                                              dtype=torch.float32, device="cpu", operations=OPS,
                                              **{"in_channels": 16, "use_rotary_positional_embeddings": True,
                                                 **variant}), seed=seed, scale=0.1)


def cogvideox_rope(heads, seed):
    """CogVideoX 1.0 T2V (5B style): 3D RoPE on the video tokens, 3 x 5 x 7 = 105 of them."""
    x = randn(2, 16, 3, 10, 14, seed=seed + 1)
    return cogvideox_model(heads, seed=seed), (x, torch.tensor([700.0, 300.0]), randn(2, 7, 64, seed=seed + 2)), {}


def cogvideox15_i2v(heads, seed):
    """CogVideoX 1.5 I2V: 2-frame temporal patches (5 latent frames padded to 6: 3 x 5 x 7 = 105
    tokens), the image latent concatenated on channels (32 in), the ofs embedding."""
    model = cogvideox_model(heads, seed=seed, in_channels=32, patch_size_t=2, ofs_embed_dim=128,
                            sample_height=8, sample_width=8, sample_frames=9)
    x = randn(2, 32, 5, 10, 14, seed=seed + 1)
    return model, (x, torch.tensor([800.0, 200.0]), randn(2, 7, 64, seed=seed + 2)), \
        {"ofs": torch.tensor([2.0, 2.0])}


def cogvideox_learned_pos(heads, seed):
    """CogVideoX 1.0 I2V (5B style): learned position embeddings added to the video before the
    blocks, no RoPE. Width 192 (it must divide by 3 for the 3D sin-cos table)."""
    model = cogvideox_model(heads, head_dim=192 // heads, seed=seed, in_channels=32,
                            use_rotary_positional_embeddings=False, use_learned_positional_embeddings=True,
                            sample_height=10, sample_width=14, sample_frames=9, max_text_seq_length=16)
    x = randn(2, 32, 3, 10, 14, seed=seed + 1)
    return model, (x, torch.tensor([600.0, 400.0]), randn(2, 7, 64, seed=seed + 2)), {}


def cogvideox():
    return cogvideox_rope(2, seed=150)


def cogvideox15_i2v_ofs():
    return cogvideox15_i2v(2, seed=155)


def cogvideox_learned():
    return cogvideox_learned_pos(2, seed=160)


def cogvideox_4heads():
    return cogvideox_rope(4, seed=165)


def cogvideox15_i2v_ofs_4heads():
    return cogvideox15_i2v(4, seed=170)


CASES = {"cogvideox": cogvideox, "cogvideox15_i2v_ofs": cogvideox15_i2v_ofs,
         "cogvideox_learned_pos": cogvideox_learned}

# Four attention heads, so that TP 2 x Ulysses 2 has a head per rank.
TP_CASES = {"cogvideox_4heads": cogvideox_4heads, "cogvideox15_i2v_ofs_4heads": cogvideox15_i2v_ofs_4heads}
