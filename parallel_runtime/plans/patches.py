"""Model patches: what each patch class that nodes put in ``transformer_options["patches"]`` needs to
run on every rank of a sharded forward. Declarations only: ``parallel/model_patches.py`` applies them.

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

A patch class with no declaration here is refused by name before any rank starts work.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .base import ContextParallelPlan, ModelPlan, Split

NODES = "comfy_extras.nodes_model_patch"


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
    # A user plan file's (plans/user.py): (the file, its text), which the workers build it from.
    source: "tuple[str, str] | None" = None


class PatchRefused(RuntimeError):
    """A model patch that cannot run sharded (with what to do instead)."""


def _encoded_at_latent_size(title: str):
    """The DiffSynth and Z-Image patches encode their control image when built, at its own size, and
    encode it again (with the VAE, lazily, inside the forward) when the latent asks for another size.
    That VAE stays on rank 0, so the sizes must agree before the forward."""
    def prepare(patch, x) -> None:
        compression = patch.vae.spacial_compression_encode()
        wanted = (x.shape[-2] * compression, x.shape[-1] * compression)
        if getattr(patch, "encoded_image", None) is None or tuple(patch.encoded_image_size) != wanted:
            have = getattr(patch, "encoded_image_size", None)
            raise PatchRefused(
                f"{title}: the control image is {_size(have)}, the latent needs {wanted[1]}x{wanted[0]}; "
                "ComfyUI would encode it again inside the sharded forward, with the VAE that only rank 0 holds. "
                f"Scale the control image (and inpaint image, mask) to {wanted[1]}x{wanted[0]} before the patch "
                "node (ImageScale), or run without Shard Transformer")
    return prepare


def _size(hw) -> str:
    return "of another size than the inpaint image" if hw is None else f"{hw[1]}x{hw[0]}"


def _render_encoded(patch, x) -> None:
    """Uni3C encodes its render video at the latent's frames and size at the first block of a forward
    (with the VAE rank 0 holds): done here, with the patch's own method, before the forward."""
    shape = tuple(x.shape[2:])
    if patch.prepared_render is None or tuple(patch.prepared_render.shape[2:]) != shape:
        patch.prepared_render = patch.encode_render_video(shape)


# What the patches ask their VAE at every call even when they encode nothing.
VAE_FACTS = ("spacial_compression_encode",)

PLANS: tuple[PatchPlan, ...] = (
    PatchPlan(classes=(f"{NODES}.DiffSynthCnetPatch",), title="Qwen-Image DiffSynth / Fun ControlNet",
              hooks=("double_block",), tokens="local", left={"vae": VAE_FACTS, "image": (), "mask": ()},
              # One control token per main-image token, added to the image's first tokens.
              cut=(Split("encoded_image", dim=1, stream="img", prefix=True),),
              prepare=_encoded_at_latent_size("Qwen-Image DiffSynth / Fun ControlNet")),
    PatchPlan(classes=(f"{NODES}.ZImageControlPatch",), title="Z-Image Fun ControlNet",
              hooks=("double_block", "noise_refiner"), tokens="whole",
              left={"vae": VAE_FACTS, "image": (), "inpaint_image": (), "mask": ()},
              # Its control stream and the last control layer run; reset after the last control
              # layer, which a model of fewer than about 21 main layers never reaches.
              state=("temp_data",), prepare=_encoded_at_latent_size("Z-Image Fun ControlNet")),
    PatchPlan(classes=(f"{NODES}.WanUni3CCnetPatch",), title="Wan Uni3C ControlNet",
              hooks=("double_block",), tokens="whole", left={"vae": VAE_FACTS, "render_video": ()},
              # Its control stream between blocks (reset at block 0) and the render latent it casts
              # to the model's dtype and device at its first call.
              state=("temp_data", "prepared_render"), prepare=_render_encoded),
)


def class_name(obj) -> str:
    """The qualified name of ``obj``'s class as the declarations write it. ComfyUI imports its
    ``comfy_extras`` node modules under their file path (``/.../ComfyUI/comfy_extras/nodes_model_patch``):
    such a name is read as the dotted module it is inside ComfyUI."""
    module = type(obj).__module__
    if "/" in module or "\\" in module:
        module = ".".join(module.replace("\\", "/").rstrip("/").split("/")[-2:])
    return f"{module}.{type(obj).__qualname__}"


def patch_plan_named(name: str) -> PatchPlan | None:
    """The declaration for the patch class of qualified name ``name``, or None."""
    for plan in PLANS:
        if name in plan.classes:
            return plan
    return None


def declared_text() -> str:
    return "; ".join(f"{p.title} ({', '.join(c.rsplit('.', 1)[1] for c in p.classes)})" for p in PLANS)


# The plan the patches' own models travel with: nothing to split (the engine runs the patch), and
# no tensor-parallel cut (held whole on every rank).
MODEL_PLAN = ModelPlan(family="model_patch", title="model patch", classes=(), heads_attr="",
                       context_parallel=ContextParallelPlan(inputs={}, outputs={}, attention={}), kind="patch")

__all__ = ["MODEL_PLAN", "PLANS", "PatchPlan", "PatchRefused", "declared_text", "class_name", "patch_plan_named"]
