"""Krea 2 cases in the conventions of ``families.py`` (ComfyUI 0.33 on): ``(model, args, kwargs)``
for ``model._forward``, batch 2 for cond + uncond, fp32, joint sequences whose lengths do not
divide by the world size. Latents are 5-D (Krea 2 uses the Wan 2.1 latent format, one frame)."""
from __future__ import annotations

import torch

from families import OPS, randn, seeded

TXT_LAYERS, TXT_DIM = 3, 64


def krea2_model(heads, kv_heads, seed):
    """Width 256 over ``heads`` heads and ``kv_heads`` KV heads; a 64-wide text fusion with as many
    heads (TP cuts it too) over a 3-layer text encoder stack."""
    from comfy.ldm.krea2.model import SingleStreamDiT

    return seeded(SingleStreamDiT(features=256, tdim=256, txtdim=TXT_DIM, heads=heads, kvheads=kv_heads, multiplier=4,
                                  layers=2, patch=2, channels=16, txtlayers=TXT_LAYERS, txtheads=heads, txtkvheads=heads,
                                  dtype=torch.float32, device="cpu", operations=OPS), seed=seed)


def context(tokens, seed):
    return randn(2, tokens, TXT_LAYERS * TXT_DIM, seed=seed)


def krea2():
    """Two heads over one KV head; 6 text + 5 x 7 = 35 image tokens = 41."""
    x = randn(2, 16, 1, 10, 14, seed=151)
    return krea2_model(2, 1, seed=150), (x, torch.tensor([0.7, 0.3]), context(6, seed=152)), {}


def krea2_reference(method="index"):
    """A 3 x 3 reference latent appended after the image: 7 text + 35 image + 9 reference = 51 tokens."""
    x = randn(2, 16, 1, 10, 14, seed=156)
    kwargs = {"ref_latents": [randn(2, 16, 1, 6, 6, seed=157)], "ref_latents_method": method}
    return krea2_model(2, 1, seed=155), (x, torch.tensor([0.6, 0.4]), context(7, seed=158)), kwargs


def krea2_4heads():
    """Four heads over two KV heads (TP 2 x Ulysses 2: a head per rank); 10 + 35 = 45 tokens."""
    x = randn(2, 16, 1, 10, 14, seed=161)
    return krea2_model(4, 2, seed=160), (x, torch.tensor([0.5, 0.8]), context(10, seed=162)), {}


CASES = {"krea2": krea2, "krea2_reference": krea2_reference}
TP_CASES = {"krea2_4heads": krea2_4heads}
