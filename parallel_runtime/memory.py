"""Per-process memory figures. PSS counts shared pages once across processes
(RSS counts them in every process that maps them), so it is the honest measure
of what N ranks sharing one copy of the weights cost."""
from __future__ import annotations


def process_memory(pid: int) -> dict:
    try:
        import psutil

        proc = psutil.Process(pid)
        try:
            full = proc.memory_full_info()
            return {"rss_bytes": int(full.rss), "pss_bytes": int(getattr(full, "pss", full.rss))}
        except (psutil.AccessDenied, AttributeError):
            return {"rss_bytes": int(proc.memory_info().rss), "pss_bytes": None}
    except Exception:  # psutil missing or the process is gone
        return {"rss_bytes": None, "pss_bytes": None}
