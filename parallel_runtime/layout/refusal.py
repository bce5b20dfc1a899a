"""Whether a model's plan can run in a layout: one check, read by Shard Transformer when a prompt
is queued (the config's sizes) and by layout auto for every layout it considers.

A rule written in two places drifts: the head-divisibility check once lived in both. Layout auto
adds only what it alone knows (the run's batch against a cfg dimension, hosts against TP groups).
"""
from __future__ import annotations

from ..config import MESH_DIMS
from ..plans.vocabulary.matching import layer_specs
from ..plans.vocabulary.tensor_parallel import TensorParallelError
from ..plans.vocabulary.transformer import TransformerPlan
from ..weights.shards import quantized_layers, quantized_message, valid_sizes


def plan_refusal(module, plan: TransformerPlan, sizes: dict[str, int]) -> str | None:
    """Why ``module`` (its ``plan`` found) cannot run with these mesh sizes, in words a user can act
    on (naming the value and the valid ones), or None."""
    for dim in MESH_DIMS:
        size = int(sizes.get(dim, 1))
        if size > 1 and dim not in plan.supports:
            return f"{plan.title} supports {', '.join(plan.supports)} here, not {dim}_size={size}; set {dim}_size to 1"
    heads = plan.heads(module)
    tp = int(sizes.get("tp", 1))
    if tp > 1:
        try:
            layer_specs(module, plan.tensor_parallel)  # every layer the plan cuts is there
            quantized = quantized_layers(module, plan.tensor_parallel, tp)
            valid = valid_sizes(module, plan.tensor_parallel, heads)
        except TensorParallelError as exc:  # a layer the plan cuts that this model lacks
            return f"{plan.title} plan: {exc}"
        if quantized:
            (name, reason), more = quantized[0], len(quantized) - 1
            return quantized_message(f"this {plan.title} model's layer {name}" + (f" (and {more} more)" if more else ""),
                                     reason)
        if tp not in valid:
            widths = ", ".join(f"{name} {int(_attr(module, path))}"
                               for name, path in plan.tensor_parallel.divisible.items())
            return (f"tp_size={tp} does not divide this {plan.title} model's {heads} attention heads and {widths}; "
                    f"valid tp_size values: {', '.join(map(str, valid))}")
    # Ulysses takes any size: heads it does not divide are padded (parallel/heads.py).
    return None


def _attr(root, path: str):
    value = root
    for part in path.split("."):
        value = getattr(value, part)
    return value
