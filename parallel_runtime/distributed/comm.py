"""Collectives that work on every backend and device pair the pack runs on.

Every collective of the runtime goes through here. NCCL runs them all on CUDA tensors and gloo
on CPU tensors. gloo on CUDA tensors is the odd one: send/recv abort the process
(``gloo::IoException ... writev: Bad address``, measured on an H100) and its other CUDA
variants are host copies inside gloo anyway. So when a group's backend is gloo and a tensor
lives on an accelerator, the data is *staged*: copied into a (pinned) host buffer, exchanged
on the CPU, copied back. That is the path of several ranks sharing one GPU, of native Windows
(no NCCL there) and of any ``backend: gloo`` on CUDA: slower than NCCL, but it runs.

``PARALLEL_FORCE_STAGING=1`` (or ``forced_staging()``) stages CPU tensors too, so the tests run
the staged path on the CPU and compare it with the direct one.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import os
import threading
import time
import types
import weakref

import torch
import torch.distributed as dist

from .local_exchange import EXCHANGES as LOCAL_EXCHANGES, enabled as local_exchange_enabled

FORCE_ENV = "PARALLEL_FORCE_STAGING"
_forced = threading.local()


@contextlib.contextmanager
def forced_staging(on: bool = True):
    """Stage every collective of this thread through host buffers (tests)."""
    before = getattr(_forced, "on", None)
    _forced.on = on
    try:
        yield
    finally:
        _forced.on = before


def staging_forced() -> bool:
    local = getattr(_forced, "on", None)
    if local is not None:
        return local
    return os.environ.get(FORCE_ENV, "") not in ("", "0")


def backend_of(group) -> str:
    return str(dist.get_backend(group)).lower()


def staged(group, tensor: torch.Tensor) -> bool:
    """Whether a collective of ``group`` on ``tensor`` must go through host buffers."""
    return staged_on(group, tensor.device)


def staged_on(group, device) -> bool:
    """Whether collectives of ``group`` on ``device``'s tensors go through host buffers."""
    if staging_forced():
        return True
    return torch.device(device).type != "cpu" and backend_of(group) == "gloo"


# ---------------------------------------------------------------- exposed communication
class CommClock:
    """Time this process spends blocked in communication: in a collective call and in waiting for
    transfers in flight; what overlaps computation is not counted (bench/profile_step.py reads it).
    On CPU ranks (gloo) a call returns when it is done; with NCCL a call only queues its work on
    the device, so on CUDA this counts host-side waits only."""

    def __init__(self):
        self.enabled = False
        self.seconds = 0.0
        self.calls = 0

    @contextlib.contextmanager
    def measuring(self):
        """Counts from zero while the block runs; yields the block's own tally, set at its end."""
        self.enabled, self.seconds, self.calls = True, 0.0, 0
        tally = types.SimpleNamespace(seconds=0.0, calls=0)
        try:
            yield tally
        finally:
            self.enabled = False
            tally.seconds, tally.calls = self.seconds, self.calls


CLOCK = CommClock()


class _Progress:
    """How many collectives (and weight buckets) this process completed: the watchdog's proof that
    the world is moving. A worker publishes its count in the shared status table; rank 0 reads
    its own here. Only ever grows (a plain int: one writer per process, readers tolerate a stale value)."""

    def __init__(self):
        self.count = 0

    def tick(self) -> None:
        self.count += 1


PROGRESS = _Progress()

# ---------------------------------------------------------------- aborts
# The watchdog (world/watchdog.py) is the only caller of ``abort_collectives``. With NCCL it aborts the
# communicators: a collective blocked on a dead peer then returns (or raises) with outputs no rank
# wrote. PARALLEL_TEST_NCCL_ABORT=1 makes gloo collectives on rank 0 behave that way on the CPU: a
# failing collective waits for the abort, as an NCCL kernel waits for its dead peer, then returns
# as if it had completed, and every later one returns at once. Tests use it to check that nothing
# computed after an abort ever reaches ComfyUI.
FAKE_ABORT_ENV = "PARALLEL_TEST_NCCL_ABORT"
_aborted = threading.Event()


def _fake_abort() -> bool:
    return os.environ.get(FAKE_ABORT_ENV, "") not in ("", "0")


def abort_collectives(backend: str) -> None:
    """Unblock this process's collectives for good (the world is being torn down)."""
    _aborted.set()
    if backend == "nccl":
        dist.distributed_c10d._abort_process_group()


def synchronize(device) -> None:
    """Wait for the work queued on ``device`` (a no-op off CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_abort() -> None:
    """A new world: collectives run again."""
    _aborted.clear()


def aborted() -> bool:
    return _aborted.is_set()


def _guarded_call(fn, args, kwargs):
    if not _fake_abort():
        return fn(*args, **kwargs)
    if _aborted.is_set():
        return None  # an aborted communicator's operation: nothing is written
    try:
        return fn(*args, **kwargs)
    except Exception:
        if not _aborted.wait(30):  # NCCL would block here until the watchdog aborts
            raise
        return None


def _posted(post, *args, **kwargs) -> list:
    """The requests of an asynchronous operation just posted (none once aborted under the fake)."""
    work = _guarded_call(post, args, kwargs)
    return [] if work is None else work if isinstance(work, list) else [work]


TRACE_ENV = "PARALLEL_TRACE_COMM"


class _Trace:
    """``PARALLEL_TRACE_COMM=<folder>``: every process (rank 0 and the workers, which inherit the
    environment) appends one line per blocking call to ``<folder>/<pid>.txt``: the call's name and
    when it was entered and left (``time.perf_counter``, one clock for every process of a host).
    ``bench/comm_timeline.py`` lines the ranks up: who waited for whom, and for how long the
    transfer took once both were in."""

    def __init__(self):
        self.folder = os.environ.get(TRACE_ENV) or None
        self._file = None

    def write(self, name: str, entered: float, left: float) -> None:
        if self._file is None:
            self._file = open(os.path.join(self.folder, f"{os.getpid()}.txt"), "a", buffering=1)
        self._file.write(f"{name} {entered:.6f} {left:.6f}\n")


TRACE = _Trace()


def _blocking(fn):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        if not CLOCK.enabled and TRACE.folder is None:
            out = _guarded_call(fn, args, kwargs)
            PROGRESS.tick()
            return out
        start = time.perf_counter()
        try:
            out = _guarded_call(fn, args, kwargs)
            PROGRESS.tick()
            return out
        finally:
            end = time.perf_counter()
            if CLOCK.enabled:
                CLOCK.seconds += end - start
                CLOCK.calls += 1
            if TRACE.folder is not None:
                TRACE.write(fn.__name__, start, end)
    return timed


# ---------------------------------------------------------------- host buffers
HOST_CAP_ENV = "PARALLEL_HOST_BUFFER_CAP_MB"  # what the pool keeps between collectives (default 256)
FAKE_PIN_ENV = "PARALLEL_TEST_FAKE_PIN"       # "1": CPU tensors' buffers go through the pin function (tests)


def pin_host(nbytes: int) -> torch.Tensor:
    """A page-locked host buffer (torch's pinned allocator)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def plain_host(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


class _HostBuffers:
    """Reusable host buffers for staged collectives, pinned when the tensor lives on an accelerator
    (pinning costs milliseconds per allocation; the same sizes recur every layer).

    Bounded: the pool keeps at most ``cap_bytes`` of free buffers (``PARALLEL_HOST_BUFFER_CAP_MB``,
    default 256 MiB) and ``KEEP_PER_SIZE`` per size, evicting the sizes released longest ago; a
    buffer larger than the cap is never kept. A weight stream's buckets (64 MiB, of ever-different
    sizes) do not come here: they go through a ``StagingRing`` of their own, allocated here
    (``outside_pool``) once per send. ``clear()`` follows every send and a world's shutdown: what
    stays pinned is a forward's working set, not a model's worth of buckets.

    ``pinned_bytes``: buffers allocated through ``pin`` that are still alive (kept or in use); the
    pool counts them itself (torch's pinned allocator rounds each block up to a power of two and
    caches freed blocks: ``clear()`` and evictions hand those back to the driver too).
    ``pin`` is replaceable and ``pin_cpu`` sends CPU tensors' buffers through it: how the tests
    run the pinned branch where nothing can be pinned (``PARALLEL_TEST_FAKE_PIN=1`` in workers)."""

    KEEP_PER_SIZE = 4
    DEFAULT_CAP_BYTES = 256 * 2**20

    def __init__(self, cap_bytes: int | None = None, pin=None, pin_cpu: bool | None = None):
        if cap_bytes is None:
            try:
                cap_bytes = int(float(os.environ[HOST_CAP_ENV]) * 2**20)
            except (KeyError, ValueError):
                cap_bytes = self.DEFAULT_CAP_BYTES
        fake = os.environ.get(FAKE_PIN_ENV, "") not in ("", "0")
        self.cap_bytes = cap_bytes
        self.pin = pin or (plain_host if fake else pin_host)
        self.pin_cpu = fake if pin_cpu is None else pin_cpu
        # size -> free buffers of that size; order: the size released longest ago first (evicted first)
        self._free: collections.OrderedDict[int, list[torch.Tensor]] = collections.OrderedDict()
        self._kept_bytes = 0
        self._pinned_bytes = 0
        self.pinned_total = 0  # bytes ever allocated through ``pin`` (tests: the pinned branch ran)
        self._lock = threading.Lock()

    # -------------------------------------------------------- figures
    @property
    def kept_bytes(self) -> int:
        return self._kept_bytes

    @property
    def pinned_bytes(self) -> int:
        return self._pinned_bytes

    def stats(self) -> dict:
        return {"host_pinned_bytes": self._pinned_bytes, "host_kept_bytes": self._kept_bytes}

    # -------------------------------------------------------- use
    def pins(self, like: torch.Tensor) -> bool:
        return self.pins_for(like.device)

    def pins_for(self, device) -> bool:
        return torch.device(device).type == "cuda" or self.pin_cpu

    def outside_pool(self, nbytes: int, device) -> torch.Tensor:
        """A host buffer for ``device``'s staging (pinned as ``acquire`` would pin it) that the pool
        never keeps: its owner holds it for a run of collectives (``StagingRing``) and drops it."""
        return self._allocate(nbytes) if self.pins_for(device) else plain_host(nbytes)

    def acquire(self, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        with self._lock:
            pool = self._free.get(nbytes)
            raw = pool.pop() if pool else None
            if raw is not None:
                self._kept_bytes -= nbytes
                if not pool:
                    del self._free[nbytes]
        if raw is None:
            raw = self._allocate(nbytes) if self.pins(like) else plain_host(nbytes)
        return raw.view(like.dtype).view(like.shape)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        raw = self.pin(nbytes)
        with self._lock:
            self._pinned_bytes += nbytes
            self.pinned_total += nbytes
        # Counted until the memory itself is freed, whoever drops the last reference.
        weakref.finalize(raw.untyped_storage(), self._unpinned, nbytes)
        return raw

    def _unpinned(self, nbytes: int) -> None:
        with self._lock:
            self._pinned_bytes -= nbytes

    def release(self, buf: torch.Tensor) -> None:
        raw = buf.reshape(-1).view(torch.uint8)
        nbytes = raw.numel()
        evicted = []
        with self._lock:
            if nbytes > self.cap_bytes:
                return  # never kept: dropped here
            pool = self._free.setdefault(nbytes, [])
            if len(pool) >= self.KEEP_PER_SIZE:
                return
            pool.append(raw)
            self._free.move_to_end(nbytes)
            self._kept_bytes += nbytes
            while self._kept_bytes > self.cap_bytes:
                size, oldest = next(iter(self._free.items()))
                evicted.append(oldest.pop(0))
                self._kept_bytes -= size
                if not oldest:
                    del self._free[size]
        if evicted:
            del evicted
            self._return_pinned()

    def clear(self) -> None:
        """Drop every kept buffer and give the pinned pages back (after a weight send, at shutdown)."""
        with self._lock:
            dropped = self._free
            self._free = collections.OrderedDict()
            self._kept_bytes = 0
        del dropped
        self._return_pinned()

    def _return_pinned(self) -> None:
        """torch's pinned allocator keeps freed blocks for reuse: hand them back to the driver."""
        if self.pin is pin_host and torch.cuda.is_initialized():
            empty = getattr(torch.accelerator, "empty_host_cache", None) or torch._C._host_emptyCache
            empty()


HOST = _HostBuffers()
# CPU ranks' Ulysses exchange buffers (exchange_buffer): a pool of their own, never pinned, so that
# HOST's figures (host_pinned_bytes / host_kept_bytes in the status) stay those of staging.
EXCHANGE = _HostBuffers(pin=plain_host, pin_cpu=False)


def clear_pools() -> None:
    """A world's end: every kept host buffer goes, staging's and the exchange's, and the shared-memory
    all-to-all segments are unmapped."""
    HOST.clear()
    EXCHANGE.clear()
    LOCAL_EXCHANGES.close_all()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    host = HOST.acquire(t)
    host.copy_(t)  # blocking: gloo reads the buffer right away
    return host


def _from_host(dst: torch.Tensor, host: torch.Tensor) -> None:
    dst.copy_(host)  # blocking: the buffer goes back to the pool next
    HOST.release(host)


def _empty_host(like: torch.Tensor) -> torch.Tensor:
    return HOST.acquire(like)


def exchange_buffer(shape, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised buffer of ``shape`` (``like``'s dtype and device) for one exchange. On the
    CPU it comes from a pool (``EXCHANGE``): the same sizes recur at every layer, and a fresh
    allocation of that size is fresh pages, a page fault for every 4 KiB the exchange writes. Hand
    it back with ``release_exchange_buffer`` once nothing reads it (no view of it may outlive that)."""
    if like.device.type != "cpu":
        return like.new_empty(shape)
    return EXCHANGE.acquire(torch.empty(shape, dtype=like.dtype, device="meta"))


def release_exchange_buffer(buf: torch.Tensor) -> None:
    if buf.device.type == "cpu":
        EXCHANGE.release(buf)


# ---------------------------------------------------------------- collectives
@_blocking
def broadcast(t: torch.Tensor, src: int, group=None) -> None:
    if not staged(group, t):
        dist.broadcast(t, src=src, group=group)
        return
    host = _to_host(t) if dist.get_rank() == src else _empty_host(t)
    dist.broadcast(host, src=src, group=group)
    _from_host(t, host)


@_blocking
def all_reduce(t: torch.Tensor, group=None) -> None:
    if not staged(group, t):
        dist.all_reduce(t, group=group)
        return
    host = _to_host(t)
    dist.all_reduce(host, group=group)
    _from_host(t, host)


@_blocking
def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    if not staged(group, inp):
        # CPU ranks of one host: through shared memory (local_exchange), else gloo's / NCCL's own.
        if not (local_exchange_enabled() and backend_of(group) == "gloo" and LOCAL_EXCHANGES.run(out, inp, group)):
            dist.all_to_all_single(out, inp, group=group)
        return
    host_in, host_out = _to_host(inp), _empty_host(out)
    dist.all_to_all_single(host_out, host_in, group=group)
    HOST.release(host_in)
    _from_host(out, host_out)


class Exchange:
    """One equal-split all-to-all whose send buffer the caller fills in place and whose received
    chunks it reads in place, so that its own layout changes are the only copies: ``send`` ([n, ...]:
    entry j goes to group rank j), then ``run()`` gives n tensors of ``shape[1:]`` (entry j from rank
    j), to be read before this group's next exchange, then ``close()``.

    CPU ranks of one host: ``send`` is this rank's shared-memory segment and the chunks are views of
    the senders' segments (``local_exchange``). Elsewhere (NCCL, gloo across hosts, staged): pooled
    buffers and ``all_to_all_single``."""

    def __init__(self, shape, like: torch.Tensor, group=None, source: torch.Tensor | None = None):
        """``source``: what to send, if the caller has it whole (of ``shape``'s size, in its order):
        copied into the segment, sent as it is where it is contiguous and no segment serves."""
        self.shape, self.group = tuple(shape), group
        self._recv, self._pooled = None, True
        self._pending = self._meeting = None
        n_bytes = like.element_size()
        for d in self.shape:
            n_bytes *= d
        self.nbytes = n_bytes
        self._local = None
        if local_exchange_enabled() and backend_of(group) == "gloo" and not staged(group, like):
            local = LOCAL_EXCHANGES.for_exchange(group, n_bytes, like.device)
            raw = local.send_buffer(n_bytes) if local is not None else None
            if raw is not None:
                self._local = local
                self.send = raw.view(like.dtype).view(self.shape)
                if source is not None:
                    self.send.view(source.shape).copy_(source)
                return
        if source is not None and source.is_contiguous():
            self.send, self._pooled = source.view(self.shape), False
            return
        self.send = exchange_buffer(self.shape, like)
        if source is not None:
            self.send.view(source.shape).copy_(source)

    def run(self) -> list[torch.Tensor]:
        self.start()
        return self.finish()

    def start(self) -> None:
        """The exchange in two halves, for a caller that computes while it travels (``run`` calls
        them one after the other): ``start`` once ``send`` holds every entry the peers read (this
        rank's own entry is not sent where the ranks share memory: it may be written after), then
        ``finish`` gives the n chunks (this rank's own one only where it was written before
        ``start``)."""
        if self._local is not None:
            self._meeting = self._local.meeting(self.nbytes)
            self._pending = Pending(_posted(dist.all_reduce, self._meeting, op=dist.ReduceOp.MAX,
                                            group=self.group, async_op=True))
            return
        self._recv = exchange_buffer(self.shape, self.send)
        self._pending = all_to_all_async(self._recv, self.send, self.group)

    def finish(self) -> list[torch.Tensor]:
        self._pending.wait()
        self._pending = None
        if self._local is None:
            return list(self._recv.unbind(0))
        if _aborted.is_set() and _fake_abort():  # the fake NCCL abort: nothing arrived
            return list(torch.zeros_like(self.send).unbind(0))
        self._local.check_meeting(self._meeting, self.nbytes)
        return [c.view(self.send.dtype).view(self.shape[1:]) for c in self._local.received(self.nbytes)]

    def close(self) -> None:
        if self._local is None:
            if self._pooled:
                release_exchange_buffer(self.send)
            if self._recv is not None:
                release_exchange_buffer(self._recv)
        self.send = self._recv = self._local = None


def all_to_all_async(out: torch.Tensor, inp: torch.Tensor, group=None) -> "Pending":
    """``all_to_all_single`` in flight: ``wait()`` on the result completes it (NCCL runs it on its
    own stream, gloo on its own thread, while this thread computes)."""
    if not staged(group, inp):
        return Pending(_posted(dist.all_to_all_single, out, inp, group=group, async_op=True))
    host_in, host_out = _to_host(inp), _empty_host(out)
    work = _posted(dist.all_to_all_single, host_out, host_in, group=group, async_op=True)
    return Pending(work, copies=[(out, host_out)], buffers=[host_in])


def _all_gather_native(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.14
    fn(out, inp, group=group)


@_blocking
def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    """``out`` (dim 0 = group size x ``inp``'s) receives every rank's ``inp`` in rank order."""
    if not staged(group, inp):
        _all_gather_native(out, inp, group)
        return
    host_in, host_out = _to_host(inp), _empty_host(out)
    _all_gather_native(host_out, host_in, group)
    HOST.release(host_in)
    _from_host(out, host_out)


@_blocking
def gather(t: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int, group=None) -> None:
    """``dst`` (a global rank) receives every rank's ``t`` into ``gather_list``."""
    if not staged(group, t):
        dist.gather(t, gather_list, dst=dst, group=group)
        return
    host = _to_host(t)
    host_list = [_empty_host(g) for g in gather_list] if gather_list is not None else None
    dist.gather(host, host_list, dst=dst, group=group)
    HOST.release(host)
    for g, h in zip(gather_list or (), host_list or ()):
        _from_host(g, h)


@_blocking
def scatter(t: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int, group=None) -> None:
    """Every rank receives its entry of ``src``'s ``scatter_list`` into ``t``."""
    if not staged(group, t):
        dist.scatter(t, scatter_list, src=src, group=group)
        return
    host_list = [_to_host(s) for s in scatter_list] if scatter_list is not None else None
    host = _empty_host(t)
    dist.scatter(host, host_list, src=src, group=group)
    for h in host_list or ():
        HOST.release(h)
    _from_host(t, host)


class StagingRing:
    """A fixed ring of host buffers for a run of staged collectives (a weight stream's buckets over
    gloo with accelerator tensors): ``count`` buffers of ``nbytes``, allocated (pinned where the
    device is an accelerator) once, when the run starts, and reused in turn, so that no collective
    of the run pins or unpins memory, whatever sizes its buckets have (the pool, ``HOST``, keeps
    buffers per size: a stream's ever-different sizes would pin afresh and evict). Dropped with the
    ring (its owner drops it at the run's end; ``HOST.clear()`` then hands the pages back).

    Double-buffered: collective ``k`` runs on buffer ``k % count`` and is posted asynchronously, so
    the caller fills buffer ``k + 1`` (rank 0: the next bucket) or reads buffer ``k - 1`` (a worker:
    the last bucket into its slots) while ``k`` travels. ``buffer(k, n)`` waits for collective
    ``k - count``, the last user of that buffer. The buffers are host tensors: gloo runs on them as
    they are, nothing is staged again."""

    def __init__(self, nbytes: int, device, count: int = 2, group=None):
        self.group, self.count = group, count
        self._buffers = [HOST.outside_pool(nbytes, device) for _ in range(count)]
        self._pending: dict[int, Pending] = {}

    def buffer(self, k: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of collective ``k``'s buffer, free to fill."""
        self.wait(k - self.count)
        return self._buffers[k % self.count][:nbytes]

    def broadcast(self, k: int, buf: torch.Tensor, src: int) -> None:
        self._pending[k] = Pending(_posted(dist.broadcast, buf, src=src, group=self.group, async_op=True))

    def scatter(self, k: int, out: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int) -> None:
        self._pending[k] = Pending(_posted(dist.scatter, out, scatter_list, src=src, group=self.group,
                                           async_op=True))

    def wait(self, k: int) -> None:
        """Collective ``k`` done (its buffer holds what arrived; a sender may refill it)."""
        pending = self._pending.pop(k, None)
        if pending is not None:
            pending.wait()

    def close(self, wait: bool = True) -> None:
        """Every collective done, the buffers dropped. ``wait=False`` (the run failed): the
        collectives in flight are left to the process group (its work holds their buffers until it
        ends) rather than waited for, which could block on a rank that is gone."""
        if wait:
            for k in sorted(self._pending):
                self.wait(k)
        self._pending.clear()
        self._buffers = []


def staging_ring(nbytes: int, device, count: int = 2, group=None) -> StagingRing | None:
    """A ``StagingRing`` where collectives of ``group`` on ``device``'s tensors are staged, else None
    (they run on device tensors as they are)."""
    if not staged_on(group, device):
        return None
    return StagingRing(nbytes, device, count, group)


class Pending:
    """Point-to-point transfers in flight; ``wait()`` completes them (and copies staged
    receives into their destinations)."""

    def __init__(self, requests, copies=(), buffers=()):
        self._requests = requests
        self._copies = copies      # (destination, host buffer) of staged receives
        self._buffers = buffers    # host buffers of staged sends

    @_blocking
    def wait(self) -> None:
        for req in self._requests:
            req.wait()
        for dst, host in self._copies:
            _from_host(dst, host)
        for host in self._buffers:
            HOST.release(host)
        self._requests, self._copies, self._buffers = [], (), ()


def p2p(ops: list[tuple[str, torch.Tensor, int]], group=None) -> Pending:
    """Post ``("send" | "recv", tensor, global peer rank)`` transfers together (one batch, so
    a ring or a halo exchange cannot deadlock on ordering) and return them in flight."""
    if not ops:
        return Pending([])
    if not staged(group, ops[0][1]):
        batch = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, group) for kind, t, peer in ops]
        return Pending(_posted(dist.batch_isend_irecv, batch))
    batch, copies, buffers = [], [], []
    for kind, t, peer in ops:
        if kind == "send":
            host = _to_host(t)
            buffers.append(host)
            batch.append(dist.P2POp(dist.isend, host, peer, group))
        else:
            host = _empty_host(t)
            copies.append((t, host))
            batch.append(dist.P2POp(dist.irecv, host, peer, group))
    return Pending(_posted(dist.batch_isend_irecv, batch), copies, buffers)
