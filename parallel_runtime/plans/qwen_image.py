"""Qwen-Image and Qwen-Image-Edit (``QwenImageTransformer2DModel``).

- Streams ``txt`` (``encoder_hidden_states``) and ``img`` (``hidden_states``: the
  image, then Edit reference tokens), cut where they enter ``transformer_blocks.0``;
  blocks return ``(txt, img)`` chunks.
- ``image_rotary_emb`` covers ``[txt, img]`` on dim 2; attention is joint over
  ``[txt, img]`` with RoPE applied before ComfyUI's attention call.
- ``norm_out`` and ``proj_out`` are per token; ``proj_out``'s output is gathered
  before unpatchify, which also drops the reference tokens.
- ControlNet residuals cover the main image (prefix of ``img``).
"""
from __future__ import annotations

from .vocabulary.context_parallel import CachedBlocks, ContextParallelPlan, Gather, PatchSite, Split
from .vocabulary.tensor_parallel import Colwise, Rowwise, TensorParallelPlan
from .vocabulary.transformer import TransformerPlan

JOINT = ("txt", "img")

PLAN = TransformerPlan(
    family="qwen_image",
    title="Qwen-Image / Qwen-Image-Edit",
    classes=("comfy.ldm.qwen_image.model.QwenImageTransformer2DModel",),
    heads_attr="transformer_blocks.0.attn.heads",
    context_parallel=ContextParallelPlan(
        inputs={
            "transformer_blocks.0": (Split("encoder_hidden_states", dim=1, stream="txt", starts_stream=True),
                                     Split("hidden_states", dim=1, stream="img", starts_stream=True)),
            "transformer_blocks.*": (Split("image_rotary_emb", dim=2, segments=JOINT),),
        },
        outputs={"proj_out": Gather(dim=1, stream="img")},
        attention={"transformer_blocks.*": JOINT},
        call_inputs=(Split("control", dim=1, stream="img", prefix=True),),
        # Not 0.33's timestep_zero_index (Qwen-Image-Edit-2511): absolute token ranges, refused when given.
        passed=frozenset({"hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "temb"}),
        # Model patches after each block (DiffSynth / Fun ControlNets) receive both streams.
        patch_sites={"double_block": PatchSite(tokens={"img": "img", "txt": "txt"})},
    ),
    notes="Edit reference images, ControlNet residuals.",
    tensor_parallel=TensorParallelPlan(
        layers={
            **{f"transformer_blocks.*.attn.{p}": Colwise()
               for p in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")},
            "transformer_blocks.*.attn.to_out.0": Rowwise(),
            "transformer_blocks.*.attn.to_add_out": Rowwise(),
            **{f"transformer_blocks.*.{s}_mlp.net.0.proj": Colwise() for s in ("img", "txt")},
            **{f"transformer_blocks.*.{s}_mlp.net.2": Rowwise() for s in ("img", "txt")},
            **{f"transformer_blocks.*.{s}_mod.1": Colwise(gather=True) for s in ("img", "txt")},
            "time_text_embed.timestep_embedder.linear_1": Colwise(),
            "time_text_embed.timestep_embedder.linear_2": Rowwise(),
            "norm_out.linear": Colwise(gather=True),
        },
        divide={"transformer_blocks.*.attn": ("heads",)},
        divisible={"MLP width": "transformer_blocks.0.img_mlp.net.2.in_features"},
    ),
    # Blocks return (encoder_hidden_states, hidden_states): text first.
    cached_blocks=(CachedBlocks("transformer_blocks.*", outputs=("encoder_hidden_states", "hidden_states"),
                                streams=("txt", "img")),),
)
