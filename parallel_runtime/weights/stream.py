"""Weights from rank 0's device memory to every rank's device, in byte buckets.

Rank 0 sends every worker a skeleton (``pickling.pack_skeleton``: the structure, no data)
and, per slot, its shape, dtype and tensor-parallel cut. Each rank allocates its slots on its
own device at its own shape (a TP rank at its slice's shape) and unpickles. The data follows
slot after slot as raw bytes, so every dtype travels alike (fp8 and bool included):

- replicated tensors: one broadcast per bucket, the same bytes to every rank;
- TP slices: one scatter per bucket, each rank receiving the slices of its TP coordinate.

Buckets are cut by a rule both sides apply to the shapes alone (``StreamLayout``), so the
collectives line up without sizes on the wire. Rank 0 computes each tensor as the forward
would use it (``weight_of``: ComfyUI's patches applied) on its device, one tensor at a time:
beside the weights, at most one bucket per rank exists on rank 0's device, and nothing is
copied to host memory, unless gloo meets CUDA tensors: then both sides stage the buckets through
a fixed pair of pinned host buffers allocated once per send (``comm.StagingRing``), rank 0 packing
each bucket straight into one while the last travels from the other, a worker copying from one
into its slots while the next arrives in the other.

Two channels carry the buckets:

- ``ProcessGroupChannel``: the world's process group (NCCL between GPUs, also across hosts).
- ``HandleChannel``: one host without NCCL (several ranks sharing a GPU through gloo): each
  bucket travels as a CUDA IPC handle over the worker's control connection and the worker
  copies it device to device (measured on an H100: 4 GiB in 7 ms, where gloo's broadcast of
  CUDA tensors moves 2.1 GB/s). On the CPU the same channel hands over shared-memory buckets,
  which is how the tests run it.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass

import torch

from .shards import Cut
from ..distributed import comm

BUCKET_BYTES = 64 * 2**20  # per rank and per bucket: small beside the weights, large for the links
TRIAL_BUCKET_BYTES = 2**20  # what model_copies exports once to check that CUDA IPC handles work


@dataclass(frozen=True)
class Entry:
    """One slot of a skeleton: its full shape, dtype and TP cut (None: replicated)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    cut: Cut | None = None
    from_file: bool = False  # every worker reads it from the checkpoint itself (``file_reads``): not streamed

    def local_shape(self, tp_size: int) -> tuple[int, ...]:
        return self.cut.shape(self.shape, tp_size) if self.cut is not None else self.shape

    def local_nbytes(self, tp_size: int) -> int:
        return math.prod(self.local_shape(tp_size)) * self.dtype.itemsize

    def wire(self) -> tuple:
        """Builtins only (a class of this pack pickled on rank 0 names its import path there)."""
        cut = None if self.cut is None else (self.cut.what, self.cut.kind, self.cut.dim, self.cut.sizes, self.cut.kv)
        return (self.shape, self.dtype, cut, self.from_file)

    @classmethod
    def from_wire(cls, item) -> "Entry":
        shape, dtype, cut, from_file = item
        return cls(tuple(shape), dtype, None if cut is None else Cut(*cut), from_file)


class StreamLayout:
    """The collectives of one weight stream, in order: ``(kind, entry indices, bytes per rank)``
    with kind "broadcast" (replicated entries) or "scatter" (TP slices). Both sides build it
    from the entries alone."""

    def __init__(self, entries: list[Entry], tp_size: int, bucket_bytes: int = BUCKET_BYTES):
        self.ops: list[tuple[str, list[int], int]] = []
        open_: dict[str, tuple[list[int], int]] = {"broadcast": ([], 0), "scatter": ([], 0)}
        for i, entry in enumerate(entries):
            if entry.from_file:
                continue
            kind = "broadcast" if entry.cut is None else "scatter"
            n = entry.local_nbytes(tp_size)
            members, total = open_[kind]
            if members and total + n > bucket_bytes:
                self.ops.append((kind, members, total))
                members, total = [], 0
            open_[kind] = (members + [i], total + n)
        for kind in ("broadcast", "scatter"):
            members, total = open_[kind]
            if members:
                self.ops.append((kind, members, total))

    @property
    def nbytes(self) -> int:
        return sum(total for _, _, total in self.ops)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def allocate(entries: list[Entry], tp_size: int, device) -> list[torch.Tensor]:
    return [torch.empty(e.local_shape(tp_size), dtype=e.dtype, device=device) for e in entries]


class LoadProgress:
    """The weights this process is receiving (a worker) or sending (rank 0): bytes done of the
    model's total, for the status route's per-rank ``load`` (plain ints: one writer, readers
    tolerate a stale value). Stays at done == total after a load, until the next; ``loads`` counts
    the loads begun, so a reader tells the next load's bytes from the last one's."""

    def __init__(self):
        self.done = 0
        self.total = 0
        self.loads = 0

    def begin(self, total: int) -> None:
        self.done, self.total = 0, int(total)
        self.loads += 1

    def add(self, nbytes: int) -> None:
        self.done = min(self.total, self.done + int(nbytes))

    def finish(self) -> None:
        self.done = self.total

    def abandon(self) -> None:
        """The load was stopped: nothing of it is held (the status shows no load)."""
        self.done = self.total = 0


LOAD = LoadProgress()


# ---------------------------------------------------------------- channels
class ProcessGroupChannel:
    """Buckets through the world's process group (rank 0 is the source).

    Where the group's collectives are staged (gloo with accelerator tensors: several ranks sharing
    one GPU), ``ring`` gives the stream a fixed pair of host buffers (``comm.StagingRing``) and the
    buckets are packed into them and received from them directly; elsewhere (NCCL, CPU tensors)
    they travel as device tensors."""

    shares_buckets = False  # a collective only reads the source bucket

    def ring(self, nbytes: int, device) -> "comm.StagingRing | None":
        return comm.staging_ring(nbytes, device)

    def send_broadcast(self, bucket: torch.Tensor) -> None:
        comm.broadcast(bucket, src=0)

    def send_scatter(self, payloads: list[torch.Tensor]) -> None:
        # Rank 0's own entry is received into itself (no tensor to throw away; NCCL's copy of a
        # tensor onto itself is no copy).
        comm.scatter(payloads[0], payloads, src=0)

    def recv_broadcast(self, nbytes: int, device) -> torch.Tensor:
        bucket = torch.empty(nbytes, dtype=torch.uint8, device=device)
        comm.broadcast(bucket, src=0)
        return bucket

    def recv_scatter(self, nbytes: int, device) -> torch.Tensor:
        bucket = torch.empty(nbytes, dtype=torch.uint8, device=device)
        comm.scatter(bucket, None, src=0)
        return bucket

    def received(self) -> None:
        pass


class HandleChannel:
    """Buckets as IPC handles over the control connections (one host, no NCCL).

    Rank 0 side: ``send(rank, tensor)`` delivers a handle, ``confirm()`` waits until every
    worker copied the bucket (so rank 0 may free it). Worker side: ``receive()`` gives the next
    bucket, ``received()`` tells rank 0 it was copied."""

    shares_buckets = True  # a handle exposes the bucket's whole storage: never a tensor of the model's

    def __init__(self, send=None, confirm=None, receive=None, received=None):
        self._send, self._confirm, self._receive, self._received = send, confirm, receive, received

    def ring(self, nbytes: int, device) -> None:
        return None  # nothing is staged: each bucket is handed over where it is

    def send_broadcast(self, bucket: torch.Tensor) -> None:
        self._send(None, bucket)
        self._confirm()

    def send_scatter(self, payloads: list[torch.Tensor]) -> None:
        self._send(payloads, None)
        self._confirm()

    def recv_broadcast(self, nbytes: int, device) -> torch.Tensor:
        return self._receive()

    recv_scatter = recv_broadcast

    def received(self) -> None:
        self._received()


# ---------------------------------------------------------------- both ends
SLOW_LOAD_ENV = "PARALLEL_TEST_SLOW_LOAD_MS"  # tests: a worker sleeps that long after each bucket it receives


def _ring_bytes(layout: StreamLayout, tp_size: int, source: bool) -> int:
    """A ring buffer's size: the largest bucket, and on rank 0 a scatter's payload for every TP
    coordinate."""
    return max((total * (tp_size if kind == "scatter" and source else 1) for kind, _, total in layout.ops), default=0)


def _ring(channel, nbytes: int, device) -> "comm.StagingRing | None":
    """The channel's staging ring for this stream (a channel without one moves buckets as they are)."""
    ring = getattr(channel, "ring", None)
    return ring(nbytes, device) if ring is not None else None


@contextlib.contextmanager
def _closing(ring: "comm.StagingRing | None"):
    """Close the stream's ring after the block; after an error without waiting for what is in flight."""
    try:
        yield
    except BaseException:
        if ring is not None:
            ring.close(wait=False)
        raise
    if ring is not None:
        ring.close()


def _on(w: torch.Tensor, device) -> torch.Tensor:
    return w if w.device == torch.device(device) else w.to(device)


def send(entries: list[Entry], weight_of, channel, device, tp_size: int, tp_coords: list[int],
         keep_coord: int | None = None, bucket_bytes: int = BUCKET_BYTES) -> list[torch.Tensor] | None:
    """Rank 0's side. ``weight_of(i)`` gives entry i's tensor as the forward uses it;
    ``tp_coords[r]`` is world rank r's TP coordinate. With ``keep_coord`` rank 0 keeps, per
    entry, its own tensor (its slice at that coordinate, on ``device``) and returns them."""
    kept: list[torch.Tensor | None] | None = [None] * len(entries) if keep_coord is not None else None
    layout = StreamLayout(entries, tp_size, bucket_bytes)
    LOAD.begin(layout.nbytes)
    ring = _ring(channel, _ring_bytes(layout, tp_size, source=True), device) if layout.ops else None
    with _closing(ring):
        for k, (kind, members, total) in enumerate(layout.ops):
            if ring is not None:
                _send_staged(ring, k, kind, members, total, entries, weight_of, device, tp_size, tp_coords,
                             keep_coord, kept)
            elif kind == "broadcast":
                _send_broadcast(channel, members, weight_of, device, kept)
            else:
                _send_scatter(channel, members, entries, weight_of, device, tp_size, tp_coords, keep_coord, kept)
            comm.PROGRESS.tick()
            LOAD.add(total)
    if kept is not None:
        for i, entry in enumerate(entries):
            if entry.from_file:
                w = _on(weight_of(i), device)
                kept[i] = w if entry.cut is None else entry.cut.apply(w, keep_coord, tp_size)
    return kept


def _send_broadcast(channel, members, weight_of, device, kept) -> None:
    pieces = []
    for i in members:
        w = _on(weight_of(i), device)
        pieces.append(_bytes(w))
        if kept is not None:
            kept[i] = w
    if len(pieces) > 1:
        bucket = torch.cat(pieces)
    else:
        bucket = pieces[0].clone() if channel.shares_buckets else pieces[0]
    channel.send_broadcast(bucket)


def _send_scatter(channel, members, entries, weight_of, device, tp_size, tp_coords, keep_coord, kept) -> None:
    per_coord: list[list[torch.Tensor]] = [[] for _ in range(tp_size)]
    for i in members:
        w = _on(weight_of(i), device)
        for c in range(tp_size):
            part = entries[i].cut.apply(w, c, tp_size)
            per_coord[c].append(_bytes(part))
            if kept is not None and c == keep_coord:
                kept[i] = part
        del w
    payload = [torch.cat(p) if len(p) > 1 else p[0] for p in per_coord]
    channel.send_scatter([payload[c] for c in tp_coords])


def _send_staged(ring, k, kind, members, total, entries, weight_of, device, tp_size, tp_coords, keep_coord,
                 kept) -> None:
    """Bucket ``k`` packed straight into its ring buffer (each byte copied once, device to host)
    and posted; the next bucket is packed while it travels. A scatter's buffer holds one payload
    per TP coordinate, and rank 0 receives its own entry into its own payload."""
    copies = tp_size if kind == "scatter" else 1
    buf = ring.buffer(k, total * copies)
    offsets = [c * total for c in range(copies)]
    for i in members:
        w = _on(weight_of(i), device)
        if kind == "broadcast":
            parts = [w]
            if kept is not None:
                kept[i] = w
        else:
            cut = entries[i].cut
            parts = []
            for c in range(tp_size):
                if kept is not None and c == keep_coord:
                    part = kept[i] = cut.apply(w, c, tp_size)  # its own tensor (not a view of the full weight)
                else:
                    view = getattr(cut, "view", None)  # one strided view: copied from where it is
                    part = view(w, c, tp_size) if view is not None else None
                    part = cut.apply(w, c, tp_size) if part is None else part
                parts.append(part)
        for c, part in enumerate(parts):
            offsets[c] = _copy_into(buf, offsets[c], part)
        del w, parts
    if kind == "broadcast":
        ring.broadcast(k, buf, src=0)
        return
    payloads = list(buf.view(tp_size, total).unbind(0))
    ring.scatter(k, payloads[tp_coords[0]], [payloads[c] for c in tp_coords], src=0)


def _copy_into(buf: torch.Tensor, offset: int, t: torch.Tensor) -> int:
    """``t``'s bytes into ``buf`` (uint8) at ``offset``, read where they are (a strided view too,
    where the offset is aligned for its dtype); the offset after them."""
    n = t.numel() * t.element_size()
    region = buf[offset: offset + n]
    if t.is_contiguous() or offset % t.element_size():
        region.copy_(_bytes(t))
    else:
        region.view(t.dtype).view(t.shape).copy_(t)
    return offset + n


def receive(entries: list[Entry], slots: list[torch.Tensor], channel, device, tp_size: int,
            bucket_bytes: int = BUCKET_BYTES) -> None:
    """A worker's side: fill ``slots`` (allocated by ``allocate``) in the order rank 0 sends
    (``LOAD`` counts the streamed bytes and what the worker reads from the file after).
    Staged (``channel.ring``): bucket ``k + 1`` arrives in one ring buffer while bucket ``k`` is
    copied from the other into its slots; no device bucket."""
    layout = StreamLayout(entries, tp_size, bucket_bytes)
    LOAD.begin(sum(e.local_nbytes(tp_size) for e in entries))
    slow = _slow_load_seconds()
    ring = _ring(channel, _ring_bytes(layout, tp_size, source=False), device) if layout.ops else None

    def post(k: int) -> None:
        kind, _, total = layout.ops[k]
        buf = ring.buffer(k, total)
        if kind == "broadcast":
            ring.broadcast(k, buf, src=0)
        else:
            ring.scatter(k, buf, None, src=0)

    with _closing(ring):
        if ring is not None:
            post(0)
        for k, (kind, members, total) in enumerate(layout.ops):
            if ring is not None:
                if k + 1 < len(layout.ops):
                    post(k + 1)  # into the other buffer, emptied at the last step
                ring.wait(k)
                bucket = ring.buffer(k, total)
            else:
                bucket = channel.recv_broadcast(total, device) if kind == "broadcast" else \
                    channel.recv_scatter(total, device)
            if bucket.numel() != total:
                raise RuntimeError(f"weight stream: a bucket of {bucket.numel()} bytes arrived where {total} were expected")
            offset = 0
            for i in members:
                dst = _bytes_view(slots[i])
                dst.copy_(bucket[offset: offset + dst.numel()])  # from the ring: done before it is reused
                offset += dst.numel()
            del bucket
            channel.received()
            comm.PROGRESS.tick()
            LOAD.add(total)
            if slow:
                time.sleep(slow)
    # The copies above are queued on the device: the worker says "loaded" (and rank 0 times the
    # send) only once they are done.
    comm.synchronize(device)


def _slow_load_seconds() -> float:
    try:
        return max(0.0, float(os.environ.get(SLOW_LOAD_ENV, "") or 0) / 1000)
    except ValueError:
        return 0.0


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)
