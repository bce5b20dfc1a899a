"""Splitting a token sequence across ranks and gathering it back, for any length.

Even split: every rank holds a chunk of ``ceil(L / n)`` tokens; the last chunks are
padded when ``L`` does not divide by ``n``. Padded tokens flow through the per-token
layers harmlessly and are removed before attention and at the gather, so the
result is exact (never unmasked padding inside attention).

Weighted split (``sizes``: ranks of different speed): rank ``i`` holds exactly
``sizes[i]`` real tokens and nothing else, so a slow rank's per-token layers do less
work; the chunks are padded to the largest one only for the collectives (the
attention's exchange and the gather), and the padding is dropped right after.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed import comm


@dataclass(frozen=True)
class SeqShard:
    """How a sequence of ``total`` tokens is cut into ``parts`` equal padded chunks."""

    total: int
    parts: int
    index: int  # this rank's chunk
    sizes: tuple[int, ...] | None = None  # weighted split: real tokens per rank (None: even split)

    @property
    def chunk(self) -> int:
        """Every rank's chunk length in the collectives (padded)."""
        if self.sizes is not None:
            return max(self.sizes)
        return -(-self.total // self.parts)

    @property
    def local(self) -> int:
        """Tokens this rank holds between collectives (padded for the even split, real for the weighted)."""
        return self.valid if self.sizes is not None else self.chunk

    def for_rank(self, index: int) -> "SeqShard":
        return SeqShard(self.total, self.parts, index, self.sizes)

    @property
    def padded_total(self) -> int:
        return self.chunk * self.parts

    @property
    def start(self) -> int:
        if self.sizes is not None:
            return sum(self.sizes[:self.index])
        return min(self.index * self.chunk, self.total)

    @property
    def stop(self) -> int:
        if self.sizes is not None:
            return self.start + self.sizes[self.index]
        return min(self.start + self.chunk, self.total)

    @property
    def valid(self) -> int:
        """Real (unpadded) tokens in this rank's chunk."""
        return self.stop - self.start


def pad_along(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    extra = length - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def weighted_sizes(total: int, weights: tuple[float, ...], least: int = 1) -> tuple[int, ...]:
    """``total`` tokens in proportion to ``weights`` (largest remainders), at least ``least`` each
    where there are enough tokens."""
    n = len(weights)
    floor = least if total >= least * n else 0
    spare = total - floor * n
    shares = [spare * w / sum(weights) for w in weights]
    sizes = [floor + int(x) for x in shares]
    for i in sorted(range(n), key=lambda i: shares[i] - int(shares[i]), reverse=True)[: total - sum(sizes)]:
        sizes[i] += 1
    return tuple(sizes)


def take_chunk(t: torch.Tensor, dim: int, shard: SeqShard) -> torch.Tensor:
    """This rank's chunk of a full-length tensor (padded for the even split)."""
    local = t.narrow(dim, shard.start, shard.valid)
    return pad_along(local, dim, shard.local).contiguous()


def real_positions(shard: SeqShard) -> torch.Tensor:
    """Positions of the real tokens in the concatenation of every rank's padded chunk."""
    return torch.cat([torch.arange(shard.for_rank(r).valid) + r * shard.chunk for r in range(shard.parts)])


def gather_chunks(local: torch.Tensor, dim: int, shard: SeqShard, group) -> torch.Tensor:
    """All-gather the chunks along ``dim`` and drop the padding: the full-length tensor."""
    if group is None or shard.parts == 1:
        return local.narrow(dim, 0, shard.total)
    moved = pad_along(local, dim, shard.chunk).movedim(dim, 0).contiguous()
    out = moved.new_empty((shard.parts * moved.shape[0], *moved.shape[1:]))
    comm.all_gather_into(out, moved, group=group)
    if shard.sizes is not None:  # padding after every rank's chunk, not only the last ones
        return out.index_select(0, real_positions(shard).to(out.device)).movedim(0, dim)
    return out[: shard.total].movedim(0, dim)
