"""Splitting a token sequence across ranks and gathering it back, for any length.

Every rank holds a chunk of ``ceil(L / n)`` tokens; the last chunks are padded
when ``L`` does not divide by ``n``. Padded tokens flow through the per-token
layers harmlessly and are removed before attention and at the gather, so the
result is exact (never unmasked padding inside attention).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import comm


@dataclass(frozen=True)
class SeqShard:
    """How a sequence of ``total`` tokens is cut into ``parts`` equal padded chunks."""

    total: int
    parts: int
    index: int  # this rank's chunk

    @property
    def chunk(self) -> int:
        return -(-self.total // self.parts)

    @property
    def padded_total(self) -> int:
        return self.chunk * self.parts

    @property
    def start(self) -> int:
        return min(self.index * self.chunk, self.total)

    @property
    def stop(self) -> int:
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


def take_chunk(t: torch.Tensor, dim: int, shard: SeqShard) -> torch.Tensor:
    """This rank's padded chunk of a full-length tensor."""
    local = t.narrow(dim, shard.start, shard.valid)
    return pad_along(local, dim, shard.chunk).contiguous()


def gather_chunks(local: torch.Tensor, dim: int, shard: SeqShard, group) -> torch.Tensor:
    """All-gather padded chunks along ``dim`` and drop the padding: the full-length tensor."""
    if group is None or shard.parts == 1:
        return local.narrow(dim, 0, shard.total)
    moved = local.movedim(dim, 0).contiguous()
    out = moved.new_empty((shard.parts * moved.shape[0], *moved.shape[1:]))
    comm.all_gather_into(out, moved, group=group)
    return out[: shard.total].movedim(0, dim)
