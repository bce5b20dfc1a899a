"""Rank 0's view of a running world: worker processes, the process group, dispatch.

The ComfyUI process is rank 0. Workers are separate processes started with
``subprocess`` on ``worker.py`` (run by path: ComfyUI imports custom nodes under
mangled names that a child could not import). Each worker has:

- a control connection (AF_UNIX socket with a random key, loopback only) for
  commands, weights (shared-memory handles) and error reports;
- a place in one ``torch.distributed`` process group for the tensors.

Lockstep: rank 0 decides everything and tells the workers what to run; any
failure tears the whole world down so that no rank is left blocked in a
collective, and the next run starts fresh workers.
"""
from __future__ import annotations

import collections
import gc
import datetime
import inspect
import json
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Listener
from pathlib import Path

import torch
import torch.distributed as dist

from . import arguments, comm, compile_regions, memory, probe, protocol, transport
from .auto_layout import AutoLayouts
from .model_copies import ModelCopies
from .watchdog import SectionStopped, Watchdog, prepare_nccl_environment
from .config import MESH_DIMS, ParallelConfig, describe_sizes
from .mesh import MeshLayout, ProcessMesh
from .execution import run_sharded
from .plans import ModelPlan, check_supported_arguments

log = logging.getLogger("parallel")

PACK_ROOT = Path(__file__).resolve().parent.parent
WORKER_SCRIPT = Path(__file__).resolve().parent / "worker.py"


def _env_seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


STARTUP_TIMEOUT_S = _env_seconds("PARALLEL_STARTUP_TIMEOUT_S", 180)
# How long a guarded section (a forward, a decode) may go without any rank completing a
# collective before the watchdog takes it for a hang: not the length of the section, which may be
# anything while the ranks progress.
COLLECTIVE_TIMEOUT_S = _env_seconds("PARALLEL_COLLECTIVE_TIMEOUT_S", 300)
# The backends' own timeout for one collective: later than the watchdog's, which names the rank that hung.
BACKEND_TIMEOUT_S = COLLECTIVE_TIMEOUT_S + 60
SHUTDOWN_GRACE_S = 15.0  # for workers to unmap their weights and exit when told to
STATUS_FIELDS = protocol.STATUS_FIELDS
PROBE_ENV = "PARALLEL_PROBE"  # "0": no link and compute probe at world start (unless layout is auto)
# Pure Ulysses exchanges the heads in this many groups, each group's all-to-all overlapping the
# attention of the others (read on rank 0 at every forward; 1, the default: one exchange).
ULYSSES_CHUNKS_ENV = "PARALLEL_ULYSSES_CHUNKS"


def ulysses_chunks_setting() -> int:
    raw = os.environ.get(ULYSSES_CHUNKS_ENV, "1").strip() or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{ULYSSES_CHUNKS_ENV}={raw!r}: give a whole number of head groups, 1 or more "
                         "(1: one all-to-all per attention, no overlap)")
    return int(raw)


def mirrored_comfy_args(device_type: str) -> dict:
    """ComfyUI's command-line settings, for the workers to start with the same ones (attention
    backend, precision flags): every rank must compute the same way. Only plain values travel."""
    out = {}
    try:
        import comfy.cli_args

        for key, value in vars(comfy.cli_args.args).items():
            if value is None or isinstance(value, (bool, int, float, str)):
                out[key] = value
    except ImportError:
        pass
    out["cpu"] = device_type == "cpu"
    out.pop("cuda_device", None)  # each worker has its own device
    return out


def cpu_threads_per_rank(world_size: int) -> int:
    """CPU ranks share the cores: one share each, unless PARALLEL_CPU_THREADS_PER_RANK says otherwise."""
    env = os.environ.get("PARALLEL_CPU_THREADS_PER_RANK")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, (os.cpu_count() or 1) // world_size)


class WorkerFailure(RuntimeError):
    """A rank failed; the message names the rank and carries its traceback."""


class WorldStartError(RuntimeError):
    pass


class _Worker:
    """Rank 0's handle on one worker: a local process, or a rank on another host (``host``)."""

    def __init__(self, rank: int, device: str, proc: subprocess.Popen | None, host: str | None = None):
        self.rank = rank
        self.device = device
        self.proc = proc
        self.host = host
        self.remote_pid = None
        self.lost = False  # a remote worker's connection closed
        self.conn = None
        self.output = collections.deque(maxlen=200)  # last lines, for crash reports
        self.storages: dict[str, list] = {}  # model key -> shared storages this worker maps
        self.maps_status_table = False
        self.released = False  # it confirmed unmapping everything before exiting
        self.reported_error: str | None = None
        self.stats: list | None = None  # a remote worker's status row
        self._recv_lock = threading.Lock()  # the prompt thread and the status route both read
        # Messages read by someone other than the one waiting for them (the status route drains a
        # remote worker's connection at any time): kept here for the next recv, never dropped.
        self._inbox: collections.deque = collections.deque()
        if proc is not None:
            self._relay = threading.Thread(target=self._relay_output, name=f"parallel-rank{rank}-log", daemon=True)
            self._relay.start()

    def _relay_output(self):
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            self.output.append(line)
            log.info("[rank %d] %s", self.rank, line)

    @property
    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return not self.lost

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else self.remote_pid

    def recv(self, timeout: float):
        """One message, or None when nothing arrived within ``timeout``."""
        with self._recv_lock:
            if self._inbox:
                return self._inbox.popleft()
            try:
                if not self.conn.poll(timeout):
                    return None
                return self.conn.recv()
            except (EOFError, OSError):
                self.lost = True
                raise

    def drain(self) -> None:
        """Take note of what the worker sent on its own (error reports, releases, a remote worker's
        status). Anything else is a reply someone waits for: it stays in the inbox for ``recv``."""
        with self._recv_lock:
            try:
                while self.conn is not None and self.conn.poll(0):
                    msg = self.conn.recv()
                    if msg and msg[0] == "stats":
                        self.stats = msg[1]
                    elif msg and msg[0] == "released":
                        self.released = True
                    else:
                        if msg and msg[0] == "error" and self.reported_error is None:
                            self.reported_error = msg[2]
                        self._inbox.append(msg)
            except (EOFError, OSError):
                self.lost = True


class World:
    """One running set of ranks for one ParallelConfig."""

    def __init__(self, config: ParallelConfig, comfyui_path: str | None = None, comfy_args: dict | None = None):
        self.config = config
        self.layout = MeshLayout.from_sizes(config.mesh_sizes)
        self.world_size = config.world_size
        self.comfyui_path = comfyui_path or _guess_comfyui_path()
        self.comfy_args = comfy_args if comfy_args is not None else mirrored_comfy_args(config.device_type)
        self.device = torch.device(config.devices[0])
        self.threads = cpu_threads_per_rank(self.world_size) if config.device_type == "cpu" else None
        self.last_dispatch: dict[str, float] = {}
        self.workers: list[_Worker] = []
        self.mesh: ProcessMesh | None = None  # the config's layout
        self.current_layout = self.layout     # the layout of the last forward (layout: auto chooses per model)
        # Every layout this world has formed groups for (layout: auto runs each model in its own).
        self.meshes: dict[tuple[int, ...], ProcessMesh] = {}
        self._process_groups: dict[tuple[int, ...], object] = {}  # rank set -> group, shared by the meshes
        self.state = "starting"
        self.failure: str | None = None
        self.started_at = time.time()
        self.last_forward_ms: float | None = None
        self.probe: dict | None = None  # probe.py: what the ranks' links and compute measured
        self.auto = AutoLayouts(self)     # layout: auto, the layout chosen per model
        self.notes: list[str] = []        # what a user should know about this world's runs
        self.forwards = 0
        self.ready_at: float | None = None
        # The first forward: its duration (weights sent included) and when it ended after the
        # workers were ready (ComfyUI's own model loading in between included).
        self.first_forward: dict | None = None
        self._listener = None
        self._socket_dir = None
        self._store = None
        self._status_table = None
        self.startup_timeout = STARTUP_TIMEOUT_S
        self.copies = ModelCopies(self)
        self.watchdog = Watchdog(self._dead_ranks, self._stop_collectives, busy=self._compiling,
                                 progress=self._progress)
        self._lock = threading.RLock()

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> "World":
        if dist.is_initialized():
            raise WorldStartError("a torch.distributed process group already exists in this process "
                                  "(another extension started one); the parallel runtime needs its own")
        transport.use_shared_memory_strategy()
        comm.reset_abort()
        if self.config.backend == "nccl":  # before the workers start: they inherit it
            prepare_nccl_environment()
        try:
            self._start()
        except BaseException:
            self.shutdown("start failed")
            raise
        self.state = "ready"
        self.ready_at = time.monotonic()
        log.info("parallel world ready: %s, %d ranks in %.1fs", self.config.describe(), self.world_size,
                 time.time() - self.started_at)
        return self

    def _start(self):
        authkey = secrets.token_bytes(32)
        if self.config.multi_host:
            # Workers on other hosts reach rank 0 over TCP on the rendezvous address.
            from .cluster import listener_for, split_address

            bind_host, _ = split_address(self.config.rendezvous)
            cluster = listener_for(self.config.rendezvous)
            self._listener = Listener((bind_host, 0), family="AF_INET", authkey=authkey)
            address, store_host = list(self._listener.address), bind_host
        else:
            self._socket_dir = tempfile.mkdtemp(prefix="comfy-parallel-")
            address = os.path.join(self._socket_dir, "control.sock")
            self._listener = Listener(address, family="AF_UNIX", authkey=authkey)
            store_host = "127.0.0.1"
        timeout = datetime.timedelta(seconds=BACKEND_TIMEOUT_S)
        self._store = dist.TCPStore(store_host, 0, self.world_size, True, timeout=timeout, wait_for_workers=False)
        self._status_table = torch.zeros(self.world_size, len(STATUS_FIELDS), dtype=torch.float64).share_memory_()
        remote: dict[str, list] = {}
        for rank in range(1, self.world_size):
            host = self.config.host_of(rank)
            boot = {
                "rank": rank, "world_size": self.world_size, "mesh": self.config.mesh_sizes,
                "devices": list(self.config.devices), "backend": self.config.backend,
                "store_host": store_host, "store_port": self._store.port, "control_address": address,
                "authkey": authkey.hex(), "comfyui_path": self.comfyui_path, "pack_root": str(PACK_ROOT),
                "parent_pid": os.getpid(), "threads": self.threads, "timeout_s": BACKEND_TIMEOUT_S,
                "comfy_args": self.comfy_args, "remote": host is not None,
                # Objects of this pack that rank 0 pickles are named after its package as ComfyUI
                # imported it; workers alias that name to their own import.
                "rank0_package": __package__,
            }
            if host is not None:
                remote.setdefault(host, []).append(boot)
                self.workers.append(_Worker(rank, self.config.devices[rank], None, host))
                continue
            proc = subprocess.Popen([sys.executable, "-u", str(WORKER_SCRIPT)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=self.comfyui_path,
                                    start_new_session=False)
            # The key goes through a pipe, not argv or the environment, which other users could read.
            proc.stdin.write(json.dumps(boot).encode() + b"\n")
            proc.stdin.close()
            self.workers.append(_Worker(rank, self.config.devices[rank], proc))
        for host, boots in remote.items():
            conn, _ = cluster.agent(host, STARTUP_TIMEOUT_S)
            conn.send(("spawn", boots))
        self._accept_all(time.monotonic() + STARTUP_TIMEOUT_S)
        for w in self.workers:
            w.conn.send(("status_table", None if w.host else _pickled_shared(self._status_table)))
            w.maps_status_table = w.host is None
        dist.init_process_group(self.config.backend, store=self._store, rank=0, world_size=self.world_size,
                                timeout=timeout)
        self.mesh = ProcessMesh(self.layout, 0, self._process_groups)
        self.meshes[self.layout.sizes] = self.mesh
        for w in self.workers:
            self.expect(w, "ready", time.monotonic() + STARTUP_TIMEOUT_S)
        self._probe()

    def _probe(self):
        """Links and compute of these ranks (probe.py), once per device set in this process."""
        key = probe.cache_key(self.config, self.threads)
        self.probe = probe.cached(key)
        if self.probe is not None or os.environ.get(PROBE_ENV, "1") == "0" and not self.config.auto_layout:
            return
        for w in self.workers:
            w.conn.send(("probe",))
        with self._threads():
            mine = probe.run(self.device, 0, self.world_size)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        self.probe = probe.combine([mine] + [self.expect(w, "probe", deadline)[1] for w in self.workers])
        probe.remember(key, self.probe)
        log.info("parallel world: %s", probe.describe(self.probe))

    def _accept_all(self, deadline: float):
        pending = {w.rank: w for w in self.workers}
        accepted = []

        def accept_loop():
            try:
                for _ in range(len(pending)):
                    accepted.append(self._listener.accept())
            except OSError:
                pass

        t = threading.Thread(target=accept_loop, name="parallel-accept", daemon=True)
        t.start()
        while pending:
            while accepted:
                conn = accepted.pop()
                msg = conn.recv()
                if msg[0] != "hello" or msg[1] not in pending:
                    raise WorldStartError(f"unexpected first message from a worker: {msg!r}")
                worker = pending.pop(msg[1])
                worker.conn, worker.remote_pid = conn, msg[2]
            for w in pending.values():
                if w.proc is not None and not w.alive:
                    time.sleep(0.2)  # let the relay thread collect the last lines
                    raise WorldStartError(f"rank {w.rank} exited with code {w.proc.returncode} while starting:\n"
                                          + "\n".join(w.output))
            if time.monotonic() > deadline:
                raise WorldStartError(f"ranks {sorted(pending)} did not connect within {STARTUP_TIMEOUT_S:.0f}s")
            time.sleep(0.02)

    def expect(self, w: _Worker, kind: str, deadline: float):
        while True:
            try:
                msg = w.recv(0.05)
            except (EOFError, OSError):
                raise WorkerFailure(self._death_report(w))
            if msg is not None:
                if msg[0] == kind:
                    return msg
                if msg[0] == "stats":
                    w.stats = msg[1]
                    continue
                if msg[0] == "error":
                    w.reported_error = msg[2]
                    raise WorkerFailure(f"rank {w.rank} failed:\n{msg[2]}")
                raise WorldStartError(f"rank {w.rank} answered {msg[0]!r} where {kind!r} was expected")
            if not w.alive:
                raise WorkerFailure(self._death_report(w))
            if time.monotonic() > deadline:
                raise WorkerFailure(f"rank {w.rank} did not answer within {STARTUP_TIMEOUT_S:.0f}s")

    def _dead_ranks(self) -> list[int]:
        return [w.rank for w in self.workers if not w.alive]

    def _progress(self) -> float:
        """Grows while any rank completes collectives (the watchdog's liveness measure): rank 0's
        own count and each local worker's, which it publishes in the shared status table. A worker
        on another host has no shared table; rank 0's count stands for it (in lockstep a rank that
        stops soon stops every other)."""
        total = float(comm.PROGRESS.count)
        table = self._status_table
        if table is not None and self.world_size > 1:
            total += float(table[1:, protocol.STATUS_FIELDS.index("progress")].sum())
        return total

    def _stop_collectives(self, reason: str, hung: bool) -> None:
        """The watchdog's way out of a collective that cannot complete (see watchdog.py)."""
        if hung:  # a living rank that never arrives: kill the workers, their sockets close
            for w in self.workers:
                if w.proc is not None and w.proc.poll() is None:
                    w.proc.kill()
        # NCCL kernels do not notice a dead peer: abort them (the one place that aborts).
        comm.abort_collectives(self.config.backend)

    def shutdown(self, reason: str = "shutdown"):
        with self._lock:
            if self.state == "stopped":
                return
            self.state = "stopped"
            self.watchdog.close()
            died_on_their_own = {w.rank for w in self.workers if not w.alive}
            for w in self.workers:
                try:
                    if w.conn is not None and w.alive:
                        w.conn.send(("shutdown",))
                except (OSError, EOFError):
                    pass
            # Leave the process group first: a worker still blocked in a collective with us then
            # fails at once, releases its weights and exits, instead of waiting for a timeout.
            # The subgroups close their connections only once nothing references them.
            self.mesh = None
            self.meshes.clear()
            self._process_groups.clear()
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # a broken group still has to go
                    log.debug("destroy_process_group failed", exc_info=True)
            gc.collect()
            deadline = time.monotonic() + SHUTDOWN_GRACE_S
            for w in self.workers:
                if w.proc is None:  # on another host: it exits when told, or when its connection closes
                    while w.conn is not None and not w.released and not w.lost and time.monotonic() < deadline:
                        w.drain()
                        time.sleep(0.05)
                    if w.conn is not None:
                        w.conn.close()
                    continue
                try:
                    w.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    w.proc.wait(5)
                w.drain()
                if w.conn is not None:
                    w.conn.close()
                if w.rank in died_on_their_own and not w.released:
                    # It died (SIGKILL, crash) still mapping the shared weights: give back its
                    # references, or the files would outlive the weights. A worker that stopped
                    # while releasing them is left alone: a leak is better than a file pulled
                    # from under a rank that still uses it.
                    for storages in w.storages.values():
                        transport.release_for_dead_receiver(storages)
                    if w.maps_status_table:
                        transport.release_for_dead_receiver([self._status_table.untyped_storage()])
                elif not w.released and w.storages:
                    log.warning("rank %d was stopped before it released its shared weights; their shared "
                                "memory is freed when ComfyUI exits", w.rank)
                w.storages.clear()
            if self._listener is not None:
                self._listener.close()
            if self._socket_dir:
                for name in os.listdir(self._socket_dir):
                    os.unlink(os.path.join(self._socket_dir, name))
                os.rmdir(self._socket_dir)
                self._socket_dir = None
            self._store = None
            comm.HOST.clear()  # the staging pool's pinned buffers (shared across worlds)
            log.info("parallel world stopped (%s)", reason)

    @property
    def healthy(self) -> bool:
        return self.state == "ready" and all(w.alive for w in self.workers)

    # ---------------------------------------------------------------- models
    @property
    def param_bytes_rank0(self) -> int:
        return self.copies.param_bytes_rank0

    def release(self, module: torch.nn.Module) -> bool:
        """ComfyUI unloaded ``module``: free it on every rank."""
        with self._lock:
            return self.copies.release(module)

    def holdings(self, module: torch.nn.Module) -> dict[int, dict]:
        """rank -> {tensor name: (shape, dtype, sha256)} of what each rank holds of ``module``
        (rank 0: what it runs), to check what arrived where without moving the weights."""
        from .tensor_parallel import named_tensors

        run_module = self.copies.run_module(module)
        if run_module is None:
            raise KeyError(f"the ranks hold no {type(module).__name__}")
        out = {0: {name: transport.tensor_digest(t) for name, t in named_tensors(run_module)}}
        key = self.copies.key_of(module)
        deadline = time.monotonic() + self.startup_timeout
        for w in self.workers:
            w.conn.send(("digest", key))
            out[w.rank] = self.expect(w, "digest", deadline)[1]
        return out

    # ---------------------------------------------------------------- forward
    def forward(self, module: torch.nn.Module, plan: ModelPlan, method, args: tuple, kwargs: dict, source=None,
                distributed_attention: bool = True, compile=None, layout: MeshLayout | None = None,
                weights: tuple[float, ...] | None = None, ulysses_chunks: int | None = None):
        """Run ``method(*args, **kwargs)`` of ``module`` on every rank, context-parallel.

        ``method`` is rank 0's bound callable (it may be a wrapper chain ending in a
        method of ``module``); workers call the method of the same name on their copy.
        ``source`` (``comfy_weights.WeightSource``) says where the weights come from in
        ComfyUI and when they changed; without it the module's tensors are sent as they are,
        once. ``compile`` (compile_regions.CompileSettings): every rank runs the plan's blocks compiled.
        ``layout``: the ranks' layout for this model (same world size; default: the config's).
        ``weights``: relative speed per rank for the token split (default: the config's, or what
        layout auto measured; () for an even split). ``ulysses_chunks``: head groups of a pure
        Ulysses exchange that overlap the attention (default: PARALLEL_ULYSSES_CHUNKS, else 1).
        """
        if self.state != "ready":
            raise WorkerFailure(f"the parallel world is {self.state}: {self.failure or ''}")
        t0 = time.perf_counter()
        chunks = ulysses_chunks if ulysses_chunks is not None else ulysses_chunks_setting()
        plan = plan.for_module(module)
        method_name = _method_name(method)
        bound = inspect.signature(_method_of(module, method_name)).bind(*args, **kwargs)
        check_supported_arguments(plan, bound)
        choose = layout is None and self.config.auto_layout and plan.kind == "transformer"
        if layout is not None and layout.world_size != self.world_size:
            raise ValueError(f"layout {layout.sizes} has {layout.world_size} ranks; this world has {self.world_size}")
        layout = layout or self.layout
        if choose:  # the model runs alone on rank 0 up to its blocks: on its own copy of the options
            trial = inspect.signature(_method_of(module, method_name)).bind(*bound.args, **bound.kwargs)
            arguments.set_options(trial, dict(arguments.get_options(bound) or {}))
        worker_bound = inspect.signature(_method_of(module, method_name)).bind(*bound.args, **bound.kwargs)
        if plan.kind == "transformer":  # text encoders take no transformer_options
            options = arguments.get_options(bound)
            arguments.set_options(worker_bound, protocol.worker_transformer_options(options))
        tensors: list = []
        spec = protocol.flatten((worker_bound.args, worker_bound.kwargs), tensors)
        meta = protocol.tensor_meta(tensors)
        t_prepared = time.perf_counter()
        # Nothing has reached a worker yet: errors above leave the world usable.
        try:
            if choose:  # inside: the ranks time the candidates, a failure there ends the world like any other
                layout = self.auto.layout_for(module, plan, _method_of(module, method_name), trial.args, trial.kwargs)
            if plan.kind == "transformer":
                self._note_idle_cfg(layout, bound)
            self.current_layout = layout
            if weights is None:
                weights = self.config.weights or (self.auto.weights_for(module) if self.config.auto_layout else ())
            sends = self.copies.sends
            with self.watchdog.guard("process groups", STARTUP_TIMEOUT_S):
                mesh = self.mesh_for(layout)
            with self.watchdog.guard("weight send", STARTUP_TIMEOUT_S):
                key, run_module = self.copies.ensure(module, plan, source, layout)
            started = time.perf_counter()
            with self._threads(), self.watchdog.guard("forward", COLLECTIVE_TIMEOUT_S):
                prompt = memory.current_prompt()  # a new prompt resets every rank's memory peaks
                memory.PEAKS.begin(prompt, self.device)
                for w in self.workers:
                    w.conn.send(("forward", key, method_name, spec, meta, distributed_attention, compile,
                                 list(layout.sizes), weights, chunks, prompt))
                t_sent = time.perf_counter()
                protocol.broadcast_tensors(tensors, meta, self.device)
                t_broadcast = time.perf_counter()
                # What rank 0 spends on dispatch besides the input broadcast (a collective).
                self.last_dispatch = {"prepare_ms": (t_prepared - t0) * 1e3,
                                      "weights_check_ms": (started - t_prepared) * 1e3,
                                      "send_ms": (t_sent - started) * 1e3, "broadcast_ms": (t_broadcast - t_sent) * 1e3}
                # With TP rank 0 runs its shard; ours is the innermost wrapper, so calling the
                # shard's method directly is what the wrapper chain would have done.
                call = method if run_module is module else _method_of(run_module, method_name)
                with compile_regions.watched(compile, (key, repr(layout.sizes)), meta):
                    out = run_sharded(run_module, plan, mesh, call, _method_of(run_module, method_name),
                                      bound.args, bound.kwargs, distributed_attention=distributed_attention,
                                      compile=compile, weights=weights, ulysses_chunks=chunks)
                comm.synchronize(self.device)  # a step's time, not the time to queue its kernels
            self.last_forward_ms = (time.perf_counter() - started) * 1e3
            memory.PEAKS.sample(self.device)  # USS peak (CPU ranks)
            self.forwards += 1
            if self.first_forward is None:
                self.first_forward = {"seconds": round(time.perf_counter() - t0, 3),
                                      "after_ready_s": round(time.monotonic() - self.ready_at, 3)}
            if self.copies.sends != sends:  # this forward carried a model to the ranks
                self.copies.last_send["forward_s"] = round(time.perf_counter() - t0, 3)
            return out
        except BaseException as exc:
            mesh = None  # noqa: F841  (this frame must not keep the subgroups open through the shutdown)
            if self.watchdog.hung:  # it killed the workers: their deaths say nothing
                failure = f"{self.watchdog.fired}; every rank was stopped and the next run starts fresh workers"
            else:
                failure = self._explain_failure(exc)
                if failure is None and isinstance(exc, SectionStopped):
                    failure = f"{exc}; every rank was stopped and the next run starts fresh workers"
            self.failure = failure or f"rank 0: {type(exc).__name__}: {exc}"
            self.state = "failed"
            self.shutdown("a rank failed" if failure else f"rank 0 raised {type(exc).__name__}")
            if failure:
                raise WorkerFailure(failure) from exc
            raise

    def calibrate(self, run: dict, layouts: list) -> list[dict]:
        """Every rank times attention and a matmul at a run's size at once (auto_layout.calibrate)."""
        from .auto_layout import calibrate

        with self.watchdog.guard("layout timings", STARTUP_TIMEOUT_S):
            for w in self.workers:
                w.conn.send(("calibrate", run, layouts))
            with self._threads():
                mine = calibrate(run, layouts, self.device)
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            return [mine] + [self.expect(w, "calibrate", deadline)[1] for w in self.workers]

    def _note_idle_cfg(self, layout: MeshLayout, bound) -> None:
        """A cfg dimension with nothing to split (CFG 1, or cond and uncond run apart) is said in the status."""
        cfg = layout.size("cfg")
        first = next(iter(bound.arguments.values()), None)
        batch = first.shape[0] if isinstance(first, torch.Tensor) and first.ndim else 1
        if cfg > 1 and batch % cfg:
            note = (f"cfg_size {cfg} has nothing to split: the model runs with a batch of {batch} (CFG 1, or "
                    f"ComfyUI running cond and uncond apart), so the {cfg} cfg groups compute the same thing; "
                    "set cfg_size 1 (or layout auto) and give the ranks to ulysses or ring")
            if note not in self.notes:
                log.warning("parallel: %s", note)
                self.notes.append(note)

    def mesh_for(self, layout: MeshLayout) -> ProcessMesh:
        """This world's process groups for ``layout``, formed on every rank the first time."""
        mesh = self.meshes.get(layout.sizes)
        if mesh is None:
            for w in self.workers:
                w.conn.send(("mesh", list(layout.sizes)))
            mesh = self.meshes[layout.sizes] = ProcessMesh(layout, 0, self._process_groups)  # every rank, in order
            log.info("parallel world: process groups for layout %s formed", describe_sizes(dict(zip(MESH_DIMS, layout.sizes))))
        return mesh

    def _threads(self):
        world = self

        class _Threads:
            def __enter__(self):
                self.saved = torch.get_num_threads()
                if world.threads is not None and world.threads != self.saved:
                    torch.set_num_threads(world.threads)

            def __exit__(self, *exc):
                if torch.get_num_threads() != self.saved:
                    torch.set_num_threads(self.saved)
        return _Threads()

    def _explain_failure(self, exc: BaseException) -> str | None:
        """Which worker failed and why, if one did (waits briefly for its report).

        A rank that died without a word (SIGKILL, OOM killer, segfault) is the cause; its peers
        then fail in their collectives with "connection reset" and report that first. So a
        silent death wins over reported errors, and a reported error is only trusted once a
        short grace period has shown no rank died."""
        started = time.monotonic()
        first_report = None
        while True:
            dead = [w for w in self.workers if not w.alive]
            for w in self.workers:  # after the liveness check: a dying worker sends its error before exiting
                w.drain()
            reported = [w for w in self.workers if w.reported_error]
            silent_dead = [w for w in dead if not w.reported_error]
            now = time.monotonic()
            if reported and first_report is None:
                first_report = now
            if silent_dead and (reported or now - started > 0.5):
                return "\n".join(self._death_report(w) for w in silent_dead)
            if reported and now - first_report > 0.5:
                w = reported[0]
                return f"rank {w.rank} ({w.device}) raised an error:\n{w.reported_error}"
            if now - started > 2.0:
                return None
            time.sleep(0.05)

    def _death_report(self, w: _Worker) -> str:
        if w.proc is None:
            return (f"rank {w.rank} on host {w.host} (pid {w.remote_pid}) lost its connection during the run; the "
                    "other ranks were stopped and the next run starts fresh workers (is that host up?)")
        code = w.proc.poll()
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        tail = "\n".join(list(w.output)[-20:])
        return (f"rank {w.rank} ({w.device}, pid {w.proc.pid}) {how} during the run; the other ranks were stopped "
                f"and the next run starts fresh workers." + (f"\nIts last output:\n{tail}" if tail else ""))

    # ---------------------------------------------------------------- status
    def _compiling(self) -> bool:
        """A rank is compiling (the first compiled step can outlast the collective timeout)."""
        if compile_regions.watch().compiling:
            return True
        # On another host a worker's last "stats" message says. Only a forward compiles, so only
        # then is it read (replies read here stay in the worker's inbox, see _Worker.drain).
        for w in (self.workers if self.watchdog.section == "forward" else ()):
            if w.host is not None:
                w.drain()
                if w.stats is not None and w.stats[protocol.COMPILE_FIELDS.start] > 0:
                    return True
        table = self._status_table
        return table is not None and bool((table[1:, protocol.COMPILE_FIELDS.start] > 0).any())

    def status(self) -> dict:
        from .memory import PEAKS, figures_from_row, process_memory, with_current

        ranks = []
        table = self._status_table
        pids = [os.getpid()] + [w.pid for w in self.workers]
        for rank, pid in enumerate(pids):
            if rank == 0:
                alive, device = True, self.config.devices[0]
                last_ms, nbytes, forwards = self.last_forward_ms, self.param_bytes_rank0, self.forwards
                gpu = protocol.device_memory(self.device)
                peaks = PEAKS.figures(self.device)  # peaks of the last prompt, staging pool (memory.PeakMemory)
                compiling, compiles, recompiles, hits, misses = compile_regions.watch().row()
            else:
                w = self.workers[rank - 1]
                if w.host is not None:
                    w.drain()
                alive, device = w.alive, w.device
                row = w.stats if w.host is not None else None
                if row is None:
                    row = table[rank].tolist() if table is not None else [0.0] * len(STATUS_FIELDS)
                last_ms = row[0] if row[2] > 0 else None
                nbytes, forwards = int(row[1]), int(row[2])
                gpu = (row[4], row[5]) if len(row) > 5 and row[4] >= 0 else (None, None)
                compiling, compiles, recompiles, hits, misses = row[protocol.COMPILE_FIELDS]
                peaks = figures_from_row(row)
                if torch.device(device).type != "cuda":  # the row's zeros before its first report
                    peaks["gpu_peak_allocated_bytes"] = peaks["gpu_peak_reserved_bytes"] = None
            if rank > 0 and self.workers[rank - 1].host is not None:  # another host: what it reported
                rss = row[len(STATUS_FIELDS)] if len(row) > len(STATUS_FIELDS) else None
                mem = {"rss_bytes": int(rss) if rss else None, "pss_bytes": None}
            else:
                mem = process_memory(pid) if alive else {"rss_bytes": None, "pss_bytes": None, "uss_bytes": None}
            peaks = with_current(peaks, mem, device)
            ranks.append({"rank": rank, "device": device, "pid": pid, "alive": alive, "param_bytes": nbytes,
                          **mem, "gpu_allocated_bytes": None if gpu[0] is None else int(gpu[0]),
                          "gpu_reserved_bytes": None if gpu[1] is None else int(gpu[1]),
                          "last_forward_ms": None if last_ms is None else round(last_ms, 3), "forwards": forwards,
                          "coords": self.current_layout.coords(rank), "host": self.config.host_of(rank) or "local",
                          "compiling": bool(compiling), "compiles": int(compiles), "recompiles": int(recompiles),
                          "compile_cache": {"hits": int(hits), "misses": int(misses)}, **peaks})
        mesh = dict(zip(MESH_DIMS, self.current_layout.sizes)) if self.config.auto_layout else self.config.mesh_sizes
        return {"world_size": self.world_size, "mesh": mesh, "backend": self.config.backend,
                "transport": self.copies.transport,
                "transport_reason": self.copies.transport_reason, "last_weight_send": self.copies.last_send or None,
                "first_forward": self.first_forward, "probe": self.probe, "layout": self.config.layout,
                "layouts": self.auto.status(), "notes": list(self.notes),
                "state": self.state, "failure": self.failure, "forwards": self.forwards,
                "compiling": any(r["compiling"] for r in ranks), "peaks_prompt": PEAKS.prompt_id,
                "ranks": ranks}


def _pickled_shared(t: torch.Tensor) -> bytes:
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(t)
    return buf.getvalue()


def _method_of(module: torch.nn.Module, name: str):
    """The class's method bound to ``module`` (not an instance-level override such as the
    dispatch an object patch installs on a text encoder's ``forward``)."""
    return getattr(type(module), name).__get__(module)


def _method_name(method) -> str:
    """The name of the model method at the end of a wrapper chain (``_forward`` for ComfyUI models)."""
    target = getattr(method, "original", method)  # comfy.patcher_extension.WrapperExecutor
    func = getattr(target, "__func__", target)
    return func.__name__


def _guess_comfyui_path() -> str:
    env = os.environ.get("COMFYUI_PATH")
    if env:
        return env
    import comfy.model_management  # ComfyUI's own package sits in the ComfyUI root (a namespace package)

    return str(Path(comfy.model_management.__file__).resolve().parent.parent)


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
