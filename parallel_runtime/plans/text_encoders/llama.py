"""Llama-family decoders (``Llama2_`` inside Mistral 3, Qwen2.5(-VL), Qwen3, Gemma 2/3
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

from ..vocabulary.tensor_parallel import Colwise, ColwiseKV, Rowwise, TensorParallelPlan
from ..vocabulary.text_encoder import TextEncoderPlan

_LLAMA = "model.layers.*"

LLAMA = TextEncoderPlan(
    family="llama",
    title="Mistral / Qwen / Gemma / Llama decoders",
    # From ComfyUI 0.33 on: Gemma3_4B_Vision, Gemma3_12B (LTX-2), Qwen3_8B (FLUX.2 klein 9B),
    # Qwen3_06B (Anima), Ministral3_3B (ERNIE-Image) and the Qwen3-VL classes (Krea 2, JoyImage).
    classes=tuple(f"comfy.text_encoders.llama.{c}" for c in
                  ("Llama2", "Mistral3Small24B", "Ministral3_3B", "Qwen25_3B", "Qwen25_7BVLI", "Qwen3_06B", "Qwen3_4B",
                   "Qwen3_8B", "Gemma2_2B", "Gemma3_4B", "Gemma3_4B_Vision", "Gemma3_12B"))
    + ("comfy.text_encoders.qwen3vl._make_qwen3vl_model.<locals>.Qwen3VL_",
       "comfy.text_encoders.joyimage.Qwen3VL8B_JoyImage"),
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
