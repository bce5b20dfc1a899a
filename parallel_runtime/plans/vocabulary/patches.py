"""Model patches: what a patch class that nodes put in ``transformer_options["patches"]`` needs to run
on every rank of a sharded forward (``PatchPlan``; ``parallel/model_patches.py`` applies it), and the
plan the patches' own models travel to the workers with (``PatchModelPlan``).

A patch (ComfyUI's ``DiffSynthCnetPatch``, ``ZImageControlPatch``, ``WanUni3CCnetPatch``) is an
object that the model calls after its blocks with their hidden states, and that holds its own
model (a ControlNet: ``model_patch.model``) and its inputs (the encoded control image, a strength).
For the ranks to compute what the unsharded model computes, every rank runs the same patch on its
part of the work:

- ``models``: attributes holding a ComfyUI ``ModelPatcher`` whose ``model`` the workers receive once
  (like the transformer; again only when it is a new model) and hold whole: under tensor
  parallelism it is not cut, so each rank runs the patch's layers in full on its whole tokens.
- ``left``: attributes that stay on rank 0 (the VAE that encoded the control image, the image
  itself); ``prepare`` brings the patch up to date on rank 0 before a forward (what the patch would
  do lazily at its first call, such as encoding the control video at the latent's size) or refuses
  what it cannot. Every other attribute travels with each forward as data (tensors, numbers), so a
  change of strength or image between prompts reaches every rank.
- ``tokens``: ``"local"``: the patch acts on each token alone, so each rank runs it on its own
  tokens; ``cut`` says which of its tensors cover a stream's tokens and are cut like it (the encoded
  control image covers the main image). ``"whole"``: the patch needs the whole sequence (its
  ControlNet has attention of its own, or walks its blocks with the model's): each rank gathers the
  streams the model plan's ``PatchSite`` names, runs the patch on the whole sequence as the
  unsharded model does, and keeps its own chunk of the result.
- ``hooks``: the ``transformer_options["patches"]`` entries the class is set on.
- ``state``: attributes the patch changes during a forward and reads in the next (ComfyUI keeps the
  object, so its state carries across steps and prompts). After each sharded forward rank 0's own
  object receives what the forward left, as it would unsharded; under CFG a state tensor whose first
  dimension is a group's share of the batch is gathered from the groups. A ``"whole"`` patch sees
  the whole sequence, so every rank ends with the same state; a ``"local"`` patch under a sequence
  split ends with its rank's own, which cannot be carried, and is refused when it changes. Any other
  attribute that a forward changes refuses the patch by name.

A patch class with no declaration (``plans/model_patches.py``, or a user plan file's ``PATCH_PLANS``)
is refused by name before any rank starts work.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .context_parallel import Split
from .plan import Plan


@dataclass(frozen=True)
class PatchPlan:
    classes: tuple[str, ...]    # qualified class names of the patch objects (globs in user plan files)
    title: str                  # what users call it
    tokens: str                 # "local" or "whole"
    hooks: tuple[str, ...] = ()  # transformer_options["patches"] entries it is set on
    # Block kinds whose ``transformer_options["patches_replace"]["dit"][(kind, i)]`` it replaces
    # ("double_block"): called with the block's arguments and ``original_block``; "local" only (it
    # meets the tokens where the block does: whole before the first block cuts them, local after).
    replaces: tuple[str, ...] = ()
    models: tuple[str, ...] = ("model_patch",)
    # Attribute -> the zero-argument methods whose answers travel in its place (the VAE's compression).
    left: dict[str, tuple[str, ...]] = field(default_factory=dict)
    cut: tuple[Split, ...] = ()  # "local": the attributes cut like a stream (Split.arg: the attribute)
    # Attributes the class keeps between calls, carried back to rank 0's object after each forward.
    state: tuple[str, ...] = ()
    # Rank 0, before each forward: ``prepare(patch, x)`` with the model's input latent ``x``.
    prepare: "Callable[[object, object], None] | None" = None
    # A user plan file's (user.py): (the file, its text), which the workers build it from.
    source: "tuple[str, str] | None" = None


class PatchRefused(RuntimeError):
    """A model patch that cannot run sharded (with what to do instead)."""


@dataclass(frozen=True)
class PatchModelPlan(Plan):
    """The plan a patch's own model (``PatchPlan.models``) travels with: nothing to split (the engine
    runs the patch, on every rank alike) and nothing cut by tensor parallelism (held whole)."""


def class_name(obj) -> str:
    """The qualified name of ``obj``'s class as the declarations write it. ComfyUI imports its
    ``comfy_extras`` node modules under their file path (``/.../ComfyUI/comfy_extras/nodes_model_patch``):
    such a name is read as the dotted module it is inside ComfyUI."""
    module = type(obj).__module__
    if "/" in module or "\\" in module:
        module = ".".join(module.replace("\\", "/").rstrip("/").split("/")[-2:])
    return f"{module}.{type(obj).__qualname__}"
