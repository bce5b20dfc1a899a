"""How a worker process starts, on this host or on another one (``agent.py``).

A worker runs ``python -m parallel_runtime.world.worker`` in the ComfyUI root: ``-m`` puts that
root first on the worker's ``sys.path`` (ComfyUI's ``comfy`` package and ``nodes.py`` win over
anything of the pack), and the pack root follows it on ``PYTHONPATH`` so that
``parallel_runtime`` imports; the worker then moves the pack root to the end of ``sys.path``.
Not ``multiprocessing``: ComfyUI imports custom nodes under mangled module names that a child
could not import, and spawn would re-import ComfyUI's ``main.py`` there. The bootstrap (with the
control channel's key) goes through stdin, not argv or the environment, which other users could
read. Standard library only: the agent imports it without torch.

On this host, rank 0 forks its workers from a fork server (``forkserver.py``): one process per
ComfyUI process that imported torch and the worker's modules once, which saves each worker those
imports (about 3 s of CPU). A fork server serves the environment it started with (the imports
read it): when this process's changes, a new one replaces it once its workers have ended. A worker
that no fork server can give is spawned as above: while the old fork server's workers still run,
when the fork server has touched CUDA (a forked child could not use it), or with
``PARALLEL_FORK_SERVER=0``.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

RUNTIME_DIR = Path(__file__).resolve().parent.parent
PACK_ROOT = RUNTIME_DIR.parent
# The worker's module under the name this process's workers import the runtime by (the runtime's
# folder name), not rank 0's: ComfyUI imports the pack under a mangled name.
WORKER_MODULE = f"{RUNTIME_DIR.name}.world.worker"
FORK_SERVER_MODULE = f"{RUNTIME_DIR.name}.world.forkserver"
FORK_SERVER_ENV = "PARALLEL_FORK_SERVER"  # "0": spawn every worker

log = logging.getLogger("parallel")

# Linux: fork, a sequenced-packet Unix socket that carries file descriptors, /proc for exits.
FORKS_HERE = sys.platform.startswith("linux") and hasattr(os, "fork") and hasattr(socket, "SOCK_SEQPACKET")


def worker_environment(pack_root: Path = PACK_ROOT) -> dict[str, str]:
    """This process's environment with the pack root on PYTHONPATH, ahead of what was there."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(pack_root)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def start_worker(boot: dict, comfyui_root: str, **popen) -> subprocess.Popen:
    """Start one worker with its bootstrap ``boot`` (closes its stdin once written)."""
    proc = subprocess.Popen([sys.executable, "-u", "-m", WORKER_MODULE], stdin=subprocess.PIPE, cwd=comfyui_root,
                            env=worker_environment(), **popen)
    proc.stdin.write(json.dumps(boot).encode() + b"\n")
    proc.stdin.close()
    return proc


def start_local_worker(boot: dict, comfyui_root: str, timeout_s: float):
    """A worker on this host, its output (stdout and stderr) on the handle's ``stdout`` pipe:
    forked from the fork server where it can give one, otherwise spawned. Either handle has
    ``Popen``'s ``pid``, ``stdout``, ``returncode``, ``poll``, ``wait``, ``kill`` and ``terminate``."""
    server = fork_server(comfyui_root)
    proc = server.start(boot, timeout_s) if server is not None else None
    if proc is None:
        proc = start_worker(boot, comfyui_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=False)
    return proc


_servers: dict[str, "ForkServer"] = {}
_servers_lock = threading.Lock()


def fork_server(comfyui_root: str) -> "ForkServer | None":
    """This process's fork server for ``comfyui_root`` (started on first use), or None where
    workers are to be spawned: switched off, refused, or this environment is not the one the fork
    server started with while workers it forked still run (otherwise it is replaced: a world
    started after ``prepare_nccl_environment``, or after a change of settings, forks again)."""
    if os.environ.get(FORK_SERVER_ENV, "1").strip() == "0" or not FORKS_HERE:
        return None
    env = worker_environment()
    with _servers_lock:
        server = _servers.get(comfyui_root)
        if server is not None and server.env != env and not server.busy:
            server.close()  # started under another environment, and none of its workers lives on
            server = None
        if server is not None and server.lost:
            server = None  # it died: a new one
        if server is None:
            try:
                server = ForkServer(comfyui_root, env)
            except OSError as exc:
                log.warning("could not start the worker fork server (%s); spawning workers instead", exc)
                return None
            _servers[comfyui_root] = server
    return server if server.env == env and server.usable else None


def close_fork_servers() -> None:
    """Stop this process's fork servers (their workers exit with them); the next worker starts a new one."""
    with _servers_lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        server.close()


class ForkedWorker:
    """Rank 0's handle on a worker the fork server forked: the fork server's child, not ours, so
    its exit status comes from the fork server's report."""

    def __init__(self, pid: int, stdout_fd: int, server: "ForkServer"):
        self.pid = pid
        self.stdout = os.fdopen(stdout_fd, "rb")
        self.returncode: int | None = None
        self._server = server
        self._exited = threading.Event()

    def _set_exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    REPORT_WAIT_S = 5.0

    def poll(self) -> int | None:
        """Its exit code once it has ended, as soon as Popen's would say so: a child that has
        ended but whose end is not reported yet (the fork server reaps it in a moment) waits for
        that report, briefly; with the fork server gone no report comes."""
        if self.returncode is None and _has_ended(self.pid):
            if self._server.lost or not self._exited.wait(self.REPORT_WAIT_S):
                self._set_exit(-signal.SIGKILL)  # unreported: the fork server was gone
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout)
            self._exited.wait(left)
        return self.returncode

    def _signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)


def _has_ended(pid: int) -> bool:
    """The process is gone or a zombie (Linux: its state in /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


class ForkServer:
    """The fork server process (``forkserver.py``) and the connection to it: a Unix datagram-ordered
    socket pair. We send ``("fork", id, boot)``; it answers ``("started", id, pid)`` with the read
    end of the worker's output pipe attached, or ``("refused", id, reason)``, and reports every
    child's end as ``("exit", pid, code)`` (Popen's codes: negative for a signal). It exits when
    this process does (its end of the socket closes)."""

    def __init__(self, comfyui_root: str, env: dict[str, str]):
        self.env = env
        self.lost = False  # the fork server is gone: a new one, or spawn
        self.refused: str | None = None
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()
        self._replies: dict[int, list] = {}
        self._reply_ready = threading.Condition(self._lock)
        self._workers: dict[int, ForkedWorker] = {}
        self._early_exits: dict[int, int] = {}
        self._next_id = 0
        try:
            self.proc = subprocess.Popen([sys.executable, "-u", "-m", FORK_SERVER_MODULE, str(theirs.fileno())],
                                         stdin=subprocess.DEVNULL, cwd=comfyui_root, env=env,
                                         pass_fds=[theirs.fileno()])
        finally:
            theirs.close()
        self._reader = threading.Thread(target=self._read, name="parallel-fork-server", daemon=True)
        self._reader.start()

    @property
    def usable(self) -> bool:
        return not self.lost and self.refused is None

    @property
    def busy(self) -> bool:
        """Workers it forked still run (they would end with it)."""
        with self._lock:
            return bool(self._workers)

    def _read(self) -> None:
        try:
            while True:
                data, fds, _, _ = socket.recv_fds(self._sock, 1 << 16, 1)
                if not data:
                    break
                msg = json.loads(data)
                with self._lock:
                    if msg[0] == "exit":
                        worker = self._workers.pop(msg[1], None)
                        if worker is not None:
                            worker._set_exit(msg[2])
                        else:  # it exited before its "started" was read
                            self._early_exits[msg[1]] = msg[2]
                    else:
                        self._replies[msg[1]] = [msg, fds]
                        self._reply_ready.notify_all()
        except OSError:
            pass
        with self._lock:
            self.lost = True
            self._reply_ready.notify_all()
        try:
            self.proc.wait(5)  # reaped: no zombie left for as long as ComfyUI runs
        except subprocess.TimeoutExpired:
            pass

    def start(self, boot: dict, timeout_s: float) -> ForkedWorker | None:
        """A forked worker, or None (the caller spawns it instead): the first one waits for the
        fork server's imports, at most ``timeout_s``."""
        with self._lock:
            if not self.usable:
                return None
            request = self._next_id
            self._next_id += 1
            try:
                self._sock.send(json.dumps(["fork", request, boot]).encode())
            except OSError:
                self.lost = True
                return None
            deadline = time.monotonic() + timeout_s
            while request not in self._replies and not self.lost and time.monotonic() < deadline:
                self._reply_ready.wait(0.5)
            reply = self._replies.pop(request, None)
            if reply is None:
                log.warning("the worker fork server did not answer; spawning workers instead")
                self.lost = True
                return None
            (kind, _, detail), fds = reply
            if kind != "started":
                self.refused = str(detail)
                log.warning("the worker fork server refused (%s); spawning workers instead", detail)
                for fd in fds:
                    os.close(fd)
                return None
            worker = ForkedWorker(detail, fds[0], self)
            if detail in self._early_exits:
                worker._set_exit(self._early_exits.pop(detail))
            else:
                self._workers[detail] = worker
            return worker

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
