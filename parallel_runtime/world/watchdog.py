"""Rank 0's guard against a collective that can never complete, and the one owner of aborts.

With gloo, a rank that dies breaks its peers' collectives at once: its sockets close. With
NCCL it does not: rank 0's kernels wait on the device for the dead peer, and after an abort the
blocked call (or the next ``synchronize``) may simply return, leaving outputs that no rank
wrote. So this watchdog is the only thing that ever aborts the collectives:

- NCCL's own asynchronous error handling is off (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``, set
  for rank 0 and inherited by the workers): NCCL never tears down communicators, nor ComfyUI's
  process, behind the runtime's back;
- while a forward, a weight send or another guarded section is in flight, this thread checks
  every 100 ms that every worker is alive and that the world is *progressing* (some rank
  completed a collective: ``comm.PROGRESS`` on rank 0, each worker's counter in the shared
  status table). A dead worker, or ``timeout_s`` without any progress (a rank that hangs
  without dying), stops the section: ``stop`` aborts the collectives (``comm.abort_collectives``)
  and, for a hang, kills the workers. A long section that keeps progressing (a 14B step on gloo,
  a long video decode) is never stopped, however long it takes;
- a section the watchdog stopped always ends in ``SectionStopped`` when its body returns, so the
  output of aborted collectives is never handed to ComfyUI.

The world then reports which rank died or hung, shuts down, and the next prompt starts fresh
workers.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

log = logging.getLogger("parallel")

# NoHandling: NCCL leaves the abort to this watchdog (it would otherwise abort or end the process
# on its own timeout, racing the watchdog's report of which rank failed).
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")


def prepare_nccl_environment() -> None:
    """Before rank 0 starts workers and creates NCCL groups: the watchdog owns every abort."""
    name, value = NCCL_ERROR_HANDLING
    if os.environ.get(name, value) != value:
        log.warning("%s=%s would let NCCL abort or end ComfyUI on its own when a rank fails; the parallel "
                    "watchdog owns that, using %s", name, os.environ[name], value)
    os.environ[name] = value


class SectionStopped(RuntimeError):
    """The watchdog stopped a guarded section: whatever its body computed is not to be used."""


class Watchdog:
    """``dead()`` lists ranks that are gone; ``progress()`` is a number that grows while any rank
    completes collectives; ``stop(reason, hung)`` unblocks rank 0 (aborts the collectives, kills
    stuck workers). One guarded section at a time."""

    INTERVAL_S = 0.1

    def __init__(self, dead, stop, name: str = "parallel-watchdog", busy=None, progress=None):
        self._dead = dead
        self._stop = stop
        self._busy = busy  # -> True while a rank does work that may outlast the timeout (torch.compile)
        self._progress = progress
        self._armed: list | None = None  # [what, deadline, timeout_s, last progress]
        self._lock = threading.Lock()  # a section ends and the watchdog fires one at a time
        self._closed = threading.Event()
        self.fired: str | None = None  # why it stopped the last guarded section
        self.hung = False              # ... because no rank progressed (it killed the workers)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, what: str, timeout_s: float):
        """Run the body under watch; ``timeout_s`` is how long the world may go without progress.
        Raises ``SectionStopped`` at the end of a body that returned after the watchdog fired."""
        with self._lock:
            self.fired, self.hung = None, False
            self._armed = [what, time.monotonic() + timeout_s, timeout_s, self._read_progress()]
        try:
            yield
        finally:
            with self._lock:
                self._armed = None
                fired = self.fired
        if fired is not None:
            raise SectionStopped(fired)

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

    def _read_progress(self):
        try:
            return self._progress() if self._progress is not None else None
        except Exception:  # a worker table being torn down
            return None

    def close(self) -> None:
        self._closed.set()

    def _loop(self) -> None:
        while not self._closed.wait(self.INTERVAL_S):
            armed = self._armed
            if armed is None:
                continue
            what, deadline, timeout_s, seen = armed
            try:
                dead = self._dead()
            except Exception:  # a worker table being torn down
                continue
            now = time.monotonic()
            progress = self._read_progress()
            if dead:
                reason = f"rank {', '.join(map(str, dead))} died during the {what}"
            elif self._is_busy() or progress != seen:
                # Compiling, or some rank completed a collective: the clock starts again.
                armed[1], armed[3] = now + timeout_s, progress
                continue
            elif now > deadline:
                reason = (f"the {what} stalled: no rank completed a collective for {timeout_s:.0f} s (the collective "
                          "timeout, PARALLEL_COLLECTIVE_TIMEOUT_S); a rank hung")
            else:
                continue
            with self._lock:
                if self._armed is not armed:  # the section ended meanwhile
                    continue
                self._armed = None
                self.fired, self.hung = reason, not dead
            log.error("parallel watchdog: %s; stopping the collectives", reason)
            try:
                self._stop(reason, hung=not dead)
            except Exception:
                log.exception("parallel watchdog: could not stop the collectives")
