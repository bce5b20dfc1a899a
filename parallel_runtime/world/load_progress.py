"""How far a model's weights are on their way to the ranks, told while they travel.

A first load of a big model takes seconds (a cold checkpoint read, a stream over the links), and
ComfyUI shows nothing meanwhile but its sampler's bar at step 0. While ``ModelCopies`` sends a
model, a thread reads every rank's load counters (``protocol.LOAD_FIELDS``: bytes done of the
total, and how many loads the rank has begun) every ``POLL_S`` and tells a listener the fraction
done: the mean over the ranks, where a rank that has not begun this load yet counts 0 and one that
began it with nothing to move counts 1. The listener hears 1.0 once the send is complete, and
nothing more after a send that failed. The world's ``on_load`` makes one listener per load
(ComfyUI's progress bar: ``comfyui_glue/load_bar.py``); a listener that raises is ignored (a
progress display must not fail a load).
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable, Iterator, Sequence

log = logging.getLogger("parallel")

POLL_S = 0.2


def fraction(rows: Sequence[Sequence[float]], begun_before: Sequence[float]) -> float:
    """How much of this load is done: ``rows`` are the ranks' LOAD_FIELDS now, ``begun_before``
    each rank's count of loads begun when this one started."""
    parts = []
    for (done, total, _read, loads), before in zip(rows, begun_before):
        if loads <= before:
            parts.append(0.0)
        else:
            parts.append(1.0 if total <= 0 else min(1.0, done / total))
    return sum(parts) / max(1, len(parts))


@contextlib.contextmanager
def watching(rows: Callable[[], list], on_load: "Callable[[], Callable[[float], None]] | None") -> Iterator[None]:
    """While the block runs, ``on_load()``'s listener hears the fraction done every ``POLL_S``."""
    listener = on_load() if on_load is not None else None
    if listener is None:
        yield
        return
    before = [row[3] for row in rows()]
    stop = threading.Event()

    def tell(value: float) -> None:
        try:
            listener(value)
        except Exception as exc:  # ComfyUI's hook raises its interrupt there, among others
            log.debug("the load progress listener raised %s: %s", type(exc).__name__, exc)

    def watch() -> None:
        while not stop.wait(POLL_S):
            tell(fraction(rows(), before))

    thread = threading.Thread(target=watch, name="parallel-load-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    tell(1.0)
