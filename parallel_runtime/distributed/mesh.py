"""Rank layout over the named mesh dimensions and the process groups along them.

Ranks are laid out row-major over ``cfg x ring x ulysses x tp`` (tp innermost, so a
TP group is a run of neighbouring devices). ``MeshLayout`` is pure arithmetic;
``ProcessMesh`` creates the torch.distributed groups, which every rank must do in
the same order.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..config import MESH_DIMS

# Composite dimensions the runtime needs groups for, besides the single ones.
COMPOSITE_DIMS = {"sp": ("ring", "ulysses"),  # the whole sequence-parallel group
                  "world": MESH_DIMS}          # every rank (text encoders shard over all of them)


@dataclass(frozen=True)
class MeshLayout:
    sizes: tuple[int, ...]  # in MESH_DIMS order

    @classmethod
    def from_sizes(cls, sizes: dict[str, int]) -> "MeshLayout":
        return cls(tuple(int(sizes.get(d, 1)) for d in MESH_DIMS))

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def size(self, dim: str) -> int:
        return math.prod(self.sizes[MESH_DIMS.index(d)] for d in self._dims(dim))

    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for dim, size in reversed(list(zip(MESH_DIMS, self.sizes))):
            out[dim] = rank % size
            rank //= size
        return {d: out[d] for d in MESH_DIMS}

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for dim, size in zip(MESH_DIMS, self.sizes):
            rank = rank * size + coords.get(dim, 0)
        return rank

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of ranks that differ only along ``dim`` (a single or composite name)."""
        varying = self._dims(dim)
        fixed = [d for d in MESH_DIMS if d not in varying]
        fixed_ranges = [range(self.sizes[MESH_DIMS.index(d)]) for d in fixed]
        varying_ranges = [range(self.sizes[MESH_DIMS.index(d)]) for d in varying]
        result = []
        for fixed_vals in itertools.product(*fixed_ranges):
            base = dict(zip(fixed, fixed_vals))
            ranks = [self.rank_of({**base, **dict(zip(varying, vals))}) for vals in itertools.product(*varying_ranges)]
            result.append(sorted(ranks))
        return result

    def group_of(self, dim: str, rank: int) -> list[int]:
        for ranks in self.groups(dim):
            if rank in ranks:
                return ranks
        raise ValueError(f"rank {rank} outside the mesh")

    @staticmethod
    def _dims(dim: str) -> tuple[str, ...]:
        if dim in COMPOSITE_DIMS:
            return COMPOSITE_DIMS[dim]
        if dim in MESH_DIMS:
            return (dim,)
        raise KeyError(f"unknown mesh dimension {dim!r}")


class ProcessMesh:
    """Process groups along each mesh dimension, for this rank.

    ``known`` (rank set -> group) is shared by every mesh of one world: a rank set that two
    dimensions (``ulysses`` and ``sp`` when ring is 1) or two layouts have in common gets one
    communicator, not one each (an NCCL communicator costs device memory and set-up time). Every
    rank builds its meshes in the same order, so every rank skips the same ``new_group`` calls."""

    def __init__(self, layout: MeshLayout, rank: int, known: dict | None = None):
        import torch.distributed as dist

        self.layout = layout
        self.rank = rank
        self._groups = {}
        self._ranks = {}
        known = {} if known is None else known
        for dim in (*MESH_DIMS, *COMPOSITE_DIMS):
            all_groups = layout.groups(dim)
            mine = None
            for ranks in all_groups:
                if len(ranks) == 1:
                    continue  # size-1 groups need no communicator
                if len(ranks) == layout.world_size:
                    group = dist.group.WORLD
                else:
                    group = known.get(tuple(ranks))
                    if group is None:  # collective over all ranks: same order everywhere
                        group = known[tuple(ranks)] = dist.new_group(ranks)
                if rank in ranks:
                    mine = group
            self._groups[dim] = mine
            self._ranks[dim] = layout.group_of(dim, rank)

    def group(self, dim: str):
        """The process group along ``dim``, or None when that dimension has size 1."""
        return self._groups[dim]

    def size(self, dim: str) -> int:
        return len(self._ranks[dim])

    def local_rank(self, dim: str) -> int:
        return self._ranks[dim].index(self.rank)

    def ranks(self, dim: str) -> list[int]:
        return list(self._ranks[dim])
