"""A small DiT that neither ComfyUI nor the pack knows: image tokens in, self-attention with
ComfyUI's ``optimized_attention`` (given ``transformer_options``, as ComfyUI's own models do),
cross-attention to the text, a timestep-modulated MLP, patches out. The class a user plan covers
in tests/test_user_plans.py."""
import math

import torch
from torch import nn

import comfy.patcher_extension
from comfy.ldm.modules.attention import optimized_attention


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * 1000.0 * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, hidden, heads, operations, device=None, dtype=None):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (operations.Linear(hidden, hidden, device=device, dtype=dtype) for _ in range(3))
        self.out = operations.Linear(hidden, hidden, device=device, dtype=dtype)

    def forward(self, x, transformer_options={}):
        return self.out(optimized_attention(self.q(x), self.k(x), self.v(x), self.heads,
                                            transformer_options=transformer_options))


class CrossAttention(nn.Module):
    def __init__(self, hidden, context_dim, heads, operations, device=None, dtype=None):
        super().__init__()
        self.heads = heads
        self.q = operations.Linear(hidden, hidden, device=device, dtype=dtype)
        self.k = operations.Linear(context_dim, hidden, device=device, dtype=dtype)
        self.v = operations.Linear(context_dim, hidden, device=device, dtype=dtype)
        self.out = operations.Linear(hidden, hidden, device=device, dtype=dtype)

    def forward(self, x, context, transformer_options={}):
        return self.out(optimized_attention(self.q(x), self.k(context), self.v(context), self.heads,
                                            transformer_options=transformer_options))


class Block(nn.Module):
    def __init__(self, hidden, heads, context_dim, mlp, operations, device=None, dtype=None):
        super().__init__()
        self.norm1 = operations.LayerNorm(hidden, elementwise_affine=False, device=device, dtype=dtype)
        self.attn = SelfAttention(hidden, heads, operations, device, dtype)
        self.norm2 = operations.LayerNorm(hidden, elementwise_affine=False, device=device, dtype=dtype)
        self.cross = CrossAttention(hidden, context_dim, heads, operations, device, dtype)
        self.norm3 = operations.LayerNorm(hidden, elementwise_affine=False, device=device, dtype=dtype)
        self.fc1 = operations.Linear(hidden, mlp, device=device, dtype=dtype)
        self.fc2 = operations.Linear(mlp, hidden, device=device, dtype=dtype)
        self.modulation = operations.Linear(hidden, 2 * hidden, device=device, dtype=dtype)

    def forward(self, x, t_emb, context, transformer_options={}):
        scale, shift = self.modulation(t_emb).unsqueeze(1).chunk(2, dim=-1)
        x = x + self.attn(self.norm1(x) * (1 + scale) + shift, transformer_options=transformer_options)
        x = x + self.cross(self.norm2(x), context, transformer_options=transformer_options)
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm3(x))))


class TinyUserDiT(nn.Module):
    def __init__(self, in_channels=16, hidden=256, heads=4, depth=2, context_dim=64, mlp=512, patch=2,
                 device=None, dtype=None, operations=None, **kwargs):
        super().__init__()
        self.dtype = dtype  # ComfyUI's model_base reads it, as from its own models
        self.patch, self.in_channels, self.hidden = patch, in_channels, hidden
        self.embed = operations.Linear(in_channels * patch * patch, hidden, device=device, dtype=dtype)
        self.time = operations.Linear(hidden, hidden, device=device, dtype=dtype)
        self.blocks = nn.ModuleList([Block(hidden, heads, context_dim, mlp, operations, device, dtype)
                                     for _ in range(depth)])
        self.final = operations.Linear(hidden, in_channels * patch * patch, device=device, dtype=dtype)

    def forward(self, x, timesteps, context, transformer_options={}, **kwargs):
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self, comfy.patcher_extension.get_all_wrappers(
                comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options)
        ).execute(x, timesteps, context, transformer_options, **kwargs)

    def _forward(self, x, timesteps, context, transformer_options={}, **kwargs):
        b, c, h, w = x.shape
        p = self.patch
        tokens = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), -1)
        rows = torch.arange(h // p, device=x.device, dtype=torch.float32).repeat_interleave(w // p)
        cols = torch.arange(w // p, device=x.device, dtype=torch.float32).repeat(h // p)
        position = torch.cat([timestep_embedding(rows / 1000.0, self.hidden // 2),
                              timestep_embedding(cols / 1000.0, self.hidden // 2)], dim=-1)
        tokens = self.embed(tokens) + position.to(x.dtype)
        t_emb = nn.functional.silu(self.time(timestep_embedding(timesteps, self.hidden).to(x.dtype)))
        for block in self.blocks:
            tokens = block(tokens, t_emb, context, transformer_options=transformer_options)
        out = self.final(tokens)
        return out.reshape(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
