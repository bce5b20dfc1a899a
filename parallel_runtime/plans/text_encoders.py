"""Text encoders (ComfyUI's own implementations in ``comfy/text_encoders/``): tensor parallel
over every rank of the world.

Text encoding runs once per prompt while every rank would otherwise wait, so the
encoder is sliced over all ranks (N = world size), not over the transformer's tp
dimension: each rank holds 1/N of every attention and MLP layer; the token
embedding table and the norms stay whole (reported apart from the layers). The
hidden states are whole on every rank after each layer (row-parallel outputs are
all-reduced), so the conditioning rank 0 returns to ComfyUI is the full one.

- T5 / UMT5 (``comfy.text_encoders.t5.T5``: T5-XXL of Flux.1 and SD3, UMT5-XXL of
  Wan, T5-base): q/k/v column-parallel, o row-parallel; the relative position bias
  table is cut by head like the attention itself; the (gated) FFN column/row.
- Llama-family decoders (``Llama2_`` inside Mistral 3, Qwen2.5(-VL), Qwen3, Gemma 2/3
  wrappers, Gemma 3 4B Vision and Gemma 3 12B, LTX-2's encoder, from ComfyUI 0.33): q
  column-parallel, k/v by KV head (replicated when there are more ranks than KV heads),
  o row-parallel, gate/up column, down row. The vision towers (Qwen2.5-VL's, Gemma 3's
  SigLIP and its projector) stay whole. LTX-2's ``LTXAVTEModel`` shards only the Gemma
  inside it: its text_embedding_projection runs on rank 0 on the gathered hidden states.
  Gemma 4 (``comfy.text_encoders.gemma4``, LTX-2.3) is not ``Llama2_``-based and is
  not listed.

  From ComfyUI 0.33 (absent classes are only names here: the plan matches the encoder's
  qualified class name, so 0.3.75 never meets them), with the same ``Attention`` / ``MLP``
  modules (q/k/v/o, gate/up/down):
  ``Qwen3_8B`` (FLUX.2 klein 9B; its 4B sibling is ``Qwen3_4B``, already listed);
  ``Qwen3_06B`` (Anima); ``Ministral3_3B`` (ERNIE-Image); Qwen3-VL's
  ``_make_qwen3vl_model.<locals>.Qwen3VL_`` (the class ``comfy.text_encoders.qwen3vl``
  makes per size: Krea 2's Qwen3-VL-4B, also the plain Qwen3-VL, Mage-Flow and Boogu
  CLIPs) and ``joyimage.Qwen3VL8B_JoyImage`` (JoyImage's Qwen3-VL-8B). The Qwen3 family's
  q_norm / k_norm are RMSNorms over head_dim, applied per head: they stay whole and need
  nothing under head sharding (Ministral 3 has none). Qwen3-VL's vision tower and its
  DeepStack mergers stay whole (rank 0 runs them before the sharded forward; the features
  the decoder adds at the image positions reach every rank with the inputs); Qwen3_8B's
  ``lm_head`` (generation only) stays whole too. A config with ``merged_qkv`` /
  ``merged_mlp`` (fused qkv_proj / gate_up_proj, off in every ComfyUI 0.33 loader) is
  refused: the plan's q_proj / gate_proj patterns find nothing.
  Not listed: Ovis25_2B (Ovis-Image), the ACE-Step 1.5 Qwen3 variants
  (``Qwen3_06B_ACE15``, ``Qwen3_*_ACE15_lm``) and MiniMax H3's ``MiniMaxQwen3VL``
  (Qwen3-VL-32B): the same layout, but no family of the support matrix uses them.
"""
from __future__ import annotations

from .base import ContextParallelPlan, ModelPlan
from .tensor_parallel import Colwise, ColwiseKV, Rowwise, TensorParallelPlan

NO_SEQUENCE_SPLIT = ContextParallelPlan(inputs={}, outputs={}, attention={})

_T5_ATTENTION = "encoder.block.*.layer.0.SelfAttention"
_T5_FF = "encoder.block.*.layer.1.DenseReluDense"

T5 = ModelPlan(
    family="t5",
    title="T5 / UMT5",
    classes=("comfy.text_encoders.t5.T5",),
    heads_attr="encoder.block.0.layer.0.SelfAttention.num_heads",
    context_parallel=NO_SEQUENCE_SPLIT,
    kind="encoder",
    notes="T5-XXL (Flux.1, SD3), UMT5-XXL (Wan), T5-base",
    tensor_parallel=TensorParallelPlan(
        layers={
            **{f"{_T5_ATTENTION}.{p}": Colwise() for p in ("q", "k", "v")},
            f"{_T5_ATTENTION}.o": Rowwise(),
            # [buckets, heads]: one column per head.
            f"{_T5_ATTENTION}.relative_attention_bias": Colwise(dim=1),
            f"{_T5_FF}.wi": Colwise(), f"{_T5_FF}.wi_0": Colwise(), f"{_T5_FF}.wi_1": Colwise(),
            f"{_T5_FF}.wo": Rowwise(),
        },
        divide={_T5_ATTENTION: ("num_heads",)},
        divisible={"feed-forward width": "encoder.block.0.layer.1.DenseReluDense.wo.in_features"},
        # Gated (T5 v1.1, UMT5) or plain FFN.
        optional=frozenset({f"{_T5_FF}.wi", f"{_T5_FF}.wi_0", f"{_T5_FF}.wi_1"}),
    ),
)

_LLAMA = "model.layers.*"

LLAMA = ModelPlan(
    family="llama",
    title="Mistral / Qwen / Gemma / Llama decoders",
    # From ComfyUI 0.33 on: Gemma3_4B_Vision, Gemma3_12B (LTX-2), Qwen3_8B (FLUX.2 klein 9B),
    # Qwen3_06B (Anima), Ministral3_3B (ERNIE-Image) and the Qwen3-VL classes (Krea 2, JoyImage).
    classes=tuple(f"comfy.text_encoders.llama.{c}" for c in
                  ("Llama2", "Mistral3Small24B", "Ministral3_3B", "Qwen25_3B", "Qwen25_7BVLI", "Qwen3_06B", "Qwen3_4B",
                   "Qwen3_8B", "Gemma2_2B", "Gemma3_4B", "Gemma3_4B_Vision", "Gemma3_12B"))
    + ("comfy.text_encoders.qwen3vl._make_qwen3vl_model.<locals>.Qwen3VL_",
       "comfy.text_encoders.joyimage.Qwen3VL8B_JoyImage"),
    heads_attr="model.layers.0.self_attn.num_heads",
    context_parallel=NO_SEQUENCE_SPLIT,
    kind="encoder",
    # Short: the README has a size limit (tests/test_docs.py); the docstring says which model uses which class.
    notes="KV heads replicated when ranks outnumber them; vision towers stay whole",
    tensor_parallel=TensorParallelPlan(
        layers={
            f"{_LLAMA}.self_attn.q_proj": Colwise(),
            f"{_LLAMA}.self_attn.k_proj": ColwiseKV(),
            f"{_LLAMA}.self_attn.v_proj": ColwiseKV(),
            f"{_LLAMA}.self_attn.o_proj": Rowwise(),
            f"{_LLAMA}.mlp.gate_proj": Colwise(), f"{_LLAMA}.mlp.up_proj": Colwise(),
            f"{_LLAMA}.mlp.down_proj": Rowwise(),
        },
        divide={f"{_LLAMA}.self_attn": ("num_heads", "num_kv_heads:kv", "inner_size")},
        divisible={"MLP width": "model.layers.0.mlp.down_proj.in_features"},
    ),
)

PLANS = (T5, LLAMA)
