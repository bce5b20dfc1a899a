"""HunyuanVideo (``comfy.ldm.hunyuan_video.model.HunyuanVideo``, the class ComfyUI also uses for its
I2V, 1.5 and HunyuanImage 2.1 variants; the T2V model is what the tests cover).

- The text first goes through the token refiner (attention over text only): it
  stays whole on every rank. Streams ``img`` and ``txt`` are cut where they enter
  ``double_blocks.0``; ``pe`` covers ``[img, txt]`` on dim 2.
- Attention is joint over ``[img, txt]`` (image first) in both block kinds.
- After the single blocks the model slices the image out with the *global* image
  length, so the joint sequence is gathered at the last single block.
- Not yet: ControlNet residuals (added with the global image length inside the
  single-block loop) and the I2V "guiding frame" modulation (absolute token ranges).
"""
from __future__ import annotations

from .base import ContextParallelPlan, Gather, ModelPlan, Split
from .flux import flux_blocks_tensor_parallel

JOINT = ("img", "txt")
ROPE = Split("pe", dim=2, segments=JOINT)

PLAN = ModelPlan(
    family="hunyuan_video",
    title="HunyuanVideo",
    classes=("comfy.ldm.hunyuan_video.model.HunyuanVideo",),
    heads_attr="num_heads",
    context_parallel=ContextParallelPlan(
        inputs={
            "double_blocks.0": (Split("img", dim=1, stream="img", starts_stream=True),
                                Split("txt", dim=1, stream="txt", starts_stream=True)),
            "double_blocks.*": (ROPE,),
            "single_blocks.*": (ROPE,),
        },
        outputs={"single_blocks.-1": Gather(dim=1, segments=JOINT)},
        attention={"double_blocks.*": JOINT, "single_blocks.*": JOINT},
        unsupported={
            "control": "ControlNet residuals are added with the global image length inside the single blocks",
            "guiding_frame_index": "the I2V guiding-frame modulation addresses absolute token ranges",
        },
    ),
    notes="HunyuanVideo T2V (reference latents too); not ControlNet or the I2V guiding frame.",
    # Flux's block classes: the same tensor-parallel layout; the patch embedding (a convolution)
    # and the text token refiner stay whole.
    tensor_parallel=flux_blocks_tensor_parallel(modulation=True, final_modulation=True, embeddings=False),
)
