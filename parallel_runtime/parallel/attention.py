"""Context-parallel attention behind ComfyUI's ``optimized_attention_override``.

ComfyUI calls the override as ``override(func, q, k, v, heads, ...)``. Two layouts
reach it: ``[B, S, H*D]`` (Wan, SD3, LTXV) and, with ``skip_reshape=True``,
``[B, H, S, D]`` (Flux family, Qwen-Image, Lumina2). RoPE is already applied.

Each rank holds a *joint chunk*: the concatenation of its padded chunks of one or
more token streams (text and image, say). ``JointLayout`` knows where the real
tokens sit in every rank's chunk, so padding never reaches a softmax.

- Ulysses (size U): an all-to-all turns sequence chunks into head shards of the
  U chunks of the group; the real tokens are picked out, the attention function
  ComfyUI chose runs on ``H / U`` heads, and a second all-to-all returns the chunks.
  Where ranks have their own cores or devices that return is overlapped
  (``attend_and_gather``): the query rows other ranks hold are attended first and sent,
  this rank's own rows while they travel, so a rank that is early does useful work
  instead of waiting at the exchange.
- Ring (size R): each rank keeps its queries and passes its key/value block around
  the ring; partial results are merged exactly with their log-sum-exp.
- USP: Ulysses inside each ring group, Ring across them.
- Cross-stream attention (queries from one split stream, keys and values from another: LTX-2's
  audio-to-video and video-to-audio attention): the queries and the key/value pairs each have
  their own ``JointLayout``; Ulysses exchanges them separately, Ring passes the key/value blocks
  with the key layout's real tokens, so it is exact for streams of any two lengths.

Key order differs from the single-device run (chunks of several streams are
interleaved), which attention does not see: softmax over keys is order-free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .heads import drop_padding, head_slots, pad_heads
from .sequence import pad_along
from ..distributed import comm


@dataclass(frozen=True)
class JointLayout:
    """Real-token positions inside every sequence-parallel rank's joint chunk."""

    chunk: int                          # length of every rank's joint chunk (padded)
    valid: tuple[torch.Tensor | None, ...]  # per sp rank: positions of real tokens, None = all real
    # Weighted split: (tokens this rank holds, padded chunk) per stream of the joint chunk; the
    # local joint tensor is padded to ``chunk`` for the exchange and cut back after it.
    local: tuple[tuple[int, int], ...] | None = None

    @property
    def local_length(self) -> int:
        return self.chunk if self.local is None else sum(n for n, _ in self.local)

    def pad_local(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self.local is None:
            return t
        parts = torch.split(t, [n for n, _ in self.local], dim=dim)
        return torch.cat([pad_along(p, dim, chunk) for p, (_, chunk) in zip(parts, self.local)], dim=dim)

    def strip_local(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self.local is None:
            return t
        parts = torch.split(t, [chunk for _, chunk in self.local], dim=dim)
        return torch.cat([p.narrow(dim, 0, n) for p, (n, _) in zip(parts, self.local)], dim=dim)

    def gathered(self, ranks: range) -> torch.Tensor | None:
        """Real-token positions in the concatenation of the chunks of ``ranks``; None if all real."""
        parts, any_pad = [], False
        for i, r in enumerate(ranks):
            idx = self.valid[r]
            if idx is None:
                idx = torch.arange(self.chunk)
            else:
                any_pad = True
            parts.append(idx + i * self.chunk)
        return torch.cat(parts) if any_pad else None


def _heads_of(args, kwargs) -> int:
    if "heads" in kwargs:
        return kwargs["heads"]
    if len(args) > 3:
        return args[3]
    raise TypeError("attention call without a 'heads' argument")


def _call_args(args, kwargs, q, k, v, heads):
    """Arguments for the wrapped attention function: canonical [B, H, S, D] in and out."""
    kw = {**kwargs, "skip_reshape": True, "skip_output_reshape": True}
    if "heads" in kwargs:
        kw["heads"] = heads
        return (q, k, v, *args[3:]), kw
    return (q, k, v, heads, *args[4:]), kw


def to_bhsd(t: torch.Tensor, heads: int, head_layout: bool) -> torch.Tensor:
    if head_layout:
        return t
    b, s, hd = t.shape
    return t.view(b, s, heads, hd // heads).transpose(1, 2)


def from_bhsd(t: torch.Tensor, output_heads_first: bool) -> torch.Tensor:
    if output_heads_first:
        return t
    b, h, s, d = t.shape
    return t.transpose(1, 2).reshape(b, s, h * d)


def scatter_heads(tensors, n: int, group) -> list[torch.Tensor]:
    """Ulysses forward: [B, H, S, D] sequence-sharded tensors (q, k, v) -> [B, H/n, n*S, D]
    head-sharded, contiguous (attention on strided inputs is slower than the copy that avoids it:
    measured 4-6 % on PyTorch's CPU flash attention). All of them travel in one exchange
    (``comm.Exchange``): each is copied once into the send buffer and once out of what arrived,
    both in place where the ranks share memory. They must be of one shape."""
    b, h, s, d = tensors[0].shape
    if any(t.shape != tensors[0].shape for t in tensors):
        raise ValueError(f"Ulysses: one exchange for tensors of shapes {[tuple(t.shape) for t in tensors]}")
    count = len(tensors)
    ex = comm.Exchange((n, count, b, h // n, s, d), tensors[0], group)  # [n (destination), tensor, B, H/n, S, D]
    for i, t in enumerate(tensors):
        ex.send[:, i].copy_(t.unflatten(1, (n, h // n)).transpose(0, 1))
    out = tensors[0].new_empty(count, b, h // n, n, s, d)
    for j, chunk in enumerate(ex.run()):  # chunk j: [tensor, B, H/n, S, D], rank j's tokens
        out[:, :, :, j].copy_(chunk)
    ex.close()
    return list(out.view(count, b, h // n, n * s, d).unbind(0))


def gather_heads(out: torch.Tensor, n: int, group, layout: "JointLayout", output_heads_first: bool) -> torch.Tensor:
    """Ulysses backward: [B, H/n, n*S, D] head-sharded -> what the attention call returns,
    sequence-sharded and this rank's tokens only: [B, H, S, D] or [B, S, H*D]. Sent as [n
    (destination chunk), S, B, H/n, D], the memory order of attention's output where it is
    [B, n*S, H/n, D] underneath (PyTorch's flash attention, a batch of 1), so that filling the send
    buffer is a plain copy, and no copy at all where it is sent as it is (NCCL); each arriving chunk
    is copied once, into its heads' place."""
    b, hn, ns, d = out.shape
    s = ns // n
    ex = comm.Exchange((n, s, b, hn, d), out, group, source=out.permute(2, 0, 1, 3))
    chunks = ex.run()  # chunk j: [S, B, H/n, D], head group j
    if output_heads_first:
        result = out.new_empty(b, n, hn, s, d)
        for j, chunk in enumerate(chunks):
            result[:, j].copy_(chunk.permute(1, 2, 0, 3))
        result = layout.strip_local(result.view(b, n * hn, s, d), 2)
    else:
        result = out.new_empty(b, s, n, hn, d)
        for j, chunk in enumerate(chunks):
            result[:, :, j].copy_(chunk.permute(1, 0, 2, 3))
        result = layout.strip_local(result.view(b, s, n * hn * d), 1)
    ex.close()
    return result


def _put(target: torch.Tensor, src: torch.Tensor, rows: torch.Tensor | None, dim: int) -> None:
    """``target`` receives ``src``, or ``src`` at ``rows`` along ``dim`` and zeros elsewhere (padding)."""
    if rows is None:
        target.copy_(src)
    else:
        target.zero_()
        target.index_copy_(dim, rows, src)


def attend_and_gather(q: torch.Tensor, n: int, rank: int, group, layout: "JointLayout", attend_rows,
                      output_heads_first: bool) -> torch.Tensor:
    """Ulysses backward overlapped with this rank's own attention: the query rows of the other
    ranks' chunks are attended first and put on their way, and this rank's own rows, which never
    travel, are attended while the exchange completes. A rank that arrives early at the exchange
    thus works instead of waiting; on GPUs the transfer runs beside that attention.

    ``q``: [B, H/n, n*S, D] head-sharded queries; ``attend_rows(q_rows, j)``: the attention of the
    query rows of chunk j, ``(out [B, H/n, rows, D], rows)``, ``rows`` the positions of the real
    tokens among the chunk's S (None: all). Each query row's attention is the same computation as
    in one call, so the result is too, bit for bit in every case measured but the tiniest (two
    query rows a call: PyTorch's CPU kernel rounds within 1.2e-7). Returns what ``gather_heads``
    returns."""
    b, hn, ns, d = q.shape
    s = ns // n
    ex = comm.Exchange((n, s, b, hn, d), q, group)  # [n (destination chunk), S, B, H/n, D]
    for j in ((rank + i) % n for i in range(1, n)):
        out, rows = attend_rows(q.narrow(2, j * s, s), j)
        _put(ex.send[j], out.permute(2, 0, 1, 3), rows, 0)
    ex.start()
    out, rows = attend_rows(q.narrow(2, rank * s, s), rank)
    if output_heads_first:
        result = out.new_empty(b, n, hn, s, d)
        _put(result[:, rank], out, rows, 2)
    else:
        result = out.new_empty(b, s, n, hn, d)
        _put(result[:, :, rank], out.permute(0, 2, 1, 3), rows, 1)
    for j, chunk in enumerate(ex.finish()):  # chunk j: [S, B, H/n, D], head group j
        if j == rank:
            continue
        if output_heads_first:
            result[:, j].copy_(chunk.permute(1, 2, 0, 3))
        else:
            result[:, :, j].copy_(chunk.permute(1, 0, 2, 3))
    ex.close()
    if output_heads_first:
        return layout.strip_local(result.view(b, n * hn, s, d), 2)
    return layout.strip_local(result.view(b, s, n * hn * d), 1)


def chunk_count(heads_per_rank: int, wanted: int) -> int:
    """The most head chunks, at most ``wanted``, that split ``heads_per_rank`` evenly."""
    return max(c for c in range(1, max(1, min(wanted, heads_per_rank)) + 1) if heads_per_rank % c == 0)


def ulysses_pipelined(qkv: torch.Tensor, n: int, group, chunks: int, attend_heads) -> torch.Tensor:
    """Ulysses with the heads in ``chunks`` groups, so that communication overlaps attention:
    every group's all-to-all is in flight from the start, a group's attention runs as soon as it
    has arrived, and its output travels back while the next group computes. ``qkv``: [3, B, H, S, D]
    sequence-sharded; ``attend_heads(q, k, v)``: attention of [B, g, n*S, D] head groups. Returns
    [B, H, S, D] sequence-sharded, the heads in the order of the unchunked exchange (each head's
    attention is the same computation, so the result is too)."""
    three, b, h, s, d = qkv.shape
    g = h // n // chunks
    grouped = qkv.reshape(three, b, n, chunks, g, s, d)  # head = destination rank, chunk, head in chunk
    incoming = []
    for j in range(chunks):
        send = grouped[:, :, :, j].permute(2, 0, 1, 3, 4, 5).contiguous()  # [n (destination), 3, B, g, S, D]
        recv = torch.empty_like(send)
        incoming.append((recv, comm.all_to_all_async(recv, send, group)))
    outgoing = []
    for recv, pending in incoming:
        pending.wait()
        q, k, v = recv.permute(1, 2, 3, 0, 4, 5).reshape(three, b, g, n * s, d).unbind(0)
        out = attend_heads(q, k, v)
        send = out.reshape(b, g, n, s, d).permute(2, 0, 1, 3, 4).contiguous()  # [n (destination chunk), B, g, S, D]
        back = torch.empty_like(send)
        outgoing.append((back, comm.all_to_all_async(back, send, group)))
    for _, pending in outgoing:
        pending.wait()
    stacked = torch.stack([back for back, _ in outgoing], dim=1)  # [n (head group), chunks, B, g, S, D]
    return stacked.permute(2, 0, 1, 3, 4, 5).reshape(b, h, s, d)


def attention_with_lse(q, k, v, scale: float):
    """Attention and its log-sum-exp per query ([B, H, Sq] in fp32), exact on every device."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)
        return out, lse.float()
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)[:2]
        return out, lse.float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
    return out, lse


def _merge(acc, acc_lse, out, lse):
    if acc is None:
        return out.float(), lse
    new_lse = torch.logaddexp(acc_lse, lse)
    acc = acc * torch.exp(acc_lse - new_lse).unsqueeze(-1) + out.float() * torch.exp(lse - new_lse).unsqueeze(-1)
    return acc, new_lse


def ring_attention(q, k, v, *, group, ring_size: int, ring_rank: int, key_index) -> torch.Tensor:
    """Exact attention of local queries over the key/value blocks of every ring rank.

    ``key_index(j)`` gives the real-token positions of ring rank j's block (None: all real).
    Blocks travel one hop per step with batched send/recv, overlapping the next compute
    (staged through host buffers where the backend cannot send accelerator tensors: ``comm``).
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    group_ranks = dist.get_process_group_ranks(group)
    send_to = group_ranks[(ring_rank + 1) % ring_size]
    recv_from = group_ranks[(ring_rank - 1) % ring_size]
    kv = torch.stack([k, v]).contiguous()
    acc = acc_lse = None
    for step in range(ring_size):
        pending = None
        if step + 1 < ring_size:
            incoming = torch.empty_like(kv)
            pending = comm.p2p([("send", kv, send_to), ("recv", incoming, recv_from)], group)
        owner = (ring_rank - step) % ring_size
        idx = key_index(owner)
        kb, vb = kv[0], kv[1]
        if idx is not None:
            if idx.numel() == 0:
                kb = None
            else:
                idx = idx.to(kb.device)
                kb, vb = kb.index_select(2, idx), vb.index_select(2, idx)
        if kb is not None:
            out, lse = attention_with_lse(q, kb, vb, scale)
            acc, acc_lse = _merge(acc, acc_lse, out, lse)
        if pending is not None:
            pending.wait()
            kv = incoming
    return acc.to(q.dtype)


@dataclass
class SequenceParallel:
    """The groups a context-parallel attention call communicates over."""

    ulysses_group: object
    ulysses_size: int
    ulysses_rank: int
    ring_group: object
    ring_size: int
    ring_rank: int
    # Pure Ulysses: head groups whose exchange overlaps the attention of the others (1: one exchange).
    ulysses_chunks: int = 1
    # Pure Ulysses, one exchange: its return overlaps the rank's own attention (attend_and_gather),
    # else the ranks meet in lockstep (gather_heads). world/settings.ulysses_overlap_setting decides.
    overlap_return: bool = True

    @property
    def sp_rank(self) -> int:
        return self.ring_rank * self.ulysses_size + self.ulysses_rank


def _checked_call(args, kwargs, sp: SequenceParallel, layouts: dict) -> tuple[int, bool]:
    """(heads, whether q/k/v come as [B, H, S, D]) of an attention call a context-parallel site may
    take: no mask, and q/k/v of this rank's chunk lengths (``layouts``: argument index -> its
    layout). Any head count: where Ulysses does not divide it, the heads are padded (``heads``)."""
    heads = _heads_of(args, kwargs)
    mask = kwargs.get("mask", args[4] if len(args) > 4 else None)
    if mask is not None:
        raise RuntimeError("context parallel: this model passed an attention mask to a context-parallel "
                           "attention (for example a padded prompt batch or a style model's attention mask); "
                           "masks there are not supported yet")
    head_layout = bool(kwargs.get("skip_reshape", False))
    for i, layout in layouts.items():
        if args[i].shape[-2 if head_layout else 1] != layout.local_length:
            raise RuntimeError(f"context parallel: attention got {args[i].shape} but this rank's joint chunk has "
                               f"{layout.local_length} tokens; the model plan does not describe this attention site")
    return heads, head_layout


def context_parallel_attention(attend, args, kwargs, *, sp: SequenceParallel, layout: JointLayout,
                               kv_layout: JointLayout | None = None):
    """Attention of the joint chunks of all sequence-parallel ranks; returns this rank's chunk.
    ``kv_layout``: the keys and values come from other streams than the queries (cross-stream)."""
    if kv_layout is not None and kv_layout is not layout:
        return cross_stream_attention(attend, args, kwargs, sp=sp, q_layout=layout, kv_layout=kv_layout)
    heads, head_layout = _checked_call(args, kwargs, sp, {0: layout})
    heads_first = bool(kwargs.get("skip_output_reshape", False))
    slots = head_slots(heads, sp.ulysses_size)  # None: Ulysses divides the heads
    # [B, H', S, D] each: this rank's padded chunk, the heads padded to a multiple of the Ulysses size
    qkv = [pad_heads(layout.pad_local(to_bhsd(t, heads, head_layout), 2), slots, sp.ulysses_size) for t in args[:3]]
    out = _joint_attention(attend, args, kwargs, sp, layout, qkv, heads_first)
    return drop_padding(out, slots, qkv[0].shape[1], heads_first)


def _joint_attention(attend, args, kwargs, sp: SequenceParallel, layout: JointLayout, qkv: list,
                     heads_first: bool):
    """``context_parallel_attention`` of q, k, v as [B, H', S, D] (H' a multiple of the Ulysses
    size); returns this rank's chunk as the call returns it, H' heads."""
    U, R = sp.ulysses_size, sp.ring_size
    heads = qkv[0].shape[1]
    # Real tokens of the U chunks this rank holds after the exchange (its ring block).
    block_ranks = lambda ring: range(ring * U, ring * U + U)  # noqa: E731
    if R == 1:
        real = layout.gathered(block_ranks(0))
        if real is not None:
            real = real.to(qkv[0].device)

        def attend_heads(q2, k2, v2):
            if real is not None:
                q2, k2, v2 = (t.index_select(2, real) for t in (q2, k2, v2))
            call_args, call_kwargs = _call_args(args, kwargs, q2, k2, v2, q2.shape[1])
            out = attend(*call_args, **call_kwargs)  # [B, heads, S_real, D]
            if real is not None:
                full = out.new_zeros(out.shape[0], out.shape[1], U * layout.chunk, out.shape[3])
                full.index_copy_(2, real, out)
                out = full
            return out

        chunks = chunk_count(heads // U, sp.ulysses_chunks) if U > 1 else 1
        if chunks > 1:
            out = ulysses_pipelined(torch.stack(qkv), U, sp.ulysses_group, chunks, attend_heads)
            return from_bhsd(layout.strip_local(out, 2), heads_first)
        if U > 1 and sp.overlap_return:
            q2, k2, v2 = scatter_heads(qkv, U, sp.ulysses_group)
            attend_rows = _row_attention(attend, args, kwargs, layout, _real_rows(k2, real), _real_rows(v2, real))
            return attend_and_gather(q2, U, sp.ulysses_rank, sp.ulysses_group, layout, attend_rows, heads_first)
        if U > 1:
            qkv = scatter_heads(qkv, U, sp.ulysses_group)
        out = attend_heads(*qkv)
    else:
        if U > 1:
            qkv = scatter_heads(qkv, U, sp.ulysses_group)
        q2, k2, v2 = qkv
        mine = layout.gathered(block_ranks(sp.ring_rank)) if layout.local is not None else None
        if mine is not None:  # weighted split: only this rank's real queries (its share of the work)
            mine = mine.to(q2.device)
            q2 = q2.index_select(2, mine)
        out = ring_attention(q2, k2, v2, group=sp.ring_group, ring_size=R, ring_rank=sp.ring_rank,
                             key_index=lambda j: layout.gathered(block_ranks(j)))
        if mine is not None:
            full = out.new_zeros(out.shape[0], out.shape[1], k2.shape[2], out.shape[3])
            full.index_copy_(2, mine, out)
            out = full
    if U > 1:
        return gather_heads(out, U, sp.ulysses_group, layout, heads_first)
    return from_bhsd(layout.strip_local(out, 2), heads_first)


def _real_rows(t: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    return t if real is None else t.index_select(2, real.to(t.device))


def _row_attention(attend, args, kwargs, q_layout: JointLayout, k, v):
    """``attend_and_gather``'s ``attend_rows`` for pure Ulysses: the real query rows of chunk j
    (``q_layout``'s, sequence-parallel rank j's) over ``k`` and ``v``, already real tokens only."""
    def attend_rows(q_rows, j):
        rows = q_layout.valid[j]
        if rows is not None:
            rows = rows.to(q_rows.device)
            if rows.numel() == 0:  # a chunk of padding only (a short stream over many ranks): no call
                return q_rows.new_zeros(*q_rows.shape[:2], 0, v.shape[-1]), rows
            q_rows = q_rows.index_select(2, rows)
        call_args, call_kwargs = _call_args(args, kwargs, q_rows, k, v, q_rows.shape[1])
        return attend(*call_args, **call_kwargs), rows
    return attend_rows


def cross_stream_attention(attend, args, kwargs, *, sp: SequenceParallel, q_layout: JointLayout,
                           kv_layout: JointLayout):
    """Queries of one set of split streams over the keys and values of another (LTX-2's
    audio-to-video attention), exact for any two lengths: Ulysses exchanges the queries and the
    key/value pairs separately (the same heads go to the same rank), Ring keeps the queries and
    passes the key/value blocks, each side's padding removed by its own layout. Returns this rank's
    query chunk."""
    q, k, v = args[:3]
    heads, head_layout = _checked_call(args, kwargs, sp, {0: q_layout, 1: kv_layout})
    heads_first = bool(kwargs.get("skip_output_reshape", False))
    slots = head_slots(heads, sp.ulysses_size)  # None: Ulysses divides the heads
    q = pad_heads(q_layout.pad_local(to_bhsd(q, heads, head_layout), 2), slots, sp.ulysses_size)
    k2, v2 = (pad_heads(kv_layout.pad_local(to_bhsd(t, heads, head_layout), 2), slots, sp.ulysses_size)
              for t in (k, v))
    out = _cross_stream(attend, args, kwargs, sp, q_layout, kv_layout, (q, k2, v2), heads_first)
    return drop_padding(out, slots, q.shape[1], heads_first)


def _cross_stream(attend, args, kwargs, sp: SequenceParallel, q_layout: JointLayout, kv_layout: JointLayout,
                  qkv: tuple, heads_first: bool):
    """``cross_stream_attention`` of q, k, v as [B, H', S, D] (H' a multiple of the Ulysses size)."""
    U, R = sp.ulysses_size, sp.ring_size
    q, k2, v2 = qkv
    if U > 1:  # two exchanges: the queries' streams and the keys' may be of different lengths
        (q,) = scatter_heads([q], U, sp.ulysses_group)
        k2, v2 = scatter_heads([k2, v2], U, sp.ulysses_group)
    block_ranks = lambda ring: range(ring * U, ring * U + U)  # noqa: E731
    if R == 1 and U > 1 and sp.overlap_return:
        real_kv = kv_layout.gathered(block_ranks(0))
        attend_rows = _row_attention(attend, args, kwargs, q_layout, _real_rows(k2, real_kv), _real_rows(v2, real_kv))
        return attend_and_gather(q, U, sp.ulysses_rank, sp.ulysses_group, q_layout, attend_rows, heads_first)
    mine = q_layout.gathered(block_ranks(sp.ring_rank))  # this rank's real queries after the exchange
    q2 = _real_rows(q, mine)
    if R == 1:
        real_kv = kv_layout.gathered(block_ranks(0))
        call_args, call_kwargs = _call_args(args, kwargs, q2, _real_rows(k2, real_kv), _real_rows(v2, real_kv),
                                            q2.shape[1])
        out = attend(*call_args, **call_kwargs)  # [B, heads, S_real, D]
    else:
        out = ring_attention(q2, k2, v2, group=sp.ring_group, ring_size=R, ring_rank=sp.ring_rank,
                             key_index=lambda j: kv_layout.gathered(block_ranks(j)))
    if mine is not None:
        full = out.new_zeros(out.shape[0], out.shape[1], q.shape[2], out.shape[3])
        full.index_copy_(2, mine.to(out.device), out)
        out = full
    if U > 1:
        return gather_heads(out, U, sp.ulysses_group, q_layout, heads_first)
    return from_bhsd(q_layout.strip_local(out, 2), heads_first)
