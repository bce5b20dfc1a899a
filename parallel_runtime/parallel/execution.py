"""One sharded forward on one rank: the same code on rank 0 and on every worker, run the way the
plan's type says (``_ENGINES``: a transformer over the mesh, a text encoder tensor parallel, a VAE
in row bands).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from . import arguments, cfg, model_patches
from .attention import SequenceParallel
from .block_cache import CacheRanks, cached_blocks
from .compile_regions import CompileSettings, compiled_regions, region_patterns
from .context_parallel import check_supported_arguments, context_parallel
from .tensor_parallel import tensor_parallel
from .vae_bands import band_convs, run_vae
from ..distributed.mesh import ProcessMesh
from ..plans.vocabulary.matching import matching_modules
from ..plans.vocabulary.plan import Plan
from ..plans.vocabulary.text_encoder import TextEncoderPlan
from ..plans.vocabulary.transformer import TransformerPlan
from ..plans.vocabulary.vae import VaePlan


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


def run_sharded(module: torch.nn.Module, plan: Plan, mesh: ProcessMesh, call, signature_of,
                args: tuple, kwargs: dict, *, distributed_attention: bool = True,
                compile: CompileSettings | None = None, weights: tuple[float, ...] | None = None,
                ulysses: tuple[int, bool] = (1, True), patch_models: list | tuple = ()):
    """``call(*args, **kwargs)`` runs the model method (whose signature ``signature_of`` has), the way
    the plan's type runs (``_ENGINES``). ``compile``: the plan's blocks run compiled (compile_regions);
    ``weights``: relative speed per global rank, for a weighted token split or VAE bands (None or all
    equal: the even split); ``ulysses``: (head groups of a pure Ulysses exchange that overlap the
    attention, whether its return overlaps the rank's own attention: ``SequenceParallel``);
    ``patch_models``: the models of the forward's model patches, as the patches' data indexes them."""
    return _engine(plan).run(module, plan, mesh, call, signature_of, args, kwargs,
                             distributed_attention=distributed_attention, compile=compile, weights=weights,
                             ulysses=ulysses, patch_models=patch_models)


def check_arguments(plan: Plan, bound) -> None:
    """Refuse, naming them, the arguments of a call that the plan cannot run sharded (before any rank
    starts work)."""
    _engine(plan).check_arguments(plan, bound)


def timed_modules(module: torch.nn.Module, plan: Plan) -> list[torch.nn.Module]:
    """The modules whose compute stands for a rank's speed under this plan (a transformer's blocks, a
    VAE's convolutions): what a test slows down to play a slower device (world/worker.py)."""
    return _engine(plan).timed(module, plan)


def _run_transformer(module: torch.nn.Module, plan: TransformerPlan, mesh: ProcessMesh, call, signature_of,
                     args: tuple, kwargs: dict, *, distributed_attention, compile, weights, ulysses, patch_models):
    """The cfg dimension takes its share of the batch; within the cfg group the plan splits the token
    streams over the sequence-parallel (ring x ulysses) ranks, and tensor parallelism its layers."""
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


def _run_text_encoder(module: torch.nn.Module, plan: TextEncoderPlan, mesh: ProcessMesh, call, signature_of,
                      args: tuple, kwargs: dict, **_):
    """Every rank of the TP group holds a slice of every layer; the whole input everywhere."""
    with tensor_parallel(module, plan.tensor_parallel, mesh.group("tp"), mesh.size("tp")):
        return call(*args, **kwargs)


def _run_vae(module: torch.nn.Module, plan: VaePlan, mesh: ProcessMesh, call, signature_of, args: tuple,
             kwargs: dict, *, distributed_attention, weights, **_):
    """Every rank decodes (or encodes) a band of rows (vae_bands)."""
    return run_vae(module, plan, mesh.group("world"), mesh.size("world"), mesh.local_rank("world"), call,
                   args, kwargs, communicate=distributed_attention, weights=group_weights(mesh, "world", weights))


def _blocks(module: torch.nn.Module, plan: TransformerPlan) -> list[torch.nn.Module]:
    return [mod for pattern in region_patterns(plan) for _, mod in matching_modules(module, pattern)]


@dataclass(frozen=True)
class _Engine:
    run: Callable
    check_arguments: Callable[[Plan, object], None]
    timed: Callable[[torch.nn.Module, Plan], list]


def _nothing(*_) -> list:
    return []


# How each plan type runs: the one place the engine tells the kinds of model apart.
_ENGINES: dict[type, _Engine] = {
    TransformerPlan: _Engine(_run_transformer, check_supported_arguments, _blocks),
    TextEncoderPlan: _Engine(_run_text_encoder, _nothing, _nothing),
    VaePlan: _Engine(_run_vae, _nothing, lambda module, plan: [conv for conv, _ in band_convs(module, plan)]),
}


def _engine(plan: Plan) -> _Engine:
    engine = next((_ENGINES[cls] for cls in type(plan).__mro__ if cls in _ENGINES), None)
    if engine is None:
        raise TypeError(f"no engine runs a {type(plan).__name__} ({plan.title}) sharded")
    return engine
