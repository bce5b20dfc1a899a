"""Ulysses for any head count: where each attention head sits in the padded head dimension.

Ulysses hands each of its U ranks an equal block of heads. Where U does not divide the H heads,
the heads are padded to ``U * ceil(H / U)`` slots: rank r's block holds ``H // U`` or
``H // U + 1`` real heads (the first ``H % U`` blocks one more), the rest of its block is zero
heads, attended like the others and dropped afterwards. A zero query over zero keys gives a
uniform softmax over zero values, so a padded head is finite and touches no real head: the result
is exact. Every rank's attention costs ``head_share`` heads, the largest share; with more ranks
than heads, a rank may hold padding only (it computes one zero head and waits).

The one rule for "which Ulysses sizes a head count allows" (any) and for the per-rank head load
that layout auto's cost model counts.
"""
from __future__ import annotations

import torch


def head_share(heads: int, ulysses: int) -> int:
    """Heads each Ulysses rank attends, padding included: ceil(heads / ulysses)."""
    return -(-heads // ulysses)


def real_heads(heads: int, ulysses: int) -> list[int]:
    """Real heads per Ulysses rank, in rank order (they sum to ``heads``)."""
    return [heads // ulysses + (1 if r < heads % ulysses else 0) for r in range(ulysses)]


def head_slots(heads: int, ulysses: int, device=None) -> torch.Tensor | None:
    """Slot of every real head in the padded head dimension (None: ``ulysses`` divides ``heads``,
    no padding). Heads keep their order, so rank r's real heads are a run of consecutive heads."""
    if heads % ulysses == 0:
        return None
    share = head_share(heads, ulysses)
    slots = [r * share + i for r, count in enumerate(real_heads(heads, ulysses)) for i in range(count)]
    return torch.tensor(slots, dtype=torch.long, device=device)


def pad_heads(t: torch.Tensor, slots: torch.Tensor | None, ulysses: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, U * ceil(H / U), S, D], the real heads at their slots, zeros elsewhere."""
    if slots is None:
        return t
    b, h, s, d = t.shape
    out = t.new_zeros(b, head_share(h, ulysses) * ulysses, s, d)
    return out.index_copy_(1, slots.to(t.device), t)


def drop_padding(out: torch.Tensor, slots: torch.Tensor | None, padded_heads: int, heads_first: bool) -> torch.Tensor:
    """The attention output with the padded heads dropped: [B, H', S, D] -> [B, H, S, D], or
    [B, S, H' * D] -> [B, S, H * D] (``padded_heads`` = H')."""
    if slots is None:
        return out
    slots = slots.to(out.device)
    if heads_first:
        return out.index_select(1, slots)
    return out.unflatten(2, (padded_heads, -1)).index_select(2, slots).flatten(2)
