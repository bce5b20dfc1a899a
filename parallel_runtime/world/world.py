"""Rank 0's view of a running world: its lifecycle (worker processes, the process group, status).

The ComfyUI process is rank 0. Workers are separate processes (``spawn.py`` starts them,
``worker.py`` is what they run). Each worker has:

- a control connection (AF_UNIX socket with a random key, loopback only) for
  commands, weights (shared-memory handles) and error reports;
- a place in one ``torch.distributed`` process group for the tensors.

Lockstep: rank 0 decides everything and tells the workers what to run; any
failure tears the whole world down so that no rank is left blocked in a
collective, and the next run starts fresh workers. ``World`` is this module's lifecycle (start,
watch, stop, status) and ``dispatch.py``'s ``Dispatch`` (what a prompt runs on the ranks).
"""
from __future__ import annotations

import datetime
import gc
import io
import logging
import os
import pickle
import secrets
import subprocess
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Listener
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.distributed as dist

from . import load_progress, memory, protocol, settings
from .cluster import listener_for, split_address
from .dispatch import Dispatch
from .memory import device_type, figures_from_row, recent_process_memory, with_current
from .spawn import PACK_ROOT, start_local_worker
from .watchdog import Watchdog, prepare_nccl_environment
from .workers import WorkerFailure, WorldStartError, _Worker
from ..config import MESH_DIMS, ParallelConfig
from ..distributed import comm, messages
from ..distributed.mesh import MeshLayout, ProcessMesh
from ..layout import probe
from ..layout.auto import AutoLayouts
from ..parallel import compile_regions
from ..parallel.heads import head_share, real_heads
from ..weights import file_reads, pickling, stream
from ..weights.model_copies import ModelCopies

log = logging.getLogger("parallel")

STATUS_FIELDS = protocol.STATUS_FIELDS
# Objects of this pack that rank 0 pickles are named after its package as ComfyUI imported it;
# workers alias that name to their own import (worker.py).
RUNTIME_PACKAGE = __package__.rpartition(".")[0]


class World(Dispatch):
    """One running set of ranks for one ParallelConfig."""

    def __init__(self, config: ParallelConfig, comfyui_path: str | None = None, comfy_args: dict | None = None,
                 on_load=None, load_cancelled=None):
        self.config = config
        self.on_load = on_load  # () -> a listener of one load's progress (load_progress.watching)
        self.load_cancelled = load_cancelled or (lambda: False)  # () -> Cancel was pressed (ComfyUI's flag)
        self.layout = MeshLayout.from_sizes(config.mesh_sizes)
        self.world_size = config.world_size
        self.comfyui_path = comfyui_path or _guess_comfyui_path()
        self.comfy_args = comfy_args if comfy_args is not None else settings.mirrored_comfy_args(config.device_type)
        self.device = torch.device(config.devices[0])
        self.threads = settings.cpu_threads_per_rank(self.world_size) if config.device_type == "cpu" else None
        self.last_dispatch: dict[str, float] = {}
        self.workers: list[_Worker] = []
        self.mesh: ProcessMesh | None = None  # the config's layout
        self.current_layout = self.layout     # the layout of the last forward (layout: auto chooses per model)
        self.last_heads: int | None = None    # attention heads of the last transformer forward's model
        # Every layout this world has formed groups for (layout: auto runs each model in its own).
        self.meshes: dict[tuple[int, ...], ProcessMesh] = {}
        self._process_groups: dict[tuple[int, ...], object] = {}  # rank set -> group, shared by the meshes
        self.state = "starting"
        self.failure: str | None = None
        self.started_at = time.time()
        self.last_forward_ms: float | None = None
        self.probe: dict | None = None  # layout/probe.py: what the ranks' links and compute measured
        self.auto = AutoLayouts(self)     # layout: auto, the layout chosen per model
        self.notes: list[str] = []        # what a user should know about this world's runs
        self.forwards = 0
        self.last_prompt = None  # the ComfyUI prompt of the last forward (memory.current_prompt)
        self.ready_at: float | None = None
        # The first forward: its duration (weights sent included) and when it ended after the
        # workers were ready (ComfyUI's own model loading in between included).
        self.first_forward: dict | None = None
        self._listener = None
        self._socket_dir = None
        self._store = None
        self._status_table = None
        self.startup_timeout = settings.STARTUP_TIMEOUT_S
        self.copies = ModelCopies(self)
        self.watchdog = Watchdog(self._dead_ranks, self._stop_collectives, busy=self._compiling,
                                 progress=self._progress)
        self._lock = threading.RLock()

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> "World":
        if dist.is_initialized():
            raise WorldStartError("a torch.distributed process group already exists in this process "
                                  "(another extension started one); the parallel runtime needs its own")
        pickling.use_shared_memory_strategy()
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
            bind_host, _ = split_address(self.config.rendezvous)
            cluster = listener_for(self.config.rendezvous)
            self._listener = Listener((bind_host, 0), family="AF_INET", authkey=authkey)
            address, store_host = list(self._listener.address), bind_host
        else:
            self._socket_dir = tempfile.mkdtemp(prefix="comfy-parallel-")
            address = os.path.join(self._socket_dir, "control.sock")
            self._listener = Listener(address, family="AF_UNIX", authkey=authkey)
            store_host = "127.0.0.1"
        timeout = datetime.timedelta(seconds=settings.BACKEND_TIMEOUT_S)
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
                "parent_pid": os.getpid(), "threads": self.threads, "timeout_s": settings.BACKEND_TIMEOUT_S,
                "comfy_args": self.comfy_args, "remote": host is not None, "rank0_package": RUNTIME_PACKAGE,
            }
            if host is not None:
                remote.setdefault(host, []).append(boot)
                self.workers.append(_Worker(rank, self.config.devices[rank], None, host))
                continue
            proc = start_local_worker(boot, self.comfyui_path, settings.STARTUP_TIMEOUT_S)
            self.workers.append(_Worker(rank, self.config.devices[rank], proc))
        for host, boots in remote.items():
            conn, _ = cluster.agent(host, settings.STARTUP_TIMEOUT_S)
            conn.send(messages.wire(messages.Spawn(boots)))
        self._accept_all(time.monotonic() + settings.STARTUP_TIMEOUT_S)
        for w in self.workers:
            w.send(messages.StatusTable(None if w.host else _pickled_shared(self._status_table)))
            w.maps_status_table = w.host is None
        dist.init_process_group(self.config.backend, store=self._store, rank=0, world_size=self.world_size,
                                timeout=timeout)
        self.mesh = ProcessMesh(self.layout, 0, self._process_groups)
        self.meshes[self.layout.sizes] = self.mesh
        for w in self.workers:
            self.expect(w, messages.Ready, time.monotonic() + settings.STARTUP_TIMEOUT_S)
        self._probe()

    def _probe(self):
        """Links and compute of these ranks (layout/probe.py), once per device set in this process."""
        key = probe.cache_key(self.config, self.threads)
        self.probe = probe.cached(key)
        if self.probe is not None or os.environ.get(settings.PROBE_ENV, "1") == "0" and not self.config.auto_layout:
            return
        for w in self.workers:
            w.send(messages.Probe())
        with self._threads():
            mine = probe.run(self.device, 0, self.world_size)
        deadline = time.monotonic() + settings.STARTUP_TIMEOUT_S
        self.probe = probe.combine([mine] + [self.expect(w, messages.ProbeResult, deadline).result
                                             for w in self.workers])
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
                msg = messages.unwire(conn.recv())
                if not isinstance(msg, messages.Hello) or msg.rank not in pending:
                    raise WorldStartError(f"unexpected first message from a worker: {msg!r}")
                worker = pending.pop(msg.rank)
                worker.conn, worker.remote_pid = conn, msg.pid
            for w in pending.values():
                if w.proc is not None and not w.alive:
                    time.sleep(0.2)  # let the relay thread collect the last lines
                    raise WorldStartError(f"rank {w.rank} exited with code {w.proc.returncode} while starting:\n"
                                          + "\n".join(w.output))
            if time.monotonic() > deadline:
                raise WorldStartError(f"ranks {sorted(pending)} did not connect within {settings.STARTUP_TIMEOUT_S:.0f}s")
            time.sleep(0.02)

    def expect(self, w: _Worker, kind: type | tuple[type, ...], deadline: float, patient: bool = False,
               waiting=None):
        """The next message of ``w``, which must be a ``kind`` record (distributed/messages.py; Stats
        reports are taken in passing). ``patient``: while the world progresses (a worker reading a
        big checkpoint cold ticks its progress per tensor) the deadline moves on by the start-up
        timeout: a long load is no hang. ``waiting()`` is called every 50 ms without an answer."""
        progress = self._progress() if patient else None
        while True:
            try:
                msg = w.recv(0.05)
            except (EOFError, OSError):
                raise WorkerFailure(self._death_report(w))
            if msg is not None:
                if isinstance(msg, kind):
                    return msg
                if isinstance(msg, messages.Stats):
                    w.stats = msg.row
                    continue
                if isinstance(msg, messages.Error):
                    w.reported_error = msg.report
                    raise WorkerFailure(f"rank {w.rank} failed:\n{msg.report}")
                raise WorldStartError(f"rank {w.rank} answered {type(msg).__name__} where {kind} was expected")
            if not w.alive:
                raise WorkerFailure(self._death_report(w))
            if waiting is not None:
                waiting()
            if patient and self._progress() != progress:
                progress, deadline = self._progress(), time.monotonic() + self.startup_timeout
            if time.monotonic() > deadline:
                raise WorkerFailure(f"rank {w.rank} did not answer within {settings.STARTUP_TIMEOUT_S:.0f}s")

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
            self._tell_workers_to_stop()
            self._leave_process_groups()
            deadline = time.monotonic() + settings.SHUTDOWN_GRACE_S
            for w in self.workers:
                self._wait_for_worker(w, deadline, died_on_their_own)
            self._close_rendezvous()
            log.info("parallel world stopped (%s)", reason)

    def _tell_workers_to_stop(self):
        for w in self.workers:
            try:
                if w.conn is not None and w.alive:
                    w.send(messages.Shutdown())
            except (OSError, EOFError):
                pass

    def _leave_process_groups(self):
        """Leave the process group first: a worker still blocked in a collective with us then
        fails at once, releases its weights and exits, instead of waiting for a timeout. The
        subgroups close their connections only once nothing references them: the kept buffers go
        first, the shared-memory exchange's among them, which is keyed by its process groups (held,
        they kept a worker blocked on us until the shutdown grace killed it, weights still mapped)."""
        comm.clear_pools()
        self.mesh = None
        self.meshes.clear()
        self._process_groups.clear()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group still has to go
                log.debug("destroy_process_group failed", exc_info=True)
        gc.collect()

    def _wait_for_worker(self, w, deadline: float, died_on_their_own: set[int]):
        if w.proc is None:  # on another host: it exits when told, or when its connection closes
            while w.conn is not None and not w.released and not w.lost and time.monotonic() < deadline:
                w.drain()
                time.sleep(0.05)
            if w.conn is not None:
                w.conn.close()
            return
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
                pickling.release_for_dead_receiver(storages)
            if w.maps_status_table:
                pickling.release_for_dead_receiver([self._status_table.untyped_storage()])
        elif not w.released and w.storages:
            log.warning("rank %d was stopped before it released its shared weights; their shared "
                        "memory is freed when ComfyUI exits", w.rank)
        w.storages.clear()

    def _close_rendezvous(self):
        if self._listener is not None:
            self._listener.close()
        if self._socket_dir:
            for name in os.listdir(self._socket_dir):
                os.unlink(os.path.join(self._socket_dir, name))
            os.rmdir(self._socket_dir)
            self._socket_dir = None
        self._store = None

    @property
    def healthy(self) -> bool:
        return self.state == "ready" and all(w.alive for w in self.workers)

    def lost_during(self, prompt) -> str | None:
        """Why this world cannot go on with ``prompt``: a rank died between two of the prompt's
        forwards. Such a prompt fails, as when the rank dies during a forward: replacing the rank
        in the middle of it would hide the death (the OOM killer, a crash)."""
        if prompt is None or prompt != self.last_prompt or self.state != "ready":
            return None
        dead = [w for w in self.workers if not w.alive]
        return "\n".join(self._death_report(w) for w in dead) or None

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

    def _heads_of(self, rank: int) -> dict | None:
        """The attention heads this rank held in the last transformer forward: ``real`` ones and
        ``attended`` (the Ulysses share, padding included: parallel/heads.py); None before one."""
        if not self.last_heads:
            return None
        sizes = dict(zip(MESH_DIMS, self.current_layout.sizes))
        local = max(1, self.last_heads // sizes["tp"])
        ulysses = self.current_layout.coords(rank)["ulysses"]
        return {"real": real_heads(local, sizes["ulysses"])[ulysses], "attended": head_share(local, sizes["ulysses"])}

    def _row_of(self, w: _Worker) -> list[float]:
        """``w``'s status row: from the shared table, or on another host its last report (read, not
        drained: any thread may ask)."""
        row = w.stats if w.host is not None else None
        if row is None:
            table = self._status_table
            row = table[w.rank].tolist() if table is not None else [0.0] * len(STATUS_FIELDS)
        return row

    def load_rows(self) -> list[tuple[float, ...]]:
        """Every rank's ``protocol.LOAD_FIELDS``, rank 0 first."""
        return [_own_load()] + [_load_of(self._row_of(w)) for w in self.workers]

    def stop_loads(self) -> None:
        """Workers reading weights from a file stop (they watch rank 0's row of the shared table)."""
        if self._status_table is not None:
            self._status_table[0, protocol.LOAD_STOPS_FIELD] += 1

    def loading(self):
        """The block sends a model to the ranks: ``on_load`` hears how far (load_progress.py)."""
        return load_progress.watching(self.load_rows, self.on_load)

    def status(self) -> dict:
        ranks = []
        table = self._status_table
        pids = [os.getpid()] + [w.pid for w in self.workers]
        for rank, pid in enumerate(pids):
            if rank == 0:
                alive, device = True, self.config.devices[0]
                last_ms, nbytes, forwards = self.last_forward_ms, self.param_bytes_rank0, self.forwards
                gpu = protocol.device_memory(self.device)
                peaks = memory.PEAKS.figures(self.device)  # peaks of the last prompt, staging pool (memory.PeakMemory)
                compiling, compiles, recompiles, hits, misses = compile_regions.watch().row()
                load = _own_load()
            else:
                w = self.workers[rank - 1]
                if w.host is not None:
                    w.drain()
                alive, device = w.alive, w.device
                row = self._row_of(w)
                last_ms = row[0] if row[2] > 0 else None
                nbytes, forwards = int(row[1]), int(row[2])
                # A CPU rank's row holds zeros there until its first full report (during its first load).
                gpu = (row[4], row[5]) if len(row) > 5 and row[4] >= 0 and device_type(device) in ("cuda", None) \
                    else (None, None)
                compiling, compiles, recompiles, hits, misses = row[protocol.COMPILE_FIELDS]
                load = _load_of(row)
                peaks = figures_from_row(row)
                peaks["device_weight_peak_bytes"] = None  # rank 0's figure (a worker holds only its copies: param_bytes)
                # A CPU rank's row holds zeros there before its first report; a rank on another host
                # (device "@host" here) says by its report whether it has a GPU.
                if device_type(device) not in ("cuda", None) or gpu[0] is None:
                    peaks["gpu_peak_allocated_bytes"] = peaks["gpu_peak_reserved_bytes"] = None
            if rank > 0 and self.workers[rank - 1].host is not None:  # another host: what it reported
                rss = row[len(STATUS_FIELDS)] if len(row) > len(STATUS_FIELDS) else None
                mem = {"rss_bytes": int(rss) if rss else None, "pss_bytes": None, "uss_bytes": None}
            else:
                mem = (recent_process_memory(pid) if alive
                       else {"rss_bytes": None, "pss_bytes": None, "uss_bytes": None})
            peaks = with_current(peaks, mem, device)
            ranks.append({"rank": rank, "device": device, "pid": pid, "alive": alive, "param_bytes": nbytes,
                          **mem, "gpu_allocated_bytes": None if gpu[0] is None else int(gpu[0]),
                          "gpu_reserved_bytes": None if gpu[1] is None else int(gpu[1]),
                          "last_forward_ms": None if last_ms is None else round(last_ms, 3), "forwards": forwards,
                          "coords": self.current_layout.coords(rank), "host": self.config.host_of(rank) or "local",
                          "heads": self._heads_of(rank), "load": protocol.load_status(*load, self.copies.transport),
                          "compiling": bool(compiling), "compiles": int(compiles), "recompiles": int(recompiles),
                          "compile_cache": {"hits": int(hits), "misses": int(misses)}, **peaks})
        mesh = dict(zip(MESH_DIMS, self.current_layout.sizes)) if self.config.auto_layout else self.config.mesh_sizes
        return {"world_size": self.world_size, "mesh": mesh, "backend": self.config.backend,
                "transport": self.copies.transport,
                "transport_reason": self.copies.transport_reason, "last_weight_send": self.copies.last_send or None,
                "weight_sends": self.copies.sends, "models": self.copies.held(),
                "first_forward": self.first_forward, "probe": self.probe, "layout": self.config.layout,
                "layouts": self.auto.status(), "notes": list(self.notes),
                "state": self.state, "failure": self.failure, "forwards": self.forwards,
                "compiling": any(r["compiling"] for r in ranks), "peaks_prompt": memory.PEAKS.prompt_id,
                "ranks": ranks}


def _pickled_shared(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(t)
    return buf.getvalue()


def _own_load() -> tuple[float, ...]:
    """Rank 0's ``protocol.LOAD_FIELDS``."""
    return stream.LOAD.done, stream.LOAD.total, file_reads.READ_BYTES.total, stream.LOAD.loads


def _load_of(row: list[float]) -> tuple[float, ...]:
    """A worker's ``protocol.LOAD_FIELDS`` from its status row (zeros from a row without them)."""
    return tuple(row[protocol.LOAD_FIELDS]) if len(row) >= protocol.LOAD_FIELDS.stop else (0.0,) * 4


def _guess_comfyui_path() -> str:
    env = os.environ.get("COMFYUI_PATH")
    if env:
        return env
    import comfy.model_management  # ComfyUI's own package sits in the ComfyUI root (a namespace package)

    return str(Path(comfy.model_management.__file__).resolve().parent.parent)


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
