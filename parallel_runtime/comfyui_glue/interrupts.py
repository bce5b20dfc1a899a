"""ComfyUI's Cancel, made safe for a forward that runs on several ranks.

ComfyUI checks its interrupt flag inside every layer (``comfy.ops.run_every_op``).
Raised in the middle of a sharded forward, it would leave the workers blocked in
a collective, and the only way out would be to kill them (and reload the weights
on the next prompt). So during a sharded forward rank 0 defers the check: the
forward finishes on every rank, the flag stays set, and ComfyUI raises the
interrupt at its next check, right after the forward. Cancel therefore takes at
most one forward, and the workers stay up for the next prompt.

A weight load is stopped instead: Cancel pressed while the workers read a model from its file
stops their reads (``weights/model_copies.LoadStopped``: no rank keeps any of the model), and the
prompt ends interrupted, as ComfyUI ends it.
"""
from __future__ import annotations

import contextlib
import threading

from ..weights.model_copies import LoadStopped
from ..world.runtime import RUNTIME

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
    except LoadStopped as exc:
        import comfy.model_management

        comfy.model_management.interrupt_current_processing(False)  # taken: this prompt ends here
        raise comfy.model_management.InterruptProcessingException() from exc
    finally:
        _state.depth -= 1


def cancel_pressed() -> bool:
    """ComfyUI's Cancel flag (read, left set)."""
    import comfy.model_management

    return comfy.model_management.processing_interrupted()


RUNTIME.load_cancelled = cancel_pressed
