"""Rank 0's guard against a collective that can never complete.

With gloo, a rank that dies breaks its peers' collectives at once: its sockets close. With
NCCL it does not: rank 0's kernels wait on the device for the dead peer, the Python thread
blocks at the next synchronisation, and NCCL's own watchdog ends the hang by tearing down the
whole process (ComfyUI) after its timeout. So:

- rank 0 creates its NCCL groups with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (on an error or a
  timeout NCCL aborts the communicators and the operation raises; the process lives);
- while a forward or a weight send is in flight, this thread checks every 100 ms that every
  worker is alive. When one is not, it aborts rank 0's communicators (NCCL), which makes the
  blocked collective raise now rather than at NCCL's timeout;
- a section that outlives ``timeout_s`` (a rank that hangs without dying) is stopped the same
  way, and its workers are killed, on every backend.

The world then reports which rank died or hung, shuts down, and the next prompt starts
fresh workers. On the CPU (gloo) only the hang path does something the backend would not.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

log = logging.getLogger("parallel")

NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # CleanUpOnly: abort the comms, keep the process


def prepare_nccl_environment() -> None:
    """Before rank 0 creates NCCL groups: errors abort the communicators, never the process."""
    name, value = NCCL_ERROR_HANDLING
    if os.environ.get(name, value) != value:
        log.warning("%s=%s would let NCCL end ComfyUI when a rank fails; using %s", name, os.environ[name], value)
    os.environ[name] = value


class Watchdog:
    """``dead()`` lists ranks that are gone; ``stop(reason)`` unblocks rank 0 (aborts the
    communicators, kills stuck workers). One guarded section at a time."""

    INTERVAL_S = 0.1

    def __init__(self, dead, stop, name: str = "parallel-watchdog", busy=None):
        self._dead = dead
        self._stop = stop
        self._busy = busy  # -> True while a rank does work that may outlast the timeout (torch.compile)
        self._armed: tuple[str, float, float] | None = None  # (what, deadline, timeout_s)
        self._closed = threading.Event()
        self.fired: str | None = None  # why it stopped the last guarded section
        self.hung = False              # ... because a living rank never arrived (it killed the workers)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, what: str, timeout_s: float):
        self.fired, self.hung = None, False
        self._armed = (what, time.monotonic() + timeout_s, timeout_s)
        try:
            yield
        finally:
            self._armed = None

    @property
    def section(self) -> str | None:
        """What the guarded section now running is ("forward", "weight send", ...), if any."""
        armed = self._armed
        return armed[0] if armed else None

    def _is_busy(self) -> bool:
        try:
            return bool(self._busy and self._busy())
        except Exception:  # a worker table being torn down
            return False

    def close(self) -> None:
        self._closed.set()

    def _loop(self) -> None:
        while not self._closed.wait(self.INTERVAL_S):
            armed = self._armed
            if armed is None:
                continue
            what, deadline, timeout_s = armed
            try:
                dead = self._dead()
            except Exception:  # a worker table being torn down
                continue
            if dead:
                reason = f"rank {', '.join(map(str, dead))} died during the {what}"
            elif self._is_busy():  # compiling: the section's clock starts again when it is done
                if self._armed is armed:
                    self._armed = (what, time.monotonic() + timeout_s, timeout_s)
                continue
            elif time.monotonic() > deadline:
                reason = (f"the {what} did not complete within the collective timeout (PARALLEL_COLLECTIVE_TIMEOUT_S); "
                          "a rank hung")
            else:
                continue
            if self._armed is not armed:  # the section ended meanwhile
                continue
            self._armed = None
            self.fired, self.hung = reason, not dead
            log.error("parallel watchdog: %s; stopping the collectives", reason)
            try:
                self._stop(reason, hung=not dead)
            except Exception:
                log.exception("parallel watchdog: could not stop the collectives")
