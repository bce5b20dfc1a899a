"""Every message between rank 0 and its workers, declared: one record per message.

Rank 0 sends a worker commands (``Forward``, ``LoadStream``, ...) over its control connection, and
the worker answers (``Loaded``, ``Digests``, ...) or reports on its own (``Stats``, ``Error``,
``Released``). A worker cannot unpickle the pack's own classes by their names on rank 0 (ComfyUI
imports the pack under a mangled module name, and a worker on another host may import it under
another), so a record crosses the connection as plain data: ``wire`` turns it into a tuple of its
name and its fields (records inside it too) on one side, ``unwire`` back on the other. Those two
are called by the connections' ends only (``workers._Worker``, ``worker._Server``, and the
rendezvous with other hosts' agents: ``cluster``, ``agent``); everything else reads and builds
records. (The fork server's requests, JSON over its own socket, are not messages to a rank.)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


# ---------------------------------------------------------------- rank 0 -> worker
@dataclass(frozen=True)
class StatusTable:
    """The shared status table (pickled handle), None for a worker on another host."""
    table: bytes | None


@dataclass(frozen=True)
class Probe:
    """Measure the links and the compute (layout/probe.py)."""


@dataclass(frozen=True)
class Calibrate:
    """Time the candidate layouts of ``layout: auto`` (layout/auto.py)."""
    run: dict
    layouts: list


@dataclass(frozen=True)
class Mesh:
    """Form the process groups of a layout."""
    sizes: list


@dataclass(frozen=True)
class Load:
    """CPU ranks of one host: map rank 0's shared pages of a model (``plan``: plans.plan_wire's form)."""
    key: str
    plan: object
    data: bytes


@dataclass(frozen=True)
class LoadStream:
    """A model's skeleton, then its bytes over the stream (weights/stream.py) and, for the slots
    ``reads`` names (``(path, {slot: key})``), from the checkpoint file (weights/file_reads.py)."""
    key: str
    plan: object
    data: bytes
    wire: list
    tp: tuple
    channel: str
    bucket_bytes: int
    reads: tuple | None = None


@dataclass(frozen=True)
class Bucket:
    """One bucket of a stream sent by handles (CUDA IPC)."""
    payload: object


@dataclass(frozen=True)
class Drop:
    """Free a model (ComfyUI unloaded it)."""
    key: str


@dataclass(frozen=True)
class Digest:
    """Report a digest of every tensor of a model (tests, ``World.holdings``)."""
    key: str


@dataclass(frozen=True)
class Trim:
    """Give freed heap back to the system."""


@dataclass(frozen=True)
class RunSettings:
    """How one forward runs on every rank."""
    distributed_attention: bool
    compile: object            # parallel/compile_regions.CompileSettings, or None
    layout: list               # the layout's mesh sizes
    weights: tuple | None      # relative speed per rank for the token split
    ulysses: tuple             # (head groups that overlap the attention, overlapped return)


@dataclass(frozen=True)
class Forward:
    """Run ``method`` of model ``key`` on this rank's share of the inputs (``spec`` and ``meta``:
    protocol.flatten's form; the tensors follow as a broadcast)."""
    key: str
    method: str
    spec: object
    meta: list
    settings: RunSettings
    prompt: object             # the ComfyUI prompt it belongs to (memory peaks reset per prompt)
    patch_keys: list = field(default_factory=list)


@dataclass(frozen=True)
class Ping:
    """Answer ``Pong`` (tests)."""


@dataclass(frozen=True)
class Shutdown:
    """Release everything and exit."""


# ---------------------------------------------------------------- rank 0 <-> the agent of another host
@dataclass(frozen=True)
class AgentHello:
    """An agent (world/agent.py) joins rank 0's rendezvous: its host's name and what it has."""
    name: str
    info: dict


@dataclass(frozen=True)
class Spawn:
    """Start these workers (their bootstraps) on the agent's host."""
    boots: list


# ---------------------------------------------------------------- worker -> rank 0
@dataclass(frozen=True)
class Hello:
    rank: int
    pid: int


@dataclass(frozen=True)
class Ready:
    rank: int


@dataclass(frozen=True)
class Error:
    """The worker failed; ``report`` is its traceback."""
    rank: int
    report: str


@dataclass(frozen=True)
class Released:
    """The worker let go of every shared weight (before it exits)."""
    rank: int


@dataclass(frozen=True)
class Loaded:
    key: str


@dataclass(frozen=True)
class LoadHalted:
    """Cancel stopped the load of ``key``: the worker holds none of it."""
    key: str


@dataclass(frozen=True)
class BucketDone:
    """A bucket sent by handles was copied (rank 0 may free it)."""


@dataclass(frozen=True)
class Digests:
    digests: dict


@dataclass(frozen=True)
class ProbeResult:
    result: dict


@dataclass(frozen=True)
class Timings:
    """``Calibrate``'s answer."""
    timings: list


@dataclass(frozen=True)
class Trimmed:
    rank: int


@dataclass(frozen=True)
class Pong:
    rank: int


@dataclass(frozen=True)
class Stats:
    """A worker on another host: its status row (protocol.STATUS_FIELDS), then its RSS."""
    row: list


RECORDS = {cls.__name__: cls for cls in (
    StatusTable, Probe, Calibrate, Mesh, Load, LoadStream, Bucket, Drop, Digest, Trim, RunSettings, Forward, Ping,
    Shutdown, AgentHello, Spawn, Hello, Ready, Error, Released, Loaded, LoadHalted, BucketDone, Digests, ProbeResult, Timings,
    Trimmed, Pong, Stats)}


_NESTED = (RunSettings,)  # the records that travel inside another


def wire(record) -> tuple:
    """``record`` as plain data: its name, then its fields (a record among them turned alike)."""
    return (type(record).__name__,) + tuple(wire(value) if isinstance(value, _NESTED) else value
                                            for value in (getattr(record, f.name) for f in dataclasses.fields(record)))


def unwire(data: tuple):
    """The record ``wire`` made ``data`` of."""
    nested = {cls.__name__ for cls in _NESTED}
    return RECORDS[data[0]](*(unwire(value) if isinstance(value, tuple) and value[:1] and value[0] in nested
                              else value for value in data[1:]))
