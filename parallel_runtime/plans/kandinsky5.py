"""Kandinsky 5 video and image (``comfy.ldm.kandinsky5.model.Kandinsky5``, ComfyUI 0.33 on).

- The text runs through its own encoder blocks (``text_transformer_blocks``:
  self-attention over the text only) before any visual token exists; they run
  whole on every rank, like Lumina's refiners: a few layers, no communication.
- The patch-embedded video (an image is one frame) is flattened to ``[B, N, C]``
  and enters ``visual_transformer_blocks.0`` as ``visual_embed``: that is the
  token stream ``x``. ``freqs`` (3D RoPE, ``[1, N, 1, D/2, 2, 2]``, tokens on
  dim 1) is cut the same way at every block. ``time_embed`` (timestep plus
  pooled text) modulates with one row per sample: passed, not cut.
- Each block's ``self_attention`` is context-parallel over ``x`` (RoPE and the
  q/k norms are applied before ComfyUI's attention call); ``cross_attention``
  to the whole text stays local.
- After the blocks the model reshapes the tokens back to ``[B, T, H, W, C]``
  (a ``reshape``, not a module), which needs every token: the stream is gathered
  at the last block and ``out_layer`` runs whole on every rank.
- The image-to-video ``time_dim_replace`` overwrites latent frames before
  patching, on every rank alike; the model ignores ``attention_mask``.
- Block Cache caches the visual blocks (each returns ``visual_embed``); the text blocks run
  at every step.

Tensor parallelism cuts the heads of every block (text blocks included): q/k/v
columns, ``out_layer`` rows (the q/k RMSNorms are per head and need nothing); the
GELU feed-forward columns, then rows. The 6-way text, 9-way visual and 2-way final
modulations are column-parallel, gathered; the timestep MLP is a column/row pair and
the text, pooled-text and visual input projections are column-parallel, gathered
(their LayerNorms then see the full width). The narrow final projection stays whole.
"""
from __future__ import annotations

from .vocabulary.context_parallel import CachedBlocks, ContextParallelPlan, Gather, Split
from .vocabulary.tensor_parallel import Colwise, Rowwise, TensorParallelPlan
from .vocabulary.transformer import TransformerPlan

BLOCKS = "visual_transformer_blocks"
TEXT_BLOCKS = "text_transformer_blocks"


def _attention_tp(attn: str) -> dict:
    return {**{f"{attn}.{p}": Colwise() for p in ("to_query", "to_key", "to_value")}, f"{attn}.out_layer": Rowwise()}


def _block_tp(blocks: str, modulation: str, attentions: tuple[str, ...]) -> dict:
    layers = {k: v for attn in attentions for k, v in _attention_tp(f"{blocks}.{attn}").items()}
    return layers | {f"{blocks}.feed_forward.in_layer": Colwise(), f"{blocks}.feed_forward.out_layer": Rowwise(),
                     f"{blocks}.{modulation}.out_layer": Colwise(gather=True)}


TENSOR_PARALLEL = TensorParallelPlan(
    layers=_block_tp(f"{BLOCKS}.*", "visual_modulation", ("self_attention", "cross_attention"))
    | _block_tp(f"{TEXT_BLOCKS}.*", "text_modulation", ("self_attention",))
    | {"time_embeddings.in_layer": Colwise(), "time_embeddings.out_layer": Rowwise(),
       "text_embeddings.in_layer": Colwise(gather=True), "pooled_text_embeddings.in_layer": Colwise(gather=True),
       "visual_embeddings.in_layer": Colwise(gather=True), "out_layer.modulation.out_layer": Colwise(gather=True)},
    divide={f"{BLOCKS}.*.self_attention": ("num_heads",), f"{BLOCKS}.*.cross_attention": ("num_heads",),
            f"{TEXT_BLOCKS}.*.self_attention": ("num_heads",)},
    divisible={"feed-forward width": f"{BLOCKS}.0.feed_forward.in_layer.out_features",
               "time embedding width": "time_embeddings.in_layer.out_features"},
    # A checkpoint without text blocks would still be the same model.
    optional=frozenset(_block_tp(f"{TEXT_BLOCKS}.*", "text_modulation", ("self_attention",))),
)

PLAN = TransformerPlan(
    family="kandinsky5",
    title="Kandinsky 5",
    classes=("comfy.ldm.kandinsky5.model.Kandinsky5",),
    heads_attr=f"{BLOCKS}.0.self_attention.num_heads",
    context_parallel=ContextParallelPlan(
        inputs={
            f"{BLOCKS}.0": (Split("visual_embed", dim=1, starts_stream=True),),  # before the RoPE cut: it starts x
            f"{BLOCKS}.*": (Split("freqs", dim=1),),
        },
        outputs={f"{BLOCKS}.-1": Gather(dim=1)},
        attention={f"{BLOCKS}.*.self_attention": ("x",)},
        # The stream once cut (``x`` inside self-attention), the cut RoPE table, the whole text
        # (cross-attention stays local) and the per-sample modulation vector.
        passed=frozenset({"visual_embed", "x", "freqs", "text_embed", "time_embed"}),
    ),
    notes="Video (T2V, I2V via time_dim_replace) and image models; the text encoder blocks run whole per rank.",
    tensor_parallel=TENSOR_PARALLEL,
    cached_blocks=(CachedBlocks(f"{BLOCKS}.*"),),
)
