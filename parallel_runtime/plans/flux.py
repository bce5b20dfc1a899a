"""Flux.1 (dev, schnell, Kontext), Flux.2 and Chroma: double-stream then single-stream blocks.

- Two token streams: ``txt`` and ``img`` (the image, then any Kontext / Flux.2
  reference tokens appended after it). Both are cut where they enter
  ``double_blocks.0``; every rank then holds ``[txt chunk ; img chunk]``.
- ``pe`` (RoPE, ``[B, 1, L_txt + L_img, D/2, 2, 2]``) covers ``[txt, img]`` on dim 2
  and reaches every block.
- Attention in both block kinds is joint over ``[txt, img]``; RoPE is applied
  before ComfyUI's attention call, so the override sees final q/k.
- The single-stream part is ``cat(txt, img)``; the model slices the image back out
  with the *local* text length, so ``final_layer`` (per token) sees this rank's
  image chunk and its output is gathered.
- ControlNet residuals cover the main image tokens (a prefix of the ``img``
  stream); each rank adds the part inside its chunk.
- The Flux ControlNet (``ControlNetFlux``, XLabs / InstantX / Union / Mistoline) is a Flux model
  of its own, run under the transformer's layout (``CONTROLNET``): the same streams, its control
  image added to the image tokens before they are cut, its per-block residual projections gathered
  (the transformer cuts them again). Its blocks call attention without ``transformer_options``, so
  the plan routes ``comfy.ldm.flux.math.optimized_attention``. No tensor-parallel plan: under TP
  each rank runs its tokens through the whole ControlNet (small next to the transformer).
"""
from __future__ import annotations

from .vocabulary.context_parallel import AttentionGlobal, CachedBlocks, ContextParallelPlan, Gather, Split
from .vocabulary.tensor_parallel import Colwise, Rowwise, TensorParallelPlan
from .vocabulary.transformer import TransformerPlan

JOINT = ("txt", "img")
ROPE = Split("pe", dim=2, segments=JOINT)
# Block arguments passed on unchanged: the streams (cut once, local ever after) and the modulation
# vector. Not ``attn_mask`` and ``modulation_dims*``: absolute token ranges (0.33's
# timestep_zero_index) that a chunk cannot follow, refused when they come with a value.
FLUX_BLOCK_ARGS = frozenset({"img", "txt", "x", "vec"})
# Block Cache: double blocks return (img, txt); single blocks the joint [txt, img] stream.
FLUX_CACHED_BLOCKS = (CachedBlocks("double_blocks.*", outputs=("img", "txt"), streams=("img", "txt")),
                      CachedBlocks("single_blocks.*", streams=(JOINT,)))


def _flux_style_plan(unsupported: dict[str, str]) -> ContextParallelPlan:
    return ContextParallelPlan(
        inputs={
            "double_blocks.0": (Split("txt", dim=1, stream="txt", starts_stream=True),
                                Split("img", dim=1, stream="img", starts_stream=True)),
            "double_blocks.*": (ROPE,),
            "single_blocks.*": (ROPE,),
        },
        outputs={"final_layer": Gather(dim=1, stream="img")},
        attention={"double_blocks.*": JOINT, "single_blocks.*": JOINT},
        call_inputs=(Split("control", dim=1, stream="img", prefix=True),),
        unsupported=unsupported,
        passed=FLUX_BLOCK_ARGS,
    )


def _gated(parent) -> bool:
    """Flux.2's SwiGLU MLP: the first projection holds gate | up."""
    return type(parent[1]).__name__ == "SiLUActivation" if hasattr(parent, "__getitem__") else False


def _single_in(block, linear) -> list[int]:
    """linear1 = q | k | v | mlp_in (mlp_in = gate | up for Flux.2)."""
    h, m = block.hidden_size, block.mlp_hidden_dim
    return [h, h, h] + ([m, m] if block.mlp_hidden_dim_first == 2 * m else [m])


def flux_blocks_tensor_parallel(modulation: bool, final_modulation: bool, embeddings: bool = True,
                                extra: dict | None = None, divisible: dict | None = None,
                                embedders: tuple[str, ...] = ("time_in", "guidance_in", "vector_in"),
                                extra_divide: dict | None = None, extra_optional: frozenset = frozenset(),
                                ) -> TensorParallelPlan:
    """Heads and MLPs of the double- and single-stream blocks split across TP ranks: fused
    projections by segment (qkv; q|k|v|mlp_in; proj|mlp_out; gate|up), output projections
    row-parallel, modulation column-parallel with gathered output."""
    layers, optional = {}, set()
    for stream in ("img", "txt"):
        layers[f"double_blocks.*.{stream}_attn.qkv"] = Colwise(segments=3)
        layers[f"double_blocks.*.{stream}_attn.proj"] = Rowwise()
        layers[f"double_blocks.*.{stream}_mlp.0"] = Colwise(segments=lambda seq, lin: 2 if _gated(seq) else 1)
        layers[f"double_blocks.*.{stream}_mlp.2"] = Rowwise()
        if modulation:
            layers[f"double_blocks.*.{stream}_mod.lin"] = Colwise(gather=True)
            optional.add(f"double_blocks.*.{stream}_mod.lin")  # Flux.2 modulates once per model instead
    layers["single_blocks.*.linear1"] = Colwise(segments=_single_in)
    layers["single_blocks.*.linear2"] = Rowwise(segments=lambda block, lin: [block.hidden_size, block.mlp_hidden_dim])
    if modulation:
        layers["single_blocks.*.modulation.lin"] = Colwise(gather=True)
        global_mod = ("double_stream_modulation_img.lin", "double_stream_modulation_txt.lin",
                      "single_stream_modulation.lin")
        layers.update({name: Colwise(gather=True) for name in global_mod})
        optional.update(("single_blocks.*.modulation.lin", *global_mod))
    if final_modulation:
        layers["final_layer.adaLN_modulation.1"] = Colwise(gather=True)
    # Input embeddings: the projections into the residual width, gathered; the timestep,
    # guidance and pooled-text MLPs as column/row pairs (guidance and pooled text exist
    # only in some variants).
    if embeddings:
        layers.update({"img_in": Colwise(gather=True), "txt_in": Colwise(gather=True)})
    for embedder in embedders:
        layers[f"{embedder}.in_layer"] = Colwise()
        layers[f"{embedder}.out_layer"] = Rowwise()
        if embedder != "time_in":
            optional.update((f"{embedder}.in_layer", f"{embedder}.out_layer"))
    layers.update(extra or {})
    return TensorParallelPlan(
        layers=layers,
        divide={"double_blocks.*": ("num_heads",),
                "single_blocks.*": ("num_heads", "hidden_size", "mlp_hidden_dim", "mlp_hidden_dim_first"),
                **(extra_divide or {})},
        divisible={"MLP width": "single_blocks.0.mlp_hidden_dim", **(divisible or {})},
        optional=frozenset(optional) | extra_optional)


MASK_WHY = "the style-model attention mask covers the joint sequence; run without the mask option"

FLUX = TransformerPlan(
    family="flux",
    title="Flux.1 / Flux.2",
    classes=("comfy.ldm.flux.model.Flux",),
    heads_attr="num_heads",
    context_parallel=_flux_style_plan({"attention_mask": MASK_WHY}),
    notes="dev, schnell, Kontext and Flux.2 reference images, ControlNet residuals.",
    tensor_parallel=flux_blocks_tensor_parallel(modulation=True, final_modulation=True),
    cached_blocks=FLUX_CACHED_BLOCKS,
)

# Chroma's blocks carry no modulation layers: one "distilled guidance" MLP stack (the
# Approximator, residual MLPEmbedders) computes every block's modulation from the timestep.
# Its MLPs are column/row pairs; its input and output projections stay whole.
CHROMA_APPROXIMATOR = {"distilled_guidance_layer.layers.*.in_layer": Colwise(),
                       "distilled_guidance_layer.layers.*.out_layer": Rowwise()}

CHROMA = TransformerPlan(
    family="chroma",
    title="Chroma",
    classes=("comfy.ldm.chroma.model.Chroma",),
    heads_attr="num_heads",
    context_parallel=_flux_style_plan({"attention_mask": MASK_WHY}),
    notes="ControlNet residuals; under TP the distilled-guidance MLPs are cut too.",
    tensor_parallel=flux_blocks_tensor_parallel(modulation=False, final_modulation=False, embedders=(),
                                                extra=CHROMA_APPROXIMATOR),
    cached_blocks=FLUX_CACHED_BLOCKS,
)

CONTROLNET = TransformerPlan(
    family="flux_controlnet",
    title="Flux ControlNet",
    classes=("comfy.ldm.flux.controlnet.ControlNetFlux",),
    heads_attr="params.num_heads",
    context_parallel=ContextParallelPlan(
        inputs=_flux_style_plan({}).inputs,
        outputs={"controlnet_blocks.*": Gather(dim=1, stream="img"),
                 "controlnet_single_blocks.*": Gather(dim=1, stream="img")},
        attention={"double_blocks.*": JOINT, "single_blocks.*": JOINT},
        passed=FLUX_BLOCK_ARGS,
        attention_globals=(AttentionGlobal("comfy.ldm.flux.math"),),
    ),
    notes="Run under the transformer's layout; whole on every rank of a TP group.",
)
