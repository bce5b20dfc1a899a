"""Block Cache's forward wrapper on ComfyUI's ModelPatcher, and its counts per prompt.

The node puts its settings in ``transformer_options`` (plain data: they travel to the workers with
every forward) and this ``DIFFUSION_MODEL`` wrapper on the model. Unsharded, the wrapper runs the
forward under ``parallel.block_cache``; behind Shard Transformer (whose wrapper runs inside this
one) every rank applies it inside its sharded forward (``parallel.execution``) and the wrapper
only counts. Either way rank 0 records, per prompt, how many steps were computed fully and how
many were cached: the status route's ``block_cache``.
"""
from __future__ import annotations

import collections
import inspect
import threading

from .wrappers import ShardedForward
from ..parallel import arguments, block_cache
from ..plans import find_plan
from ..world.memory import current_prompt
from ..world.runtime import RUNTIME

WRAPPER_KEY = "hybrid_block_cache"
KEPT_PROMPTS = 16

_lock = threading.Lock()
_by_prompt: "collections.OrderedDict[object, dict]" = collections.OrderedDict()


def counts() -> list[dict]:
    """The last prompts' steps, newest last: {prompt_id, computed, cached, measures} (``measures``: the
    change measure of each forward, None where the step was not measured: warm-up)."""
    with _lock:
        return [{"prompt_id": prompt, **row} for prompt, row in _by_prompt.items()]


def _note(outcome: dict) -> None:
    if not outcome:
        return
    prompt = current_prompt()
    with _lock:
        row = _by_prompt.pop(prompt, None) or {"computed": 0, "cached": 0, "measures": []}
        row["cached" if outcome["cached"] else "computed"] += 1
        measure = outcome.get("measure")
        row["measures"].append(None if measure is None or measure != measure or measure == float("inf")
                               else round(measure, 6))
        if outcome.get("disagreements"):
            row["disagreements"] = outcome["disagreements"]
        _by_prompt[prompt] = row
        while len(_by_prompt) > KEPT_PROMPTS:
            _by_prompt.popitem(last=False)


class BlockCacheForward:
    """The DIFFUSION_MODEL wrapper of Block Cache (a plain callable: ComfyUI's cast leaves it alone)."""

    def __call__(self, executor, *args, **kwargs):
        inner = executor.wrappers[executor.idx + 1:]
        module = executor.class_obj
        block_cache.last_outcome()  # what an earlier forward left
        if any(isinstance(w, ShardedForward) for w in inner):
            out = executor(*args, **kwargs)  # every rank applies it inside the sharded forward
        else:
            plan = find_plan(module)
            bound = inspect.signature(type(module)._forward).bind(module, *args, **kwargs)
            with block_cache.cached_blocks(module, plan.for_module(module), arguments.get_options(bound)):
                out = executor(*args, **kwargs)
        _note(block_cache.last_outcome())
        return out


RUNTIME.block_cache = counts
