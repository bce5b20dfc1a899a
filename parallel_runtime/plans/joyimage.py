"""JoyImage (``comfy.ldm.joyimage.model.JoyImageTransformer3DModel``, ComfyUI 0.33 on): double-stream blocks only.

- The patch embedding (a 3D convolution) and the text projection run whole on every
  rank. Streams ``img`` (``hidden_states``) and ``txt`` (``encoder_hidden_states``) are
  cut where they enter ``double_blocks.0``; every block returns its ``(img, txt)`` chunks.
- Attention is joint over ``[img, txt]`` (image first) in every block's ``attn``; the
  q/k RMSNorm and RoPE (``comfy_kitchen.rms_rope``) are applied before ComfyUI's
  attention call, and the block splits the output with its own (local) image length.
- ``image_rotary_emb`` (3D RoPE, ``[1, N_img, 1, D/2, 2, 2]``, tokens on dim 1) covers
  the image only: cut on dim 1 with it at every block. ``temb`` (the 6-way modulation
  plus each block's learned table) is one row per sample: passed, not cut.
- Reference latents (edit) ride at the end of the ``img`` stream. After the blocks the
  model keeps the first ``t * h * w`` image tokens, an absolute count a chunk cannot
  follow: the image is gathered from the last block's ``(img, txt)`` output, and
  ``norm_out`` / ``proj_out`` (per token, small) run whole on every rank.
- Block Cache: every block returns ``(hidden_states, encoder_hidden_states)``, both streams updated.

Tensor parallelism cuts the heads of every block (the fused img/txt qkv by segment,
the output projections by rows; the q/k RMSNorms are per head and need nothing) and
both GELU feed-forwards (columns, then rows). The timestep MLP and the text projection
are column/row pairs; the shared 6-way modulation projection ``time_proj`` is
column-parallel, gathered. The patch convolution and ``proj_out`` stay whole.
"""
from __future__ import annotations

from .vocabulary.context_parallel import CachedBlocks, ContextParallelPlan, Gather, Split
from .vocabulary.tensor_parallel import Colwise, Rowwise, TensorParallelPlan
from .vocabulary.transformer import TransformerPlan

JOINT = ("img", "txt")
BLOCKS = "double_blocks"

TENSOR_PARALLEL = TensorParallelPlan(
    layers={
        **{f"{BLOCKS}.*.attn.{s}_attn_qkv": Colwise(segments=3) for s in ("img", "txt")},
        **{f"{BLOCKS}.*.attn.{s}_attn_proj": Rowwise() for s in ("img", "txt")},
        **{f"{BLOCKS}.*.{s}_mlp.net.0.proj": Colwise() for s in ("img", "txt")},
        **{f"{BLOCKS}.*.{s}_mlp.net.2": Rowwise() for s in ("img", "txt")},
        "condition_embedder.time_embedder.linear_1": Colwise(),
        "condition_embedder.time_embedder.linear_2": Rowwise(),
        "condition_embedder.time_proj": Colwise(gather=True),
        "condition_embedder.text_embedder.linear_1": Colwise(),
        "condition_embedder.text_embedder.linear_2": Rowwise(),
    },
    divide={f"{BLOCKS}.*.attn": ("num_attention_heads",)},
    divisible={"MLP width": f"{BLOCKS}.0.img_mlp.net.2.in_features",
               "time embedding width": "condition_embedder.time_embedder.linear_1.out_features"},
)

PLAN = TransformerPlan(
    family="joyimage",
    title="JoyImage",
    classes=("comfy.ldm.joyimage.model.JoyImageTransformer3DModel",),
    heads_attr=f"{BLOCKS}.0.attn.num_attention_heads",
    context_parallel=ContextParallelPlan(
        inputs={
            f"{BLOCKS}.0": (Split("hidden_states", dim=1, stream="img", starts_stream=True),
                            Split("encoder_hidden_states", dim=1, stream="txt", starts_stream=True)),
            f"{BLOCKS}.*": (Split("image_rotary_emb", dim=1, stream="img"),),
        },
        # The model drops reference tokens by their absolute count after the blocks: the image is
        # gathered from the last block's (img, txt) and the final layer runs whole on every rank.
        outputs={f"{BLOCKS}.-1": Gather(dim=1, stream="img", item=0)},
        attention={f"{BLOCKS}.*.attn": JOINT},
        # The streams once cut (``img`` / ``txt`` inside attention), the cut RoPE table inside
        # attention, and the per-sample modulation vector.
        passed=frozenset({"hidden_states", "encoder_hidden_states", "temb", "img", "txt", "image_rotary_emb"}),
    ),
    notes="Text-to-image and edit (reference latents).",
    tensor_parallel=TENSOR_PARALLEL,
    cached_blocks=(CachedBlocks(f"{BLOCKS}.*", outputs=("hidden_states", "encoder_hidden_states"),
                                streams=("img", "txt")),),
)
