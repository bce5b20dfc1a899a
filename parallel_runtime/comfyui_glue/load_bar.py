"""ComfyUI's progress bar while a model's weights go to the ranks (world/load_progress.py says how far).

The bar is the running node's (the sampler's), in percent, drawn from the load's watcher thread.
ComfyUI's progress hook also takes Cancel's flag (``throw_exception_if_processing_interrupted``
clears it as it raises): raised in that thread, the Cancel would be lost. So the bar is updated
only under ComfyUI's interrupt lock with the flag clear, and a Cancel pressed during a load stays
set for the prompt thread (the next forward's interrupt check, after the load).
"""
from __future__ import annotations

from ..world.runtime import RUNTIME

STEPS = 100  # the bar's total: percent of the load


def progress_bar():
    """A listener for one load: ComfyUI's progress bar on the node that is running."""
    import comfy.model_management as mm
    import comfy.utils

    if comfy.utils.PROGRESS_BAR_HOOK is None:  # no server (a script): nothing to draw on
        return None
    bar = comfy.utils.ProgressBar(STEPS, node_id=_running_node())

    def update(fraction: float) -> None:
        with mm.interrupt_processing_mutex:
            if not mm.processing_interrupted():
                bar.update_absolute(round(fraction * STEPS))
    return update


def _running_node():
    """The node this prompt thread runs (the watcher thread cannot tell: ComfyUI keeps it in a
    context variable); None where this ComfyUI does not say."""
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:
        return None
    context = get_executing_context()
    return None if context is None else context.node_id


RUNTIME.on_load = progress_bar
