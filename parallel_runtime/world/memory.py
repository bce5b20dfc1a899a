"""Per-process memory figures. PSS counts shared pages once across processes
(RSS counts them in every process that maps them), so it is the honest measure
of what N ranks sharing one copy of the weights cost; USS is what only that process holds."""
from __future__ import annotations

import ctypes
import gc
import os
import sys
import time
import weakref

import psutil
import torch

from . import protocol
from ..distributed import comm

try:
    import resource  # POSIX only
except ImportError:
    resource = None


def process_memory(pid: int) -> dict:
    try:
        proc = psutil.Process(pid)
        try:
            full = proc.memory_full_info()
            return {"rss_bytes": int(full.rss), "pss_bytes": int(getattr(full, "pss", full.rss)),
                    "uss_bytes": int(full.uss)}
        except (psutil.AccessDenied, AttributeError):
            return {"rss_bytes": int(proc.memory_info().rss), "pss_bytes": None, "uss_bytes": None}
    except Exception:  # psutil missing or the process is gone
        return {"rss_bytes": None, "pss_bytes": None, "uss_bytes": None}


MEMORY_MAX_AGE_S = 0.5  # the status route's memory figures are at most this old
_recent: dict[int, tuple[float, dict]] = {}


def recent_process_memory(pid: int) -> dict:
    """``process_memory`` as the status route shows it: read from /proc (about 20 ms a process on a
    big heap) at most every MEMORY_MAX_AGE_S per process, so polling the route from several tabs,
    or flooding it, costs the ranks no more than two reads a second."""
    now = time.monotonic()
    seen = _recent.get(pid)
    if seen is not None and now - seen[0] < MEMORY_MAX_AGE_S:
        return dict(seen[1])
    figures = process_memory(pid)
    if len(_recent) > 4096:  # pids of ended worlds
        _recent.clear()
    _recent[pid] = (now, figures)
    return dict(figures)


def release_free_heap(collect: bool = True) -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim). A CPU rank's forward
    allocates and frees large temporaries (dequantized weights, attention buffers); once
    glibc's dynamic mmap threshold has grown it keeps them mapped, so each rank would hold
    a step's worth of dead heap between steps. ``collect``: run Python's collector first (not
    after every step: on a large heap it takes longer than the trim)."""
    if collect:
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


KEEP_HEAP_ENV = "PARALLEL_CPU_KEEP_HEAP"  # "0": a CPU worker keeps glibc's default heap behaviour
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4    # glibc's mallopt parameters (malloc.h)


def keep_freed_heap() -> bool:
    """A CPU worker's allocations all come from its heap, and what a forward frees stays there for
    the next forward: glibc's default hands every allocation over 32 MiB its own ``mmap`` (given back
    at ``free``) and trims the heap's top, so each forward faulted its temporaries in again, a page
    at a time: 11k-33k page faults (2.2 us each here) per flux_ulysses2 forward on a worker, at
    times other than on rank 0, which then waited for it at the next exchange. The memory goes back
    to the OS when the worker idles (``release_free_heap`` after ``settings.IDLE_TRIM_S``). True
    where glibc took the settings; off with ``PARALLEL_CPU_KEEP_HEAP=0``."""
    if os.environ.get(KEEP_HEAP_ENV, "1") in ("0", ""):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):  # not glibc
        return False


# ---------------------------------------------------------------- peaks of the last prompt
def current_prompt():
    """The id of the prompt ComfyUI runs now (its prompt worker sets ``last_prompt_id`` before it
    executes one), or None outside a ComfyUI server (scripts, tests)."""
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    return getattr(instance, "last_prompt_id", None)


def rss_peak_bytes() -> int | None:
    """This process's peak resident set (VmHWM, reset by ``reset_rss_peak``; else ru_maxrss: since start)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if resource is None:
        return None
    try:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak) if sys.platform == "darwin" else int(peak) * 1024
    except OSError:
        return None


def reset_rss_peak() -> bool:
    """Set the peak resident set back to the current one (Linux: 5 into /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """This process's memory high-water marks for the last prompt, as the seeds' --track-memory
    shows them: on CUDA ranks torch's peak allocated and reserved bytes, on every rank the peak
    RSS (the kernel's VmHWM) and, on CPU ranks, the peak USS (sampled at the end of each forward
    and load, the largest kept: USS has no kernel high-water mark).

    The rule: every rank resets its peaks at its first forward of a new prompt. Rank 0 reads the
    prompt id from ComfyUI (``current_prompt``) and sends it with each forward; ``begin(prompt)``
    resets when it differs from the last one seen. Outside ComfyUI (no prompt id) the peaks run
    from the first forward on. What happens before a prompt's first forward (its weight send, say)
    counts in the previous prompt's peaks.

    ``device_peaks`` / ``reset_device`` / ``uss`` are replaceable (tests fake the CUDA branch).

    Reading USS walks every mapping of the process (smaps: about 20 ms with torch loaded, more in
    ComfyUI): once per forward that doubled a small model's step, and 1 s apart it still cost every
    step of a 2-rank Flux 13 ms, 0.7 % (rank 0 samples after its forward while the workers wait for
    the next). So samples are at least ``interval_s`` apart (the first of each prompt always taken);
    the status route adds the USS it reads itself, so a peak is never shown below the current figure."""

    _UNSEEN = object()
    SAMPLE_INTERVAL_S = 30.0

    def __init__(self, device_peaks=None, reset_device=None, uss=None, interval_s: float | None = None):
        self.device_peaks = device_peaks or _device_peaks
        self.reset_device = reset_device or _reset_device_peaks
        self.uss = uss or (lambda: process_memory(os.getpid())["uss_bytes"])
        # An injected reader (tests) is cheap: every sample counts.
        self.interval_s = interval_s if interval_s is not None else (self.SAMPLE_INTERVAL_S if uss is None else 0.0)
        self._sampled_at: float | None = None
        self.prompt = self._UNSEEN
        self.uss_peak: int | None = None
        self.weights_peak: int | None = None  # rank 0: weight bytes on its compute device (device_weight_bytes)
        self.rss_resets = True  # False where the kernel's peak cannot be reset: the RSS peak runs from start

    @property
    def prompt_id(self):
        """The prompt these peaks are of (None: none seen yet, or outside ComfyUI)."""
        return None if self.prompt is self._UNSEEN else self.prompt

    def begin(self, prompt, device) -> bool:
        """A forward of ``prompt`` starts: reset the peaks if it is a new one (returns whether)."""
        if self.prompt is not self._UNSEEN and prompt == self.prompt:
            return False
        self.prompt = prompt
        self.reset_device(torch_device(device))
        self.rss_resets = reset_rss_peak()
        self.uss_peak = None
        self.weights_peak = None
        self._sampled_at = None
        return True

    def sample_weights(self, nbytes: int) -> None:
        """Rank 0: the weight bytes on its compute device now (``device_weight_bytes``), the largest kept."""
        self.weights_peak = nbytes if self.weights_peak is None else max(self.weights_peak, nbytes)

    def sample(self, device) -> None:
        """Take a USS sample (CPU ranks; on accelerators reading smaps each step is not worth it)."""
        if device_type(device) != "cpu":
            return
        now = time.monotonic()
        if self._sampled_at is not None and now - self._sampled_at < self.interval_s:
            return
        self._sampled_at = now
        uss = self.uss()
        if uss is not None:
            self.uss_peak = uss if self.uss_peak is None else max(self.uss_peak, uss)

    def figures(self, device) -> dict:
        """The peaks as the status route shows them (None: not measured on this rank)."""
        allocated, reserved = self.device_peaks(torch_device(device))
        return {"gpu_peak_allocated_bytes": allocated, "gpu_peak_reserved_bytes": reserved,
                "rss_peak_bytes": rss_peak_bytes(), "uss_peak_bytes": self.uss_peak,
                "device_weight_peak_bytes": self.weights_peak, **comm.HOST.stats()}

    def row(self, device) -> list[float]:
        """protocol.MEMORY_FIELDS of this rank's status row (-1: not measured)."""
        f = self.figures(device)
        keys = ("gpu_peak_allocated_bytes", "gpu_peak_reserved_bytes", "rss_peak_bytes", "uss_peak_bytes",
                "host_pinned_bytes", "host_kept_bytes")
        return [-1.0 if f[k] is None else float(f[k]) for k in keys]


def figures_from_row(row) -> dict:
    """The inverse of ``PeakMemory.row`` (rank 0 reading a worker's row): None for -1 or a short row."""
    values = list(row[protocol.MEMORY_FIELDS]) if len(row) >= protocol.MEMORY_FIELDS.stop else []
    keys = ("gpu_peak_allocated_bytes", "gpu_peak_reserved_bytes", "rss_peak_bytes", "uss_peak_bytes",
            "host_pinned_bytes", "host_kept_bytes")
    return {k: (int(v) if v >= 0 else None) for k, v in zip(keys, values)} if values else dict.fromkeys(keys)


def torch_device(device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def device_type(device) -> str | None:
    """"cuda", "cpu", ... of a rank's device, or None where rank 0 does not know it (a rank on another
    host is listed by its host, "@name", until it reports)."""
    if isinstance(device, torch.device):
        return device.type
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError, ValueError):
        return None


def _device_peaks(device):
    return protocol.device_peaks(device)


def _reset_device_peaks(device):
    protocol.reset_device_peaks(device)


PEAKS = PeakMemory()  # this process's


# ---------------------------------------------------------------- rank 0's weights on its device
# ComfyUI models loaded by a sharded patcher (comfyui_glue/patcher.py) -> the bytes of rank 0's
# shard that patcher added to ComfyUI's count of the model's loaded weights (0: none added).
SHARDED_MODELS: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()


def comfy_loaded_weight_bytes(device) -> int:
    """The weights of the sharded models that ComfyUI loaded onto ``device``, by ComfyUI's own count
    (``model_loaded_weight_memory``: what its loader moved there, which with tensor parallelism leaves
    the sharded modules out), less rank 0's shard where the pack added it to that count. 0 outside
    ComfyUI."""
    mm = sys.modules.get("comfy.model_management")
    total = 0
    for loaded in list(getattr(mm, "current_loaded_models", ())):
        patcher = loaded.model
        model = getattr(patcher, "model", None)
        if model is None or torch_device(loaded.device) != torch_device(device):
            continue
        # A sharded patcher (its ``_sharding``), or a model one loaded: ComfyUI may keep it loaded under
        # another patcher that did not load it again (an unsharded run's, loaded fully).
        sharding = getattr(patcher, "_sharding", None)
        if model not in SHARDED_MODELS and not (callable(sharding) and sharding() is not None):
            continue
        total += max(0, int(getattr(model, "model_loaded_weight_memory", 0)) - SHARDED_MODELS.get(model, 0))
    return total


def device_weight_bytes(device, own_copies_bytes: int) -> int:
    """Rank 0's weight bytes on its compute device: what ComfyUI loaded there of the sharded models
    plus the pack's own copies there (tensor-parallel shards; a context-parallel rank 0 runs
    ComfyUI's module itself, counted by ComfyUI). On the CPU, where ComfyUI computes and offloads
    on one device, this is the figure a GPU run would have (the full weights ComfyUI keeps offloaded
    are not counted), made of the same accounting."""
    return comfy_loaded_weight_bytes(device) + own_copies_bytes


def with_current(peaks: dict, current: dict, device) -> dict:
    """``peaks`` (a rank's last report) made consistent with ``current`` (process_memory read now):
    a peak is never below what the process holds now. USS peaks are CPU ranks' only."""
    out = dict(peaks)
    for peak_key, now_key in (("rss_peak_bytes", "rss_bytes"), ("uss_peak_bytes", "uss_bytes")):
        if peak_key == "uss_peak_bytes" and device_type(device) != "cpu":
            continue
        values = [v for v in (out.get(peak_key), current.get(now_key)) if v]
        out[peak_key] = max(values) if values else None
    return out
