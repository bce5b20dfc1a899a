"""All-to-all through shared memory for CPU ranks of one host (issue 35).

gloo moves an all-to-all between two processes of one machine through the kernel's TCP loopback:
a copy into the socket, a copy out of it, the TCP stack and gloo's own threads in between, all
on the cores that also compute. Here every rank instead writes the chunks it sends into a
shared-memory segment of its own (``/dev/shm``, mapped by every rank of the group), the ranks meet
in one small gloo all-reduce, and each reads the chunks addressed to it straight out of its peers'
segments. ``comm.Exchange`` hands the caller the segment itself to fill and the chunks to read in
place, so the data is copied once each way, by the caller's own layout changes. gloo carries 16
bytes a meeting; the meeting keeps gloo's failure handling (a dead peer, a timeout, an abort) for
the exchange as a whole. Each segment has two halves that exchanges use in turn, so one meeting an
exchange is enough: the next one's meeting proves that every rank has read this one before the
half is written again.

Used by ``comm.all_to_all_single`` for CPU tensors of a gloo group, when every rank of the group
can map the others' segments (checked once per group, collectively: ranks on other hosts cannot,
and the group keeps gloo). The result is bit for bit the one gloo's all-to-all gives (it only
moves bytes). Off with ``PARALLEL_SHM_EXCHANGE=0``; exchanges larger than
``PARALLEL_SHM_EXCHANGE_CAP_MB`` (default 512) per rank keep gloo. On GPUs nothing changes: NCCL
moves device tensors, and gloo's staged path keeps its host buffers.

Segments are reserved with ``posix_fallocate`` (a full ``/dev/shm``, as in a container's default
64 MB, is a refusal and the group keeps gloo, never a SIGBUS), and unlinked as soon as every peer
has mapped them: the memory goes when the last rank unmaps it, also when a rank is killed.
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
import threading

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ENV = "PARALLEL_SHM_EXCHANGE"
CAP_ENV = "PARALLEL_SHM_EXCHANGE_CAP_MB"
DEFAULT_CAP_MB = 512
FOLDER = "/dev/shm"
_HEADER = 64          # bytes before the data: the segment's token, which a peer checks after mapping it
_ROUND = 2**20        # capacities grow in whole MiB


def _path(token: int) -> str:
    return os.path.join(FOLDER, f"hybrid-parallel-{token:016x}")


def enabled() -> bool:
    """On unless switched off, where the system can reserve a segment (``posix_fallocate``: Linux
    and the other POSIX systems that have it; not macOS or Windows, whose CPU ranks keep gloo)."""
    return hasattr(os, "posix_fallocate") and os.environ.get(ENV, "1") not in ("0", "")


def cap_bytes() -> int:
    try:
        return int(float(os.environ[CAP_ENV]) * 2**20)
    except (KeyError, ValueError):
        return DEFAULT_CAP_MB * 2**20


class _Segment:
    """One rank's mapped segment (its own or a peer's); ``data``: the bytes after the header."""

    def __init__(self, path: str, size: int, create: bool, token: int):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # reserved now: ENOSPC here, not SIGBUS on a later write
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.data = self.bytes[_HEADER:]
        self.header = self.bytes[:8].view(torch.int64)
        if create:
            self.header[0] = token

    def close(self) -> None:
        self.bytes = self.data = self.header = None
        try:
            self.map.close()
        except BufferError:  # a view still exported: the mapping goes with its last reference
            pass


class _GroupExchange:
    """The segments of one process group: this rank's and its peers', all of one capacity, each in
    two halves that exchanges use in turn (a half written by exchange k is written again by k + 2
    only: by then exchange k + 1's meeting has shown that every rank read k)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.capacity = 0  # bytes of one half
        self.segments: list[_Segment] = []
        self.usable = True
        self.turn = 0      # the half the next exchange writes

    def close(self) -> None:
        for s in self.segments:
            s.close()
        self.segments = []
        self.capacity = 0

    @staticmethod
    def meeting(value: int) -> torch.Tensor:
        """What a rank brings to an exchange's meeting (a MAX all-reduce of the group): its size and
        its negation, so that ``check_meeting`` sees the largest and the smallest of every rank's."""
        return torch.tensor([value, -value], dtype=torch.int64)

    @staticmethod
    def check_meeting(t: torch.Tensor, value: int) -> None:
        """After the meeting: every rank passed the same ``value`` (the exchange's size)."""
        if int(t[0]) != -int(t[1]):
            raise RuntimeError(f"all-to-all of different sizes across the ranks of one group: from "
                               f"{-int(t[1])} to {int(t[0])} bytes (this rank: {value})")

    def _agree(self, ok: bool) -> bool:
        t = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(int(t[0]))

    def _half(self, r: int, turn: int) -> torch.Tensor:
        return self.segments[r].data[turn * self.capacity:(turn + 1) * self.capacity]

    def reserve(self, nbytes: int) -> bool:
        """Segments of at least ``nbytes`` a half on every rank (collective; the same ``nbytes``
        everywhere, and no view of the old segments read or written any more). False, on every rank
        alike, where some rank cannot have them: the group keeps gloo."""
        if nbytes <= self.capacity:
            return True
        capacity = -(-nbytes // _ROUND) * _ROUND
        size = _HEADER + 2 * capacity
        token = secrets.randbits(62) + 1
        own, error = None, None
        try:
            own = _Segment(_path(token), size, True, token)
        except OSError as exc:
            error = exc
        tokens = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(tokens, torch.tensor([token if own is not None else 0], dtype=torch.int64), group=self.group)
        peers = {}
        try:
            for r, peer_token in enumerate(int(t) for t in tokens):
                if r == self.rank or error is not None:
                    continue
                if peer_token == 0:
                    raise OSError(f"rank {r} of the group could not reserve its segment")
                peers[r] = seg = _Segment(_path(peer_token), size, False, peer_token)
                if int(seg.header[0]) != peer_token:
                    raise OSError(f"rank {r}'s segment holds another token")
        except OSError as exc:
            error = exc
        ok = self._agree(error is None)
        if own is not None:  # every peer that could map it has: the name can go
            try:
                os.unlink(_path(token))
            except OSError:
                pass
        if not ok:
            for seg in [own, *peers.values()]:
                if seg is not None:
                    seg.close()
            self.usable = False
            log.info("all-to-all through gloo for this group: shared-memory segments unavailable (%s)",
                     error or "another rank could not map them")
            return False
        self.close()
        self.segments = [own if r == self.rank else peers[r] for r in range(self.size)]
        self.capacity = capacity
        return True

    def send_buffer(self, nbytes: int) -> torch.Tensor | None:
        """Where this rank writes the next exchange's ``nbytes`` (its chunk for rank j at j * nbytes / n),
        or None (on every rank alike) where it goes through gloo."""
        if not self.reserve(nbytes):
            return None
        return self._half(self.rank, self.turn)[:nbytes]

    def exchange(self, nbytes: int) -> list[torch.Tensor]:
        """Every rank has written its send buffer: the n chunks addressed to this rank, chunk j from
        rank j, read in place (in the senders' segments). Read them before the next exchange's
        ``send_buffer`` on this rank: after its meeting they may be written again."""
        t = self.meeting(nbytes)  # every rank of the group is here, and all passed the same size
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        self.check_meeting(t, nbytes)
        return self.received(nbytes)

    def received(self, nbytes: int) -> list[torch.Tensor]:
        """``exchange``'s chunks, once the caller held the meeting itself (``meeting``, a MAX
        all-reduce of the group, waited for, then ``check_meeting``): how a rank computes while the
        others arrive."""
        chunk = nbytes // self.size
        at = self.rank * chunk
        chunks = [self._half(j, self.turn)[at:at + chunk] for j in range(self.size)]
        self.turn ^= 1
        return chunks


class _Exchanges:
    """Per process group, its shared-memory exchange (or the finding that it has none)."""

    def __init__(self):
        self._groups: dict[object, _GroupExchange] = {}
        self._lock = threading.Lock()

    def for_exchange(self, group, nbytes: int, device: torch.device) -> _GroupExchange | None:
        """The group's exchange, for an all-to-all of ``nbytes`` a rank, or None where this one must go
        through gloo (decided alike on every rank: the size and the group's segments are the same
        everywhere; the caller, comm, has asked ``enabled()`` first). The caller then takes
        ``send_buffer`` (None there too: gloo)."""
        if device.type != "cpu" or nbytes > cap_bytes():
            return None
        key = group if group is not None else dist.group.WORLD
        with self._lock:
            ex = self._groups.get(key)
            if ex is None:
                ex = self._groups[key] = _GroupExchange(group)
        if not ex.usable or ex.size < 2 or nbytes % ex.size:
            return None
        return ex

    def run(self, out: torch.Tensor, inp: torch.Tensor, group) -> bool:
        """``dist.all_to_all_single(out, inp)`` with equal splits through shared memory: one copy in,
        one copy out. False where gloo must move it."""
        nbytes = inp.numel() * inp.element_size()
        if not (inp.is_contiguous() and out.is_contiguous()) or out.numel() * out.element_size() != nbytes:
            return False
        ex = self.for_exchange(group, nbytes, inp.device)
        send = ex.send_buffer(nbytes) if ex is not None else None
        if send is None:
            return False
        send.copy_(inp.reshape(-1).view(torch.uint8))
        dst = out.reshape(-1).view(torch.uint8)
        chunk = nbytes // ex.size
        for j, c in enumerate(ex.exchange(nbytes)):
            dst[j * chunk:(j + 1) * chunk].copy_(c)
        return True

    def close_all(self) -> None:
        """A world's end: unmap every segment (their names are already gone)."""
        with self._lock:
            groups, self._groups = self._groups, {}
        for ex in groups.values():
            ex.close()

    @property
    def mapped_bytes(self) -> int:
        return sum(2 * ex.capacity * len(ex.segments) for ex in self._groups.values())


EXCHANGES = _Exchanges()
