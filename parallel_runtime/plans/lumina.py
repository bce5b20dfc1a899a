"""Lumina2 and Z-Image (``NextDiT``).

The caption and image tokens are refined separately (``context_refiner``,
``noise_refiner``: short stacks over one kind of token each), then joined as
``[caption, image]`` for the main ``layers``. The joined sequence is one stream,
cut where it enters ``layers.0`` together with its RoPE table ``freqs_cis``
(tokens on dim 1); the refiners stay whole on every rank (a few layers of
redundant work, no communication). ``final_layer`` is per token and gathered
before unpatchify, which slices the image back out.

Block Cache caches the main ``layers`` (each returns the joint stream); the refiners run at
every step. The ``double_block`` patches (Z-Image Fun ControlNets) run after every layer, cached
or not, like ControlNet residuals between blocks.

Tensor parallelism cuts the heads of every block (refiners included): the fused qkv
projection by segment (q heads, then K and V heads of grouped-query attention; each rank
keeps the KV heads its query heads use, so the KV heads must divide by tp_size too), the
SwiGLU feed-forward as w1 / w3 columns and w2 rows, the per-block modulation column-parallel
with its output gathered. The q/k norms are per head and need nothing.
"""
from __future__ import annotations

from .vocabulary.context_parallel import CachedBlocks, ContextParallelPlan, Gather, PatchSite, Split
from .vocabulary.tensor_parallel import Colwise, Rowwise, TensorParallelPlan
from .vocabulary.transformer import TransformerPlan


def _qkv_segments(attention, linear) -> list[int]:
    q, kv = attention.n_local_heads * attention.head_dim, attention.n_local_kv_heads * attention.head_dim
    return [q, kv, kv]


def _block_tp(blocks: str) -> dict:
    return {f"{blocks}.attention.qkv": Colwise(segments=_qkv_segments), f"{blocks}.attention.out": Rowwise(),
            f"{blocks}.feed_forward.w1": Colwise(), f"{blocks}.feed_forward.w3": Colwise(),
            f"{blocks}.feed_forward.w2": Rowwise(),
            # Lumina2: (SiLU, Linear); Z-Image: (Linear,). The caption refiner has none.
            f"{blocks}.adaLN_modulation.-1": Colwise(gather=True)}


STACKS = ("layers.*", "noise_refiner.*", "context_refiner.*", "siglip_refiner.*")
TENSOR_PARALLEL = TensorParallelPlan(
    layers={k: v for blocks in STACKS for k, v in _block_tp(blocks).items()}
    | {"final_layer.adaLN_modulation.-1": Colwise(gather=True)},
    divide={f"{blocks}.attention": ("n_local_heads", "n_local_kv_heads") for blocks in STACKS},
    divisible={"heads": "n_heads", "KV heads": "layers.0.attention.n_local_kv_heads",
               "feed-forward width": "layers.0.feed_forward.w1.out_features"},
    # Only Z-Image Omni has SigLIP refiners; the caption refiner has no modulation.
    optional=frozenset({k for k in _block_tp("siglip_refiner.*")} | {"context_refiner.*.adaLN_modulation.-1"}),
)

def _caption_length(kwargs: dict, total: int) -> int:
    """Where ``_forward`` cuts the joint stream for its ``double_block`` patches: after the caption,
    whose length is what the whole image part (``img_input``, never cut) leaves of the stream."""
    return total - kwargs["img_input"].shape[1]


# Model patches (Z-Image Fun ControlNets): after each main layer ``_forward`` hands them the joint
# stream cut at the caption length into ``txt`` and ``img``; the noise refiner's run before the cut.
PATCH_SITES = {"double_block": PatchSite(joint=("txt", "img"), joint_stream="x", joint_at=_caption_length),
               "noise_refiner": PatchSite(before_split=True)}

PLAN = TransformerPlan(
    family="lumina2",
    title="Lumina2 / Z-Image",
    classes=("comfy.ldm.lumina.model.NextDiT",),
    heads_attr="n_heads",
    context_parallel=ContextParallelPlan(
        inputs={
            "layers.0": (Split("x", dim=1, starts_stream=True),),
            "layers.*": (Split("freqs_cis", dim=1),),
        },
        outputs={"final_layer": Gather(dim=1)},
        attention={"layers.*": ("x",)},
        # Not 0.33's timestep_zero_index (Z-Image Omni): absolute token ranges, refused when given.
        passed=frozenset({"x", "x_mask", "adaln_input", "c"}),
        patch_sites=PATCH_SITES,
    ),
    notes=("Refiners run whole on every rank under context parallelism and are cut under TP; grouped-query "
           "KV heads must divide by tp_size. Not Z-Image Omni (0.33's timestep_zero_index: refused)."),
    tensor_parallel=TENSOR_PARALLEL,
    cached_blocks=(CachedBlocks("layers.*"),),
)
