"""The cfg dimension: conditional and unconditional passes on different rank groups.

ComfyUI batches cond and uncond into one forward (``transformer_options
["cond_or_uncond"]`` says which chunk is which). Each cfg group takes its share
of that batch: every input whose first dimension is the batch is cut the same
way, and the outputs are gathered back along the batch. A batch that does not
divide by the cfg size (CFG 1, or ComfyUI running cond and uncond separately to
save memory) is computed whole by every group: still exact, just not faster.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import arguments
from ..distributed import comm

# Per-sample entries of transformer_options (lists of one item per cond chunk, or one value per row).
PER_CHUNK_OPTIONS = ("cond_or_uncond", "uuids")
PER_ROW_OPTIONS = ("sigmas",)


@dataclass(frozen=True)
class BatchSplit:
    size: int       # full batch
    parts: int      # cfg groups sharing it (1: not split)
    index: int

    @property
    def rows(self) -> slice:
        n = self.size // self.parts
        return slice(self.index * n, (self.index + 1) * n)


def batch_of(first) -> int:
    """The batch of a forward's first argument: a tensor, or the streams of a model that takes
    several latents in a list (LTX-2's ``[video, audio]``), which share it; 1 when there is none."""
    if isinstance(first, (list, tuple)) and first and all(isinstance(t, torch.Tensor) and t.ndim for t in first):
        batches = {t.shape[0] for t in first}
        return batches.pop() if len(batches) == 1 else 1
    return first.shape[0] if isinstance(first, torch.Tensor) and first.ndim else 1


def plan_split(batch: int, cfg_size: int, cfg_rank: int) -> BatchSplit:
    if cfg_size > 1 and batch % cfg_size == 0:
        return BatchSplit(batch, cfg_size, cfg_rank)
    return BatchSplit(batch, 1, 0)


def map_tensors(value, fn):
    """``value`` with each tensor in it (inside lists, tuples, named tuples, dicts) replaced by
    ``fn(tensor)``; everything else as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, tuple):
        items = [map_tensors(v, fn) for v in value]
        return tuple(items) if type(value) is tuple else type(value)(*items)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


def _cut(value, split: BatchSplit):
    """This group's rows of every tensor in ``value`` whose first dimension is the batch."""
    return map_tensors(value, lambda t: t[split.rows] if t.ndim and t.shape[0] == split.size else t)


def split_bound(bound, split: BatchSplit) -> None:
    """Replace a forward's bound arguments by this group's share (transformer_options copied, not changed)."""
    if split.parts == 1:
        return
    options = arguments.get_options(bound)
    place = arguments.holder(bound)
    place[arguments.OPTIONS] = None  # keep the schedule and friends out of the generic cut below
    for name, value in list(bound.arguments.items()):
        bound.arguments[name] = _cut(value, split)
    arguments.set_options(bound, _split_options(options, split))


def _split_options(options: dict, split: BatchSplit) -> dict:
    options = dict(options)
    for key in PER_ROW_OPTIONS:
        if isinstance(options.get(key), torch.Tensor):
            options[key] = _cut(options[key], split)
    for key in PER_CHUNK_OPTIONS:
        entries = options.get(key)
        if isinstance(entries, list) and entries and len(entries) % split.parts == 0:
            n = len(entries) // split.parts
            options[key] = entries[split.index * n:(split.index + 1) * n]
    return options


def gather_output(out, split: BatchSplit, group):
    """The whole batch of the output: a tensor, or a list of them (one per stream), or a dict of
    tuples of them (a ControlNet's residuals per block)."""
    if split.parts == 1:
        return out
    if isinstance(out, list) and out and all(isinstance(t, torch.Tensor) for t in out):
        return [gather_output(t, split, group) for t in out]
    if isinstance(out, dict):
        return {key: gather_output(value, split, group) for key, value in out.items()}
    if type(out) is tuple and all(isinstance(t, torch.Tensor) for t in out):
        gathered: dict[int, torch.Tensor] = {}  # the ControlNet repeats one block's residual: gathered once
        for t in out:
            if id(t) not in gathered:
                gathered[id(t)] = gather_output(t, split, group)
        return tuple(gathered[id(t)] for t in out)
    if not isinstance(out, torch.Tensor):
        raise RuntimeError(f"cfg parallel: the model returned a {type(out).__name__}, not a tensor")
    full = out.new_empty((split.size, *out.shape[1:]))
    comm.all_gather_into(full, out.contiguous(), group=group)
    return full
