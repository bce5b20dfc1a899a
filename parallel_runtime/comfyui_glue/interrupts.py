"""ComfyUI's Cancel, made safe for a forward that runs on several ranks.

ComfyUI checks its interrupt flag inside every layer (``comfy.ops.run_every_op``).
Raised in the middle of a sharded forward, it would leave the workers blocked in
a collective, and the only way out would be to kill them (and reload the weights
on the next prompt). So during a sharded forward rank 0 defers the check: the
forward finishes on every rank, the flag stays set, and ComfyUI raises the
interrupt at its next check, right after the forward. Cancel therefore takes at
most one forward, and the workers stay up for the next prompt.
"""
from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def _install() -> None:
    import comfy.ops

    original = comfy.ops.run_every_op
    if getattr(original, "_defers_for_parallel", False):
        return

    def run_every_op():
        if getattr(_state, "depth", 0):
            return
        return original()

    run_every_op._defers_for_parallel = True
    comfy.ops.run_every_op = run_every_op


@contextlib.contextmanager
def deferred():
    """Defer ComfyUI's per-layer interrupt check in this thread while the block runs."""
    _install()
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
