"""T5 / UMT5 (``comfy.text_encoders.t5.T5``: T5-XXL of Flux.1 and SD3, UMT5-XXL of
Wan, T5-base): q/k/v column-parallel, o row-parallel; the relative position bias
table is cut by head like the attention itself; the (gated) FFN column/row.
"""
from __future__ import annotations

from ..vocabulary.tensor_parallel import Colwise, Rowwise, TensorParallelPlan
from ..vocabulary.text_encoder import TextEncoderPlan

_T5_ATTENTION = "encoder.block.*.layer.0.SelfAttention"
_T5_FF = "encoder.block.*.layer.1.DenseReluDense"

T5 = TextEncoderPlan(
    family="t5",
    title="T5 / UMT5",
    classes=("comfy.text_encoders.t5.T5",),
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
