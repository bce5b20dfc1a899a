"""Rank 0's handle on one worker process (or a rank on another host), and the failures a world reports."""
from __future__ import annotations

import collections
import logging
import subprocess
import threading

from ..distributed import messages

log = logging.getLogger("parallel")


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

    def send(self, record) -> None:
        """A message to the worker (distributed/messages.py)."""
        self.conn.send(messages.wire(record))

    def recv(self, timeout: float):
        """One message (a record), or None when nothing arrived within ``timeout``."""
        with self._recv_lock:
            if self._inbox:
                return self._inbox.popleft()
            try:
                if not self.conn.poll(timeout):
                    return None
                return messages.unwire(self.conn.recv())
            except (EOFError, OSError):
                self.lost = True
                raise

    def drain(self) -> None:
        """Take note of what the worker sent on its own (error reports, releases, a remote worker's
        status). Anything else is a reply someone waits for: it stays in the inbox for ``recv``."""
        with self._recv_lock:
            try:
                while self.conn is not None and self.conn.poll(0):
                    msg = messages.unwire(self.conn.recv())
                    if isinstance(msg, messages.Stats):
                        self.stats = msg.row
                    elif isinstance(msg, messages.Released):
                        self.released = True
                    else:
                        if isinstance(msg, messages.Error) and self.reported_error is None:
                            self.reported_error = msg.report
                        self._inbox.append(msg)
            except (EOFError, OSError):
                self.lost = True
