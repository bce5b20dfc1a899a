"""HunyuanVideo (``comfy.ldm.hunyuan_video.model.HunyuanVideo``, the class ComfyUI also uses for
HunyuanVideo I2V, HunyuanVideo 1.5 (T2V, I2V, SR distilled) and HunyuanImage 2.1 and its refiner).

- The text first goes through the token refiner (attention over text only): it
  stays whole on every rank. Streams ``img`` and ``txt`` are cut where they enter
  ``double_blocks.0``; ``pe`` covers the joint sequence on dim 2.
- Attention is joint over ``[img, txt]`` in both block kinds up to ComfyUI 0.3.x (its
  blocks carry ``flipped_img_txt``), over ``[txt, img]`` from 0.33 on (RoPE, the joint
  sequence and the final slice too): the plan reads the order off the model's blocks.
- After the single blocks, image first (0.3.x), the model slices the image out with the
  *global* image length, so the joint sequence is gathered at the last single block. Text
  first (0.33), it slices with the *local* text length and the global image length, then
  cuts reference latents off by their absolute length: the image part is gathered at the last
  single block and the text part left local, so the slice yields the whole image and the
  cut is exact (``final_layer``, per token and small, then runs whole on every rank).
- Side inputs join the text stream before ``double_blocks.0``, so the text split covers them:
  the byt5 glyph tokens (``txt_byt5`` through ``byt5_in``: after the text for HunyuanImage 2.1,
  before it for 1.5) and 1.5's vision tokens (``clip_fea`` through ``vision_in``, first), each
  with its ``cond_type_embedding``. RoPE ids are zero over the whole text part. Concatenated
  image latents (I2V, refiner, SR) are channels of ``x``; meanflow's second timestep and the
  guidance are per sample. Under TP ``byt5_in``, ``vision_in`` and ``time_r_in`` are cut too.
- Not yet: ControlNet residuals (added with the global image length inside the
  single-block loop) and the I2V "guiding frame" modulation (absolute token ranges).
- Block Cache: Flux's block classes, so Flux's stacks: the double blocks return ``(img, txt)``,
  the single blocks the joint stream in the release's order.
"""
from __future__ import annotations

import dataclasses

from .flux import FLUX_BLOCK_ARGS, flux_blocks_tensor_parallel
from .vocabulary.context_parallel import CachedBlocks, ContextParallelPlan, Gather, Split
from .vocabulary.tensor_parallel import Colwise, Rowwise
from .vocabulary.transformer import TransformerPlan



REFINER_BLOCKS = "txt_in.individual_token_refiner.blocks.*"
# The text token refiner (``txt_in``: a few attention blocks over the text before the main ones):
# qkv by segment (q | k | v, then heads), projection and MLP as column/row pairs, its modulation
# gathered; its timestep and pooled-text MLPs as pairs. Optional: variants without it.
TOKEN_REFINER = {f"{REFINER_BLOCKS}.self_attn.qkv": Colwise(segments=3), f"{REFINER_BLOCKS}.self_attn.proj": Rowwise(),
                 f"{REFINER_BLOCKS}.mlp.0": Colwise(), f"{REFINER_BLOCKS}.mlp.2": Rowwise(),
                 f"{REFINER_BLOCKS}.adaLN_modulation.-1": Colwise(gather=True),
                 **{f"txt_in.{e}.{layer}": spec for e in ("t_embedder", "c_embedder")
                    for layer, spec in (("in_layer", Colwise()), ("out_layer", Rowwise()))}}
# The side inputs' projections into the residual width, as column/row pairs (the last one of
# ByT5Mapper, after a second activation, gathered): HunyuanImage 2.1 / 1.5's byt5 glyph mapper
# (1472 -> 2048 -> 2048 -> hidden), 1.5's vision projection (MLPProj: norm, linear, GELU, linear,
# norm) and meanflow's second timestep MLP. Optional: only some variants have them.
SIDE_INPUTS = {"byt5_in.fc1": Colwise(), "byt5_in.fc2": Rowwise(), "byt5_in.fc3": Colwise(gather=True),
               "vision_in.proj.1": Colwise(), "vision_in.proj.3": Rowwise(),
               "time_r_in.in_layer": Colwise(), "time_r_in.out_layer": Rowwise()}


def _plan(joint: tuple[str, str], gather: dict, unsupported: dict) -> TransformerPlan:
    rope = Split("pe", dim=2, segments=joint)
    return TransformerPlan(
        family="hunyuan_video",
        title="HunyuanVideo",
        classes=("comfy.ldm.hunyuan_video.model.HunyuanVideo",),
        heads_attr="num_heads",
        context_parallel=ContextParallelPlan(
            inputs={
                "double_blocks.0": (Split("img", dim=1, stream="img", starts_stream=True),
                                    Split("txt", dim=1, stream="txt", starts_stream=True)),
                "double_blocks.*": (rope,),
                "single_blocks.*": (rope,),
            },
            outputs=gather,
            attention={"double_blocks.*": joint, "single_blocks.*": joint},
            unsupported={
                "control": "ControlNet residuals are added with the global image length inside the single blocks",
                "guiding_frame_index": "the I2V guiding-frame modulation addresses absolute token ranges",
                **unsupported,
            },
            passed=FLUX_BLOCK_ARGS,
        ),
        notes="HunyuanVideo T2V, HunyuanVideo 1.5 (byt5, vision tokens, SR), HunyuanImage 2.1 (byt5 glyph "
              "tokens, refiner), reference latents; not ControlNet or the I2V guiding frame.",
        # Flux's block classes: the same tensor-parallel layout; the patch embedding (a convolution)
        # stays whole. The text token refiner's blocks are cut like them.
        tensor_parallel=flux_blocks_tensor_parallel(modulation=True, final_modulation=True, embeddings=False,
                                                    extra={**TOKEN_REFINER, **SIDE_INPUTS},
                                                    extra_divide={REFINER_BLOCKS: ("heads",)},
                                                    extra_optional=frozenset(TOKEN_REFINER) | frozenset(SIDE_INPUTS)),
        cached_blocks=(CachedBlocks("double_blocks.*", outputs=("img", "txt"), streams=("img", "txt")),
                       CachedBlocks("single_blocks.*", streams=(joint,))),
    )


# ComfyUI up to 0.3.x: blocks built with flipped_img_txt.
IMAGE_FIRST = _plan(("img", "txt"), {"single_blocks.-1": Gather(dim=1, segments=("img", "txt"))}, {})
# ComfyUI 0.33 on: no flag, text first. The image is gathered at the last single block and the
# text left as this rank's chunk, so that the model's slice (local text length, global image
# length) leaves the whole image, from which it cuts reference latents by their absolute count.
TEXT_FIRST = _plan(("txt", "img"),
                   {"single_blocks.-1": Gather(dim=1, segments=("txt", "img"), keep_local=("txt",))}, {})


def _joint_order(model) -> TransformerPlan:
    flipped = len(model.double_blocks) and getattr(model.double_blocks[0], "flipped_img_txt", False)
    return IMAGE_FIRST if flipped else TEXT_FIRST


PLAN = dataclasses.replace(IMAGE_FIRST, variant=_joint_order)
