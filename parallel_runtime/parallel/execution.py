"""One sharded forward on one rank: the same code on rank 0 and on every worker.

The cfg dimension takes its share of the batch; within the cfg group the plan
splits the token streams over the sequence-parallel (ring x ulysses) ranks.
"""
from __future__ import annotations

import inspect

import torch

from . import arguments, cfg, model_patches
from .attention import SequenceParallel
from .block_cache import CacheRanks, cached_blocks
from .compile_regions import CompileSettings, compiled_regions
from .context_parallel import context_parallel
from .tensor_parallel import tensor_parallel
from .vae_bands import run_vae
from ..distributed.mesh import ProcessMesh
from ..plans import ModelPlan


def sequence_parallel(mesh: ProcessMesh, ulysses_chunks: int = 1, overlap_return: bool = True) -> SequenceParallel:
    return SequenceParallel(
        ulysses_group=mesh.group("ulysses"), ulysses_size=mesh.size("ulysses"),
        ulysses_rank=mesh.local_rank("ulysses"),
        ring_group=mesh.group("ring"), ring_size=mesh.size("ring"), ring_rank=mesh.local_rank("ring"),
        ulysses_chunks=ulysses_chunks, overlap_return=overlap_return)


def group_weights(mesh: ProcessMesh, dim: str, weights: tuple[float, ...] | None) -> tuple[float, ...] | None:
    """The weights of this rank's group along ``dim`` ("sp", "world"), or None where they are all alike."""
    if not weights:
        return None
    mine = tuple(float(weights[r]) for r in mesh.ranks(dim))
    return mine if len(set(mine)) > 1 else None


def cache_ranks(mesh: ProcessMesh, stream_shard) -> CacheRanks:
    """Block Cache's view of the mesh: one decision over the whole world, residuals cut under TP."""
    return CacheRanks(world_group=mesh.group("world"), world_size=mesh.size("world"), rank=mesh.rank,
                      tp_group=mesh.group("tp"), tp_size=mesh.size("tp"), tp_rank=mesh.local_rank("tp"),
                      stream_shard=stream_shard)


def run_sharded(module: torch.nn.Module, plan: ModelPlan, mesh: ProcessMesh, call, signature_of,
                args: tuple, kwargs: dict, *, distributed_attention: bool = True,
                compile: CompileSettings | None = None, weights: tuple[float, ...] | None = None,
                ulysses: tuple[int, bool] = (1, True), patch_models: list | tuple = ()):
    """``call(*args, **kwargs)`` runs the model method (whose signature ``signature_of`` has);
    ``compile``: the plan's blocks run compiled (compile_regions); ``weights``: relative speed
    per global rank, for a weighted token split or VAE bands (None or all equal: the even split);
    ``ulysses``: (head groups of a pure Ulysses exchange that overlap the attention, whether its
    return overlaps the rank's own attention: ``SequenceParallel``);
    ``patch_models``: the models of the forward's model patches, as the patches' data indexes them."""
    if plan.kind == "vae":  # every rank decodes (or encodes) a band of rows; see vae_bands
        return run_vae(module, plan, mesh.group("world"), mesh.size("world"), mesh.local_rank("world"), call,
                       args, kwargs, communicate=distributed_attention, weights=group_weights(mesh, "world", weights))
    if plan.kind == "encoder":  # every rank of a TP group holds a slice of every layer; the whole input everywhere
        with tensor_parallel(module, plan.tensor_parallel, mesh.group("tp"), mesh.size("tp")):
            return call(*args, **kwargs)
    bound = inspect.signature(signature_of).bind(*args, **kwargs)
    split = cfg.plan_split(cfg.batch_of(next(iter(bound.arguments.values()))), mesh.size("cfg"), mesh.local_rank("cfg"))
    cfg.split_bound(bound, split)
    with tensor_parallel(module, plan.tensor_parallel, mesh.group("tp"), mesh.size("tp")), \
            context_parallel(module, plan, bound, sp=sequence_parallel(mesh, *ulysses), sp_group=mesh.group("sp"),
                             distributed_attention=distributed_attention, weights=group_weights(mesh, "sp", weights)) \
            as ctx, \
            compiled_regions(module, plan, compile, layout=repr(mesh.layout.sizes)), \
            cached_blocks(module, plan, arguments.get_options(bound), cache_ranks(mesh, ctx.streams.get)), \
            model_patches.running(plan, arguments.get_options(bound), list(patch_models), ctx,
                                  (split, mesh.group("cfg"))):
        out = call(*bound.args, **bound.kwargs)
    return cfg.gather_output(out, split, mesh.group("cfg"))
