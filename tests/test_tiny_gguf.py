"""The GGUF quantizers of tools/tiny_gguf.py against gguf-py's dequantizer, and the file writer.

gguf-py (the ``gguf`` package ComfyUI-GGUF imports) dequantizes Q8_0, Q4_K and Q5_K; what the
quantizers write must come back from it close to the input: within half a quantization step,
the step being bounded from the input alone (each block's range and the format's code widths),
not from the quantizer's own choices. Dequantized values quantized again must give the same
values (the codes reproduce themselves) or at least stay within the bound.
"""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import tiny_gguf  # noqa: E402  (tools/ is on the path: conftest)

K_LEVELS = {"Q4_K": 15, "Q5_K": 31}
UP = 1 + 2.0 ** -10  # a float16 scale rounded up: at most one unit in its 11-bit mantissa
TINY = 2.0 ** -24    # float16's smallest step (subnormal scales)


def dequantize(raw, qtype):
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])


def bound(x: np.ndarray, qtype: str) -> np.ndarray:
    """Largest error each value may have, from the input and the format: half a step.

    Q8_0: step d = max|x| / 127 per 32 values, d stored in float16. K formats: a sub-block of 32
    spans at most from min(min x, 0) less one offset unit dmin to max x, in ``levels`` steps, plus
    one scale unit d of slack for the 6-bit scale code; dmin and d are the super-block's largest
    offset and step over 63, in float16."""
    scale = float(np.abs(x).max()) or 1.0
    eps = 4e-7 * scale  # float32 arithmetic of quantizing and dequantizing
    if qtype == "Q8_0":
        b = x.reshape(-1, 32).astype(np.float64)
        d = np.abs(b).max(axis=1, keepdims=True) / 127
        err = d / 2 + 127 * (d * 2.0 ** -11 + TINY / 2)
        return np.broadcast_to(err, b.shape).reshape(x.shape) + eps
    levels = K_LEVELS[qtype]
    b = x.reshape(-1, 8, 32).astype(np.float64)
    lo = np.minimum(b.min(axis=2), 0)
    hi = b.max(axis=2)
    dmin = (-lo).max(axis=1, keepdims=True) / 63 * UP + TINY
    span = hi - lo + dmin
    d = span.max(axis=1, keepdims=True) / (63 * levels) * UP + TINY
    step = span / levels + d
    err = step / 2 + 1e-3 * (d + dmin)  # tiny_gguf.SLACK of a unit
    return np.broadcast_to(err[..., None], b.shape).reshape(x.shape) + eps


def inputs():
    rng = np.random.default_rng(1234)
    gauss = rng.standard_normal((6, 1024)).astype(np.float32) * 0.05
    mixed = rng.standard_normal((4, 32, 32)) * 10.0 ** rng.uniform(-4, 1, (4, 32, 1))  # sub-blocks of unequal range
    outliers = gauss.copy()
    outliers[:, ::97] *= 100
    return {
        "gaussian": gauss,
        "uniform": rng.uniform(-1, 1, (3, 512)).astype(np.float32),
        "positive": (np.abs(gauss) + 0.5).astype(np.float32),
        "negative": (-np.abs(gauss) - 0.5).astype(np.float32),
        "constant": np.full((2, 512), 0.3, np.float32),
        "negative constant": np.full((2, 512), -0.3, np.float32),
        "zeros": np.zeros((2, 256), np.float32),
        "mixed magnitudes": mixed.reshape(4, 1024).astype(np.float32),
        "outliers": outliers,
        "large": (rng.standard_normal((2, 512)) * 300).astype(np.float32),
        "3-d": rng.standard_normal((2, 3, 512)).astype(np.float32),
    }


CASES = inputs()


def check(x, raw, qtype) -> np.ndarray:
    """Dequantized through gguf-py, every value within the bound; returns the values."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    assert raw.dtype == np.uint8
    assert raw.shape == (*x.shape[:-1], x.shape[-1] // block_values * block_bytes)
    out = dequantize(raw, qtype)
    assert out.shape == x.shape and np.isfinite(out).all()
    err = np.abs(out.astype(np.float64) - x)
    limit = bound(x, qtype)
    worst = np.unravel_index(np.argmax(err - limit), x.shape)
    assert (err <= limit).all(), f"{qtype}: error {err[worst]:.3g} over the bound {limit[worst]:.3g} at {worst}"
    return out


@pytest.mark.parametrize("qtype", tiny_gguf.GGUF_QTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_within_half_a_step(qtype, case):
    x = CASES[case]
    check(x, tiny_gguf.quantize(x, qtype), qtype)


def test_q8_0_is_ggml_reference():
    """Q8_0 has one answer (ggml's reference quantizer, which gguf-py implements): same bytes."""
    for case, x in CASES.items():
        ours = tiny_gguf.quantize(x, "Q8_0")
        theirs = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
        assert np.array_equal(ours, theirs), case


@pytest.mark.parametrize("qtype", tiny_gguf.GGUF_QTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_requantizing_is_stable(qtype, case):
    """Dequantized values quantized again: valid blocks within the bound of their own input,
    never drifting from the original by more than twice its bound, and the same bytes again
    after at most three rounds (at once but for sub-blocks much narrower than their neighbours)."""
    x = CASES[case]
    raw = tiny_gguf.quantize(x, qtype)
    values = dequantize(raw, qtype)
    for rounds in range(1, 4):
        again = tiny_gguf.quantize(values, qtype)
        values = check(values, again, qtype)
        assert (np.abs(values.astype(np.float64) - x) <= 2 * bound(x, qtype)).all()
        if np.array_equal(again, raw):
            break
        raw = again
    else:
        pytest.fail(f"{qtype} {case}: no fixed point after 3 rounds")


@pytest.mark.parametrize("qtype", tiny_gguf.GGUF_QTYPES)
def test_requantizing_gives_the_same_values(qtype):
    """Weights of similar range per sub-block (the usual case) come back as exactly the values
    they dequantize to; Q5_K's narrowest sub-blocks (under half the widest one's range) may not."""
    for case in ("gaussian", "uniform", "3-d"):
        x = CASES[case]
        values = dequantize(tiny_gguf.quantize(x, qtype), qtype)
        same = np.mean(dequantize(tiny_gguf.quantize(values, qtype), qtype) == values)
        assert same >= (1.0 if qtype != "Q5_K" else 0.99), (case, same)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K"])
def test_the_bound_catches_a_wrong_layout(qtype):
    """The check can fail: bytes in a plausible but wrong layout land outside the bound."""
    x = CASES["gaussian"]
    raw = tiny_gguf.quantize(x, qtype)
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1])
    nibbles = blocks.copy()
    nibbles[:, -128:] = (nibbles[:, -128:] >> 4) | (nibbles[:, -128:] << 4)  # sub-blocks 2c and 2c+1 swapped
    scales = blocks.copy()
    scales[:, 4:8], scales[:, 8:12] = blocks[:, 8:12], blocks[:, 4:8]      # mins and low bits swapped
    for wrong in (nibbles, scales):
        with pytest.raises(AssertionError):
            check(x, wrong.reshape(raw.shape), qtype)


def test_rows_must_split_into_blocks():
    with pytest.raises(ValueError):
        tiny_gguf.quantize(np.zeros((4, 96), np.float32), "Q4_K")
    with pytest.raises(ValueError):
        tiny_gguf.quantize(np.full((1, 32), np.nan, np.float32), "Q8_0")


def test_what_is_quantized():
    t = tiny_gguf.tensor_type
    assert t("blocks.0.self_attn.q.weight", (1024, 1024), "Q4_K", "wan") == "Q4_K"
    assert t("blocks.0.self_attn.q.bias", (1024,), "Q4_K", "wan") == "F32"
    assert t("blocks.0.modulation", (1, 6, 1024), "Q8_0", "wan") == "F32"
    assert t("patch_embedding.weight", (1024, 16, 1, 2, 2), "Q8_0", "wan") == "F32"
    assert t("text_embedding.0.weight", (1024, 4096), "Q8_0", "wan") == "F16"
    assert t("head.head.weight", (64, 1024), "Q8_0", "wan") == "F16"
    assert t("single_blocks.0.linear2.weight", (1024, 5120), "Q5_K", "flux") == "Q5_K"
    assert t("img_in.weight", (1024, 64), "Q8_0", "flux") == "F16"
    assert t("enc.blk.0.attn_o.weight", (4096, 64), "Q4_K", "t5encoder") == "F16"  # rows of 64: no K blocks
    assert t("enc.blk.0.attn_o.weight", (4096, 64), "Q8_0", "t5encoder") == "Q8_0"
    assert t("enc.blk.0.attn_rel_b.weight", (32, 64), "Q8_0", "t5encoder") == "F32"
    assert t("some.small.weight", (16, 32), "Q8_0", "flux") == "F32"


def test_write_gguf(tmp_path):
    """A file gguf-py reads back: the architecture, each tensor's type and logical shape, the
    quantized ones as (rows, bytes per row) uint8 that dequantize to the written values."""
    import torch

    rng = np.random.default_rng(7)
    sd = {
        "blocks.0.self_attn.q.weight": torch.from_numpy(rng.standard_normal((8, 512)).astype(np.float32)),
        "blocks.0.self_attn.q.bias": torch.from_numpy(rng.standard_normal(512).astype(np.float32)),
        "blocks.0.ffn.0.weight": torch.from_numpy(rng.standard_normal((64, 96)).astype(np.float16)),
        "blocks.0.modulation": torch.from_numpy(rng.standard_normal((1, 6, 512)).astype(np.float32)),
        "patch_embedding.weight": torch.from_numpy(rng.standard_normal((32, 16, 1, 2, 2)).astype(np.float32)),
        "spiece_model": torch.frombuffer(bytearray(b"\x00\x7f\x80\xff tokenizer"), dtype=torch.uint8),
    }
    path = tmp_path / "t.gguf"
    stats = tiny_gguf.write_gguf(path, sd, "Q4_K", "wan")
    reader = gguf.GGUFReader(path)
    field = reader.get_field("general.architecture")
    assert str(field.parts[field.data[-1]], encoding="utf-8") == "wan"
    tensors = {t.name: t for t in reader.tensors}
    assert list(tensors) == list(sd)
    expected = {"blocks.0.self_attn.q.weight": "Q4_K", "blocks.0.self_attn.q.bias": "F32",
                "blocks.0.ffn.0.weight": "F16", "blocks.0.modulation": "F32", "patch_embedding.weight": "F32",
                "spiece_model": "I8"}
    assert {k: t.tensor_type.name for k, t in tensors.items()} == expected == stats["types"]
    for name, t in tensors.items():
        assert tuple(int(v) for v in reversed(t.shape)) == tuple(sd[name].shape)
    q = tensors["blocks.0.self_attn.q.weight"]
    assert q.data.dtype == np.uint8 and q.data.shape == (8, 512 // 256 * 144)
    w = sd["blocks.0.self_attn.q.weight"].numpy()
    assert np.array_equal(q.data, tiny_gguf.quantize(w, "Q4_K"))
    assert np.array_equal(tensors["blocks.0.ffn.0.weight"].data, sd["blocks.0.ffn.0.weight"].numpy())
    assert np.array_equal(tensors["patch_embedding.weight"].data, sd["patch_embedding.weight"].numpy())
    assert bytes(tensors["spiece_model"].data.view(np.uint8)) == bytes(sd["spiece_model"].numpy())
    assert stats["tensor_bytes"] == sum(t.n_bytes for t in tensors.values())


def test_file_names():
    assert tiny_gguf.GGUF_FILES["wan_q8_0"] == "tiny_wan_1024_q8_0.gguf"
    assert tiny_gguf.GGUF_FILES["flux_q4_k"] == "tiny_flux_1024_q4_k.gguf"
    assert tiny_gguf.GGUF_FILES["umt5_q8_0"] == "tiny_umt5_q8_0.gguf"
    assert {model for model, _ in tiny_gguf.GGUF_SPECS.values()} == {"wan", "flux", "umt5"}
    assert set(tiny_gguf.GGUF_SPECS) == set(tiny_gguf.GGUF_FILES)
