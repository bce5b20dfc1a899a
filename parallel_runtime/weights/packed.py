"""Weights stored in a packed form: GGUF files loaded by ComfyUI-GGUF.

ComfyUI-GGUF keeps every tensor of a GGUF file as a ``GGMLTensor``: a tensor subclass whose
data is what the file stores (quantized blocks as raw bytes, shaped ``(*rows, bytes per
row)``; F16/F32 tensors as they are) and whose ``tensor_type`` / ``tensor_shape`` say what it
means. Its layers dequantize at every forward and apply LoRA patches there, from the tensor's
``patches`` attribute.

What the ranks do with such a tensor:

- replicated (context parallel, or a layer TP does not cut): the stored data travels as it is,
  with the patches ComfyUI has for it, so every rank dequantizes and patches exactly as rank 0.
  F16 / F32 tensors are patched like ordinary ones (ComfyUI-GGUF merges their patches).
- cut by TP: the stored data is cut, never dequantized, where the cut falls on the format's
  block boundaries: along output features (whole rows) always, along input features when every
  rank's part is a whole number of blocks. Its LoRA patches are cut alike (``patch_cuts``), so
  each rank patches its own slice when it dequantizes. Otherwise (a cut off the blocks, patches
  that cannot be cut) rank 0 dequantizes and patches the layer as its forward would and cuts
  that: exact, but that layer is no longer quantized on the ranks. ``cut_or_dequantize`` logs
  each such layer once.

Everything here works on what a tensor *is*, by duck typing: this pack never imports ComfyUI-GGUF.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch

from . import quantized
from .patch_cuts import PatchCut, cut_patches

log = logging.getLogger("parallel")

_TORCH_TYPES = {0: torch.float32, 1: torch.float16}  # GGMLQuantizationType F32, F16: stored as they are


@dataclass(frozen=True)
class Packing:
    """How a packed tensor's stored data maps onto the tensor it stands for."""

    name: str          # "GGUF Q4_K"
    block: int         # values per block along the last dimension (1: stored as it is)
    block_bytes: int   # stored bytes per block

    @property
    def quantized(self) -> bool:
        return self.block != 1


def packing(t) -> Packing | None:
    """The packing of ``t`` (a ComfyUI-GGUF tensor), or None for an ordinary tensor."""
    if not isinstance(t, torch.Tensor) or not hasattr(t, "tensor_type") or not hasattr(t, "tensor_shape"):
        return None
    return _type_packing(t.tensor_type)


def _type_packing(qtype) -> Packing:
    if qtype is None or int(qtype) in _TORCH_TYPES:
        return Packing(f"GGUF {getattr(qtype, 'name', 'F32')}", 1, 0)
    try:
        import gguf

        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    except (ImportError, KeyError):
        block, block_bytes = 0, 0  # unknown to this gguf package: sent whole, never cut
    return Packing(f"GGUF {getattr(qtype, 'name', qtype)}", block, block_bytes)


def stored(t: torch.Tensor) -> torch.Tensor:
    """The stored data of a packed tensor as an ordinary tensor (same memory)."""
    return t.as_subclass(torch.Tensor)


def logical_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.tensor_shape) if packing(t) is not None else tuple(t.shape)


def repack(like: torch.Tensor, data: torch.Tensor, patches=None) -> torch.Tensor:
    """A tensor of ``like``'s class and type around stored ``data`` (a cut of it, or the whole)."""
    return rebuild(type(like), data, like.tensor_type, patches)


def rebuild(cls, data: torch.Tensor, tensor_type, patches=None, as_param: bool = False) -> torch.Tensor:
    """``cls(data, tensor_type=..., tensor_shape=...)``, the shape worked out from the data.
    Module level: a worker rebuilds the tensors it receives with it."""
    pack = _type_packing(tensor_type)
    shape = tuple(data.shape)
    if pack.quantized and pack.block_bytes:
        shape = (*shape[:-1], shape[-1] // pack.block_bytes * pack.block)
    out = cls(data, tensor_type=tensor_type, tensor_shape=torch.Size(shape), patches=list(patches or []))
    return torch.nn.Parameter(out, requires_grad=False) if as_param else out


def dequantized(layer, w: torch.Tensor, dtype) -> torch.Tensor:
    """``w`` as ``layer``'s forward computes with it: ComfyUI-GGUF's layers dequantize and apply
    the tensor's patches in ``get_weight``."""
    get_weight = getattr(layer, "get_weight", None)
    if get_weight is None:
        raise RuntimeError(f"{type(layer).__name__} holds a packed tensor but has no get_weight to dequantize it")
    return get_weight(w, dtype)


def has_patches(t) -> bool:
    return bool(getattr(t, "patches", None))


def with_patches(t: torch.Tensor, patches: list) -> torch.Tensor:
    """The same stored data under a new tensor object carrying ``patches`` (ComfyUI-GGUF's
    ``[(patch list, key)]``); ``t`` itself is left as ComfyUI has it."""
    return repack(t, stored(t), patches)


# ---------------------------------------------------------------- cuts
def _cut_dim(cut) -> int | None:
    return None if cut.kind == "bias_once" else (cut.dim if cut.kind == "segments" else 0)


def why_dequantized(cut, w: torch.Tensor, size: int) -> str | None:
    """Why TP cannot cut ``w`` as stored for ``size`` ranks (None: it can)."""
    return _cut_as_stored(cut, w, size)[0]


def _cut_as_stored(cut, w: torch.Tensor, size: int) -> tuple[str | None, PatchCut | None]:
    """(why TP cannot cut ``w`` as stored, None where it can; its patches cut alike, if any)."""
    pack = packing(w)
    if pack is None:
        return None, None
    if not pack.quantized:  # an F16 / F32 tensor: its layer merges the patches; TP cuts the merged weight
        return ("it carries LoRA / weight patches, which its layer merges" if has_patches(w) else None), None
    if _cut_dim(cut) == len(w.tensor_shape) - 1:  # input features: whole blocks per rank?
        if not pack.block:
            return f"this gguf package does not know {pack.name}'s block size", None
        parts = [s // size for s in cut.sizes]
        if any(p % pack.block for p in parts):
            return (f"{size} ranks' parts of its input features ({', '.join(map(str, parts))} per segment) are "
                    f"not whole {pack.name} blocks of {pack.block}"), None
    if not has_patches(w):
        return None, None
    patches = cut_patches(w.patches, cut, size)
    if isinstance(patches, str):
        return f"its LoRA / weight patches cannot be cut: {patches}", None
    return None, patches


def stored_cut(cut, t: torch.Tensor):
    """``cut`` (a ``shards.Cut`` of the tensor ``t`` stands for) as a cut of its stored
    data. Only for tensors ``why_dequantized`` lets through."""
    pack = packing(t)
    if pack is None or not pack.quantized or _cut_dim(cut) != len(t.tensor_shape) - 1:
        return cut
    return replace(cut, sizes=tuple(s // pack.block * pack.block_bytes for s in cut.sizes))


def cut_or_dequantize(cut, w: torch.Tensor, rank: int, size: int, dequantize) -> torch.Tensor:
    """``cut.apply`` for any tensor: a packed one is cut as stored where it can be, else
    ``dequantize(w)`` (the layer's own dequantization, patches applied) is cut."""
    if packing(w) is None:
        return cut.apply(w, rank, size)
    reason, patches = _cut_as_stored(cut, w, size)
    if reason is None:
        return repack(w, stored_cut(cut, w).apply(stored(w), rank, size),
                      patches.for_rank(rank, size) if patches is not None else None)
    _note_dequantized(cut.what, packing(w).name, reason)
    return cut.apply(dequantize(w), rank, size)


_NOTED: set = set()


def _note_dequantized(what: str, name: str, reason: str) -> None:
    if (what, reason) not in _NOTED:
        _NOTED.add((what, reason))
        log.warning("tensor parallel: layer %s (%s) is dequantized on rank 0 and cut in the compute dtype, "
                    "because %s; exact, but this layer is not quantized on the ranks", what, name, reason)


def stored_nbytes(cut, t: torch.Tensor, size: int, dequantized_itemsize: int = 4) -> int:
    """Bytes one TP rank holds of ``t`` (cut by ``cut``, or whole), from shapes alone."""
    if quantized.layout_name(t) is not None:
        return quantized.stored_nbytes(t, cut, size)
    if packing(t) is None:
        shape = cut.shape(tuple(t.shape), size) if cut is not None else tuple(t.shape)
        return math.prod(shape) * t.element_size()
    data = stored(t)
    if cut is None:
        return data.numel() * data.element_size()
    if why_dequantized(cut, t, size) is not None:
        return math.prod(cut.shape(logical_shape(t), size)) * dequantized_itemsize
    return math.prod(stored_cut(cut, t).shape(tuple(data.shape), size)) * data.element_size()


# ---------------------------------------------------------------- streams
@dataclass(frozen=True)
class StreamForm:
    """How a packed tensor travels in a weight stream: its stored data (with ``patches``, cut by
    ``cut`` or whole), or dequantized in ``dtype`` (``stored`` False) and cut like any tensor.
    ``patch_cuts``: id(tensor) -> how the stream cuts each tensor of the patches of a cut one."""

    stored: bool
    patches: tuple = ()
    dtype: torch.dtype | None = None
    patch_cuts: dict | None = None


def stream_form(t: torch.Tensor, cut, size: int, patches: list, dtype) -> StreamForm | None:
    """None for an ordinary tensor, and for an unquantized GGUF one (it travels as what it is, its
    patches merged like any tensor's). A cut tensor travels stored with its patches cut alike, or
    dequantized."""
    if packing(t) is None or not packing(t).quantized:
        return None
    if cut is None:
        return StreamForm(True, tuple(patches))
    reason, cut_ones = _cut_as_stored(cut, with_patches(t, patches) if patches else t, size)
    if reason is None:
        if cut_ones is None:
            return StreamForm(True)
        return StreamForm(True, tuple(cut_ones.patches), patch_cuts=cut_ones.cuts)
    _note_dequantized(cut.what, packing(t).name, reason)
    return StreamForm(False, tuple(patches), dtype)
