"""What rank 0 sends to the workers for one forward, and how.

A forward call is split into a small picklable *spec* (structure, scalars, tensor
shapes) that travels over the control connection, and the tensors themselves,
which travel by ``broadcast`` over the process group: one flat buffer per dtype,
so a forward costs a handful of collectives whatever the number of inputs.

Only plain data can reach a worker: anything else (a callable patch from another
node, an object with state) would run on rank 0 only and make the ranks diverge,
so it is refused with the path of the offending entry. A data object of ComfyUI's own
(an instance of a ``comfy.*`` class, not callable, whose attributes are all plain data in
turn: MiniMax-H3's ``PackedLayout`` in its conditioning) travels as its class and
attributes and is rebuilt without calling its constructor; one with a callable or another
object inside is refused like any other.
"""
from __future__ import annotations

import enum
import uuid
import torch

from ..distributed import comm
from ..parallel.model_patches import ORIGINS

# transformer_options entries that orchestrate sampling on rank 0 and are not
# part of the computation the workers repeat: wrappers and callbacks run on rank 0
# around the sharded forward; "easycache" is the state of ComfyUI's EasyCache and
# LazyCache, read only by their own wrappers (which run outside ours). The model patches' origins are
# ComfyUI's patch objects, which receive the state each forward leaves (parallel/model_patches.py).
RANK0_ONLY_KEYS = frozenset({"wrappers", "callbacks", "easycache", "hybrid_parallel_compile", ORIGINS})
# Entries that hold callables when another node patches the model: they would
# change rank 0's computation only, so they are refused when non-empty. ("patches" and
# "patches_replace" are not: parallel/model_patches.py encodes the declared patch classes in them as
# data, and refuses the others by name.)
PATCH_KEYS = ("optimized_attention_override",)

# One row per rank in the status table rank 0 shares with its local workers (a remote worker
# sends its row, followed by its RSS). GPU figures are -1 on other devices, and so is a figure
# the rank could not measure. New fields go at the end (COMPILE_FIELDS and readers of the older
# ones index them). The peaks are the last prompt's (memory.PeakMemory says since when);
# host_pinned / host_kept: the staging pool's pinned bytes and what it keeps (comm._HostBuffers).
STATUS_FIELDS = ("last_forward_ms", "param_bytes", "forwards", "progress", "gpu_allocated", "gpu_reserved",
                 "compiling", "compiles", "recompiles", "compile_cache_hits", "compile_cache_misses",
                 "gpu_peak_allocated", "gpu_peak_reserved", "rss_peak", "uss_peak", "host_pinned", "host_kept",
                 "load_done", "load_total", "file_read_bytes", "loads", "load_stops")
COMPILE_FIELDS = slice(6, 11)  # compile_regions.CompileWatch.row()
MEMORY_FIELDS = slice(11, 17)  # the fields above from gpu_peak_allocated on, memory.PeakMemory.row()
# weights.stream.LOAD's bytes done and total, weights.file_reads.READ_BYTES, and LOAD.loads (which
# load the bytes belong to: world/load_progress.py)
LOAD_FIELDS = slice(17, 21)
# Rank 0's row only: how many loads Cancel stopped; a worker reading from a file stops when it grows.
LOAD_STOPS_FIELD = 21


def load_status(done: float, total: float, read: float, loads: float, via: str) -> dict | None:
    """A rank's ``load`` in the status route (from its ``LOAD_FIELDS``): the last model's weights,
    bytes done of the total, and the way they travel (the world's transport), and every byte this
    rank ever read from checkpoint files; None before any load."""
    if total <= 0:
        return None
    return {"done_bytes": int(done), "total_bytes": int(total), "via": via, "file_read_bytes": int(read)}


def device_memory(device: torch.device) -> tuple[int | None, int | None]:
    """(allocated, reserved) bytes of this process on ``device``; (None, None) off CUDA."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def device_peaks(device: torch.device) -> tuple[int | None, int | None]:
    """(allocated, reserved) high-water marks on ``device`` since ``reset_device_peaks``; (None, None) off CUDA."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def reset_device_peaks(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


_PLAIN = (type(None), bool, int, float, complex, str, bytes, uuid.UUID, torch.dtype, torch.device, slice, range)


class UnsupportedInput(TypeError):
    pass


# The spec is built from builtins only: a class of this pack pickled on rank 0 would
# name the module path ComfyUI gave the pack, which a worker cannot import.
# Nodes: ("t", index) tensor, ("v", value) plain value, ("d", [(key, node)]) dict,
# ("l", [node]) list, ("u", [node]) tuple, ("n", cls, [node]) other tuple type, ("o", cls, [(attribute,
# node)]) a data object of ComfyUI's.
TENSOR, VALUE, DICT, LIST, TUPLE, NAMED, OBJECT = "t", "v", "d", "l", "u", "n", "o"


def _comfy_data_object(obj) -> bool:
    """An instance of one of ComfyUI's own classes (every rank imports them) holding only its
    attributes: no callable, no module, nothing hidden in slots."""
    cls = type(obj)
    return (cls.__module__.split(".")[0] == "comfy" and not callable(obj) and not isinstance(obj, torch.nn.Module)
            and not hasattr(cls, "__slots__") and isinstance(getattr(obj, "__dict__", None), dict))


def flatten(obj, tensors: list, path: str = "input", _seen: dict | None = None):
    """Encode ``obj`` as a spec, collecting its tensors in ``tensors``: each distinct tensor once (a
    ControlNet's residuals repeat one block's tensor for many blocks of the model: 57 entries, 2
    tensors for an XLabs Flux ControlNet), and every place it appears refers to it."""
    seen = {} if _seen is None else _seen
    if isinstance(obj, torch.Tensor):
        known = seen.get(id(obj))
        if known is not None and tensors[known] is obj:
            return (TENSOR, known)
        tensors.append(obj)
        seen[id(obj)] = len(tensors) - 1
        return (TENSOR, len(tensors) - 1)
    if isinstance(obj, _PLAIN) or isinstance(obj, enum.Enum):
        return (VALUE, obj)
    if isinstance(obj, dict):
        return (DICT, [(k, flatten(v, tensors, f"{path}[{k!r}]", seen)) for k, v in obj.items()])
    if isinstance(obj, list):
        return (LIST, [flatten(v, tensors, f"{path}[{i}]", seen) for i, v in enumerate(obj)])
    if isinstance(obj, tuple):
        items = [flatten(v, tensors, f"{path}[{i}]", seen) for i, v in enumerate(obj)]
        return (TUPLE, items) if type(obj) is tuple else (NAMED, type(obj), items)
    if _comfy_data_object(obj):
        return (OBJECT, type(obj), [(k, flatten(v, tensors, f"{path}.{k}", seen)) for k, v in vars(obj).items()])
    raise UnsupportedInput(f"{path} is a {type(obj).__module__}.{type(obj).__qualname__}, which cannot be sent "
                           "to the other ranks (only tensors and plain values can)")


def unflatten(spec, tensors: list):
    tag = spec[0]
    if tag == TENSOR:
        return tensors[spec[1]]
    if tag == VALUE:
        return spec[1]
    if tag == DICT:
        return {k: unflatten(v, tensors) for k, v in spec[1]}
    if tag == LIST:
        return [unflatten(v, tensors) for v in spec[1]]
    if tag == TUPLE:
        return tuple(unflatten(v, tensors) for v in spec[1])
    if tag == NAMED:  # a namedtuple takes its fields one by one, other tuple types (torch.Size) an iterable
        cls, items = spec[1], [unflatten(v, tensors) for v in spec[2]]
        return cls(*items) if hasattr(cls, "_fields") else cls(items)
    if tag == OBJECT:
        obj = spec[1].__new__(spec[1])
        obj.__dict__.update({k: unflatten(v, tensors) for k, v in spec[2]})
        return obj
    raise ValueError(f"bad spec node {tag!r}")


def tensor_meta(tensors: list[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


def worker_transformer_options(options: dict) -> dict:
    """The part of rank 0's transformer_options the workers need, or a clear refusal."""
    out = {}
    for key, value in options.items():
        if key in RANK0_ONLY_KEYS:
            continue
        if key in PATCH_KEYS:
            if value:
                raise UnsupportedInput(
                    f"transformer_options[{key!r}] was set by another node ({_describe(value)}); such patches run "
                    "inside the sharded forward and this version cannot run them on every rank. Remove that node, "
                    "or place it where it does not patch the transformer's forward")
            continue
        out[key] = value
    return out


def _describe(value) -> str:
    if isinstance(value, dict):
        inner = [f"{k}: {_describe(v)}" for k, v in list(value.items())[:4]]
        return "{" + ", ".join(inner) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value[:4]) + "]"
    name = getattr(value, "__qualname__", None) or type(value).__qualname__
    module = getattr(value, "__module__", None) or type(value).__module__
    return f"{module}.{name}"


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def broadcast_tensors(tensors: list[torch.Tensor] | None, meta: list, device: torch.device,
                      group=None, src: int = 0) -> list[torch.Tensor]:
    """Broadcast tensors from ``src``: one flat buffer per dtype. Receivers pass ``tensors=None``
    and the ``meta`` (shape, dtype per tensor) that came with the spec."""
    out: list[torch.Tensor | None] = [None] * len(meta)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_, dtype) in enumerate(meta):
        by_dtype.setdefault(dtype, []).append(i)
    for dtype, members in by_dtype.items():
        total = sum(_numel(meta[i][0]) for i in members)
        wire_dtype = torch.uint8 if dtype == torch.bool else dtype
        if tensors is not None:
            flat = torch.cat([tensors[i].detach().to(device=device, dtype=wire_dtype).reshape(-1) for i in members])
        else:
            flat = torch.empty(total, dtype=wire_dtype, device=device)
        if total:
            comm.broadcast(flat, src=src, group=group)
        offset = 0
        for i in members:
            shape = meta[i][0]
            n = _numel(shape)
            piece = flat[offset: offset + n].view(shape)
            out[i] = piece.to(torch.bool) if dtype == torch.bool else piece
            offset += n
    return out  # type: ignore[return-value]
