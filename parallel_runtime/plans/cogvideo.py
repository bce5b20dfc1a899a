"""CogVideoX 1.0 / 1.5 (``comfy.ldm.cogvideo.model.CogVideoXTransformer3DModel``, ComfyUI 0.33 on).

- The patch embedding joins the text and the video (adding any learned or sin-cos
  position embedding to the video there) and the model slices them apart again;
  everything before ``blocks.0`` runs whole on every rank. Streams ``txt``
  (``encoder_hidden_states``) and ``img`` (``hidden_states``) are cut where they
  enter ``blocks.0``; every block returns its ``(img, txt)`` chunks.
- Attention is joint over ``[txt, img]`` in every block. The block takes the text
  length from its own (local) text input, so it slices RoPE onto this rank's video
  chunk and splits the attention output back correctly.
- ``image_rotary_emb`` (RoPE variants) is a ``(cos, sin)`` tuple of
  ``[video tokens, head_dim]`` tables: both items are cut on dim 0 with the video.
  ``temb`` is one row per sample (timestep plus the 1.5 I2V ``ofs``): not cut.
- The text is dropped after the blocks; ``norm_final``, ``norm_out`` and
  ``proj_out`` are per video token, and ``proj_out``'s output is gathered before
  unpatchify.
- Block Cache: every block returns ``(hidden_states, encoder_hidden_states)``, both streams updated.

Tensor parallelism cuts the heads (q/k/v columns, ``attn_out`` rows; the q/k LayerNorms
are per head and need nothing) and the feed-forward (columns, then rows) of every block;
both 6-way block modulations and the final 2-way one are column-parallel, gathered. The
timestep (and 1.5 I2V ``ofs``) MLPs are column/row pairs and the text projection is
column-parallel, gathered; the video patch projection (a convolution in 1.0) stays whole.
"""
from __future__ import annotations

from .vocabulary.context_parallel import CachedBlocks, ContextParallelPlan, Gather, Split
from .vocabulary.tensor_parallel import Colwise, Rowwise, TensorParallelPlan
from .vocabulary.transformer import TransformerPlan

JOINT = ("txt", "img")
# (cos, sin), each [video tokens, head_dim]; None where the model adds position embeddings instead.
ROPE = (Split("image_rotary_emb", dim=0, stream="img", item=0),
        Split("image_rotary_emb", dim=0, stream="img", item=1))

OFS = ("ofs_embedding_linear_1", "ofs_embedding_linear_2")  # CogVideoX 1.5 I2V only

TENSOR_PARALLEL = TensorParallelPlan(
    layers={
        **{f"blocks.*.{p}": Colwise() for p in ("q", "k", "v")},
        "blocks.*.attn_out": Rowwise(),
        "blocks.*.ff_proj": Colwise(),
        "blocks.*.ff_out": Rowwise(),
        "blocks.*.norm1.linear": Colwise(gather=True),
        "blocks.*.norm2.linear": Colwise(gather=True),
        "norm_out.linear": Colwise(gather=True),
        "time_embedding_linear_1": Colwise(),
        "time_embedding_linear_2": Rowwise(),
        OFS[0]: Colwise(),
        OFS[1]: Rowwise(),
        "patch_embed.text_proj": Colwise(gather=True),
    },
    divide={"blocks.*": ("num_heads",)},
    divisible={"feed-forward width": "blocks.0.ff_proj.out_features",
               "time embedding width": "time_embedding_linear_1.out_features"},
    optional=frozenset(OFS),
)

PLAN = TransformerPlan(
    family="cogvideox",
    title="CogVideoX",
    classes=("comfy.ldm.cogvideo.model.CogVideoXTransformer3DModel",),
    heads_attr="num_attention_heads",
    context_parallel=ContextParallelPlan(
        inputs={
            "blocks.0": (Split("encoder_hidden_states", dim=1, stream="txt", starts_stream=True),
                         Split("hidden_states", dim=1, stream="img", starts_stream=True)),
            "blocks.*": ROPE,
        },
        outputs={"proj_out": Gather(dim=1, stream="img")},
        attention={"blocks.*": JOINT},
        # The streams once cut and the per-sample modulation vector.
        passed=frozenset({"hidden_states", "encoder_hidden_states", "temb"}),
    ),
    notes="T2V and I2V, 1.0 (RoPE or learned position embeddings) and 1.5 (temporal patches, ofs).",
    tensor_parallel=TENSOR_PARALLEL,
    cached_blocks=(CachedBlocks("blocks.*", outputs=("hidden_states", "encoder_hidden_states"),
                                streams=("img", "txt")),),
)
