"""Tiny GGUF files from the tiny models, for tests that load quantized weights (nothing downloaded).

GGUF is the llama.cpp file format that the third-party node pack ComfyUI-GGUF (city96) loads into
ComfyUI with its ``UnetLoaderGGUF`` and ``CLIPLoaderGGUF`` nodes: each tensor is stored either as
plain F32/F16 or as blocks of quantized values that its layers dequantize on the fly. This module
writes such files itself, so the tests need neither a download nor llama.cpp's quantize tool:

- quantizers in numpy for the three block formats the tests use: Q8_0 (32 values per block: an
  fp16 scale and 32 int8), Q4_K and Q5_K (256 values per super-block: fp16 scale and min, eight
  sub-blocks of 32 with 6-bit scale and min codes, 4 or 5 bits per value). gguf-py 0.19 (the
  ``gguf`` package) only dequantizes the K formats; the tests check these quantizers against its
  dequantizer (tests/test_tiny_gguf.py);
- ``write_gguf``: a state dict to a GGUF file, quantizing the weights a real conversion would
  quantize and keeping the rest in F32/F16 (see ``tensor_type``);
- ``write_tiny_gguf_files``: the tiny files under a ComfyUI base directory.

The files:

- Wan 2.1 T2V at width 1024 (8 heads of 128, feed-forward 2048, 2 blocks): ComfyUI's detection
  reads all of that from the key shapes, and every quantized weight's input width (1024 or 2048)
  divided by 2 or 4 ranks of tensor parallelism is still a multiple of the K formats' 256 values;
- Flux.1 at width 1024, one double and one single block, MLP 4096, text and pooled widths 64 (the
  tiny prompt datasets' of tools/tiny_families.py), guidance. ComfyUI 0.33 detects 8 heads of 128
  from it; 0.3.75's detection fixes 24 heads whatever the width, so it does not load there (no
  Flux.1 narrower than 3072 does);
- UMT5-XXL (Wan's text encoder) for ``CLIPLoaderGGUF`` with type ``wan``, 4096 wide for the tiny
  Wan: see ``umt5_state_dict``.

``GGUF_FILES`` maps short names ("wan_q4_k") to file names ("tiny_wan_1024_q4_k.gguf");
``unet_prompt`` and ``text_encoder_prompt`` make API-format workflows that load them.

Tensor names: the image models keep ComfyUI's own keys (those of the safetensors files the tiny
models write); the text encoder uses llama.cpp's T5 names, which ComfyUI-GGUF maps back.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np

from workflows import parallel_config_node

GGUF_QTYPES = ("Q8_0", "Q4_K", "Q5_K")
QK8_0 = 32   # values per Q8_0 block
QK_K = 256   # values per K-quant super-block (8 sub-blocks of 32)
BLOCK_BYTES = {"Q8_0": 2 + QK8_0, "Q4_K": 2 + 2 + 12 + QK_K // 2, "Q5_K": 2 + 2 + 12 + QK_K // 8 + QK_K // 2}
BLOCK_VALUES = {"Q8_0": QK8_0, "Q4_K": QK_K, "Q5_K": QK_K}
K_LEVELS = {"Q4_K": 15, "Q5_K": 31}  # largest code of a value


# ----------------------------------------------------------------------------------- quantizers
def _rows(array, block: int) -> np.ndarray:
    x = np.asarray(array, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % block:
        raise ValueError(f"rows of {x.shape[-1:]} values do not split into blocks of {block}")
    if not np.isfinite(x).all():
        raise ValueError("cannot quantize NaN or infinity")
    return x


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    """(n,) float16 -> (n, 2) little-endian bytes."""
    return np.ascontiguousarray(values.astype("<f2")).view(np.uint8).reshape(-1, 2)


# How far below a whole code unit a ratio may be rounded down instead of up: float error, not
# signal, so that re-quantizing dequantized values finds the same scales (see _k_codes).
SLACK = 1e-3


def _fp16_at_least(values: np.ndarray) -> np.ndarray:
    """The smallest float16 not below each (non-negative) float32 value, give or take a relative
    2**-16: a scale rounded up, so that the codes it divides still reach the block's extremes."""
    h = values.astype(np.float16)
    short = h.astype(np.float32) < values * np.float32(1 - 2.0 ** -16)
    h[short] = np.nextafter(h[short], np.float16(np.inf))
    if not np.isfinite(h).all():
        raise ValueError("values too large for a float16 block scale")
    return h


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """Round to nearest, ties away from zero (C's roundf, which ggml's reference quantizer uses)."""
    a = np.abs(v)
    whole = np.floor(a)
    return np.copysign(whole + (a - whole >= 0.5), v)


def quantize_q8_0(array) -> np.ndarray:
    """Q8_0: per 32 values, scale d = max|x| / 127 (stored fp16) and int8 codes round(x / d)."""
    x = _rows(array, QK8_0)
    blocks = x.reshape(-1, QK8_0)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    codes = _round_half_away(blocks * inv).astype(np.int8)
    out = np.concatenate([_fp16_bytes(d[:, 0].astype(np.float16)), codes.view(np.uint8)], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK8_0 * BLOCK_BYTES["Q8_0"])


def _k_codes(blocks: np.ndarray, levels: int):
    """Codes of K-quant super-blocks ``blocks`` (n, 8, 32): value = d * scale_j * q - dmin * min_j,
    q in 0..levels, scale_j and min_j 6-bit codes, d and dmin float16.

    Each sub-block's grid starts at its smallest value (or 0, if that is smaller: the offset is
    subtracted) to the nearest unit dmin, or at the unit below when the nearest one is more than
    half a step above it. Its step puts its largest value on the top code when a scale code does
    that within half a step, else it is the smallest step whose top code reaches that value
    within half a step. So every value is within half a step of a code (up to SLACK of a unit),
    the step being at most (max - min + dmin) / levels plus one unit d. The units are the
    widest sub-block's step and the largest offset over 63 (those get code 63). That makes the
    codes reproduce themselves: dequantized values quantized again give back the same bytes, as
    long as each sub-block's extremes land on its first and last code (narrow sub-blocks, under
    about half (Q5_K) or a quarter (Q4_K) of the widest one's range, may not: their values then
    move, by at most the same bound)."""
    lo = np.minimum(blocks.min(axis=2), 0.0)                      # (n, 8), <= 0
    hi = blocks.max(axis=2)
    dmin = _fp16_at_least(-lo.min(axis=1) / np.float32(63))      # (n,)
    dmin32 = dmin.astype(np.float32)[:, None]
    ratio = np.divide(-lo, dmin32, out=np.zeros_like(lo), where=dmin32 > 0)
    mins = np.clip(np.rint(ratio), 0, 63)
    for _ in range(3):  # a grid start moved down widens a sub-block, and can only widen the others' steps
        offset = dmin32 * mins                                    # what dequantization subtracts
        span = np.maximum(hi + offset, 0)                         # from the grid's start to the largest value
        d = _fp16_at_least(span.max(axis=1) / np.float32(63 * levels))
        d32 = d.astype(np.float32)[:, None]
        units = np.divide(span, d32, out=np.zeros_like(span), where=d32 > 0)  # the span in units d
        scales = np.rint(units / levels)                          # largest value on the top code
        short = scales * (levels + 0.5) < units - SLACK           # ... unless that leaves it over half a step above
        scales = np.clip(np.where(short, np.ceil(units / (levels + 0.5) - SLACK), scales), 0, 63)
        step = d32 * scales
        high_start = lo + offset < -(step / 2 + SLACK * dmin32)   # grid starts over half a step above lo
        if not high_start.any():
            break
        mins = np.where(high_start, np.clip(np.ceil(ratio - SLACK), 0, 63), mins)
    shifted = blocks + offset[..., None]
    q = np.divide(shifted, step[..., None], out=np.zeros_like(shifted), where=step[..., None] > 0)
    q = np.clip(np.rint(q), 0, levels)
    return d, dmin, scales.astype(np.uint8), mins.astype(np.uint8), q.astype(np.uint8)


def _k_scale_bytes(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit mins in 12 bytes: bytes 0-3 hold scales 0-3, bytes 4-7
    mins 0-3, each with the top two bits of scale/min 4-7 in bits 6-7; bytes 8-11 hold the low
    four bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    s_lo, s_hi = scales[:, :4], scales[:, 4:]
    m_lo, m_hi = mins[:, :4], mins[:, 4:]
    return np.concatenate([s_lo | ((s_hi >> 4) << 6), m_lo | ((m_hi >> 4) << 6), (s_hi & 0x0F) | ((m_hi & 0x0F) << 4)],
                          axis=1).astype(np.uint8)


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 8, 32) codes -> (n, 128) bytes: bytes 32c..32c+31 hold sub-block 2c in their low
    nibble and sub-block 2c+1 in their high nibble."""
    low = (q & 0x0F).reshape(q.shape[0], 4, 2, 32)
    return (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(q.shape[0], 128)


def _quantize_k(array, qtype: str) -> np.ndarray:
    x = _rows(array, QK_K)
    blocks = x.reshape(-1, 8, 32)
    d, dmin, scales, mins, q = _k_codes(blocks, K_LEVELS[qtype])
    parts = [_fp16_bytes(d), _fp16_bytes(dmin), _k_scale_bytes(scales, mins)]
    if qtype == "Q5_K":  # fifth bits: bit j of byte l is the high bit of value l of sub-block j
        high = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]
        parts.append(np.bitwise_or.reduce(high, axis=1).astype(np.uint8))
    parts.append(_low_nibbles(q))
    out = np.concatenate(parts, axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * BLOCK_BYTES[qtype])


def quantize_q4_k(array) -> np.ndarray:
    return _quantize_k(array, "Q4_K")


def quantize_q5_k(array) -> np.ndarray:
    return _quantize_k(array, "Q5_K")


QUANTIZERS = {"Q8_0": quantize_q8_0, "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k}


def quantize(array, qtype: str) -> np.ndarray:
    """``array`` (..., n) as ``qtype`` blocks: uint8 of shape (..., n / block values * block bytes),
    the raw form gguf-py's writer and dequantizer take."""
    return QUANTIZERS[qtype](array)


# ----------------------------------------------------------------------------------- in this process
def import_gguf_nodes(comfyui_path):
    """ComfyUI-GGUF (installed by tools/host.py) imported the way ComfyUI imports a custom node
    package: under its folder's path, dots as ``_x_``, so that worker processes find its classes
    by the same name. Needs ComfyUI importable (its ``nodes`` module is imported first)."""
    import importlib.util
    import sys

    if "nodes" not in sys.modules:  # ComfyUI's nodes.py, which ComfyUI-GGUF imports: by path, since
        # this pack's own nodes/ folder may come first on sys.path
        spec = importlib.util.spec_from_file_location("nodes", Path(comfyui_path) / "nodes.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["nodes"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop("nodes", None)
            raise
    folder = Path(comfyui_path) / "custom_nodes" / "ComfyUI-GGUF"
    if not (folder / "ops.py").is_file():
        raise FileNotFoundError(f"ComfyUI-GGUF is not installed in {folder}: tools/host.py installs it")
    name = str(folder).replace(".", "_x_")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def quantize_linears(model, qtype: str, gguf_nodes, prefix: str = "") -> int:
    """Turn every Linear under ``prefix`` whose input width is whole ``qtype`` blocks into
    ComfyUI-GGUF's layer holding ``qtype`` blocks, as UnetLoaderGGUF would load such a file
    (biases stay as they are). Returns how many layers were converted."""
    import gguf
    import torch

    ops = gguf_nodes.ops
    count = 0
    for name, layer in model.named_modules():
        if not name.startswith(prefix) or not isinstance(layer, torch.nn.Linear) or \
                layer.in_features % BLOCK_VALUES[qtype]:
            continue
        data = quantize(layer.weight.detach().float().cpu().numpy(), qtype)
        layer.__class__ = ops.GGMLOps.Linear
        layer.weight = torch.nn.Parameter(ops.GGMLTensor(torch.from_numpy(data), tensor_type=getattr(
            gguf.GGMLQuantizationType, qtype), tensor_shape=layer.weight.shape), requires_grad=False)
        count += 1
    return count


# ----------------------------------------------------------------------------------- what to quantize
# Tensors a conversion leaves unquantized, by name, per architecture: the input and output
# projections and embeddings, which are small next to the blocks but set the quality (the same
# choice llama.cpp's image-model patch in ComfyUI-GGUF/tools makes for these families).
KEEP = {
    "wan": ("patch_embedding.", "text_embedding.", "time_embedding.", "time_projection.", "img_emb.", "head."),
    "flux": ("img_in.", "txt_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer."),
}
# Kept in F32 rather than F16: parameters the model reads directly instead of through a layer
# (Wan's modulation), and T5's relative position bias, a lookup table of (buckets, heads).
HIGH_PRECISION = {"wan": (".modulation",), "t5encoder": ("attn_rel_b.",)}
SMALL = 1024  # tensors of at most this many values stay in F32


def tensor_type(name: str, shape: tuple[int, ...], qtype: str, arch: str) -> str:
    """The GGUF type ``name`` is stored in: ``qtype`` for the 2-D weights of the blocks, F32 for
    vectors (biases, norm scales), tensors of other ranks (Wan's modulation, its 3-D convolution),
    small tensors and the high-precision names, F16 for the kept 2-D weights and for those whose
    rows do not split into ``qtype`` blocks (the row is what a block format cuts)."""
    count = int(np.prod(shape)) if shape else 1
    if len(shape) != 2 or count <= SMALL or any(p in name for p in HIGH_PRECISION.get(arch, ())):
        return "F32"
    if any(p in name for p in KEEP.get(arch, ())) or shape[-1] % BLOCK_VALUES[qtype]:
        return "F16"
    return qtype


FILE_TYPES = {"Q8_0": "MOSTLY_Q8_0", "Q4_K": "MOSTLY_Q4_K_S", "Q5_K": "MOSTLY_Q5_K_S"}


def _numpy(value) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        import torch

        value = value.detach().cpu()
        if value.is_floating_point():
            value = value.to(torch.float32)
        return value.contiguous().numpy()
    return np.asarray(value)


def write_gguf(path, state_dict: dict, qtype: str, arch: str) -> dict:
    """Write ``state_dict`` (name -> torch tensor or numpy array) to the GGUF file ``path`` with
    ``general.architecture`` = ``arch``, quantizing to ``qtype`` what ``tensor_type`` says.
    Integer tensors (a tokenizer's bytes) are stored as they are (uint8 as I8).
    Returns {"types": {name: type}, "tensor_bytes": sum of the stored tensors' bytes}."""
    import gguf

    if qtype not in QUANTIZERS:
        raise ValueError(f"qtype {qtype!r}: one of {', '.join(QUANTIZERS)}")
    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[qtype]])
    types, total = {}, 0
    for name, value in state_dict.items():
        data = _numpy(value)
        if data.dtype.kind in "iub":  # not weights: stored unchanged
            data = data.view(np.int8) if data.dtype in (np.uint8, np.bool_) else data
            kind = f"I{data.dtype.itemsize * 8}"
            writer.add_tensor(name, data)
        else:
            kind = tensor_type(name, data.shape, qtype, arch)
            if kind == "F32":
                data = data.astype(np.float32)
                writer.add_tensor(name, data)
            elif kind == "F16":
                data = data.astype(np.float16)
                writer.add_tensor(name, data)
            else:
                data = quantize(data, kind)
                writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
        types[name] = kind
        total += data.nbytes
    writer.write_header_to_file(path=str(path))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return {"types": types, "tensor_bytes": total}


# ----------------------------------------------------------------------------------- the tiny models
WAN_DIM, WAN_FFN_DIM = 1024, 2048
FLUX_HIDDEN = 1024  # ComfyUI 0.33 derives heads = hidden // 128 (8); 0.3.75's detection fixes 24 heads,
                    # so no Flux.1 narrower than 3072 loads there through UnetLoaderGGUF
FLUX_TEXT_DIM = 64  # txt_in and vector_in: the prompt datasets of tools/tiny_families.py (PROMPT_POOLED)
# UMT5 as ComfyUI's loader builds it for CLIPLoaderGGUF (nothing tells it another config): width
# 4096 and 24 blocks (what its detection and layer norms require), 64 heads (the relative
# position tables). GGUF layers take the shapes the file gives, so the projections inside the
# blocks can be narrow: 64 wide (one value per head) and a 64-wide feed-forward, but for the last
# block's feed-forward, which ComfyUI 0.33 detects T5-XXL by: its real width, 10240.
UMT5_CONFIG = {"d_model": 4096, "num_layers": 24, "num_heads": 64, "d_kv": 1, "d_ff": 64, "vocab_size": 320}
UMT5_LAST_FF = 10240


def wan_state_dict(seed: int = 40) -> dict:
    from tiny_models import TinyWan, wan_state_dict as build

    return build(TinyWan(dim=WAN_DIM, ffn_dim=WAN_FFN_DIM, num_layers=2), seed=seed)


def flux_state_dict(seed: int = 41) -> dict:
    import torch

    import comfy.ldm.flux.model
    import comfy.ops
    from tiny_models import _random_state_dict, make

    return _random_state_dict(lambda: make(comfy.ldm.flux.model.Flux,
        image_model="flux", in_channels=16, out_channels=16, vec_in_dim=FLUX_TEXT_DIM, context_in_dim=FLUX_TEXT_DIM,
        hidden_size=FLUX_HIDDEN, mlp_ratio=4.0, num_heads=FLUX_HIDDEN // 128, depth=1, depth_single_blocks=1,
        axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True, dtype=torch.float32,
        operations=comfy.ops.disable_weight_init), seed, dtype=torch.float32)


# ComfyUI's T5 keys -> llama.cpp's (ComfyUI-GGUF's loader maps them back)
T5_TO_LLAMA_CPP = (
    (r"^shared\.", "token_embd."),
    (r"^encoder\.final_layer_norm\.", "enc.output_norm."),
    (r"^encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.relative_attention_bias\.", r"enc.blk.\1.attn_rel_b."),
    (r"^encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.([qkvo])\.", r"enc.blk.\1.attn_\2."),
    (r"^encoder\.block\.(\d+)\.layer\.0\.layer_norm\.", r"enc.blk.\1.attn_norm."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wi_0\.", r"enc.blk.\1.ffn_gate."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wi_1\.", r"enc.blk.\1.ffn_up."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wo\.", r"enc.blk.\1.ffn_down."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.layer_norm\.", r"enc.blk.\1.ffn_norm."),
)


def llama_cpp_t5_name(key: str) -> str:
    for pattern, replacement in T5_TO_LLAMA_CPP:
        new, n = re.subn(pattern, replacement, key)
        if n:
            return new
    raise KeyError(f"no llama.cpp name for T5 key {key!r}")


def umt5_state_dict(seed: int = 42) -> dict:
    """UMT5-XXL in llama.cpp's names at ``UMT5_CONFIG`` with the last feed-forward ``UMT5_LAST_FF``
    wide (170M parameters, 126M of them in that feed-forward), with the small SentencePiece
    model of tools/tiny_text_encoders.py as a byte tensor ``spiece_model``: ComfyUI's UMT5
    tokenizer takes it from the state dict (ComfyUI-GGUF rebuilds one from GGUF metadata only for
    the real 256384-token vocabulary)."""
    import torch

    import comfy.ops
    import comfy.text_encoders.t5
    from tiny_models import _random_state_dict, comfy_json_config
    from tiny_text_encoders import sentencepiece_model

    config = comfy_json_config(comfy.text_encoders.t5, "umt5_config_xxl.json", UMT5_CONFIG)
    def t5():
        return comfy.text_encoders.t5.T5(config, torch.float32, None, comfy.ops.disable_weight_init)

    sd = _random_state_dict(t5, seed, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    last = f"encoder.block.{UMT5_CONFIG['num_layers'] - 1}.layer.1.DenseReluDense"
    width, ff = UMT5_CONFIG["d_model"], UMT5_LAST_FF
    for name, shape in (("wi_0", (ff, width)), ("wi_1", (ff, width)), ("wo", (width, ff))):
        sd[f"{last}.{name}.weight"] = torch.randn(shape, generator=gen) * (0.5 / shape[1] ** 0.5)
    out = {llama_cpp_t5_name(k): v for k, v in sd.items()}
    out["spiece_model"] = torch.frombuffer(bytearray(sentencepiece_model(UMT5_CONFIG["vocab_size"])), dtype=torch.uint8)
    return out


MODELS = {  # short model name -> (state dict maker, general.architecture, file name stem, folder)
    "wan": (wan_state_dict, "wan", f"tiny_wan_{WAN_DIM}", "diffusion_models"),
    "flux": (flux_state_dict, "flux", f"tiny_flux_{FLUX_HIDDEN}", "diffusion_models"),
    "umt5": (umt5_state_dict, "t5encoder", "tiny_umt5", "text_encoders"),
}
MODEL_QTYPES = {"wan": GGUF_QTYPES, "flux": GGUF_QTYPES, "umt5": ("Q8_0", "Q4_K")}
# short name ("wan_q4_k") -> (model, qtype)
GGUF_SPECS = {f"{model}_{q.lower()}": (model, q) for model, qtypes in MODEL_QTYPES.items() for q in qtypes}
# short name ("wan_q4_k") -> file name ("tiny_wan_1024_q4_k.gguf")
GGUF_FILES = {name: f"{MODELS[model][2]}_{q.lower()}.gguf" for name, (model, q) in GGUF_SPECS.items()}


def gguf_path(base_dir, name: str) -> Path:
    """Where ``write_tiny_gguf_files`` puts ``name`` under the base directory ``base_dir``."""
    return Path(base_dir) / "models" / MODELS[GGUF_SPECS[name][0]][3] / GGUF_FILES[name]


def write_tiny_gguf_files(base_dir, only=None, report: dict | None = None) -> dict[str, Path]:
    """Write the tiny GGUF files (all, or the short names in ``only``) under a ComfyUI base
    directory's models/diffusion_models and models/text_encoders; idempotent (a file that exists
    is kept). Needs ComfyUI importable with ``comfy.cli_args.args.cpu`` set. ``report``, when
    given, gets per written file {"seconds", "file_bytes", "tensor_bytes", "types"}."""
    paths = {}
    made = {}
    for name in GGUF_FILES:
        if only is not None and name not in only:
            continue
        path = paths[name] = gguf_path(base_dir, name)
        if path.exists():
            continue
        model, qtype = GGUF_SPECS[name]
        maker, arch = MODELS[model][:2]
        start = time.perf_counter()
        if model not in made:
            made.clear()  # one model's weights in memory at a time
            made[model] = maker()
        built = time.perf_counter()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial")
        stats = write_gguf(tmp, made[model], qtype, arch)
        os.replace(tmp, path)
        if report is not None:
            report[name] = dict(stats, seconds=time.perf_counter() - start, build_seconds=built - start,
                                file_bytes=path.stat().st_size)
    return paths


# ----------------------------------------------------------------------------------- workflows
WAN_PROMPT = "tiny_wan_prompt"              # tools/tiny_models.py: one 12-token 4096-wide embedding
FLUX_PROMPT = "tiny_family_prompt_pooled"   # tools/tiny_families.py: 7 tokens of 64, pooled 64
LATENTS = {
    "wan": {"class_type": "EmptyHunyuanLatentVideo",
            "inputs": {"width": 32, "height": 32, "length": 1, "batch_size": 1}},
    "flux": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
}


def write_prompt_datasets(base_dir) -> None:
    """The conditioning datasets the GGUF workflows read (LoadTrainingDataset), as
    tools/tiny_models.py and tools/tiny_families.py write them; idempotent."""
    import torch

    from tiny_families import PROMPT_POOLED, TEXT_DIM, TEXT_TOKENS
    from tiny_models import DATASET_DIRS, TINY_FILES, write_conditioning_dataset, write_tiny_wan_files

    assert (WAN_PROMPT, FLUX_PROMPT) == (TINY_FILES["prompt_dataset"], PROMPT_POOLED)
    write_tiny_wan_files(base_dir, only=["prompt_dataset"])
    if not all((Path(base_dir) / root / FLUX_PROMPT / "shard_0000.pkl").exists() for root in DATASET_DIRS):
        gen = torch.Generator().manual_seed(210)  # tiny_families.write_family_files' draws
        text = torch.randn(1, TEXT_TOKENS, TEXT_DIM, generator=gen)
        pooled = torch.randn(1, TEXT_DIM, generator=gen)
        write_conditioning_dataset(base_dir, FLUX_PROMPT, text, {"pooled_output": pooled})


def _parallel(prompt: dict, model: list, parallel: dict | None) -> list:
    if parallel is None:
        return model
    prompt["p1"] = parallel_config_node(**parallel)
    prompt["p2"] = {"class_type": "ShardTransformer", "inputs": {"model": model, "parallel_config": ["p1", 0]}}
    return ["p2", 0]


def unet_prompt(name: str, parallel: dict | None = None, steps: int = 2, positive: list | None = None) -> dict:
    """UnetLoaderGGUF (``name``, a GGUF_FILES key of an image model) -> (Shard Transformer) ->
    KSampler (CFG 3, ``steps`` steps, a tiny latent) -> SaveLatent to latents/gguf_<name>, in API
    format. The positive conditioning comes from the model's prompt dataset (see
    ``write_prompt_datasets``) unless ``positive`` names another node's output."""
    model_kind = GGUF_SPECS[name][0]
    prompt = {
        "1": {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": GGUF_FILES[name]}},
        "4": {"class_type": "LoadTrainingDataset",
              "inputs": {"folder_name": WAN_PROMPT if model_kind == "wan" else FLUX_PROMPT}},
        "6": LATENTS[model_kind],
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": f"latents/gguf_{name}"}},
    }
    positive = positive or ["4", 1]
    prompt["5"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": positive}}
    prompt["7"] = {"class_type": "KSampler",
                   "inputs": {"model": _parallel(prompt, ["1", 0], parallel), "positive": positive,
                              "negative": ["5", 0], "latent_image": ["6", 0], "seed": 11, "steps": steps, "cfg": 3.0,
                              "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}
    return prompt


def text_encoder_prompt(name: str, text: str, folder: str, clip_type: str = "wan", unet: str | None = None) -> dict:
    """CLIPLoaderGGUF (``name``, a GGUF_FILES key of a text encoder) -> CLIPTextEncode, the
    conditioning saved with SaveTrainingDataset to ``folder``; with ``unet`` (a Wan GGUF_FILES
    key) it also conditions that model's KSampler run (``unet_prompt``)."""
    prompt = {
        "t1": {"class_type": "CLIPLoaderGGUF", "inputs": {"clip_name": GGUF_FILES[name], "type": clip_type}},
        "t2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["t1", 0], "text": text}},
        "t3": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "t4": {"class_type": "SaveTrainingDataset", "inputs": {"latents": ["t3", 0], "conditioning": ["t2", 0],
                                                               "folder_name": folder, "shard_size": 1000}},
    }
    if unet is not None:
        sampled = unet_prompt(unet, positive=["t2", 0])
        del sampled["4"]
        prompt.update(sampled)
    return prompt


def main(argv=None) -> None:
    """python tools/tiny_gguf.py BASE_DIR [NAME ...]: write the files (with the host's interpreter)
    and print each one's size, tensor bytes, types and time."""
    import argparse
    import collections
    import sys

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("base_dir")
    parser.add_argument("names", nargs="*", help=f"short names ({', '.join(GGUF_FILES)}); default all")
    opts = parser.parse_args(argv)
    tools = Path(__file__).resolve().parent
    sys.path.insert(0, str(tools))
    sys.path.append(str(tools.parent))  # after ComfyUI's root: its nodes.py must win over the pack's nodes/
    from parallel_runtime.comfyui_location import comfyui_path

    sys.path.insert(0, comfyui_path("set it up with tools/host.py"))
    import comfy.options  # noqa: F401
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    report = {}
    paths = write_tiny_gguf_files(opts.base_dir, only=opts.names or None, report=report)
    for name, path in paths.items():
        r = report.get(name)
        if r is None:
            print(f"{name:10s} {path} (already there)")
            continue
        kinds = collections.Counter(r["types"].values())
        types = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        print(f"{name:10s} {path.name:28s} file {r['file_bytes'] / 2**20:7.2f} MiB  "
              f"tensors {r['tensor_bytes'] / 2**20:7.2f} MiB  {r['seconds']:5.2f} s "
              f"(weights {r['build_seconds']:.2f} s)  {types}")


if __name__ == "__main__":
    main()
