"""Ranks on other hosts: rank 0's listener for the agents those hosts run.

Every other host runs an agent (``parallel_runtime/world/agent.py``, started by
``tools/remote_worker.sh``) that connects to rank 0's rendezvous address and waits. When a
world needs ranks on that host, rank 0 sends the agent their bootstrap; the agent starts one
worker process per rank, and the workers connect back over TCP exactly like local ones.

Nothing listens on the network unless a Parallel Config names other hosts, and every
connection must present the shared key from ``PARALLEL_CLUSTER_KEY`` (set it on every host):
reaching ComfyUI's ranks from the network is opt-in.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from multiprocessing.connection import Listener

from ..config import CLUSTER_KEY_ENV as KEY_ENV, cluster_key_problem
from ..distributed import messages

log = logging.getLogger("parallel")


class ClusterError(RuntimeError):
    pass


def cluster_key() -> bytes:
    problem = cluster_key_problem()
    if problem:
        raise ClusterError(problem)
    return os.environ[KEY_ENV].encode()


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class ClusterListener:
    """Accepts agent connections on the rendezvous address, for the life of ComfyUI."""

    def __init__(self, address: str):
        self.address = address
        self._listener = Listener(split_address(address), family="AF_INET", authkey=cluster_key())
        self._agents: dict[str, tuple] = {}
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept_loop, name="parallel-cluster", daemon=True).start()
        log.info("waiting for remote hosts on %s", address)

    def _accept_loop(self):
        while not self._closed:
            try:
                conn = self._listener.accept()
                msg = messages.unwire(conn.recv())
            except Exception:  # a wrong key or a broken handshake: refuse that one, keep listening
                if self._closed:
                    return
                log.warning("refused a connection on %s (wrong %s?)", self.address, KEY_ENV)
                continue
            if not isinstance(msg, messages.AgentHello):
                conn.close()
                continue
            name = msg.name
            with self._lock:
                old = self._agents.pop(name, None)
                if old is not None:
                    old[0].close()
                self._agents[name] = (conn, msg.info)
            log.info("remote host %s joined (%s)", name, msg.info)

    def agent(self, name: str, timeout: float):
        """The connection of host ``name``'s agent, waiting for it to join."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                entry = self._agents.get(name)
            if entry is not None:
                conn, info = entry
                if not conn.closed:
                    return conn, info
            if time.monotonic() > deadline:
                raise ClusterError(f"host {name} has not joined on {self.address} within {timeout:.0f}s; start "
                                   f"tools/remote_worker.sh --rendezvous {self.address} --name {name} there")
            time.sleep(0.1)

    def forget(self, name: str) -> None:
        with self._lock:
            entry = self._agents.pop(name, None)
        if entry is not None:
            entry[0].close()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            for conn, _ in self._agents.values():
                conn.close()
            self._agents.clear()
        self._listener.close()


_listener: ClusterListener | None = None


def listener_for(address: str) -> ClusterListener:
    """The process's listener on ``address`` (one at a time; a new address replaces it)."""
    global _listener
    if _listener is None or _listener.address != address:
        if _listener is not None:
            _listener.close()
        _listener = ClusterListener(address)
    return _listener


def close() -> None:
    global _listener
    if _listener is not None:
        _listener.close()
        _listener = None
