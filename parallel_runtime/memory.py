"""Per-process memory figures. PSS counts shared pages once across processes
(RSS counts them in every process that maps them), so it is the honest measure
of what N ranks sharing one copy of the weights cost; USS is what only that process holds."""
from __future__ import annotations


def process_memory(pid: int) -> dict:
    try:
        import psutil

        proc = psutil.Process(pid)
        try:
            full = proc.memory_full_info()
            return {"rss_bytes": int(full.rss), "pss_bytes": int(getattr(full, "pss", full.rss)),
                    "uss_bytes": int(full.uss)}
        except (psutil.AccessDenied, AttributeError):
            return {"rss_bytes": int(proc.memory_info().rss), "pss_bytes": None, "uss_bytes": None}
    except Exception:  # psutil missing or the process is gone
        return {"rss_bytes": None, "pss_bytes": None, "uss_bytes": None}


def release_free_heap(collect: bool = True) -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim). A CPU rank's forward
    allocates and frees large temporaries (dequantized weights, attention buffers); once
    glibc's dynamic mmap threshold has grown it keeps them mapped, so each rank would hold
    a step's worth of dead heap between steps. ``collect``: run Python's collector first (not
    after every step: on a large heap it takes longer than the trim)."""
    import ctypes
    import gc

    if collect:
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
