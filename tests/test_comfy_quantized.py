"""ComfyUI's quantized weights (``QuantizedTensor``) cut for tensor parallelism as stored
(``parallel_runtime.weights.quantized``), on the ComfyUI release this host runs.

Every layout this release can make on the CPU is quantized from a random weight with ComfyUI's
own ``QuantizedTensor.from_float``; each TP cut (``tensor_parallel.Cut``: Colwise, fused
Colwise, grouped-query K/V rows, Rowwise, the biases) is then checked against ``Cut.apply`` of
the full weight's own dequantized value, and in ComfyUI's quantized Linear (``comfy.ops``).
Where the module refuses a cut, the test decides independently (from the layout's block size)
that it had to.
"""
from __future__ import annotations

import copy
import dataclasses
import io
import json
import pickle
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing  # noqa: F401  (registers the tensor reductions ForkingPickler uses)
import torch.nn.functional as F

import comfy.ops
import comfy.quant_ops
from parallel_runtime.weights import quantized as cq
from parallel_runtime.weights.shards import Cut

NEW_API = hasattr(comfy.quant_ops, "get_layout_class")  # 0.33+: comfy_kitchen's QuantizedTensor
QT = comfy.quant_ops.QuantizedTensor


@dataclass(frozen=True)
class Case:
    layout: str
    kwargs: dict = field(default_factory=dict)  # for from_float
    comfy_quant: dict | None = None             # the checkpoint's per-layer config that loads it
    block: int = 1                              # input features a rank's part must start/end on
    one_d: bool = True                          # a 1-D tensor (a bias) can be quantized in it
    k_multiple: int = 1                         # the layout needs input features in multiples of this


CASES = {
    "fp8": Case("TensorCoreFP8Layout", dict(scale=torch.tensor(0.004)), {"format": "float8_e4m3fn"}),
    "fp8_e4m3": Case("TensorCoreFP8E4M3Layout", dict(scale="recalculate"), {"format": "float8_e4m3fn"}),
    "fp8_e5m2": Case("TensorCoreFP8E5M2Layout", dict(scale="recalculate"), {"format": "float8_e5m2"}),
    "mxfp8": Case("TensorCoreMXFP8Layout", {}, {"format": "mxfp8"}, block=32, one_d=False),
    "nvfp4": Case("TensorCoreNVFP4Layout", {}, {"format": "nvfp4"}, block=16, one_d=False),
    "int8": Case("TensorWiseINT8Layout", {}, {"format": "int8_tensorwise"}),
    "int8_per_channel": Case("TensorWiseINT8Layout", dict(per_channel=True), {"format": "int8_tensorwise"},
                             one_d=False),
    "int8_convrot": Case("TensorWiseINT8Layout", dict(per_channel=True, convrot=True, convrot_groupsize=64),
                         {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 64},
                         block=64, one_d=False, k_multiple=64),
}
# Layouts the module refuses by design (packed int4 in kernel-specific storage), with the
# from_float options the CPU-quantizable ones take.
REFUSED = {
    "TensorCoreConvRotW4A4Layout": {},
    "AsymW4A8Int8Layout": {},
    "TensorCoreAWQW4A16Layout": {},
    "TensorCoreSVDQuantW4A4Layout": {},
}
SHAPES = [(192, 256), (200, 256), (64, 80)]  # 200 rows and 80 columns: the block layouts pad them


def registered_layouts() -> set[str]:
    if NEW_API:
        from comfy_kitchen.tensor.base import LAYOUTS
    else:
        LAYOUTS = comfy.quant_ops.LAYOUTS
    return set(LAYOUTS)


HERE = [key for key, case in CASES.items() if case.layout in registered_layouts()]  # this release's layouts


def here(keys: list, what: str) -> list:
    """``keys``, or one skipped parameter saying that this release has no such layout."""
    return keys or [pytest.param(None, marks=pytest.mark.skip(reason=f"this ComfyUI release has no {what}"))]


def make(case: Case, w: torch.Tensor):
    """``w`` quantized in the case's layout, or a skip saying why this host cannot."""
    if case.layout not in registered_layouts():
        pytest.skip(f"{case.layout} does not exist in this ComfyUI release")
    try:
        return QT.from_float(w, case.layout, **case.kwargs)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"this host cannot make {case.layout} on the CPU: {type(exc).__name__}: {exc}")


def weight(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.2
    if len(shape) == 2:  # some rows and blocks far larger than others: scales that differ a lot
        w[::7] *= 9.0
        w[:, 3::11] *= 0.01
    return w.to(dtype)


def inner_tensors(t) -> list[torch.Tensor]:
    """Every tensor a QuantizedTensor holds (data and scales), by its own flatten protocol."""
    names, _ = t.__tensor_flatten__()
    return [getattr(t, n) for n in names]


def layout_of(t) -> str:
    return getattr(t, "_layout_cls", None) or t._layout_type


def cuts_2d(rows: int, cols: int) -> dict[str, Cut]:
    a = rows // 3 - (rows // 3) % 8
    c = cols // 2
    return {
        "colwise": Cut("w", "segments", 0, (rows,)),
        "colwise_fused": Cut("w", "segments", 0, (a, rows - a)),
        "colwise_kv": Cut("w", "rows", kv=(8, 2, rows // 2)),
        "rowwise": Cut("w", "segments", 1, (cols,)),
        "rowwise_fused": Cut("w", "segments", 1, (c, cols - c)),
        "bias_once": Cut("w", "bias_once"),
    }


def divides(cut: Cut, size: int) -> bool:
    return cut.kind != "segments" or all(s % size == 0 for s in cut.sizes)


def expected_possible(case: Case, cut: Cut, size: int) -> bool:
    """Decided here, not by the module: a cut along the input features must start and end every
    rank's part on the layout's blocks."""
    if cut.kind != "segments" or cut.dim != 1 or case.block == 1:
        return True
    offset = 0
    for s in cut.sizes:
        part = s // size
        for r in range(size):
            if (offset + r * part) % case.block or part % case.block:
                return False
        offset += s
    return True


def reassemble(parts: list[torch.Tensor], cut: Cut, size: int) -> torch.Tensor | None:
    """The full tensor from every rank's part (None where parts overlap: replicated K/V heads)."""
    if cut.kind == "bias_once":
        return sum(parts[1:], parts[0])
    if cut.kind == "rows":
        heads, kv, d = cut.kv
        return torch.cat(parts, 0) if size <= kv else None
    pieces = [p.split([s // size for s in cut.sizes], cut.dim) for p in parts]
    return torch.cat([pieces[r][i] for i in range(len(cut.sizes)) for r in range(size)], cut.dim)


def check_cut(t, case: Case, cut: Cut, size: int) -> list | None:
    """Everything about one cut of ``t``; the parts, or None where it is (rightly) refused."""
    name = layout_of(t)
    full = t.dequantize()
    reason = cq.why_not_cut(t, cut, size)
    if not expected_possible(case, cut, size):
        assert reason is not None and name in reason, reason
        with pytest.raises(ValueError, match=name):
            cq.cut_quantized(t, cut, 0, size)
        with pytest.raises(ValueError, match=name):
            cq.stored_nbytes(t, cut, size)
        return None
    assert reason is None, reason
    originals = {x.untyped_storage().data_ptr() for x in inner_tensors(t)}
    parts, values = [], []
    for rank in range(size):
        part = cq.cut_quantized(t, cut, rank, size)
        assert type(part) is type(t) and layout_of(part) == name
        value = part.dequantize()
        expected = cut.apply(full, rank, size)
        assert value.dtype == expected.dtype and value.shape == expected.shape
        assert torch.equal(value, expected), f"rank {rank}: max error {(value - expected).abs().max()}"
        assert tuple(part.shape) == tuple(cut.apply(torch.empty(t.shape, device="meta"), rank, size).shape)
        held = inner_tensors(part)
        assert cq.stored_nbytes(t, cut, size) == sum(x.nbytes for x in held)
        for x in held:  # fresh memory, holding no more than the part
            assert x.untyped_storage().data_ptr() not in originals
            assert x.untyped_storage().nbytes() == x.nbytes
        parts.append(part)
        values.append(value)
    whole = reassemble(values, cut, size)
    if whole is not None:
        assert torch.equal(whole, full)
    return parts


# ------------------------------------------------------------------ the cuts themselves
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("case,shape", [(c, s) for c in HERE for s in SHAPES if s[1] % CASES[c].k_multiple == 0],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_weight_cuts_dequantize_to_the_cut_of_the_full_weight(case, shape, size, dtype):
    case = CASES[case]
    t = make(case, weight(shape, dtype))
    refused = 0
    for name, cut in cuts_2d(*shape).items():
        if not divides(cut, size):
            continue
        if check_cut(t, case, cut, size) is None:
            refused += 1
    if case.block > 1 and shape[1] // size % case.block:
        assert refused == 2  # both Rowwise cuts


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("case", [c for c in HERE if CASES[c].one_d])
def test_bias_cuts(case, size):
    case = CASES[case]
    t = make(case, weight((96,)) + 0.5)
    for cut in (Cut("b", "segments", 0, (96,)), Cut("b", "segments", 0, (32, 64)), Cut("b", "bias_once"),
                Cut("b", "rows", kv=(8, 2, 48))):
        assert check_cut(t, case, cut, size) is not None


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("case", [c for c in HERE if CASES[c].one_d])
def test_per_tensor_layouts_cut_weights_of_any_rank(case, size):
    """A convolution's 4-D weight (per-tensor scales broadcast over any shape)."""
    case = CASES[case]
    t = make(case, weight((32, 16, 3, 3)))
    for cut in (Cut("w", "segments", 0, (32,)), Cut("w", "segments", 1, (16,)), Cut("w", "segments", 0, (8, 24)),
                Cut("w", "bias_once")):
        assert check_cut(t, case, cut, size) is not None


@pytest.mark.parametrize("case", here([c for c in HERE if CASES[c].block > 1], "block-scaled layout"))
def test_block_layouts_refuse_parts_off_their_blocks(case):
    case = CASES[case]
    cols = 3 * case.block * 4  # parts of 1.5 blocks at tp 8, 3 blocks at tp 4
    t = make(case, weight((64, cols)))
    assert cq.why_not_cut(t, Cut("w", "segments", 1, (cols,)), 4) is None
    for cut, size in ((Cut("w", "segments", 1, (cols,)), 8),
                      (Cut("w", "segments", 1, (cols // 4, cols * 3 // 4)), 2)):
        assert case.layout in cq.why_not_cut(t, cut, size)
        check_cut(t, case, cut, size)
    # rows cut anywhere, also into parts the layout pads again
    assert check_cut(t, case, Cut("w", "segments", 0, (64,)), 8) is not None


def test_parts_are_stored_as_the_layout_stores_a_tensor_of_their_shape():
    """Padding of the block layouts' data and tiled scales: a part holds what ``from_float``
    makes for a tensor of the part's shape."""
    for key in ("mxfp8", "nvfp4"):
        case = CASES[key]
        if case.layout not in registered_layouts():
            continue
        for shape in ((200, 256), (64, 80), (256, 64)):
            t = make(case, weight(shape))
            for cut, size in ((Cut("w", "segments", 0, (shape[0],)), 4), (Cut("w", "segments", 0, (shape[0],)), 8),
                              (Cut("w", "segments", 1, (shape[1],)), 2)):
                if cq.why_not_cut(t, cut, size) is not None:
                    continue
                part = cq.cut_quantized(t, cut, 1, size)
                again = QT.from_float(part.dequantize(), case.layout)
                assert [tuple(x.shape) for x in inner_tensors(part)] == [tuple(x.shape) for x in inner_tensors(again)]
                assert [x.dtype for x in inner_tensors(part)] == [x.dtype for x in inner_tensors(again)]


# ------------------------------------------------------------------ in ComfyUI's Linear
def comfy_linear(t, case: Case, bias: torch.Tensor, dtype, full_precision: bool) -> torch.nn.Module:
    """A Linear of ComfyUI's mixed-precision ops, loaded from a checkpoint's keys holding ``t``
    (``full_precision``: as ComfyUI runs a format the device cannot compute: dequantized)."""
    rows, cols = t.shape
    if NEW_API:
        ops = comfy.ops.mixed_precision_ops({}, compute_dtype=dtype, full_precision_mm=full_precision)
        sd = t.state_dict("weight")
        sd["comfy_quant"] = torch.tensor(list(json.dumps(case.comfy_quant).encode()), dtype=torch.uint8)
    else:
        ops = comfy.ops.mixed_precision_ops({"": dict(case.comfy_quant)}, compute_dtype=dtype,
                                            full_precision_mm=full_precision)
        sd = {"weight": t._qdata, "weight_scale": t._layout_params["scale"]}
    sd["bias"] = bias
    layer = ops.Linear(cols, rows)
    layer.load_state_dict(sd)
    assert type(layer.weight).__name__ == "QuantizedTensor"
    return layer


def shard_layer(layer, cut: Cut, bias_cut: Cut, rank: int, size: int):
    """The layer as ``tensor_parallel.build_shard`` makes a shard: a deep copy whose cut tensors
    are replaced (Parameters of the parts)."""
    w = torch.nn.Parameter(cq.cut_quantized(layer.weight, cut, rank, size), requires_grad=False)
    b = torch.nn.Parameter(bias_cut.apply(layer.bias.detach(), rank, size), requires_grad=False)
    return copy.deepcopy(layer, {id(layer.weight): w, id(layer.bias): b})


def input_cut(cut: Cut, x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    if cut.kind == "segments" and cut.dim == 1:
        return Cut("x", "segments", x.dim() - 1, cut.sizes).apply(x, rank, size)
    return x


LINEAR_CUTS = ["colwise", "colwise_fused", "colwise_kv", "rowwise", "rowwise_fused"]
INT8 = "TensorWiseINT8Layout"


def input_as_computed(layer, case: Case, x: torch.Tensor, dequantizing: bool) -> torch.Tensor | None:
    """``x`` as ComfyUI's layer feeds it to the matmul: as it is where the layer dequantizes its
    weight (the 0.3.x Linear without an input scale; since 0.33 ``full_precision_mm``, which
    ComfyUI sets for a format the device cannot compute), else quantized as the layer quantizes
    it: since 0.33 the Linear quantizes its input in the weight's layout (no input scale), and
    the INT8 kernel quantizes each input row itself. None: not reproduced here (ConvRot rotates
    the input first)."""
    if not NEW_API or (dequantizing and case.layout != INT8):
        return x
    rows = x.reshape(-1, x.shape[-1])
    if case.layout == INT8:
        if case.kwargs.get("convrot"):
            return None
        quantized = QT.from_float(rows, INT8, is_weight=False)
    else:
        quantized = QT.from_float(rows, layer.layout_type, scale=None)
    return quantized.dequantize().reshape(x.shape)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", ["dequantizing", "native"])
@pytest.mark.parametrize("case", [c for c in HERE if CASES[c].comfy_quant])
def test_cut_weights_work_in_comfyuis_quantized_linear(case, path, dtype, size):
    """A shard of ComfyUI's mixed-precision Linear (loaded from a checkpoint's keys, its weight
    replaced by the part as ``build_shard`` does):

    - Colwise / K/V rows: exactly the slice of the unsharded layer's output (same ops).
    - fp32, every cut: F.linear of the input as the layer computes with it (``input_as_computed``)
      with the cut of the full weight's dequantized value, within 1e-6 relative to the largest sum
      of absolute products (the scale of a different summation order's rounding). Exact on 0.3.x. Not exact since 0.33 because PyTorch decomposes F.linear on
      a QuantizedTensor weight into t + addmm, which comfy_kitchen runs on the dequantized weight
      with the bias fused (another summation order than F.linear; the unsharded layer differs
      from F.linear alike), or in the layout's own kernel (fp8 / INT8: fp32 or int32 sums).

    ``native``: the layout's quantized kernel, where it runs on this CPU."""
    case = CASES[case]
    rows, cols = 192, 256
    t = make(case, weight((rows, cols), dtype))
    bias = weight((rows,), dtype, seed=1)
    layer = comfy_linear(t, case, bias, dtype, full_precision=path == "dequantizing")
    full = layer.weight.dequantize()
    assert torch.equal(full, t.dequantize())
    x = weight((2, 5, cols), dtype, seed=2)
    try:
        with torch.no_grad():
            reference = layer(x)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"ComfyUI's quantized kernel for {case.layout} does not run on this CPU ({exc}); ComfyUI "
                    "dequantizes there instead (the 'dequantizing' path)")
    for name in LINEAR_CUTS:
        cut = cuts_2d(rows, cols)[name]
        if not divides(cut, size) or not expected_possible(case, cut, size):
            continue
        rowwise = cut.kind == "segments" and cut.dim == 1
        bias_cut = Cut("b", "bias_once") if rowwise else cut if cut.kind == "rows" else Cut("b", "segments", 0, cut.sizes)
        for rank in range(size):
            shard = shard_layer(layer, cut, bias_cut, rank, size)
            xr = input_cut(cut, x, rank, size)
            with torch.no_grad():
                got = shard(xr)
            if not rowwise:
                expected = cut.apply(reference.movedim(-1, 0), rank, size).movedim(0, -1)
                assert torch.equal(got, expected), f"{name} rank {rank}: {(got - expected).abs().max()}"
            computed = input_as_computed(layer, case, xr, path == "dequantizing")
            if dtype != torch.float32 or computed is None:
                continue
            expected = F.linear(computed, cut.apply(full, rank, size), bias_cut.apply(bias, rank, size))
            assert got.dtype == expected.dtype and got.shape == expected.shape
            if not NEW_API:
                assert torch.equal(got, expected), f"{name} rank {rank}: {(got - expected).abs().max()}"
            # a summation order's rounding is relative to the summed products' magnitude
            magnitude = F.linear(computed.abs(), cut.apply(full, rank, size).abs(), bias_cut.apply(bias, rank, size).abs())
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6 * magnitude.max().item())


# ------------------------------------------------------------------ names and refusals
def test_layout_name():
    t = QT.from_float(weight((32, 64)), "TensorCoreFP8Layout", scale=torch.tensor(0.004))
    assert cq.layout_name(t) == "TensorCoreFP8Layout"
    assert cq.layout_name(torch.nn.Parameter(t, requires_grad=False)) == "TensorCoreFP8Layout"
    assert cq.layout_name(torch.zeros(3)) is None
    assert cq.layout_name(torch.nn.Parameter(torch.zeros(3))) is None
    assert cq.layout_name(None) is None and cq.layout_name("TensorCoreFP8Layout") is None
    # a Parameter is cut like the tensor it wraps
    cut = Cut("w", "segments", 0, (32,))
    part = cq.cut_quantized(torch.nn.Parameter(t, requires_grad=False), cut, 1, 2)
    assert torch.equal(part.dequantize(), t.dequantize()[16:])


@pytest.mark.parametrize("case", HERE)
def test_stored_bytes_of_a_whole_tensor(case):
    """Replicated (no cut): data and scales, not the logical dtype's size."""
    case = CASES[case]
    t = make(case, weight((192, 256)))
    held = sum(x.nbytes for x in inner_tensors(t))
    assert cq.stored_nbytes(t, None, 4) == cq.quantized_nbytes(t) == held
    assert held < 192 * 256 * 4 // 3  # a quarter of fp32, or less, plus scales


def test_plain_tensors_are_not_for_this_module():
    cut = Cut("w", "segments", 0, (8,))
    assert cq.why_not_cut(torch.zeros(8, 4), cut, 2) is None
    with pytest.raises(TypeError):
        cq.cut_quantized(torch.zeros(8, 4), cut, 0, 2)


def as_loaded(layout: str, shape) -> torch.Tensor:
    """A QuantizedTensor of a layout that only calibrated checkpoints hold (from_float refuses),
    made as a loader makes one: stored data and the layout's parameters (placeholder values:
    only its layout and structure matter to a refusal)."""
    params_cls = comfy.quant_ops.get_layout_class(layout).Params
    values = {}
    for f in dataclasses.fields(params_cls):
        if f.name == "orig_dtype":
            values[f.name] = torch.float32
        elif f.name == "orig_shape":
            values[f.name] = tuple(shape)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            values[f.name] = torch.ones(shape[0])
    return QT(torch.zeros((shape[0], shape[1] // 2), dtype=torch.int8), layout, params_cls(**values))


@pytest.mark.parametrize("layout", here([name for name in REFUSED if name in registered_layouts()],
                                          "packed int4 layout"))
def test_layouts_stored_for_their_own_kernels_are_refused_naming_them(layout):
    try:
        t = QT.from_float(weight((64, 256)), layout, **REFUSED[layout])
    except NotImplementedError:  # calibrated formats (AWQ, SVDQuant)
        t = as_loaded(layout, (64, 256))
    for cut in cuts_2d(64, 256).values():
        reason = cq.why_not_cut(t, cut, 2)
        assert reason is not None and layout in reason
        with pytest.raises(ValueError, match=layout):
            cq.cut_quantized(t, cut, 0, 2)
        with pytest.raises(ValueError, match=layout):
            cq.stored_nbytes(t, cut, 2)


def test_a_layout_this_version_does_not_know_is_refused_naming_it():
    t = QT.from_float(weight((32, 64)), "TensorCoreFP8Layout", scale=torch.tensor(0.004))
    if NEW_API:
        unknown = QT(t._qdata, "SomeFutureLayout", t._params)
    else:
        unknown = QT(t._qdata, "SomeFutureLayout", dict(t._layout_params))
    reason = cq.why_not_cut(unknown, Cut("w", "segments", 0, (32,)), 2)
    assert reason is not None and "SomeFutureLayout" in reason


def test_a_known_layout_with_parameters_this_version_does_not_know_is_refused():
    t = QT.from_float(weight((32, 64)), "TensorCoreFP8Layout", scale=torch.tensor(0.004))
    if NEW_API:
        @dataclasses.dataclass(frozen=True)
        class MoreParams(type(t._params)):
            zero_point: torch.Tensor | None = None
        odd = QT(t._qdata, "TensorCoreFP8Layout", MoreParams(**vars(t._params), zero_point=torch.zeros(32)))
    else:
        odd = QT(t._qdata, "TensorCoreFP8Layout", dict(t._layout_params, zero_point=torch.zeros(32)))
    reason = cq.why_not_cut(odd, Cut("w", "segments", 0, (32,)), 2)
    assert reason is not None and "TensorCoreFP8Layout" in reason


def test_a_transposed_view_is_refused():
    if not NEW_API or "TensorCoreNVFP4Layout" not in registered_layouts():
        pytest.skip("only comfy_kitchen's NVFP4 / MXFP8 / INT8 tensors carry a logical transpose")
    for key in ("nvfp4", "mxfp8", "int8"):
        t = make(CASES[key], weight((64, 128))).t()
        reason = cq.why_not_cut(t, Cut("w", "segments", 0, (128,)), 2)
        assert reason is not None and CASES[key].layout in reason and "transposed" in reason


def test_every_layout_of_this_release_is_covered():
    """A layout a new ComfyUI release adds fails here until it is cut or refused on purpose."""
    covered = {c.layout for c in CASES.values()} | set(REFUSED)
    assert registered_layouts() <= covered, registered_layouts() - covered


# ------------------------------------------------------------------ travelling to other processes
class _Pickler(ForkingPickler):
    """How a transport can send QuantizedTensors (which ForkingPickler cannot pickle: it crashes
    the process): as the plain tensors they hold (``flatten``), rebuilt on arrival (``unflatten``)."""

    def reducer_override(self, obj):
        if cq.layout_name(obj) is not None:
            tensors, ctx = cq.flatten(obj)
            rebuilt = (cq.unflatten, (type(cq._quantized(obj)), tensors, ctx))
            if isinstance(obj, torch.nn.Parameter):
                return (torch.nn.Parameter, (_Rebuilt(rebuilt), False))
            return rebuilt
        return NotImplemented


class _Rebuilt:
    def __init__(self, reduction):
        self.reduction = reduction

    def __reduce__(self):
        return self.reduction


def _roundtrip(obj):
    buf = io.BytesIO()
    _Pickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return pickle.loads(buf.getvalue())


@pytest.mark.parametrize("case", [c for c in HERE if CASES[c].comfy_quant])
def test_parts_travel_as_the_tensors_they_hold(case):
    """A shard's weight pickled as the plain tensors it holds arrives computing the same; ``part_spec`` tells a receiver, from shapes alone, what to allocate for a part and
    how to rebuild it."""
    case = CASES[case]
    t = make(case, weight((192, 256)))
    layer = comfy_linear(t, case, weight((192,), seed=1), torch.float32, full_precision=True)
    x = weight((2, 5, 256), seed=2)
    for cut, bias_cut in ((Cut("w", "segments", 0, (64, 128)), Cut("b", "segments", 0, (64, 128))),
                          (Cut("w", "segments", 1, (256,)), Cut("b", "bias_once"))):
        spec, ctx = cq.part_spec(layer.weight, cut, 2)
        for rank in range(2):
            shard = shard_layer(layer, cut, bias_cut, rank, 2)
            tensors, part_ctx = cq.flatten(shard.weight)
            assert {n: (tuple(x.shape), x.dtype) for n, x in tensors.items()} == spec
            assert repr(part_ctx) == repr(ctx)
            rebuilt = cq.unflatten(type(shard.weight), {n: x.clone() for n, x in tensors.items()}, ctx)
            assert torch.equal(rebuilt.dequantize(), shard.weight.dequantize())
            weight_arrived = _roundtrip(shard.weight)  # (the layer's class travels by transport's own means)
            assert type(weight_arrived).__name__ == "QuantizedTensor"
            assert isinstance(weight_arrived, torch.nn.Parameter)
            arrived = copy.deepcopy(shard, {id(shard.weight): weight_arrived})
            with torch.no_grad():
                xr = input_cut(cut, x, rank, 2)
                assert torch.equal(arrived(xr), shard(xr))
