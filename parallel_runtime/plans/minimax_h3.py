"""MiniMax-H3 (``comfy.ldm.minimax.model.MiniMaxH3Model``, ComfyUI 0.33 on): video with audio as
one packed single-stream sequence.

- The model packs ``[text | keyframe / reference rows | audio | video]`` itself (``PackedLayout``,
  not a module) into one ``[S, hidden]`` sequence without a batch dimension and hands it to
  ``blocks``: that whole packed sequence is the stream ``x``, cut along dim 0 where it enters
  ``blocks.0``, so each rank holds one contiguous chunk of it (equal token counts; every token
  costs the same in a single-stream block). Attention in ``blocks.*.attn`` is one joint
  self-attention over all of it, context-parallel; it has no mask, so the streams' order inside
  the chunks does not matter.
- Two side inputs of the blocks depend on absolute positions in the packed sequence, and each rank
  gets its part of them: the RoPE table (``rope_freqs``, ``[1, S, 1, ...]``, tokens on dim 1,
  every segment's own positions) is cut like the stream; ``mod_segments``, the table of
  ``(start, stop, row)`` spans that gives text, audio and video their own modulation rows (a
  per-token row index under a denoise mask), is cut as spans (``Split.spans``): the parts inside
  the rank's chunk, at local positions, per-token indices cut alike.
- ``t_emb`` is one row per distinct timestep, not per token: passed.
- The stream is gathered at the last block: ``final_layer`` takes the video and audio rows out of
  the whole sequence by absolute ``video_seg`` / ``audio_seg`` and runs whole on every rank
  (a norm and two narrow linears).
- The token refiner (text only, no RoPE) runs where ComfyUI runs it: once per sampling in
  ``extra_conds``, on ComfyUI's own model; a forward given unrefined text runs it whole on every
  rank. Keyframes, references, presentation tags and denoise masks only change the packed
  layout, the table and the per-token rows, all cut above: nothing is refused (denoise masks are
  tested; keyframe and reference rows, which need the 32B text encoder's nodes, are not yet).
- Block Cache caches ``blocks`` (each returns the packed stream, tokens on dim 0); the token
  refiner is not among them.
- The layout (``minimax_payload["layout"]``, a ``PackedLayout`` built by ``extra_conds``) reaches
  the workers as one of ComfyUI's data objects (``world/protocol.py``).

Tensor parallelism cuts the heads of every attention, DiT and refiner (the fused ``qkv_proj`` as
three segments, ``out_proj`` rows; the q/k norms are per head and need nothing, the RoPE table is
the same for every head), the SwiGLU ``fc1`` (gate | up segments) and ``fc2`` rows, each block's
6 x 3 modulation projection (``adaln_proj``, about 40 % of a block) and the final layer's
column-parallel, gathered, and the time embedder as a column/row pair.
"""
from __future__ import annotations

from .vocabulary.context_parallel import CachedBlocks, ContextParallelPlan, Gather, Split
from .vocabulary.tensor_parallel import Colwise, Rowwise, TensorParallelPlan
from .vocabulary.transformer import TransformerPlan

STACKS = ("blocks.*", "token_refiner.blocks.*")


def _block_tp(blocks: str) -> dict:
    return {f"{blocks}.attn.qkv_proj": Colwise(segments=3), f"{blocks}.attn.out_proj": Rowwise(),
            f"{blocks}.mlp.fc1": Colwise(segments=2), f"{blocks}.mlp.fc2": Rowwise()}


# Checkpoints with a precomputed time-embedding curve (``adaln_t_table``) have no time embedder.
TIME_EMBEDDER = {"time_embedder.proj_in": Colwise(), "time_embedder.proj_out": Rowwise()}

TENSOR_PARALLEL = TensorParallelPlan(
    layers={k: v for blocks in STACKS for k, v in _block_tp(blocks).items()} | TIME_EMBEDDER
    | {"blocks.*.adaln_proj.linear": Colwise(gather=True), "final_layer.adaln_proj.linear": Colwise(gather=True)},
    divide={f"{blocks}.attn": ("heads",) for blocks in STACKS},
    divisible={"heads": "blocks.0.attn.heads", "feed-forward width": "blocks.0.mlp.fc2.in_features"},
    optional=frozenset(TIME_EMBEDDER),
)

PLAN = TransformerPlan(
    family="minimax_h3",
    title="MiniMax-H3",
    classes=("comfy.ldm.minimax.model.MiniMaxH3Model",),
    heads_attr="blocks.0.attn.heads",
    context_parallel=ContextParallelPlan(
        inputs={
            "blocks.0": (Split("x", dim=0, starts_stream=True),),
            "blocks.*": (Split("rope_freqs", dim=1), Split("mod_segments", spans=True)),
        },
        outputs={"blocks.-1": Gather(dim=0)},
        attention={"blocks.*.attn": ("x",)},
        # The stream once cut (later blocks, the attention), its cut RoPE table (the attention),
        # the per-timestep embedding.
        passed=frozenset({"x", "t_emb", "rope_freqs"}),
    ),
    notes="Video with audio (t2va), denoise masks on either stream; keyframe and reference rows follow the "
          "same cuts (not yet tested).",
    tensor_parallel=TENSOR_PARALLEL,
    cached_blocks=(CachedBlocks("blocks.*", dim=0),),
)
