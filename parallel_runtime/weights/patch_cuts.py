"""LoRA patches cut for tensor parallelism like the weight they patch.

ComfyUI-GGUF applies a layer's LoRA patches when it dequantizes, at every forward, from the
patch list the tensor carries (``[(patches, key)]``, each patch ComfyUI's
``(strength, adapter, strength_model, offset, function)``). A TP rank holds a slice of the
stored blocks; for it to patch its slice itself (and keep it quantized), each patch is cut the
same way:

- a LoRA (``LoRAAdapter``, up x down): with the weight's rows cut, its ``up`` rows are (the
  same segments); with its input features cut, its ``down`` columns are. ``up @ down`` of the
  parts is then exactly the part of the full product. The rank (and so ``alpha / rank``) stays.
- a ``diff`` patch: cut like the weight;
- a patch with an ``offset`` (the part of a fused weight a LoRA of one projection targets: q, k
  or v of Flux's ``qkv``) along the cut dimension, when it covers whole segments of the cut:
  its offset becomes the same segments' place in a rank's slice, its tensors are cut by those
  segments. An offset along the other dimension stays.

Anything else (LoHa, LoKr, OFT, DoRA's norm over the whole weight, LoCon's mid weights, patch
functions, offsets across segments) is not cut: ``cut_patches`` says why, and the caller
dequantizes that layer on rank 0 instead (exact, as before).

The result keeps the full patch tensors and says how each is cut (``PatchCut.cuts``): the
weight stream cuts them per rank like any weight, and ``for_rank`` cuts them in place of it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class PatchCut:
    """Patches whose offsets and structure hold for every rank's slice; ``cuts``: id(tensor) ->
    how each of their tensors is cut (a ``shards.Cut``)."""

    patches: list          # ComfyUI-GGUF's [(patch list, key)]
    cuts: dict

    def for_rank(self, rank: int, size: int) -> list:
        """The patches with every tensor replaced by this rank's part of it."""
        return _map_tensors(self.patches, lambda t: self.cuts[id(t)].apply(t, rank, size) if id(t) in self.cuts else t)


def cut_patches(patches: list, cut, size: int) -> PatchCut | str:
    """``patches`` (``[(patch list, key)]``) of a weight that TP cuts by ``cut`` for ``size``
    ranks, cut alike; or the reason they cannot be."""
    if cut.kind != "segments":
        return f"its cut ({cut.kind}) does not apply to patches"
    out, cuts = [], {}
    for patch_list, key in patches:
        cut_list = []
        for patch in patch_list:
            made = _cut_patch(patch, cut, size, cuts)
            if isinstance(made, str):
                return made
            cut_list.append(made)
        out.append((cut_list, key))
    return PatchCut(out, cuts)


def _covered_segments(cut, start: int, length: int) -> tuple[tuple[int, ...], int] | None:
    """The segments of ``cut`` that [start, start + length) is made of, and the length of those
    before it; None unless the range is whole segments."""
    offset, before, covered = 0, 0, []
    for s in cut.sizes:
        if start <= offset and offset + s <= start + length:
            covered.append(s)
        elif offset < start + length and start < offset + s:
            return None  # a segment partly inside
        elif offset + s <= start:
            before += s
        offset += s
    return (tuple(covered), before) if covered and sum(covered) == length else None


def _cut_patch(patch, cut, size: int, cuts: dict):
    if not isinstance(patch, tuple) or len(patch) != 5:
        return "a patch of a form this version does not know"
    strength, adapter, strength_model, offset, function = patch
    if function is not None:
        return "a patch applies a function to the weight"
    target = cut
    if offset is not None and offset[0] == cut.dim:
        dim, start, length = offset
        found = _covered_segments(cut, start, length)
        if found is None:
            return f"a patch's offset ({start}..{start + length}) is not whole segments of the cut"
        covered, before = found
        target = replace(cut, sizes=covered)
        offset = (dim, before // size, length // size)  # where those segments lie in a rank's slice
    tensors = _adapter_tensors(adapter, target.dim)
    if isinstance(tensors, str):
        return tensors
    for t in tensors:
        if cuts.get(id(t), target) != target:  # one tensor in two patches, cut two ways: not one slice
            return "a patch tensor shared by patches that cut it differently"
        cuts[id(t)] = target
    return (strength, adapter, strength_model, offset, function)


def _adapter_tensors(adapter, dim: int):
    """The tensors of ``adapter`` that a cut along ``dim`` of the weight cuts (along the same
    dim), or why it cannot be cut."""
    name = getattr(adapter, "name", None)
    if name == "lora" and hasattr(adapter, "weights"):
        up, down, _alpha, mid, dora_scale, reshape = (tuple(adapter.weights) + (None,) * 6)[:6]
        if mid is not None or dora_scale is not None or reshape is not None:
            return "a LoRA with mid weights, DoRA or a reshape (made for the whole weight)"
        if up.ndim != 2 or down.ndim != 2:
            return "a LoRA of a layer that is not a matrix"
        return [up] if dim == 0 else [down]
    if isinstance(adapter, tuple):
        kind, values = ("diff", adapter) if len(adapter) == 1 else adapter
        if kind == "diff" and len(values) == 1 and isinstance(values[0], torch.Tensor):
            return [values[0]]
        return f"a '{kind}' patch"
    return f"a {name or type(adapter).__name__} patch"


def _map_tensors(patches: list, fn) -> list:
    """The patch lists with every tensor of their adapters replaced by ``fn(tensor)``."""
    out = []
    for patch_list, key in patches:
        mapped = []
        for strength, adapter, strength_model, offset, function in patch_list:
            if isinstance(adapter, tuple):
                kind, values = ("diff", adapter) if len(adapter) == 1 else adapter
                adapter = (kind, tuple(fn(v) if isinstance(v, torch.Tensor) else v for v in values))
            else:
                adapter = type(adapter)(adapter.loaded_keys,
                                        tuple(fn(v) if isinstance(v, torch.Tensor) else v for v in adapter.weights))
            mapped.append((strength, adapter, strength_model, offset, function))
        out.append((mapped, key))
    return out
