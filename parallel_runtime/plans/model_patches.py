"""The model patches the pack runs on every rank (ComfyUI's ``comfy_extras.nodes_model_patch``):
ControlNets that nodes attach to Qwen-Image, Z-Image and Wan as ``transformer_options["patches"]``.
Each encodes its control input with a VAE that stays on rank 0, so ``prepare`` brings it up to the
latent's size there before the forward, or refuses."""
from __future__ import annotations

from .vocabulary.context_parallel import Split
from .vocabulary.patches import PatchModelPlan, PatchPlan, PatchRefused

NODES = "comfy_extras.nodes_model_patch"


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


# The plan the patches' own models travel with (``PatchModelPlan``).
PATCH_MODEL_PLAN = PatchModelPlan(family="model_patch", title="model patch")
