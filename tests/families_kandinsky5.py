"""Small Kandinsky 5 configs (ComfyUI 0.33 on), in the conventions of ``families.py``: each case
returns (model, args, kwargs) for ``model._forward``, batch 2 for cond + uncond, fp32, and
7 text tokens next to 105 video (or 35 image) tokens (none divides by 2 or 4).
"""
from __future__ import annotations

import torch

from families import OPS, randn, seeded


def kandinsky5_model(heads=2, seed=180, image=False):
    """One text block and two visual blocks of width 256 (two heads of 128 or four of 64).
    Video: 33 input channels (latent, the I2V image latent and its mask, as ``concat_cond``
    joins them); image: 16 channels, no RoPE scaling (the 2560-wide image model's config)."""
    from comfy.ldm.kandinsky5.model import Kandinsky5

    axes = (32, 48, 48) if heads == 2 else (16, 24, 24)  # head_dim = sum(axes)
    variant = dict(in_visual_dim=16, visual_embed_dim=64, rope_scale_factor=(1.0, 1.0, 1.0)) if image else \
        dict(in_visual_dim=16, visual_embed_dim=33 * 4)
    return seeded(Kandinsky5(out_visual_dim=16, in_text_dim=64, in_text_dim2=32, time_dim=128, model_dim=256,
                             ff_dim=512, patch_size=(1, 2, 2), num_text_blocks=1, num_visual_blocks=2,
                             axes_dims=axes, dtype=torch.float32, device="cpu", operations=OPS, **variant),
                  seed=seed)


def video(heads, seed, i2v=False):
    """3 x 5 x 7 = 105 video tokens; I2V overwrites the first latent frame (``time_dim_replace``)."""
    x = randn(2, 33, 3, 10, 14, seed=seed + 1)
    kwargs = {"time_dim_replace": randn(2, 16, 1, 10, 14, seed=seed + 4)} if i2v else {}
    return kandinsky5_model(heads, seed=seed), \
        (x, torch.tensor([700.0, 300.0]), randn(2, 7, 64, seed=seed + 2), randn(2, 32, seed=seed + 3)), kwargs


def image(heads, seed):
    """A 4-D latent (one frame): 5 x 7 = 35 image tokens."""
    x = randn(2, 16, 10, 14, seed=seed + 1)
    return kandinsky5_model(heads, seed=seed, image=True), \
        (x, torch.tensor([800.0, 200.0]), randn(2, 7, 64, seed=seed + 2), randn(2, 32, seed=seed + 3)), {}


CASES = {
    "kandinsky5": lambda: video(2, seed=180),
    "kandinsky5_i2v": lambda: video(2, seed=185, i2v=True),
    "kandinsky5_image": lambda: image(2, seed=190),
}

# Four attention heads, so that TP 2 x Ulysses 2 has a head per rank.
TP_CASES = {
    "kandinsky5_4heads": lambda: video(4, seed=195, i2v=True),
}
