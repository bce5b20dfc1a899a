"""JoyImage cases in the conventions of ``families.py`` (ComfyUI 0.33 on): ``(model, args, kwargs)``
for ``model._forward``, batch 2 for cond + uncond, fp32, image and text lengths that do not divide
by the world size. Latents are 5-D (JoyImage uses the Wan 2.1 latent format, one frame)."""
from __future__ import annotations

import torch

from families import OPS, randn, seeded

TEXT_DIM = 64


def joyimage_model(heads, seed):
    """Two blocks of width 256 over ``heads`` heads (3D RoPE axes summing to the head width)."""
    from comfy.ldm.joyimage.model import JoyImageTransformer3DModel

    rope = [16, 56, 56] if heads == 2 else [16, 24, 24]
    return seeded(JoyImageTransformer3DModel(patch_size=[1, 2, 2], in_channels=16, hidden_size=256,
                                             num_attention_heads=heads, text_dim=TEXT_DIM, mlp_width_ratio=4.0,
                                             num_layers=2, rope_dim_list=rope, theta=10000,
                                             dtype=torch.float32, device="cpu", operations=OPS), seed=seed, scale=0.1)


def joyimage():
    """A 9 x 13 latent padded to the patch grid: 5 x 7 = 35 image tokens, 7 text tokens."""
    x = randn(2, 16, 1, 9, 13, seed=171)
    return joyimage_model(2, seed=170), (x, torch.tensor([700.0, 300.0]), randn(2, 7, TEXT_DIM, seed=172)), {}


def joyimage_reference():
    """An edit reference latent (3 x 3 tokens after the image), which the model cuts off by count."""
    x = randn(2, 16, 1, 10, 14, seed=176)
    kwargs = {"ref_latents": [randn(2, 16, 1, 6, 6, seed=177)]}
    return joyimage_model(2, seed=175), (x, torch.tensor([600.0, 400.0]), randn(2, 7, TEXT_DIM, seed=178)), kwargs


def joyimage_4heads():
    """Four heads (TP 2 x Ulysses 2: a head per rank); 35 image + 10 text tokens."""
    x = randn(2, 16, 1, 10, 14, seed=181)
    return joyimage_model(4, seed=180), (x, torch.tensor([500.0, 800.0]), randn(2, 10, TEXT_DIM, seed=182)), {}


CASES = {"joyimage": joyimage, "joyimage_reference": joyimage_reference}
TP_CASES = {"joyimage_4heads": joyimage_4heads}
