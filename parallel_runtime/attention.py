"""Context-parallel attention behind ComfyUI's ``optimized_attention_override``.

ComfyUI calls the override as ``override(func, q, k, v, heads, ...)``. Two layouts
reach it: ``[B, S, H*D]`` (Wan, SD3, LTXV) and, with ``skip_reshape=True``,
``[B, H, S, D]`` (Flux family, Qwen-Image, Lumina2). RoPE is already applied.

Ulysses: one all-to-all turns sequence-sharded q/k/v into head-sharded full
sequences; the padding of uneven chunks is cut off so that attention sees exactly
the real tokens; the wrapped attention function (whatever backend ComfyUI picked)
runs on ``H / n`` heads; a second all-to-all returns the sequence shards.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .sequence import SeqShard


def _heads_of(args, kwargs):
    if "heads" in kwargs:
        return kwargs["heads"]
    if len(args) > 3:
        return args[3]
    raise TypeError("attention call without a 'heads' argument")


def _with_heads(args, kwargs, heads):
    if "heads" in kwargs:
        return args, {**kwargs, "heads": heads}
    return (*args[:3], heads, *args[4:]), kwargs


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Exchange equal chunks of dim 0 (one per rank in ``group``)."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def ulysses_attention(attend, args, kwargs, *, group, shard: SeqShard):
    """Run ``attend(q, k, v, heads, ...)`` over the full sequence with heads split across ``group``."""
    q, k, v = args[:3]
    n = shard.parts
    heads = _heads_of(args, kwargs)
    if heads % n:
        raise RuntimeError(f"Ulysses: {heads} attention heads do not divide by the Ulysses size {n}")
    if kwargs.get("mask") is not None:
        raise RuntimeError("Ulysses: attention masks at context-parallel sites are not supported by this version")
    head_layout = bool(kwargs.get("skip_reshape", False))  # [B, H, S, D] instead of [B, S, H*D]
    local_heads = heads // n

    if head_layout:
        b, _, s_chunk, d = q.shape
        # [3, B, n, H/n, Sc, D] -> [n, 3, B, H/n, Sc, D]
        packed = torch.stack([t.reshape(b, n, local_heads, s_chunk, d) for t in (q, k, v)]).permute(2, 0, 1, 3, 4, 5)
        recv = _all_to_all(packed.contiguous(), group)  # [n (sequence chunk), 3, B, H/n, Sc, D]
        full = recv.permute(1, 2, 3, 0, 4, 5).reshape(3, b, local_heads, n * s_chunk, d)[:, :, :, : shard.total]
        q2, k2, v2 = full.unbind(0)
    else:
        b, s_chunk, hd = q.shape
        d = hd // heads
        packed = torch.stack([t.reshape(b, s_chunk, n, local_heads, d) for t in (q, k, v)]).permute(3, 0, 1, 2, 4, 5)
        recv = _all_to_all(packed.contiguous(), group)  # [n (sequence chunk), 3, B, Sc, H/n, D]
        full = recv.permute(1, 2, 0, 3, 4, 5).reshape(3, b, n * s_chunk, local_heads * d)[:, :, : shard.total]
        q2, k2, v2 = full.unbind(0)

    new_args, new_kwargs = _with_heads((q2, k2, v2, *args[3:]), kwargs, local_heads)
    out = attend(*new_args, **new_kwargs)

    # Back to this rank's sequence chunk with all heads.
    if kwargs.get("skip_output_reshape", False):
        out = out.transpose(1, 2)  # [B, S, H/n, D]
    out = out.reshape(b, shard.total, local_heads, d)
    if shard.padded_total != shard.total:
        out = torch.cat([out, out.new_zeros(b, shard.padded_total - shard.total, local_heads, d)], dim=1)
    send = out.reshape(b, n, s_chunk, local_heads, d).permute(1, 0, 2, 3, 4).contiguous()
    back = _all_to_all(send, group)  # [n (head group), B, Sc, H/n, D]
    back = back.permute(1, 2, 0, 3, 4)  # [B, Sc, n, H/n, D]
    if kwargs.get("skip_output_reshape", False):
        return back.reshape(b, s_chunk, heads, d).transpose(1, 2)
    return back.reshape(b, s_chunk, heads * d)
