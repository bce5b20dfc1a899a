"""``layout: auto``: the layout each model runs in, chosen per size of its input.

At a model's first forward with inputs of a size (a new resolution, frame count or batch)
rank 0 runs the model alone through the first block of each block stack (Flux: the double
blocks and one single block; Wan: one block) to read the shape of the run: the token streams,
the batch, the width, the matmuls a block makes. With those and the probe's figures,
``cost_model`` predicts every layout of the world's ranks; layouts the model cannot run
(heads that do not divide, a cfg dimension with nothing to split, weights that do not fit) are
refused with the reason, and the fastest of the rest is kept for that model and size, unless
the layout the model last ran in is within ``KEEP_MARGIN`` of it (a layout of another
tensor-parallel size means sending the weights again).
"""
from __future__ import annotations

import logging
import math
import time
import weakref
from dataclasses import dataclass

import torch

from . import cost_model
from .probe import median_seconds, model_attention_function
from .refusal import plan_refusal
from ..config import describe_sizes
from ..distributed.mesh import MeshLayout
from ..parallel import scoped_hooks
from ..parallel.attention import attention_with_lse
from ..parallel.compile_regions import region_patterns
from ..parallel.heads import head_share
from ..plans.vocabulary.context_parallel import MAIN_STREAM
from ..plans.vocabulary.matching import layer_specs, matching_modules, on_item, replace_arguments
from ..plans.vocabulary.tensor_parallel import Norm, Rowwise
from ..plans.vocabulary.transformer import TransformerPlan
from ..weights import pickling

log = logging.getLogger("parallel")

MEMORY_HEADROOM = 0.9  # of a rank's free memory a layout may plan to use


class _Enough(Exception):
    """The first block of every block stack has run: the shape of the run is known."""


@dataclass
class _LinearCall:
    rows: int
    macs: int       # per row
    split: bool     # a layer tensor parallelism cuts


def measure_shape(module: torch.nn.Module, plan: TransformerPlan, method, args: tuple, kwargs: dict) -> cost_model.ModelShape:
    """The run's shape: rank 0 runs ``method`` until the first block of each of the plan's block
    stacks has run, recording the token streams and every matmul those blocks make (a layer that
    runs once per sample, such as a modulation, costs the same on every rank; one that runs per
    token is cut by the sequence ranks). Blocks of one stack are alike, so one stands for all."""
    cp = plan.context_parallel
    stacks = [(pattern, matching_modules(module, pattern)) for pattern in region_patterns(plan)]
    stacks = [(pattern, found) for pattern, found in stacks if found]
    streams, calls = _run_to_first_blocks(module, plan, stacks, method, args, kwargs)
    if not streams:
        raise RuntimeError(f"layout auto: the {plan.title} model reached no token stream of its plan; set the "
                           "layout by hand (layout: manual)")
    main_shape, main_dim, dtype = streams.get(MAIN_STREAM) or next(iter(streams.values()))
    batch = int(main_shape[0])
    lengths = [int(shape[dim]) for shape, dim, _ in streams.values()]
    token_rows = {batch * n for n in lengths} | {batch * sum(lengths)}  # a stream, or the streams joined
    macs = {(True, True): 0.0, (True, False): 0.0, (False, True): 0.0, (False, False): 0.0}
    linear_calls = 0
    for pattern, found in stacks:
        for call in calls[pattern]:
            macs[(call.rows in token_rows, call.split)] += len(found) * call.rows * call.macs
            linear_calls += len(found)
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    specs = list(layer_specs(module, plan.tensor_parallel)) if plan.tensor_parallel is not None else []
    split_bytes = pickling.param_bytes_all(mod for _, mod, spec in specs if not isinstance(spec, Norm))
    return cost_model.ModelShape(
        tokens=sum(lengths), batch=batch, hidden=int(main_shape[-1]), heads=plan.heads(module),
        blocks=sum(len(found) for _, found in stacks),
        attention_sites=sum(len(matching_modules(module, p)) for p in cp.attention),
        token_macs_split=macs[(True, True)], token_macs_whole=macs[(True, False)],
        sample_macs_split=macs[(False, True)], sample_macs_whole=macs[(False, False)], linear_calls=linear_calls,
        row_parallel=tuple(mod.out_features for _, mod, spec in specs
                           if isinstance(spec, Rowwise) and isinstance(mod, torch.nn.Linear)),
        split_norms=sum(isinstance(spec, Norm) for _, _, spec in specs),
        weight_bytes_split=split_bytes, weight_bytes_whole=max(0, pickling.param_bytes(module) - split_bytes),
        element_bytes=torch.empty((), dtype=dtype).element_size(),
        input_bytes=sum(t.numel() * t.element_size() for t in tensors),
        output_bytes=tensors[0].numel() * tensors[0].element_size() if tensors else 0)


def _run_to_first_blocks(module, plan: TransformerPlan, stacks, method, args, kwargs):
    """Run ``method`` until the first block of every stack has run (then stop it): the token
    streams where they start (stream -> (shape, token dim, dtype)) and each first block's matmuls
    (stack pattern -> its ``_LinearCall`` list)."""
    streams: dict[str, tuple[torch.Size, int, torch.dtype]] = {}
    split_layers = {id(mod) for _, mod, spec in layer_specs(module, plan.tensor_parallel)
                    if not isinstance(spec, Norm)} if plan.tensor_parallel is not None else set()
    calls: dict[str, list[_LinearCall]] = {pattern: [] for pattern, _ in stacks}
    done: set[str] = set()

    def recorder(specs):
        def record(value, spec):
            if spec.starts_stream and spec.stream not in streams:
                on_item(value, spec.item, lambda t: streams.setdefault(spec.stream, (t.shape, spec.dim, t.dtype)))
            return None  # nothing is replaced

        return lambda mod, a, kw: replace_arguments(mod, a, kw, specs, record)

    def linear_hook(pattern):
        def hook(mod, a):
            if pattern not in done and a and isinstance(a[0], torch.Tensor):
                calls[pattern].append(_LinearCall(a[0].numel() // mod.in_features, mod.in_features * mod.out_features,
                                                  id(mod) in split_layers))
        return hook

    def block_done(pattern):
        def hook(mod, a, out):
            done.add(pattern)
            if len(done) == len(stacks):
                raise _Enough
        return hook

    handles = []
    try:
        for pattern, specs in plan.context_parallel.inputs.items():
            if any(s.starts_stream for s in specs):
                for _, mod in matching_modules(module, pattern):
                    handles.append(scoped_hooks.pre_hook(mod, recorder(specs), with_kwargs=True))
        for pattern, found in stacks:
            first = found[0][1]
            for mod in first.modules():
                if isinstance(mod, torch.nn.Linear):
                    handles.append(scoped_hooks.pre_hook(mod, linear_hook(pattern)))
            handles.append(scoped_hooks.post_hook(first, block_done(pattern)))
        try:
            with torch.inference_mode():
                method(*args, **kwargs)
        except _Enough:
            pass
    finally:
        for h in handles:
            h.remove()
    return streams, calls


def calibrate(run: dict, layouts: list[dict[str, int]], device: torch.device) -> dict:
    """Timings at this run's size (``run``: tokens, batch, hidden, heads, dtype), taken by every
    rank at once so that ranks sharing a machine share it as in a step: one attention site per
    layout and a block-sized matmul."""
    shape = cost_model.ModelShape(tokens=run["tokens"], batch=run["batch"], hidden=run["hidden"], heads=run["heads"],
                                  blocks=0, attention_sites=0, token_macs_split=0, token_macs_whole=0,
                                  sample_macs_split=0, sample_macs_whole=0, linear_calls=0)
    dtype = getattr(torch, run["dtype"])
    world_size = math.prod(layouts[0].values()) if layouts else 1
    return {"sites": attention_site_seconds(shape, layouts, device, dtype),
            "matmul_flops_per_s": matmul_rate(shape, world_size, device, dtype)}


def attention_site_seconds(shape: cost_model.ModelShape, layouts: list[dict[str, int]], device: torch.device,
                           dtype: torch.dtype) -> dict[tuple[int, int, int], float]:
    """(ring, ulysses, tp) -> seconds of one attention site on one rank at this run's size, with
    the kernel the layout runs (ComfyUI's attention function, or the Ring kernel per
    hop): attention throughput depends on the length too much for the probe's one size."""
    model_attention = model_attention_function()
    head_dim = max(1, shape.hidden // shape.heads)
    out = {}
    for sizes in layouts:
        key = (sizes["ring"], sizes["ulysses"], sizes["tp"])
        heads = head_share(shape.heads // sizes["tp"], sizes["ulysses"])  # padded heads included
        if key in out or heads < 1:
            continue
        ring = sizes["ring"]
        length = -(-shape.tokens // ring)
        q = torch.randn(1, heads, length, head_dim, device=device, dtype=dtype)
        if ring > 1:
            step = median_seconds(lambda: attention_with_lse(q, q, q, head_dim ** -0.5), device, repeats=1)
            out[key] = ring * step * shape.batch
        else:
            flat = q.transpose(1, 2).reshape(1, length, heads * head_dim)
            out[key] = median_seconds(lambda: model_attention(flat, flat, flat, heads), device, repeats=1) * shape.batch
    return out


def matmul_rate(shape: cost_model.ModelShape, world_size: int, device: torch.device, dtype: torch.dtype) -> float:
    """Matmul flops per second at the size of a block's MLP on one rank's tokens."""
    # At least 1024 rows: a smaller product takes a millisecond, too short to time on a busy machine.
    rows = max(1024, shape.batch * shape.tokens // world_size)
    a = torch.randn(rows, shape.hidden, device=device, dtype=dtype)
    b = torch.randn(shape.hidden, 4 * shape.hidden, device=device, dtype=dtype)
    return 2.0 * rows * shape.hidden * 4 * shape.hidden / median_seconds(lambda: torch.mm(a, b), device, repeats=5)


def refusal(module, plan: TransformerPlan, sizes: dict[str, int], shape: cost_model.ModelShape, config) -> str | None:
    """Why this model cannot run in this layout, or None: the plan's own check (the one Shard
    Transformer makes, layout/refusal.py), then what only a run's shape and the hosts can say."""
    why = plan_refusal(module, plan, sizes)
    if why is not None:
        return why
    if sizes["cfg"] > 1 and shape.batch % sizes["cfg"]:
        return (f"a batch of {shape.batch} (CFG 1 gives one entry) has nothing to split over {sizes['cfg']} cfg "
                "groups: they would compute the same thing")
    tp = sizes["tp"]
    for name, count in config.hosts if tp > 1 else ():
        if count % tp:
            return f"host {name} has {count} ranks, not a multiple of tp {tp}"
    return None


# Ranks whose measured matmul speeds differ by more than this get a weighted token split.
UNEVEN_SPEEDS = 1.1
# A model keeps the layout it last ran in for a new input size when that layout is predicted at
# most this much slower than the best: switching may re-send the weights (another TP size).
KEEP_MARGIN = 0.05


@dataclass
class Choice:
    model: str
    shape: cost_model.ModelShape
    chosen: cost_model.Prediction
    predictions: list[cost_model.Prediction]   # every runnable layout, fastest first
    refused: dict[str, str]                    # layout -> why not
    seconds: float
    weights: tuple[float, ...] = ()            # per rank relative speed (a weighted split), () = even

    def as_dict(self) -> dict:
        return {"model": self.model, "layout": self.chosen.sizes, "predicted_step_ms": round(self.chosen.step_s * 1e3, 3),
                "alternatives": [p.as_dict() for p in self.predictions], "refused": self.refused,
                "tokens": self.shape.tokens, "batch": self.shape.batch, "chosen_in_s": round(self.seconds, 3),
                "weights": list(self.weights)}


def choose(module, plan: TransformerPlan, shape: cost_model.ModelShape, probe: dict, config, world_size: int,
           site_seconds: dict | None = None, matmul_flops_per_s: float | None = None
           ) -> tuple[list[cost_model.Prediction], dict[str, str]]:
    """Predictions of every runnable layout (fastest first) and the refused ones with reasons
    (``site_seconds``, ``matmul_flops_per_s``: rank 0's timings at the run's size, over the probe's)."""
    rates = cost_model.Rates.from_probe(probe, site_seconds=site_seconds, matmul_flops_per_s=matmul_flops_per_s)
    runnable, refused = [], {}
    for sizes in cost_model.layouts(world_size):
        why = refusal(module, plan, sizes, shape, config)
        prediction = cost_model.predict(shape, sizes, rates)
        if why is None and prediction.memory_bytes > rates.free_memory_bytes * MEMORY_HEADROOM:
            why = (f"needs about {prediction.memory_bytes / 2**30:.1f} GiB per rank; the fullest rank has "
                   f"{rates.free_memory_bytes / 2**30:.1f} GiB free")
        if why is None:
            runnable.append(prediction)
        else:
            refused[describe_sizes(sizes)] = why
    runnable.sort(key=lambda p: p.step_s)
    return runnable, refused


def keep_or_best(runnable: list[cost_model.Prediction], current: dict[str, int] | None) -> cost_model.Prediction:
    """The fastest prediction, or the one of the ``current`` layout where it is within KEEP_MARGIN."""
    best = runnable[0]
    kept = next((p for p in runnable if p.sizes == current), None)
    if kept is not None and kept.step_s <= best.step_s * (1 + KEEP_MARGIN):
        return kept
    return best


def input_sizes(args: tuple, kwargs: dict) -> tuple:
    """The shapes of a call's tensors (not its transformer options): a choice holds for one size."""
    sizes = []

    def walk(value):
        if isinstance(value, torch.Tensor):
            sizes.append(tuple(value.shape))
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for k, v in value.items():
                if k != "transformer_options":
                    walk(v)
    walk(args)
    walk(kwargs)
    return tuple(sizes)


def _dtype_of(shape: cost_model.ModelShape) -> torch.dtype:
    return {2: torch.bfloat16, 8: torch.float64}.get(shape.element_bytes, torch.float32)


class AutoLayouts:
    """The layout of each model a world runs under ``layout: auto`` (rank 0)."""

    def __init__(self, world):
        self._world = weakref.ref(world)
        # per model: input sizes -> the choice for them
        self._chosen: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, Choice]]" = weakref.WeakKeyDictionary()
        self._current: "weakref.WeakKeyDictionary[torch.nn.Module, Choice]" = weakref.WeakKeyDictionary()
        self._last_measured: tuple[float, ...] = ()  # the speeds the latest choice measured

    def layout_for(self, module, plan: TransformerPlan, method, args: tuple, kwargs: dict) -> MeshLayout:
        per_size = self._chosen.get(module)
        if per_size is None:
            per_size = self._chosen[module] = {}
        key = input_sizes(args, kwargs)
        found = per_size.get(key)
        if found is None:
            current = self._current.get(module)
            found = per_size[key] = self._choose(module, plan, method, args, kwargs,
                                                 current.chosen.sizes if current is not None else None)
            self._last_measured = found.weights
        self._current[module] = found
        return MeshLayout.from_sizes(found.chosen.sizes)

    def _choose(self, module, plan, method, args, kwargs, current: dict[str, int] | None) -> Choice:
        world = self._world()
        started = time.perf_counter()
        with world._threads():
            shape = measure_shape(module, plan, method, args, kwargs)
        candidates = [sizes for sizes in cost_model.layouts(world.world_size)
                      if refusal(module, plan, sizes, shape, world.config) is None]
        run = {"tokens": shape.tokens, "batch": shape.batch, "hidden": shape.hidden, "heads": shape.heads,
               "dtype": str(_dtype_of(shape)).replace("torch.", "")}
        timings = world.calibrate(run, candidates)
        # Ranks run in lockstep: the slowest rank's time is the step's.
        sites = {key: max(t["sites"][key] for t in timings) for key in timings[0]["sites"]}
        speeds = [t["matmul_flops_per_s"] for t in timings]
        weights = () if max(speeds) <= UNEVEN_SPEEDS * min(speeds) else tuple(v / max(speeds) for v in speeds)
        # With a weighted split the token work goes at the ranks' summed speed, not n x the slowest.
        rate = sum(speeds) / len(speeds) if weights else min(speeds)
        runnable, refused = choose(module, plan, shape, world.probe, world.config, world.world_size, sites, rate)
        if not runnable:
            raise RuntimeError(f"layout auto: no layout of {world.world_size} ranks can run this {plan.title} "
                               "model: " + "; ".join(f"{k}: {v}" for k, v in refused.items()))
        chosen = keep_or_best(runnable, current)
        choice = Choice(f"{type(module).__name__}", shape, chosen, runnable, refused,
                        time.perf_counter() - started, weights)
        if weights:
            log.info("layout auto: the ranks' speeds differ (%s): tokens split in proportion",
                     ", ".join(f"{w:.2f}" for w in weights))
        alternatives = ", ".join(f"{describe_sizes(p.sizes)} {p.step_s * 1e3:.0f} ms"
                                 for p in [p for p in runnable if p is not chosen][:3])
        kept = f" (kept from its last run: {describe_sizes(runnable[0].sizes)} is predicted only " \
               f"{(1 - runnable[0].step_s / chosen.step_s) * 100:.0f} % faster)" if chosen is not runnable[0] else ""
        log.info("layout auto: %s with %d tokens, batch %d runs as %s%s (predicted %.0f ms a step; then %s)",
                 plan.title, shape.tokens, shape.batch, describe_sizes(chosen.sizes), kept,
                 chosen.step_s * 1e3, alternatives or "no other layout")
        return choice

    def weights_for(self, module) -> tuple[float, ...]:
        """The speeds measured for this model; for a model auto does not lay out (a VAE's bands),
        those of the latest model it did (() until then: even bands)."""
        found = self._current.get(module)
        return found.weights if found is not None else self._last_measured

    def status(self) -> list[dict]:
        """Every choice made, per model and input size."""
        return [c.as_dict() for per_size in list(self._chosen.values()) for c in per_size.values()]
