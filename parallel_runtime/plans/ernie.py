"""ERNIE-Image (``ErnieImageModel``, ComfyUI 0.33 on).

The image tokens and the projected text tokens are joined as ``[image, text]`` before the
``layers`` and stay one stream: cut where it enters ``layers.0``, with the RoPE table built for
the joint sequence (``rotary_pos_emb``, tokens on dim 1) cut the same way at every layer. The
shared modulation (``adaLN_modulation``, computed once from the timestep) is one row per sample
and passes unchanged. ``final_norm`` and ``final_linear`` are per token; ``final_linear``'s
output is gathered before the model slices the image back out and unpatchifies it.

Its attention calls ``optimized_attention(q, k, v, heads, mask=...)`` without
``transformer_options``, so ComfyUI's ``optimized_attention_override`` never reaches it:
``attention_globals`` names that module global, which the engine replaces for each sharded
forward so that the calls inside ``layers.*`` are distributed all the same. The class's
``forward`` runs no DIFFUSION_MODEL wrappers (it has no ``_forward``); Shard Transformer then
replaces the forward itself (``comfyui_glue/wrappers.py``).

No ``cached_blocks`` (Block Cache refuses the family): sharded, a layer Block Cache skipped makes no
attention call, which the guard of ``attention_globals`` refuses as a layer that bypassed the
distributed attention.

Tensor parallelism cuts the heads of every layer (q, k, v column-parallel, the output projection
row-parallel; the q/k RMSNorms are per head and need nothing), the GELU-gated feed-forward
(gate and up columns, ``linear_fc2`` rows), the timestep embedding, and the shared and final
modulations column-parallel with their outputs gathered.
"""
from __future__ import annotations

from .vocabulary.context_parallel import AttentionGlobal, ContextParallelPlan, Gather, Split
from .vocabulary.tensor_parallel import Colwise, Rowwise, TensorParallelPlan
from .vocabulary.transformer import TransformerPlan

LAYERS = "layers.*"

PLAN = TransformerPlan(
    family="ernie_image",
    title="ERNIE-Image",
    classes=("comfy.ldm.ernie.model.ErnieImageModel",),
    heads_attr="num_heads",
    context_parallel=ContextParallelPlan(
        inputs={
            "layers.0": (Split("x", dim=1, starts_stream=True),),
            LAYERS: (Split("rotary_pos_emb", dim=1),),
        },
        outputs={"final_linear": Gather(dim=1)},
        attention={LAYERS: ("x",)},
        # The stream once cut, the cut RoPE table and the shared modulation (one row per sample).
        # Not attention_mask: ComfyUI passes none; one that arrives with a value is refused.
        passed=frozenset({"x", "rotary_pos_emb", "temb"}),
        attention_globals=(AttentionGlobal("comfy.ldm.ernie.model", "optimized_attention"),),
    ),
    notes="Text-to-image. Its attention takes no transformer_options: attention overrides of other nodes "
          "(SageAttention) do not reach it, sharded or not.",
    tensor_parallel=TensorParallelPlan(
        layers={
            **{f"{LAYERS}.self_attention.{p}": Colwise() for p in ("to_q", "to_k", "to_v")},
            f"{LAYERS}.self_attention.to_out.0": Rowwise(),
            f"{LAYERS}.mlp.gate_proj": Colwise(), f"{LAYERS}.mlp.up_proj": Colwise(),
            f"{LAYERS}.mlp.linear_fc2": Rowwise(),
            "adaLN_modulation.1": Colwise(gather=True),
            "time_embedding.linear_1": Colwise(),
            "time_embedding.linear_2": Rowwise(),
            "final_norm.linear": Colwise(gather=True),
        },
        divide={f"{LAYERS}.self_attention": ("heads",)},
        divisible={"MLP width": "layers.0.mlp.linear_fc2.in_features"},
    ),
)
