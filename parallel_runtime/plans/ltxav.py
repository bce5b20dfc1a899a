"""LTX-2 (``comfy.ldm.lightricks.av_model.LTXAVModel``, ComfyUI 0.33 on): LTXV's blocks with a second,
audio token stream beside the video one, and attention between the two.

- Two streams of different lengths: ``v`` (video) and ``a`` (audio). A block takes and returns
  them as the tuple ``(vx, ax)``; both are cut where they enter ``transformer_blocks.0``. Each
  stream's RoPE (``(matrix [B, N, H, ...], split)`` tuples), the RoPE of the audio-video
  attention (``v_cross_pe`` / ``a_cross_pe``) and the audio's per-token modulation follow at
  every block.
- ``attn1`` (video) and ``audio_attn1`` (audio) are self-attention, context-parallel over their
  own stream; ``attn2`` / ``audio_attn2`` attend to the text and stay local. The audio-to-video
  attention takes its queries from the video and its keys and values from the audio, the
  video-to-audio one the other way round: cross-stream sites (queries' streams, keys' streams),
  exact under Ulysses and Ring for any two lengths.
- The video is gathered at the last block (its output modulation is not a module), the audio
  where it enters ``audio_norm_out``.
- A denoise mask (image-to-video, inpainting; ``audio_denoise_mask`` for the audio) gives each
  stream one timestep per token. The audio's arrive as ``[B, N, ...]`` tensors and are cut; the
  video's as ``CompressedTimestep`` objects (one row per frame, or per token for a spatial mask)
  that a token split cannot cut: the plan declares them ``convert``-ed to the per-token tensor
  the block accepts in their place (same additions, bit for bit), then cut.
- Keyframe guides (LTXVAddGuide: ``keyframe_idxs``, ``guide_attention_entries``,
  ``generated_keyframes``) are guide latent frames appended to the video: the model places their
  tokens, drops masked ones and marks keyframe tokens before ``transformer_blocks.0``, where the
  split cuts them with the rest of the video, and drops them again after the video's gather.
- Block Cache: a block takes ``x = (vx, ax)`` and returns both streams updated, element by element
  (``CachedBlocks.outputs`` names the tuple's items).
- Refused by name before any rank works: guide entries below full strength or with their own
  attention mask (the model biases attention between absolute token ranges of the video with a
  ``self_attention_mask``), and the ID-LoRA reference audio (tokens prepended to the audio and cut
  off again by their absolute count).

Tensor parallelism cuts the heads of all six attentions of a block (q/k/v columns, ``to_out``
rows, full-width q/k RMSNorms with an all-reduced mean square, optional per-head gates; every
RoPE table its rank's heads) and both feed-forwards, and the timestep embedders and modulation
projections of both streams and of the audio-video attention as in LTXV.
"""
from __future__ import annotations

from .ltxv import adaln_tp, attention_tp
from .vocabulary.context_parallel import CachedBlocks, ContextParallelPlan, Gather, Split
from .vocabulary.tensor_parallel import Colwise, Rowwise, SliceInput, TensorParallelPlan
from .vocabulary.transformer import TransformerPlan

VIDEO, AUDIO = "v", "a"
SELF_ATTENTION = ("transformer_blocks.*.attn1", "transformer_blocks.*.audio_attn1")
TEXT_ATTENTION = ("transformer_blocks.*.attn2", "transformer_blocks.*.audio_attn2")
AV_ATTENTION = ("transformer_blocks.*.audio_to_video_attn", "transformer_blocks.*.video_to_audio_attn")
ATTENTION = SELF_ATTENTION + TEXT_ATTENTION + AV_ATTENTION
ADALN = ("adaln_single", "prompt_adaln_single", "audio_adaln_single", "audio_prompt_adaln_single",
         "av_ca_video_scale_shift_adaln_single", "av_ca_a2v_gate_adaln_single",
         "av_ca_audio_scale_shift_adaln_single", "av_ca_v2a_gate_adaln_single")
# The prompt modulations exist only in models with cross-attention AdaLN (LTX-2.3).
OPTIONAL_ADALN = ("prompt_adaln_single", "audio_prompt_adaln_single")
FEED_FORWARD = {f"transformer_blocks.*.{ff}.net.0.proj": Colwise() for ff in ("ff", "audio_ff")} \
    | {f"transformer_blocks.*.{ff}.net.2": Rowwise() for ff in ("ff", "audio_ff")}
ROPE_HEADS = (SliceInput("pe", dim=2, item=0), SliceInput("k_pe", dim=2, item=0))

TENSOR_PARALLEL = TensorParallelPlan(
    layers={k: v for attn in ATTENTION for k, v in attention_tp(attn).items()} | FEED_FORWARD
    | {k: v for adaln in ADALN for k, v in adaln_tp(adaln).items()},
    divide={attn: ("heads",) for attn in ATTENTION},
    divisible={"video heads": "transformer_blocks.0.attn1.heads",
               "audio heads": "transformer_blocks.0.audio_attn1.heads",
               "video feed-forward width": "transformer_blocks.0.ff.net.2.in_features",
               "audio feed-forward width": "transformer_blocks.0.audio_ff.net.2.in_features"},
    optional=frozenset({f"{attn}.to_gate_logits" for attn in ATTENTION}
                       | {k for adaln in OPTIONAL_ADALN for k in adaln_tp(adaln)}),
    inputs={attn: ROPE_HEADS for attn in SELF_ATTENTION + AV_ATTENTION},
)


def per_token(value):
    """A ``CompressedTimestep`` (per-frame rows, or one row for every token) as the ``[B, tokens
    or 1, D]`` tensor its ``expand()`` gives. The block's ``get_ada_values`` takes that tensor in
    its place and adds the same table to the same rows, so the values are bit for bit the same."""
    return value.expand() if type(value).__name__ == "CompressedTimestep" else value


# Per-token side inputs of a block: RoPE tuples of each stream and the modulation of each stream
# ([B, 1, ...] broadcast, [B, N, ...] per token: a denoise mask). The video's modulation arrives as
# CompressedTimestep objects: expanded per token, then cut.
VIDEO_TIMESTEPS = ("v_timestep", "v_cross_scale_shift_timestep", "v_cross_gate_timestep")
BLOCK_INPUTS = (
    Split("v_pe", dim=1, item=0, stream=VIDEO), Split("v_cross_pe", dim=1, item=0, stream=VIDEO),
    Split("a_pe", dim=1, item=0, stream=AUDIO), Split("a_cross_pe", dim=1, item=0, stream=AUDIO),
    Split("a_timestep", dim=1, stream=AUDIO), Split("a_cross_scale_shift_timestep", dim=1, stream=AUDIO),
    Split("a_cross_gate_timestep", dim=1, stream=AUDIO),
) + tuple(Split(arg, dim=1, stream=VIDEO, convert=per_token) for arg in VIDEO_TIMESTEPS)

UNSUPPORTED = {
    "guide_attention_entries": "a guide below full strength or with its own attention mask makes the model "
                               "bias attention between absolute token ranges of the video",
    "ref_audio": "reference audio tokens are prepended to the audio and cut off by their absolute count",
}


def guide_attention_biased(entries) -> bool:
    """Whether the model builds a guide self-attention mask from these entries (its own test in
    ``_build_guide_self_attention_mask``); guides at full strength without a mask build none. A mask
    built anyway reaches the blocks as ``self_attention_mask``, which no plan passes: refused there."""
    return any(e["strength"] != 1.0 or e.get("pixel_mask") is not None for e in entries)


PLAN = TransformerPlan(
    family="ltxav",
    title="LTX-2",
    classes=("comfy.ldm.lightricks.av_model.LTXAVModel",),
    heads_attr="transformer_blocks.0.attn1.heads",
    context_parallel=ContextParallelPlan(
        inputs={
            "transformer_blocks.0": (Split("x", dim=1, item=0, stream=VIDEO, starts_stream=True),
                                     Split("x", dim=1, item=1, stream=AUDIO, starts_stream=True)),
            "transformer_blocks.*": BLOCK_INPUTS,
        },
        outputs={"transformer_blocks.-1": Gather(dim=1, stream=VIDEO, item=0),
                 "audio_norm_out": Gather(dim=1, stream=AUDIO)},
        attention={"transformer_blocks.*.attn1": (VIDEO,), "transformer_blocks.*.audio_attn1": (AUDIO,),
                   "transformer_blocks.*.audio_to_video_attn": ((VIDEO,), (AUDIO,)),
                   "transformer_blocks.*.video_to_audio_attn": ((AUDIO,), (VIDEO,))},
        unsupported=UNSUPPORTED,
        unsupported_when={"guide_attention_entries": guide_attention_biased},
        passed=frozenset({"x", "v_context", "a_context", "attention_mask", "v_prompt_timestep",
                          "a_prompt_timestep", "context", "pe", "k_pe", "mask", "input"}),
    ),
    notes="T2V with audio, image-to-video, denoise masks on either stream, keyframe guides at full strength; "
          "not guide attention below full strength or reference audio (refused by name).",
    tensor_parallel=TENSOR_PARALLEL,
    cached_blocks=(CachedBlocks("transformer_blocks.*", outputs=(("x", 0), ("x", 1)), streams=(VIDEO, AUDIO)),),
)
