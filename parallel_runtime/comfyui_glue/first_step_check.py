"""The optional first-step check: for someone trying the pack on a ComfyUI release it was not
tested with. The first forward of every sampling run is computed sharded and, once more,
unsharded on rank 0 with the model as ComfyUI holds it; a difference beyond float rounding
stops the prompt with a message, rather than letting a subtly wrong image through.

On with Shard Transformer's ``verify_first_step`` input or ``PARALLEL_VERIFY_FIRST_STEP=1`` in
ComfyUI's environment. It costs one unsharded step per prompt, on rank 0's device.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from ..plans.vocabulary.matching import comfyui_release
from ..world.runtime import RUNTIME

log = logging.getLogger("parallel")

ENV = "PARALLEL_VERIFY_FIRST_STEP"
# Relative L2 error of the whole output: what reordered sums give (fp32 measured 1e-7 to 1e-6
# here), well below what a wrong split gives (order 1).
FP32_TOLERANCE = 1e-4
TOLERANCE = {torch.float32: FP32_TOLERANCE, torch.float64: 1e-6}
# bf16 / fp16: a stated multiple of the measured rounding r of an unsharded bf16 run against the same
# run in fp32. A sharded run that rounds like the unsharded one lies within r of the fp32 result, as
# that one does, so within 2r of it (docs/gpu_check.md#tolerances). The one rule, used by this check
# and by tools/gpu_check.py (which measures r on every run): :func:`tolerance`.
BF16_ROUNDING_MULTIPLE = 2
# This check runs inside a user's prompt and cannot afford an fp32 copy of the model to measure r, so
# its r is the newest stored measurement of the GPU check's case bf16_rounding (the tiny Wan graph,
# unsharded, bf16 against fp32, over a whole sampling run); tests/test_first_step_check.py fails when
# a newer stored run holds another figure.
BF16_ROUNDING = 3.5e-3
BF16_ROUNDING_SOURCE = "bench/results/cpu_check_2026-11-28_bf16_rounding.json"


def tolerance(dtype, rounding: float | None = None) -> float:
    """The relative L2 error two results of one model in ``dtype`` may differ by: fixed in fp32 and
    fp64; in bf16 / fp16 (and any other dtype) BF16_ROUNDING_MULTIPLE times the measured bf16 rounding ``rounding`` (by
    default this check's stored BF16_ROUNDING). ``dtype``: a torch dtype or its name ("bfloat16")."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype in TOLERANCE:
        return TOLERANCE[dtype]
    r = BF16_ROUNDING if rounding is None else rounding
    if not r > 0:
        raise ValueError(f"a bf16 tolerance needs a measured rounding above 0, not {r}")
    return BF16_ROUNDING_MULTIPLE * r


def requested(node_input: bool) -> bool:
    return bool(node_input) or os.environ.get(ENV, "") not in ("", "0")


class FirstStep:
    """Per sharded model: whether this sampling run's first forward is still to be checked,
    and what the last check found (shown by the status route)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.pending = False
        self.last: dict | None = None

    def begin_run(self) -> None:
        self.pending = self.enabled

    def check(self, title: str, sharded, unsharded_call) -> None:
        """Compare ``sharded`` with ``unsharded_call()``; raise when they differ beyond rounding."""
        self.pending = False
        started = time.perf_counter()
        with torch.inference_mode():
            reference = unsharded_call()
        rel = relative_error(sharded, reference)
        tol = tolerance(reference.dtype)
        # The last check's findings, for the status route.
        self.last = RUNTIME.first_step_check = {
            "model": title, "relative_error": rel, "tolerance": tol, "ok": rel <= tol, "release": comfyui_release(),
            "seconds": round(time.perf_counter() - started, 3)}
        log.info("parallel first-step check, %s: relative error %.2e (tolerance %.1e)", title, rel, tol)
        if rel > tol:
            raise RuntimeError(
                f"Shard Transformer: the sharded first step of this {title} model differs from the unsharded one by "
                f"{rel:.2e} (relative L2; rounding stays below {tol:.1e}): on {comfyui_release()} the pack computes "
                "this model wrongly. The prompt was stopped; run it without Shard Transformer, and please report "
                "the ComfyUI release and the model")


def relative_error(out, ref) -> float:
    if isinstance(out, (tuple, list)):
        return max(relative_error(o, r) for o, r in zip(out, ref))
    diff = (out.float() - ref.float()).norm()
    return float(diff / ref.float().norm().clamp_min(1e-12))
