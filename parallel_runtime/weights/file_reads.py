"""Weights a worker reads itself from the checkpoint ComfyUI loaded, instead of receiving them.

Where the weights travel as a stream (accelerators; ``stream``), every worker reading its own
tensors from the file (whole for context parallelism, its slices under tensor parallelism) takes
them off rank 0's device and links, and the ranks read at once. A tensor is read from the file
only where that gives exactly what the forward uses, checked on rank 0 before the send:

- the file is the one ComfyUI's loader recorded (``ModelPatcher.cached_patcher_init``, ComfyUI
  0.33 on), a ``.safetensors`` file, still there;
- the tensor is plain (not a GGUF block or a quantized layout) and no patch applies to it (a
  LoRA's tensors travel merged, as before);
- the file holds its name (under the prefix the file's keys carry) at its shape, and four rows
  read from the file (the first and the last among them), cast to the model's dtype, equal rank
  0's tensor bit for bit (a model changed in place by another node, or a file changed on disk
  since the load, fails that: a sample, not a proof, for a change confined to other rows).

Every other tensor travels over the stream, and ``ReadPlan.why_streamed`` says why (the status
route's ``last_weight_send``). ``PARALLEL_FILE_READS=0`` turns the reads off.
"""
from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from . import packed, quantized
from ..distributed import comm

SWITCH_ENV = "PARALLEL_FILE_READS"
SLOW_ENV = "PARALLEL_TEST_SLOW_FILE_READS_MS"  # tests: milliseconds a worker waits per tensor it reads (a cold disk)
PREFIXES = ("", "model.diffusion_model.", "diffusion_model.", "model.")  # how checkpoint files name a model's keys


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "1") not in ("0", "")


def checkpoint_of(patcher) -> tuple[str | None, str]:
    """The safetensors file ``patcher``'s model was loaded from, or None and why not."""
    init = getattr(patcher, "cached_patcher_init", None)
    if not init:
        return None, "this ComfyUI does not record the file a model came from (0.33 does), or a custom loader built it"
    args = init[1] if len(init) > 1 else ()
    path = args[0] if args and isinstance(args[0], (str, os.PathLike)) else None
    if path is None:
        return None, "the model's loader recorded no file path"
    path = os.fspath(path)
    if not path.endswith(".safetensors"):
        return None, f"{os.path.basename(path)} is not a .safetensors file"
    if not os.path.isfile(path):
        return None, f"{path} is no longer there"
    return path, ""


@dataclass
class ReadPlan:
    """Which skeleton slots every worker reads from ``path`` (slot -> key in the file)."""

    path: str | None
    keys: dict[int, str] = field(default_factory=dict)
    why_streamed: Counter = field(default_factory=Counter)

    def wire(self):
        return None if not self.keys else (self.path, dict(self.keys))


def _prefix(names: list[str], file_keys: set[str]) -> str:
    return max(PREFIXES, key=lambda p: sum(1 for n in names if p + n in file_keys))


SAMPLED_ROWS = 4  # rows of each tensor compared with the file, spread from the first to the last


def _rows_equal(handle, key: str, t: torch.Tensor) -> bool:
    """``SAMPLED_ROWS`` rows of the file's tensor, the first and the last among them, cast to ``t``'s
    dtype, equal ``t``'s (bit for bit)."""
    sl = handle.get_slice(key)
    if t.dim() == 0:
        return torch.equal(handle.get_tensor(key).to(t.dtype), t.detach().cpu())
    n = t.shape[0]
    for row in sorted({(n - 1) * k // (SAMPLED_ROWS - 1) for k in range(SAMPLED_ROWS)}):
        from_file = sl[row:row + 1].to(t.dtype)
        if not torch.equal(from_file, t.detach()[row:row + 1].cpu()):
            return False
    return True


def plan_reads(path: str | None, why_not: str, slots: list[tuple[int, str | None, torch.Tensor, bool]]) -> ReadPlan:
    """``slots``: (slot index, tensor name, rank 0's tensor as the forward uses it unpatched, patched?)
    of the plain tensors the stream would send. Checks each against the file."""
    plan = ReadPlan(path)
    if path is None:
        plan.why_streamed[why_not] += len(slots)
        return plan
    with safe_open(path, framework="pt") as handle:
        file_keys = set(handle.keys())
        prefix = _prefix([n for _, n, _, _ in slots if n], file_keys)
        for index, name, t, patched in slots:
            key = None if name is None else prefix + name
            if patched:
                plan.why_streamed["patched (a LoRA or another weight patch): sent merged"] += 1
            elif key is None or key not in file_keys:
                plan.why_streamed["not under its name in the file (converted keys, or built in memory)"] += 1
            elif tuple(handle.get_slice(key).get_shape()) != tuple(t.shape):
                plan.why_streamed["another shape in the file"] += 1
            elif not _rows_equal(handle, key, t):
                plan.why_streamed["differs from the file (changed in place, or the file changed since the load)"] += 1
            else:
                plan.keys[index] = key
    return plan


def readable(t: torch.Tensor) -> bool:
    """A plain tensor: not a GGUF block nor one of ComfyUI's quantized layouts."""
    return packed.packing(t) is None and quantized.layout_name(t) is None


def read(handle, key: str, dtype: torch.dtype, cut, tp_rank: int, tp_size: int) -> torch.Tensor:
    """A worker's tensor from the file: whole, or its TP part (a cut of one or more segments along
    a dimension reads only its own ranges; other cuts read the whole tensor and cut it)."""
    if cut is None:
        return handle.get_tensor(key).to(dtype)
    if cut.kind == "segments" and cut.dim in (0, 1):
        sl = handle.get_slice(key)
        pieces, offset = [], 0
        for s in cut.sizes:
            part = s // tp_size
            lo, hi = offset + tp_rank * part, offset + (tp_rank + 1) * part
            pieces.append(sl[lo:hi] if cut.dim == 0 else sl[:, lo:hi])
            offset += s
        out = torch.cat(pieces, dim=cut.dim) if len(pieces) > 1 else pieces[0]
        return out.to(dtype)
    return cut.apply(handle.get_tensor(key).to(dtype), tp_rank, tp_size)


class ReadBytes:
    """Bytes this process read from checkpoint files, ever (the status route's ``file_read_bytes``)."""

    def __init__(self):
        self.total = 0


READ_BYTES = ReadBytes()


def reusable(held: dict, path: str, keys: dict, tp: tuple, slots: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Slots a worker already holds from the same file, key and TP coordinate (``held``: slot ->
    (path, key, tp, tensor) of the model's previous version): a LoRA strength change re-reads
    nothing but what it patches."""
    found = {}
    for index, key in keys.items():
        old = held.get(int(index))
        if old is not None and old[:3] == (path, key, tuple(tp)) and old[3].shape == slots[int(index)].shape \
                and old[3].dtype == slots[int(index)].dtype:
            found[int(index)] = old[3]
    return found


def read_into(path: str, keys: dict[int, str], entries, slots: list[torch.Tensor], tp: tuple[int, int],
              progress=None, stop=None) -> bool:
    """Fill ``slots[i]`` for every slot ``keys`` names from the file (a worker's side). ``stop()``,
    asked before each tensor, ends the reads early (Cancel): False then, True when all were read."""
    tp_rank, tp_size = tp
    slow_s = float(os.environ.get(SLOW_ENV, "0") or 0) / 1e3
    with safe_open(path, framework="pt") as handle:
        for index, key in sorted(keys.items()):
            if stop is not None and stop():
                return False
            if slow_s:
                time.sleep(slow_s)
            index = int(index)
            slot = slots[index]
            entry = entries[index]
            cut = entry.cut if tp_size > 1 else None
            slot.copy_(read(handle, key, entry.dtype, cut, tp_rank, tp_size))
            comm.PROGRESS.tick()  # a long cold read is progress for rank 0's watchdog, not a hang
            READ_BYTES.total += slot.numel() * slot.element_size()
            if progress is not None:
                progress(slot.numel() * slot.element_size())
    return True
