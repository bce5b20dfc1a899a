"""Cutting ComfyUI's quantized weights (``QuantizedTensor``) for tensor parallelism, as stored.

ComfyUI keeps the weights of a quantized checkpoint (a ``comfy_quant`` entry per layer: fp8 with
a per-tensor scale, MXFP8, NVFP4, INT8, ...; since 0.33 plain "scaled fp8" files too) as a
``QuantizedTensor``: a tensor subclass holding the stored data (``_qdata``) and the layout's
parameters (scales). Releases differ in how:

- up to 0.3.x (``comfy/quant_ops.py``): ``_layout_type`` names the layout, ``_layout_params`` is a
  dict (``scale``, ``orig_dtype``); only ``TensorCoreFP8Layout`` exists and the tensor's shape
  and dtype are the stored fp8 data's.
- since 0.33 (``comfy_kitchen.tensor``, re-exported by ``comfy/quant_ops.py``): ``_layout_cls``
  names the layout, ``_params`` is a frozen dataclass of the layout (``scale``, ``orig_dtype``,
  ``orig_shape`` and the layout's own fields); shape and dtype are the logical ones.

This module cuts such a tensor the way ``shards.Cut`` cuts a plain one, into a new
``QuantizedTensor`` of the same layout whose dequantized value is exactly ``Cut.apply`` of the
full dequantized value, without dequantizing:

- scales that broadcast over the data (fp8 and INT8 per-tensor / per-row scales): the data is
  cut; a scale is kept where it is shared along the cut dimension and cut alongside the data
  where it has one entry per index of that dimension.
- block-scaled layouts (MXFP8: 1x32 blocks with E8M0 scales; NVFP4: 1x16 blocks with fp8
  scales and two values per byte), 2-D only: rows (output features) cut anywhere; columns only
  where every rank's part starts and ends on a block boundary. Their block scales are stored in
  cuBLAS' tiled ("swizzled") order: they are put back in row order, cut like the data and
  re-tiled, padded as the layout pads (data to 32 / 16 rows, scales to 128 x 4 tiles, zeros).
- INT8 with ConvRot (Hadamard-rotated in groups along the input features): columns only on
  rotation group boundaries.

Anything else (the packed int4 layouts, layouts this version does not know, logically
transposed tensors) gets a reason from ``why_not_cut`` naming the layout. Everything works by
duck typing on what a tensor holds: this module imports neither ComfyUI nor comfy_kitchen.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..plans.vocabulary.tensor_parallel import kv_rows

# Layout families, by the name of a class in the layout's MRO (comfy_kitchen dispatches the same
# way, so ComfyUI's own subclasses, TensorCoreFP8E4M3Layout / E5M2, are found through their base).
_FP8 = "TensorCoreFP8Layout"
_INT8 = "TensorWiseINT8Layout"
_MXFP8 = "TensorCoreMXFP8Layout"
_NVFP4 = "TensorCoreNVFP4Layout"

# Dataclass fields each family's parameters may have (since 0.33). A subclass adding anything
# else is a layout this module does not know: refused rather than guessed.
_KNOWN_FIELDS = {
    _FP8: {"scale", "orig_dtype", "orig_shape"},
    _INT8: {"scale", "orig_dtype", "orig_shape", "is_weight", "convrot", "convrot_groupsize", "transposed"},
    _MXFP8: {"scale", "orig_dtype", "orig_shape", "transposed"},
    _NVFP4: {"scale", "orig_dtype", "orig_shape", "block_scale", "transposed"},
}
_LEGACY_KEYS = {"scale", "orig_dtype", "block_size"}  # 0.3.x TensorCoreFP8Layout's dict

# Block-scaled layouts: values per scale block along the columns, data values per stored
# element along the columns, the multiple the data's rows and columns are padded to, and the
# parameter holding the tiled block scales.
_BLOCKED = {
    _MXFP8: dict(block=32, per_element=1, pad=32, field="scale"),
    _NVFP4: dict(block=16, per_element=2, pad=16, field="block_scale"),
}

_NOT_CUT = {
    "TensorCoreConvRotW4A4Layout": "packs int4 values with per-row scales for its int4 tensor-core kernel (some "
                                   "backends re-tile them)",
    "AsymW4A8Int8Layout": "packs int4 values with per-group scales, a per-channel scale and a correction term",
    "TensorCoreAWQW4A16Layout": "packs int4 values with per-group scales and zero points in its kernel's order",
    "TensorCoreSVDQuantW4A4Layout": "packs int4 values in its kernel's order and adds a low-rank branch and input "
                                    "smoothing that a cut would have to split too",
}

# cuBLAS' block-scale tiles: 128 rows x 4 columns of scales, each stored as 32 x 16.
_TILE_ROWS, _TILE_COLS = 128, 4


# ------------------------------------------------------------------ what a tensor is
def _quantized(t) -> torch.Tensor | None:
    """``t`` if it is a QuantizedTensor (a Parameter made from one is one), the QuantizedTensor
    a Parameter wraps, else None."""
    if not isinstance(t, torch.Tensor):
        return None
    if type(t).__name__ == "QuantizedTensor" and hasattr(t, "_qdata"):
        return t
    if isinstance(t, torch.nn.Parameter):
        data = t.data
        if type(data).__name__ == "QuantizedTensor" and hasattr(data, "_qdata"):
            return data
    return None


def layout_name(t) -> str | None:
    """The name of the ComfyUI quantized layout ``t`` is stored in ("TensorCoreFP8Layout",
    "TensorCoreNVFP4Layout", ...), also for a Parameter wrapping a QuantizedTensor; None for
    anything else."""
    q = _quantized(t)
    if q is None:
        return None
    name = getattr(q, "_layout_cls", None) or getattr(q, "_layout_type", None)
    if name is None:
        return "QuantizedTensor"
    return name if isinstance(name, str) else getattr(name, "__name__", str(name))


def _is_legacy(q) -> bool:
    return hasattr(q, "_layout_params") and not hasattr(q, "_params")


def _family(q) -> str | None:
    """Which layout family ``q``'s layout belongs to, or None if it is none this module cuts."""
    name = layout_name(q)
    if _is_legacy(q):
        params = q._layout_params
        if name == _FP8 and isinstance(params, dict) and set(params) <= _LEGACY_KEYS:
            return _FP8
        return None
    params = getattr(q, "_params", None)
    if not dataclasses.is_dataclass(params):
        return None
    bases = {name}
    try:
        layout_cls = q.layout_cls
        bases |= {c.__name__ for c in type.mro(layout_cls)}
    except Exception:  # noqa: BLE001 - an unregistered name: judge by the name alone
        pass
    for family in (_NVFP4, _MXFP8, _INT8, _FP8):
        if family in bases:
            fields = {f.name for f in dataclasses.fields(params)}
            return family if fields <= _KNOWN_FIELDS[family] else None
    return None


def _params_dict(q) -> dict:
    if _is_legacy(q):
        return dict(q._layout_params)
    return {f.name: getattr(q._params, f.name) for f in dataclasses.fields(q._params)}


def _tensor_params(q) -> dict[str, torch.Tensor]:
    return {k: v for k, v in _params_dict(q).items() if isinstance(v, torch.Tensor)}


def _logical_shape(q) -> tuple[int, ...]:
    if _is_legacy(q):
        return tuple(q._qdata.shape)
    return tuple(q._params.orig_shape)


# ------------------------------------------------------------------ where a cut falls
def _cut_dim(cut) -> int:
    return cut.dim if cut.kind == "segments" else 0


def _ranges(cut, length: int, rank: int, size: int) -> list[tuple[int, int]]:
    """(start, length) of rank's pieces along the cut dimension, in order (``Cut.apply``)."""
    if cut.kind == "rows":
        heads, kv, d = cut.kv
        s = kv_rows(heads, kv, d, rank, size, cut.what)
        if s.stop > length:
            raise ValueError(f"{kv} key/value heads of {d} do not fit the {length} rows")
        return [(s.start, s.stop - s.start)]
    if sum(cut.sizes) != length:
        raise ValueError(f"segments {list(cut.sizes)} do not add up to the {length} features along dimension {cut.dim}")
    out, offset = [], 0
    for s in cut.sizes:
        if s % size:
            raise ValueError(f"a segment of {s} features does not divide by tp_size {size}")
        part = s // size
        out.append((offset + rank * part, part))
        offset += s
    return out


def _every_rank(cut, length: int, size: int) -> list[list[tuple[int, int]]]:
    return [_ranges(cut, length, r, size) for r in range(size)]


def _roundup(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ------------------------------------------------------------------ the plan of a cut
@dataclass
class _Piece:
    """How one stored tensor of the part is made from the full one."""

    shape: tuple[int, ...]                     # of the part's tensor
    itemsize: int
    make: Callable[[], torch.Tensor]           # builds it (fresh memory)


@dataclass
class _Plan:
    data: _Piece
    params: dict[str, _Piece]                  # tensor parameters; the others are copied
    shape: tuple[int, ...]                     # the part's logical shape


def _clone_piece(x: torch.Tensor) -> _Piece:
    return _Piece(tuple(x.shape), x.element_size(), lambda: _fresh(x))


def _fresh(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone(memory_format=torch.contiguous_format)


def _bytes_view(x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """One-byte dtypes (fp8, E8M0) as uint8, so that every CPU op handles them."""
    if x.element_size() == 1 and x.dtype != torch.uint8:
        return x.view(torch.uint8), x.dtype
    return x, x.dtype


def _take(x: torch.Tensor, axis: int, ranges: list[tuple[int, int]], unit: int = 1) -> torch.Tensor:
    """The pieces ``ranges`` (in units of ``unit`` indices) of ``x`` along ``axis``, concatenated,
    in fresh memory."""
    raw, dtype = _bytes_view(x.detach())
    pieces = [raw.narrow(axis, start // unit, length // unit) for start, length in ranges]
    out = torch.cat(pieces, dim=axis) if len(pieces) > 1 else pieces[0].clone(memory_format=torch.contiguous_format)
    return out.view(dtype) if out.dtype != dtype else out


def _zeros(x: torch.Tensor) -> torch.Tensor:
    raw, dtype = _bytes_view(x.detach())
    out = torch.zeros(raw.shape, dtype=raw.dtype, device=raw.device)
    return out.view(dtype) if out.dtype != dtype else out


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` (2-D) with zero rows appended up to ``rows``."""
    if x.shape[0] == rows:
        return x
    raw, dtype = _bytes_view(x)
    out = torch.zeros((rows, raw.shape[1]), dtype=raw.dtype, device=raw.device)
    out[: raw.shape[0]] = raw
    return out.view(dtype) if out.dtype != dtype else out


def untile_scales(tiled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Block scales from cuBLAS' tiled order back to a ``rows`` x ``cols`` matrix in row order.

    The tiled tensor holds the matrix padded to 128-row x 4-column tiles, tile after tile (tiles
    in row-major order); inside a tile, scale (32 * i + j, c) sits at position (j, 4 * i + c) of
    a 32 x 16 block."""
    row_tiles, col_tiles = -(-rows // _TILE_ROWS), -(-cols // _TILE_COLS)
    raw, dtype = _bytes_view(tiled)
    if raw.numel() != row_tiles * col_tiles * _TILE_ROWS * _TILE_COLS:
        raise ValueError(f"{raw.numel()} tiled block scales do not hold {rows} x {cols} scales")
    # (row tile, column tile, j, i, c) -> (row tile, i, j, column tile, c)
    plain = raw.reshape(row_tiles, col_tiles, 32, 4, _TILE_COLS).permute(0, 3, 2, 1, 4)
    plain = plain.reshape(row_tiles * _TILE_ROWS, col_tiles * _TILE_COLS)[:rows, :cols]
    return plain.view(dtype) if dtype != raw.dtype else plain


def tile_scales(plain: torch.Tensor) -> torch.Tensor:
    """The inverse of ``untile_scales``: a matrix of block scales in cuBLAS' tiled order, padded
    with zeros to whole tiles, shaped (padded rows, padded columns) as the layouts store it."""
    rows, cols = plain.shape
    padded_rows, padded_cols = _roundup(rows, _TILE_ROWS), _roundup(cols, _TILE_COLS)
    raw, dtype = _bytes_view(plain)
    full = torch.zeros((padded_rows, padded_cols), dtype=raw.dtype, device=raw.device)
    full[:rows, :cols] = raw
    tiled = full.reshape(padded_rows // _TILE_ROWS, 4, 32, padded_cols // _TILE_COLS, _TILE_COLS)
    tiled = tiled.permute(0, 3, 2, 1, 4).reshape(padded_rows, padded_cols).contiguous()
    return tiled.view(dtype) if dtype != raw.dtype else tiled


def _tiled_shape(rows: int, cols: int) -> tuple[int, int]:
    return _roundup(rows, _TILE_ROWS), _roundup(cols, _TILE_COLS)


class _Refused(Exception):
    pass


def _plan(q, cut, rank: int, size: int) -> _Plan:
    """How rank's part is made; raises _Refused(reason) where it cannot be made exactly."""
    name = layout_name(q)
    family = _family(q)
    if family is None:
        why = _NOT_CUT.get(name, "this version does not know how it stores its data and scales")
        raise _Refused(f"ComfyUI's quantized layout {name} {why}, so it cannot be cut without dequantizing")
    params = _params_dict(q)
    if params.get("transposed", False):
        raise _Refused(f"ComfyUI's quantized layout {name}: this tensor is logically transposed (a view made for a "
                       "matmul), not a weight as stored")
    shape = _logical_shape(q)
    if cut.kind not in ("segments", "rows", "bias_once"):
        raise _Refused(f"ComfyUI's quantized layout {name}: unknown cut {cut.kind!r}")
    if cut.kind == "bias_once":
        return _bias_once_plan(q, rank, shape)
    dim = _cut_dim(cut)
    if dim >= len(shape):
        raise _Refused(f"ComfyUI's quantized layout {name}: a {len(shape)}-D tensor has no dimension {dim} to cut")
    try:
        ranges = _ranges(cut, shape[dim], rank, size)
        every = _every_rank(cut, shape[dim], size)
    except (ValueError, RuntimeError) as exc:  # RuntimeError: tensor_parallel's refusals of a K/V cut
        raise _Refused(f"ComfyUI's quantized layout {name}: {exc}") from None
    if family in _BLOCKED:
        return _blocked_plan(q, family, name, shape, dim, ranges, every)
    return _broadcast_plan(q, family, name, shape, dim, ranges, every)


def _bias_once_plan(q, rank: int, shape) -> _Plan:
    """Rank 0 keeps the tensor, the others hold zeros in the same layout (its scales kept, so
    that every value dequantizes to 0)."""
    data = q._qdata
    piece = _clone_piece(data) if rank == 0 else _Piece(tuple(data.shape), data.element_size(), lambda: _zeros(data))
    return _Plan(piece, {k: _clone_piece(v) for k, v in _tensor_params(q).items()}, tuple(shape))


def _check_aligned(every, unit: int, name: str, what: str) -> None:
    for ranges in every:
        for start, length in ranges:
            if start % unit or length % unit:
                raise _Refused(f"ComfyUI's quantized layout {name} {what}: a rank's part of features "
                               f"{start}..{start + length} does not start and end on a multiple of {unit}")


def _broadcast_plan(q, family, name, shape, dim, ranges, every) -> _Plan:
    """fp8 / INT8: scales multiply the data elementwise, broadcast over it."""
    data = q._qdata
    params = _params_dict(q)
    if tuple(data.shape) != tuple(shape):
        raise _Refused(f"ComfyUI's quantized layout {name}: its data {tuple(data.shape)} is not stored in the "
                       f"tensor's shape {tuple(shape)}")
    if family == _INT8 and params.get("convrot", False):
        if len(shape) != 2:
            raise _Refused(f"ComfyUI's quantized layout {name} with ConvRot is 2-D only")
        if dim == 1:
            group = int(params.get("convrot_groupsize", 256))
            _check_aligned(every, group, name, f"(ConvRot, rotated in groups of {group} input features)")
    length = sum(n for _, n in ranges)
    part_shape = tuple(length if i == dim else n for i, n in enumerate(shape))
    pieces = {}
    for key, value in _tensor_params(q).items():
        axis = value.dim() - (len(shape) - dim)  # the scale's axis that lines up with ``dim``
        if axis < 0 or value.shape[axis] == 1:
            pieces[key] = _clone_piece(value)
        elif value.shape[axis] == shape[dim]:
            sliced = tuple(length if i == axis else n for i, n in enumerate(value.shape))
            pieces[key] = _Piece(sliced, value.element_size(),
                                 lambda value=value, axis=axis: _take(value, axis, ranges))
        else:
            raise _Refused(f"ComfyUI's quantized layout {name}: its {key} of shape {tuple(value.shape)} does not "
                           f"broadcast over the data {tuple(shape)}")
    data_piece = _Piece(part_shape, data.element_size(), lambda: _take(data, dim, ranges))
    return _Plan(data_piece, pieces, part_shape)


def _blocked_plan(q, family, name, shape, dim, ranges, every) -> _Plan:
    """MXFP8 / NVFP4: 2-D, one scale per block of ``block`` values along a row, tiled."""
    spec = _BLOCKED[family]
    block, per_element, pad, field = spec["block"], spec["per_element"], spec["pad"], spec["field"]
    data = q._qdata
    params = _params_dict(q)
    tiled = params.get(field)
    if len(shape) != 2 or data.dim() != 2 or not isinstance(tiled, torch.Tensor):
        raise _Refused(f"ComfyUI's quantized layout {name} is only cut as a 2-D weight with its block scales")
    rows, cols = shape
    stored_rows, stored_cols = data.shape[0], data.shape[1] * per_element  # values per stored row, padding included
    if stored_rows < rows or stored_cols < cols or stored_cols % block:
        raise _Refused(f"ComfyUI's quantized layout {name}: stored data {tuple(data.shape)} does not hold {shape}")
    blocks = stored_cols // block
    if tiled.numel() != math.prod(_tiled_shape(stored_rows, blocks)):
        raise _Refused(f"ComfyUI's quantized layout {name}: {tuple(tiled.shape)} block scales do not tile "
                       f"{stored_rows} x {blocks} blocks")
    others = {k: _clone_piece(v) for k, v in _tensor_params(q).items() if k != field}
    if dim == 0:  # whole rows: any cut; the part is padded again as the layout pads
        part_rows = sum(n for _, n in ranges)
        padded = _roundup(part_rows, pad)

        def make_data():
            return _pad_rows(_take(data[:rows], 0, ranges), padded)

        def make_scales():
            plain = untile_scales(tiled, stored_rows, blocks)[:rows]
            return tile_scales(_pad_rows(_take(plain, 0, ranges), padded))

        data_piece = _Piece((padded, data.shape[1]), data.element_size(), make_data)
        scale_piece = _Piece(_tiled_shape(padded, blocks), tiled.element_size(), make_scales)
        part_shape = (part_rows, cols)
    else:  # columns: whole blocks only
        _check_aligned(every, block, name, f"(one scale per {block} input features)")
        part_cols = sum(n for _, n in ranges)

        def make_data():
            return _take(data, 1, ranges, per_element)

        def make_scales():
            return tile_scales(_take(untile_scales(tiled, stored_rows, blocks), 1, ranges, block))

        data_piece = _Piece((stored_rows, part_cols // per_element), data.element_size(), make_data)
        scale_piece = _Piece(_tiled_shape(stored_rows, part_cols // block), tiled.element_size(), make_scales)
        part_shape = (rows, part_cols)
    others[field] = scale_piece
    return _Plan(data_piece, others, part_shape)


# ------------------------------------------------------------------ the API
def why_not_cut(t, cut, size: int) -> str | None:
    """None when every rank's part of ``t`` (a QuantizedTensor, or a Parameter wrapping one) under
    ``cut`` (``shards.Cut``) for ``size`` ranks can be made exactly without
    dequantizing; else why not, naming the layout. None for a tensor that is not quantized
    (``Cut.apply`` cuts it as it is)."""
    q = _quantized(t)
    if q is None:
        return None
    try:
        for rank in range(size):
            _plan(q, cut, rank, size)
    except _Refused as exc:
        return str(exc)
    return None


def cut_quantized(t, cut, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``t`` (a QuantizedTensor, or a Parameter wrapping one) under
    ``cut``: a new QuantizedTensor of the same layout, in fresh memory (data and scales), whose
    dequantized value equals ``cut.apply(t.dequantize(), rank, size)`` exactly. Raises
    ValueError (the ``why_not_cut`` reason) where that cannot be done, TypeError for a tensor
    that is not quantized."""
    q = _quantized(t)
    if q is None:
        raise TypeError(f"cut_quantized: {type(t).__name__} is not a ComfyUI QuantizedTensor")
    reason = why_not_cut(q, cut, size)
    if reason is not None:
        raise ValueError(reason)
    plan = _plan(q, cut, rank, size)
    data = plan.data.make()
    values = {k: piece.make() for k, piece in plan.params.items()}
    params = _params_dict(q)
    for key, value in params.items():
        if key not in values:
            values[key] = value
    layout = layout_name(q)
    if _is_legacy(q):
        return type(q)(data, layout, values)
    if "orig_shape" in values:
        values["orig_shape"] = tuple(plan.shape)
    return type(q)(data, layout, type(q._params)(**values))


def stored_nbytes(t, cut, size: int) -> int:
    """Bytes one rank holds of ``t`` cut by ``cut`` for ``size`` ranks (data and every tensor
    parameter, as ``cut_quantized`` makes them), from shapes alone; ``cut`` None: ``t`` whole
    (replicated). Every rank holds the same. Raises ValueError (the ``why_not_cut`` reason) where
    the cut cannot be made. (``t.nbytes`` is no measure: since 0.33 it counts the data only, and
    ``numel() * element_size()`` counts the logical dtype.)"""
    q = _quantized(t)
    if q is None:
        raise TypeError(f"stored_nbytes: {type(t).__name__} is not a ComfyUI QuantizedTensor")
    if cut is None:
        return quantized_nbytes(q)
    reason = why_not_cut(q, cut, size)
    if reason is not None:
        raise ValueError(reason)
    plan = _plan(q, cut, 0, size)
    pieces = [plan.data, *plan.params.values()]
    return sum(math.prod(p.shape) * p.itemsize for p in pieces)


def quantized_nbytes(t) -> int:
    """Bytes a QuantizedTensor holds whole: its data and every tensor parameter."""
    q = _quantized(t)
    if q is None:
        raise TypeError(f"quantized_nbytes: {type(t).__name__} is not a ComfyUI QuantizedTensor")
    return q._qdata.nbytes + sum(v.nbytes for v in _tensor_params(q).values())


# ------------------------------------------------------------------ travelling to other processes
# A QuantizedTensor cannot be pickled as a tensor (its wrapper has no storage of its own: pickle
# fails, torch.multiprocessing's ForkingPickler crashes the process). It travels as what it holds,
# by its own flatten protocol (``__tensor_flatten__`` / ``__tensor_unflatten__``, both releases):
# plain tensors, and a context of builtins, dtypes and (since 0.33) its parameters' class.
def flatten(t) -> tuple[dict[str, torch.Tensor], object]:
    """The plain tensors a QuantizedTensor (or a Parameter wrapping one) holds, by name (data
    first), and the picklable context ``unflatten`` rebuilds it from."""
    q = _quantized(t)
    if q is None:
        raise TypeError(f"flatten: {type(t).__name__} is not a ComfyUI QuantizedTensor")
    names, ctx = q.__tensor_flatten__()
    return {n: getattr(q, n) for n in names}, ctx


def unflatten(cls: type, tensors: dict[str, torch.Tensor], ctx) -> torch.Tensor:
    """The QuantizedTensor of class ``cls`` holding ``tensors`` (as ``flatten`` names them)."""
    return cls.__tensor_unflatten__(dict(tensors), ctx, None, None)


def part_spec(t, cut, size: int) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], object]:
    """What every rank's part of ``t`` holds, from shapes alone (no data is read or copied):
    name -> (shape, dtype) of each of its plain tensors, in ``flatten`` order, and the context
    that rebuilds the part around them (``unflatten(type(t), tensors, ctx)``). Raises ValueError
    (the ``why_not_cut`` reason) where the cut cannot be made."""
    q = _quantized(t)
    if q is None:
        raise TypeError(f"part_spec: {type(t).__name__} is not a ComfyUI QuantizedTensor")
    part = cut_quantized(q.to("meta"), cut, 0, size)
    tensors, ctx = flatten(part)
    return {n: (tuple(x.shape), x.dtype) for n, x in tensors.items()}, ctx


def unwrapped(t) -> torch.Tensor:
    """The QuantizedTensor itself (``t``, or the one a Parameter wraps)."""
    q = _quantized(t)
    if q is None:
        raise TypeError(f"{type(t).__name__} is not a ComfyUI QuantizedTensor")
    return q


class PartForm:
    """How a quantized tensor TP cuts travels in a weight stream: one slot per plain tensor of a
    rank's part (``specs``: name -> (shape, dtype)), rebuilt with the part's context ``ctx``."""

    def __init__(self, t, cut, size: int):
        self.cut = cut
        self.specs, self.ctx = part_spec(t, cut, size)


class PartOf:
    """One plain tensor (data or scales) of each rank's part of a quantized tensor, as a weight
    stream entry's cut: its shape is the part's (``part_spec``), and ``apply`` cuts the rank's
    part of the whole quantized tensor and takes that tensor of it. Travels as a ``Cut`` of
    kind "part" (a worker needs only the shape)."""

    kind, dim, kv = "part", 0, (0, 0, 0)

    def __init__(self, cut, name: str, shape: tuple[int, ...]):
        self.what, self.name, self.sizes, self._cut = cut.what, name, tuple(shape), cut

    def shape(self, full, size: int) -> tuple[int, ...]:
        return self.sizes

    def apply(self, t, rank: int, size: int) -> torch.Tensor:
        return flatten(cut_quantized(t, self._cut, rank, size))[0][self.name]
