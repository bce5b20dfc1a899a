"""Small configs of every supported model family, built from ComfyUI's own classes,
with inputs whose token counts do not divide by the world size.

Each case returns (model, args, kwargs) for ``model._forward``; batch 2 stands for
ComfyUI's batched cond + uncond, so the cfg dimension has something to split.
"""
from __future__ import annotations

import torch

from tiny_models import TinyWan, build_wan_model

CASES = {}


def case(name):
    def register(fn):
        CASES[name] = fn
        return fn
    return register


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@case("wan21_t2v")
def wan_t2v():
    model = build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=2), seed=0, text_dim=64)
    x = randn(2, 16, 3, 10, 14, seed=1)  # 3 x 5 x 7 = 105 tokens
    return model, (x, torch.tensor([700.0, 300.0]), randn(2, 7, 64, seed=2)), {}


@case("wan21_i2v")
def wan_i2v():
    model = build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=2), seed=4, text_dim=64, model_type="i2v")
    x = randn(2, 16, 2, 6, 10, seed=5)  # 30 tokens
    return model, (x, torch.tensor([900.0, 100.0]), randn(2, 9, 64, seed=6)), {"clip_fea": randn(2, 257, 1280, seed=7)}


@case("wan22_ti2v_per_frame_t")
def wan_per_frame():
    """Wan 2.2 TI2V: one timestep per latent frame, repeated per token by the model."""
    model = build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=2), seed=8, text_dim=64)
    x = randn(2, 16, 3, 6, 10, seed=9)  # 45 tokens
    t = torch.rand(2, 3, generator=torch.Generator().manual_seed(10)) * 1000
    return model, (x, t, randn(2, 5, 64, seed=11)), {}
