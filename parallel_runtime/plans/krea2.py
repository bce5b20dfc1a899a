"""Krea 2 (``comfy.ldm.krea2.model.SingleStreamDiT``, ComfyUI 0.33 on): one token stream.

- The text fusion transformer (``txtfusion``: attention over the 12 encoder layers
  of each text token, then over the text) and ``txtmlp`` run whole on every rank,
  like Lumina's refiners: a few narrow layers, no communication.
- The model joins ``[text, image (+ reference tokens)]`` itself (``torch.cat``, not
  a module) and hands the joint sequence to ``blocks``: that is the stream ``x``,
  cut where it enters ``blocks.0``; ``freqs`` (RoPE, ``[B, 1, L, D/2, 2, 2]``,
  tokens on dim 2) is cut the same way at every block.
- ``vec`` (the 6-way modulation) is one row per sample, not per token: passed.
- Attention in ``blocks.*.attn`` is context-parallel over ``x``; RoPE and the
  grouped-query K/V repeat happen before ComfyUI's attention call. The text
  fusion's attention stays local.
- ``last`` is per token (its modulation one row per sample); its output,
  ``patch**2 * channels`` wide, is gathered, and the model slices the image out of
  the full sequence with the full text length.
- Block Cache caches ``blocks`` (each returns the joint stream); the text fusion runs at every step.
- Not ``timestep_zero_index`` (reference method ``index_timestep_zero``: an absolute
  token position where the modulation switches): no chunk can follow it, so the
  blocks refuse it when it comes with a value.

Tensor parallelism cuts the heads of every block (text fusion included): q, the
per-head sigmoid gate columns, K/V by KV head (grouped-query: ranks beyond the KV
heads share one), ``wo`` rows; SwiGLU gate/up columns and down rows. The q/k norms
are per head and need nothing. The timestep and text MLPs are column/row pairs; the
shared 6-way modulation projection ``tproj`` is column-parallel, gathered.
"""
from __future__ import annotations

from .vocabulary.context_parallel import CachedBlocks, ContextParallelPlan, Gather, Split
from .vocabulary.tensor_parallel import Colwise, ColwiseKV, Rowwise, TensorParallelPlan
from .vocabulary.transformer import TransformerPlan

STACKS = ("blocks.*", "txtfusion.layerwise_blocks.*", "txtfusion.refiner_blocks.*")
KV = ColwiseKV(heads="heads", kv_heads="kvheads", head_dim="headdim")


def _block_tp(blocks: str) -> dict:
    return {f"{blocks}.attn.wq": Colwise(), f"{blocks}.attn.wk": KV, f"{blocks}.attn.wv": KV,
            f"{blocks}.attn.gate": Colwise(), f"{blocks}.attn.wo": Rowwise(),
            f"{blocks}.mlp.gate": Colwise(), f"{blocks}.mlp.up": Colwise(), f"{blocks}.mlp.down": Rowwise()}


TENSOR_PARALLEL = TensorParallelPlan(
    layers={k: v for blocks in STACKS for k, v in _block_tp(blocks).items()}
    | {"tmlp.0": Colwise(), "tmlp.2": Rowwise(), "txtmlp.1": Colwise(), "txtmlp.3": Rowwise(),
       "tproj.1": Colwise(gather=True)},
    divide={f"{blocks}.attn": ("heads", "kvheads:kv") for blocks in STACKS},
    divisible={"KV heads": "blocks.0.attn.kvheads", "MLP width": "blocks.0.mlp.down.in_features",
               "text heads": "txtfusion.refiner_blocks.0.attn.heads",
               "text KV heads": "txtfusion.refiner_blocks.0.attn.kvheads",
               "text MLP width": "txtfusion.refiner_blocks.0.mlp.down.in_features"},
)

PLAN = TransformerPlan(
    family="krea2",
    title="Krea 2",
    classes=("comfy.ldm.krea2.model.SingleStreamDiT",),
    heads_attr="heads",
    context_parallel=ContextParallelPlan(
        inputs={
            "blocks.0": (Split("x", dim=1, starts_stream=True),),
            "blocks.*": (Split("freqs", dim=2),),
        },
        outputs={"last": Gather(dim=1)},
        attention={"blocks.*.attn": ("x",)},
        # The stream once cut, the cut RoPE table, the per-sample modulation (blocks' ``vec``,
        # ``last``'s ``tvec``). Not ``mask`` nor ``timestep_zero_index``: refused when given.
        passed=frozenset({"x", "vec", "freqs", "tvec"}),
    ),
    notes=("Reference latents (methods other than index_timestep_zero, which is refused). The text fusion "
           "runs whole on every rank under context parallelism and is cut under TP."),
    tensor_parallel=TENSOR_PARALLEL,
    cached_blocks=(CachedBlocks("blocks.*"),),
)
