"""Chroma Radiance (``comfy.ldm.chroma_radiance.model.ChromaRadiance``): Chroma's blocks in pixel
space, with a NeRF head per patch after them.

- The blocks are Chroma's and are cut like Chroma's (plans/flux.py): streams ``txt`` and
  ``img`` (one token per pixel patch, from the ``img_in_patch`` convolution) cut where they
  enter ``double_blocks.0``, ``pe`` cut on dim 2 over ``[txt, img]`` at every block, attention
  joint over ``[txt, img]`` in both block kinds.
- The model has no ``final_layer``: after the last single block it slices the image off the
  joint stream with the *local* text length and hands it to ``forward_nerf`` (a method, not a
  module), which unfolds the *full* padded pixels into patches, reshapes them by the patch count
  of the hidden state it was given, runs the NeRF blocks per patch, folds the patches back into
  the image and runs the final layer (in its conv form a 3x3 convolution across patch borders).
  Neither the pixels nor the fold can follow a token chunk, so the image is gathered at the
  output of ``single_blocks.-1``: the image segment is all-gathered and the text segment kept as
  this rank's chunk, so the model's own slice leaves exactly the full image. The NeRF head then
  runs whole on every rank (a few percent of the compute; nothing after it is cut).
- Block Cache: Chroma's stacks (``FLUX_CACHED_BLOCKS``); the NeRF head runs at every step.
- Refused: ``attention_mask`` (as for Chroma) and ControlNet ``control``: the model adds the
  last single block's residual after that block, where the image is already full length.

Tensor parallelism is Chroma's (heads and MLPs of every block, the distilled-guidance MLPs)
with the text projection and each NeRF block's ``param_generator`` (the large layer of the
head: it generates every patch's MLP weights from its hidden state) column-parallel, gathered.
The patch convolution, the DCT embedder and the final layer stay whole.
"""
from __future__ import annotations

from .flux import (CHROMA_APPROXIMATOR, FLUX_BLOCK_ARGS, FLUX_CACHED_BLOCKS, JOINT, MASK_WHY, ROPE,
                   flux_blocks_tensor_parallel)
from .vocabulary.context_parallel import ContextParallelPlan, Gather, Split
from .vocabulary.tensor_parallel import Colwise
from .vocabulary.transformer import TransformerPlan

CONTROL_WHY = ("the image is gathered at the last single block for the NeRF head, before the model adds that "
               "block's ControlNet residual; run without ControlNet")

PLAN = TransformerPlan(
    family="chroma_radiance",
    title="Chroma Radiance",
    classes=("comfy.ldm.chroma_radiance.model.ChromaRadiance",),
    heads_attr="num_heads",
    context_parallel=ContextParallelPlan(
        inputs={
            "double_blocks.0": (Split("txt", dim=1, stream="txt", starts_stream=True),
                                Split("img", dim=1, stream="img", starts_stream=True)),
            "double_blocks.*": (ROPE,),
            "single_blocks.*": (ROPE,),
        },
        outputs={"single_blocks.-1": Gather(dim=1, segments=JOINT, keep_local=("txt",))},
        attention={"double_blocks.*": JOINT, "single_blocks.*": JOINT},
        unsupported={"attention_mask": MASK_WHY, "control": CONTROL_WHY},
        passed=FLUX_BLOCK_ARGS,
    ),
    notes="Pixel space; the NeRF head runs whole on every rank after the image is gathered. No ControlNet.",
    tensor_parallel=flux_blocks_tensor_parallel(
        modulation=False, final_modulation=False, embeddings=False, embedders=(),
        extra={**CHROMA_APPROXIMATOR, "txt_in": Colwise(gather=True),
               "nerf_blocks.*.param_generator": Colwise(gather=True)},
        divisible={"NeRF head width": "nerf_blocks.0.param_generator.out_features"}),
    cached_blocks=FLUX_CACHED_BLOCKS,
)
