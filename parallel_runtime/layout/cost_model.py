"""Predicted time and memory of one step per layout, from the model's shape and the probe.

Pure arithmetic, no torch. A step on one rank is its compute plus its communication (only the
Ring hops overlap compute):

- matmuls: the blocks' multiply-adds as rank 0 counted them in the first block of each stack,
  those on token rows divided by the sequence ranks, those in the layers TP cuts by tp, at the
  matmul rate rank 0 timed at a block's size for this run (the probe's where it did not), plus a
  fixed cost per call;
- attention: ``4 x batch x (tokens / (ring x ulysses)) x tokens x width / tp`` at the probe's rate
  for ComfyUI's attention function, or for the Ring kernel when ring > 1 (Ulysses and Ring cut
  the same work, by heads or by queries); where rank 0 timed one site at the run's own size
  (``auto.attention_site_seconds``), that time instead;
- elementwise work (norms, modulation, activations, residual adds): ``ELEMENTWISE_PASSES``
  passes over the residual stream per block at the probe's memory rate;
- Ulysses: four all-to-alls per attention site (q, k, v, out); Ring: ``ring - 1`` exchanges of
  the key/value chunk per site, each hidden behind the previous block's attention where it is
  shorter (the runtime overlaps them); TP: one all-reduce per row-parallel layer and one small one per
  norm of a split width; the output gather; cfg: the batch gather.

Each collective costs ``latency + bytes / bandwidth`` with the probe's fit for that kind.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import MESH_DIMS
from ..parallel.heads import head_share

# Elementwise passes over the residual stream per block (norm, modulation, gate, residual, the
# activation on the wider MLP state): a model constant, not a measurement.
ELEMENTWISE_PASSES = 24
# Rank 0 prepares, pickles and broadcasts a forward's inputs: a few collective latencies.
DISPATCH_LATENCIES = 4


@dataclass(frozen=True)
class ModelShape:
    """What one forward of a model costs, independent of the layout."""

    tokens: int                   # tokens of the streams that meet in attention (summed)
    batch: int
    hidden: int                   # width of the residual stream
    heads: int
    blocks: int                   # repeated blocks
    attention_sites: int          # context-parallel attention calls per forward
    # Multiply-adds of the block stacks' matmuls in one forward (batch included): on rows that are
    # tokens (cut by the sequence ranks) or per sample (every rank), in layers TP cuts or not.
    token_macs_split: float
    token_macs_whole: float
    sample_macs_split: float
    sample_macs_whole: float
    linear_calls: int             # matmul calls per forward (fixed cost each)
    row_parallel: tuple[int, ...] = ()   # output width of each row-parallel layer (one all-reduce each)
    split_norms: int = 0          # norms over a split width (one small all-reduce each)
    weight_bytes_split: int = 0   # bytes of weights that TP splits
    weight_bytes_whole: int = 0   # bytes of the other weights
    element_bytes: int = 4
    input_bytes: int = 0          # the forward's tensors rank 0 broadcasts
    output_bytes: int = 0         # the output, gathered over the sequence and cfg ranks


@dataclass(frozen=True)
class Prediction:
    sizes: dict[str, int]
    step_s: float
    compute_s: float
    comm_s: float
    memory_bytes: int             # the largest rank's weights plus activations
    comm_bytes: int               # bytes one rank sends per step
    parts: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"sizes": self.sizes, "step_ms": round(self.step_s * 1e3, 3),
                "compute_ms": round(self.compute_s * 1e3, 3), "comm_ms": round(self.comm_s * 1e3, 3),
                "memory_bytes": self.memory_bytes, "comm_bytes": self.comm_bytes,
                "parts_ms": {k: round(v * 1e3, 3) for k, v in self.parts.items()}}


@dataclass(frozen=True)
class Rates:
    """The probe's figures the model uses (the slowest rank's compute: ranks run in lockstep)."""

    matmul_flops_per_s: float
    op_overhead_s: float
    attention_flops_per_s: float       # ComfyUI's attention function (one rank, Ulysses)
    ring_attention_flops_per_s: float  # the Ring steps' kernel
    memory_bytes_per_s: float
    free_memory_bytes: int
    links: dict[str, dict]
    # (ring, ulysses, tp) -> one attention site's seconds at the run's size, where measured
    site_seconds: dict | None = None

    @classmethod
    def from_probe(cls, probe: dict, site_seconds: dict | None = None,
                   matmul_flops_per_s: float | None = None) -> "Rates":
        ranks = probe["ranks"]
        return cls(matmul_flops_per_s=matmul_flops_per_s or min(r["matmul_flops_per_s"] for r in ranks),
                   op_overhead_s=max(r["op_overhead_s"] for r in ranks),
                   attention_flops_per_s=min(r["attention_flops_per_s"] for r in ranks),
                   ring_attention_flops_per_s=min(r["ring_attention_flops_per_s"] for r in ranks),
                   memory_bytes_per_s=min(r["memory_bytes_per_s"] for r in ranks),
                   free_memory_bytes=min(r["free_memory_bytes"] for r in ranks),
                   links=probe["links"], site_seconds=site_seconds)

    def collective(self, kind: str, nbytes: float, count: float = 1.0) -> float:
        link = self.links[kind]
        return count * (link["latency_s"] + nbytes / link["bytes_per_s"]) if count and nbytes >= 0 else 0.0


def ulysses_padding(heads: int, ulysses: int) -> float:
    """Attention work per Ulysses rank against an even split: ``head_share * ulysses / heads`` (1.0
    where Ulysses divides the heads; 4 heads on 3 ranks: 2 each, 1.5)."""
    return head_share(heads, ulysses) * ulysses / heads if heads > 0 else 1.0


def predict(shape: ModelShape, sizes: dict[str, int], rates: Rates) -> Prediction:
    cfg, ring, ulysses, tp = (sizes.get(d, 1) for d in MESH_DIMS)
    groups = cfg if shape.batch % cfg == 0 else 1  # a batch that does not divide: every group runs it whole
    batch = shape.batch // groups
    sp = ring * ulysses
    local_tokens = math.ceil(shape.tokens / sp)
    rows = batch * local_tokens
    e = shape.element_bytes

    macs = (shape.token_macs_split / tp + shape.token_macs_whole) / (groups * sp) + \
        (shape.sample_macs_split / tp + shape.sample_macs_whole) / groups
    matmul = 2.0 * macs / rates.matmul_flops_per_s + shape.linear_calls * rates.op_overhead_s
    # Ulysses: every token's queries for 1/ulysses of the heads; Ring: 1/ring of the queries, all heads.
    # A Ulysses size that does not divide the heads pads them: every rank attends the largest share.
    padding = ulysses_padding(shape.heads // tp if shape.heads >= tp else 1, ulysses)
    attention_flops = shape.attention_sites * 4.0 * batch * local_tokens * shape.tokens * shape.hidden / tp * padding
    measured_site = (rates.site_seconds or {}).get((ring, ulysses, tp))
    if measured_site is not None:
        attention = shape.attention_sites * measured_site / groups
    else:
        attention = attention_flops / (rates.ring_attention_flops_per_s if ring > 1 else rates.attention_flops_per_s)
    elementwise = shape.blocks * ELEMENTWISE_PASSES * rows * shape.hidden * e / rates.memory_bytes_per_s

    stream_bytes = rows * shape.hidden / tp * e * padding  # one rank's q, k, v or out at an attention site
    parts = {"matmul": matmul, "attention": attention, "elementwise": elementwise}
    sent = 0.0
    if ulysses > 1:
        parts["ulysses"] = rates.collective("all_to_all", stream_bytes, 4 * shape.attention_sites)
        sent += 4 * shape.attention_sites * stream_bytes * (ulysses - 1) / ulysses
    if ring > 1:  # each hop travels while the previous block is attended: only the excess shows
        hop = rates.collective("send_recv", 2 * stream_bytes)
        parts["ring"] = (ring - 1) * shape.attention_sites * max(0.0, hop - attention / shape.attention_sites / ring)
        sent += 2 * stream_bytes * (ring - 1) * shape.attention_sites
    if tp > 1:
        reduce_bytes = sum(rows * width * e for width in shape.row_parallel)
        parts["tp"] = sum(rates.collective("all_reduce", rows * width * e) for width in shape.row_parallel) + \
            rates.collective("all_reduce", rows * 4, shape.split_norms)
        sent += 2 * reduce_bytes * (tp - 1) / tp
    if sp > 1 or groups > 1:  # gathering the output: an all-gather, about half an all-reduce of the whole
        gathered = shape.output_bytes * (1 - 1 / (sp * groups))
        parts["gather"] = rates.collective("all_reduce", gathered / 2)
        sent += gathered / (sp * groups)
    parts["dispatch"] = rates.collective("all_reduce", shape.input_bytes) + \
        DISPATCH_LATENCIES * rates.links["all_reduce"]["latency_s"]
    compute = matmul + attention + elementwise
    comm = sum(v for k, v in parts.items() if k not in ("matmul", "attention", "elementwise"))
    weights = shape.weight_bytes_split / tp + shape.weight_bytes_whole
    # Live activations: the residual stream, q, k, v and a block's wider MLP state (a rough bound).
    activations = 10 * rows * shape.hidden * e
    return Prediction(sizes={d: s for d, s in zip(MESH_DIMS, (cfg, ring, ulysses, tp))}, step_s=compute + comm,
                      compute_s=compute, comm_s=comm, memory_bytes=int(weights + activations),
                      comm_bytes=int(sent), parts=parts)


def layouts(world_size: int) -> list[dict[str, int]]:
    """Every cfg x ring x ulysses x tp whose product is the world size."""
    out = []
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    for cfg in divisors:
        for ring in divisors:
            for ulysses in divisors:
                rest = world_size // (cfg * ring * ulysses) if world_size % (cfg * ring * ulysses) == 0 else 0
                if rest and cfg * ring * ulysses * rest == world_size:
                    out.append({"cfg": cfg, "ring": ring, "ulysses": ulysses, "tp": rest})
    return out
