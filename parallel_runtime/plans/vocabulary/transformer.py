"""A transformer plan: a diffusion model that Shard Transformer runs over the Parallel Config's
mesh (cfg x ring x ulysses x tp), with its token streams cut by its ``ContextParallelPlan``
(``context_parallel.py``) and, optionally, its layers by a ``TensorParallelPlan``. User plan files
write it as ``ModelPlan`` (``user.py``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from .context_parallel import CachedBlocks, ContextParallelPlan
from .matching import PlanMismatch, attention_global_holder, comfyui_release, forward_signature, matching_modules
from .plan import Plan
from .tensor_parallel import TensorParallelPlan


@dataclass(frozen=True)
class TransformerPlan(Plan):
    classes: tuple[str, ...]  # qualified class names this plan covers
    heads_attr: str           # attribute path (dotted) of the root module holding the head count
    context_parallel: ContextParallelPlan
    notes: str = ""           # the support matrix's notes
    tensor_parallel: "TensorParallelPlan | None" = None
    # Where ComfyUI releases build the family differently (HunyuanVideo's joint order): the
    # plan for this very module, chosen from its own structure, so every rank chooses alike.
    variant: "Callable[[torch.nn.Module], TransformerPlan] | None" = None
    # Modules whose forward torch.compile compiles one by one (parallel/compile_regions.py); empty: the
    # repeated blocks the plan's patterns name.
    compile_regions: tuple[str, ...] = ()
    # The block stacks Block Cache skips the middle of (``CachedBlocks``, in the order the model runs
    # them); empty: Block Cache refuses the family.
    cached_blocks: tuple[CachedBlocks, ...] = ()
    # A user plan (user.py): (the file it came from, its text), which the workers build it from.
    source: "tuple[str, str] | None" = None

    configured_layout: ClassVar[bool] = True
    takes_transformer_options: ClassVar[bool] = True

    def for_module(self, module: torch.nn.Module) -> "TransformerPlan":
        return self if self.variant is None else self.variant(module)

    @property
    def supports(self) -> tuple[str, ...]:
        """Mesh dimensions the plan supports (for the support matrix and the node's checks)."""
        return ("ulysses", "ring", "cfg") + (("tp",) if self.tensor_parallel is not None else ())

    def heads(self, module: torch.nn.Module) -> int:
        value = module
        for part in self.heads_attr.split("."):
            value = getattr(value, part)
        return int(value)

    def check_matches(self, root: torch.nn.Module) -> None:
        """Every pattern names a module (a plan that silently matched nothing would leave attention
        local-only), every argument the plan cuts is still a parameter of the forward it hooks (or a
        cut would silently not happen), and every attention global the plan routes is still where
        the model calls it."""
        cp = self.context_parallel
        for pattern in (*cp.inputs, *cp.outputs, *cp.attention):
            if not matching_modules(root, pattern):
                raise PlanMismatch(f"{self.title} plan: no module matches '{pattern}' in {type(root).__name__} of "
                                   f"{comfyui_release()}; this model variant is not covered by the plan")
        for spec in cp.attention_globals:
            attention_global_holder(self, spec)
        for pattern, splits in cp.inputs.items():
            for name, module in matching_modules(root, pattern):
                _, var_kw, named = forward_signature(module)
                missing = [s.arg for s in splits if s.arg not in named and not var_kw]
                if missing:
                    raise PlanMismatch(
                        f"{self.title} plan: {name} ({type(module).__name__}) of {comfyui_release()} takes no "
                        f"{', '.join(map(repr, sorted(set(missing))))}, which the plan cuts across ranks: this ComfyUI "
                        "builds the model differently from what the plan was written for. Refused rather than "
                        "computing a wrong result; run this model without Shard Transformer here, or use a pack "
                        "release that knows it")
