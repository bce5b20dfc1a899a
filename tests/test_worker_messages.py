"""Rank 0's handle on a worker: a message read by one thread (the status route draining a remote
worker's connection) must still reach the thread that waits for it (the prompt thread's expect)."""
import multiprocessing
import threading
import time

import pytest
import torch

from parallel_runtime.world import protocol
from parallel_runtime.config import HostDevices, build_config
from parallel_runtime.world.world import World
from parallel_runtime.world.workers import WorkerFailure, _Worker


@pytest.fixture()
def remote():
    mine, theirs = multiprocessing.Pipe()
    worker = _Worker(1, "cpu", None, host="gpu-b")
    worker.conn = mine
    world = World(build_config(ulysses_size=2, host=HostDevices("cpu", cpu_count=2)), comfyui_path=".")
    world.workers = [worker]
    try:
        yield world, worker, theirs
    finally:
        world.watchdog.close()
        mine.close()
        theirs.close()


def test_a_reply_drained_by_the_status_route_reaches_the_waiting_thread(remote):
    world, worker, theirs = remote
    row = [float(i) for i in range(len(protocol.STATUS_FIELDS))]
    theirs.send(("stats", row))
    theirs.send(("loaded", 7))
    worker.drain()  # what /parallel/status does for a worker on another host
    assert worker.stats == row
    assert world.expect(worker, "loaded", time.monotonic() + 2) == ("loaded", 7)
    assert worker.recv(0) is None  # consumed once


def test_an_error_drained_by_the_status_route_still_fails_the_wait_at_once(remote):
    world, worker, theirs = remote
    theirs.send(("error", 1, "Traceback: out of memory on rank 1"))
    worker.drain()
    assert worker.reported_error.endswith("out of memory on rank 1")
    started = time.monotonic()
    with pytest.raises(WorkerFailure, match="out of memory on rank 1"):
        world.expect(worker, "loaded", time.monotonic() + 30)
    assert time.monotonic() - started < 5


def test_drain_keeps_replies_in_order_and_notes_a_release(remote):
    world, worker, theirs = remote
    for kind in ("bucket_done", "released", "loaded"):
        theirs.send((kind, 0))
    worker.drain()
    worker.drain()  # twice: nothing is read twice or lost
    assert worker.released
    assert world.expect(worker, "bucket_done", time.monotonic() + 2)[0] == "bucket_done"
    assert world.expect(worker, "loaded", time.monotonic() + 2)[0] == "loaded"


# ---------------------------------------------------------------- a CPU worker's freed heap
@pytest.fixture()
def idle_server(monkeypatch):
    """A worker's command loop on a pipe, with malloc_trim counted instead of run."""
    from parallel_runtime.world import settings, worker as worker_module

    trims = []
    monkeypatch.setattr(worker_module, "release_free_heap", lambda collect=True: trims.append(collect))
    monkeypatch.setattr(settings, "IDLE_TRIM_S", 0.2)
    mine, theirs = multiprocessing.Pipe()
    server = object.__new__(worker_module._Server)
    server.conn, server.rank, server.device, server.heap_to_trim = mine, 1, torch.device("cpu"), True
    try:
        yield server, theirs, trims
    finally:
        mine.close()
        theirs.close()


def test_a_worker_keeps_its_heap_while_the_next_forward_is_already_waiting(idle_server):
    server, theirs, trims = idle_server
    theirs.send(("forward", "next"))
    assert server._next_command() == ("forward", "next")
    assert trims == [] and server.heap_to_trim  # mid-run: the freed heap is reused by the next forward


def test_a_worker_that_idles_gives_its_freed_heap_back_once(idle_server):
    server, theirs, trims = idle_server
    threading.Timer(0.6, theirs.send, args=(("forward", "later"),)).start()
    started = time.monotonic()
    assert server._next_command() == ("forward", "later")
    assert time.monotonic() - started >= 0.5  # it still waited for the command after trimming
    assert trims == [False] and not server.heap_to_trim
    theirs.send(("forward", "again"))
    server._next_command()
    assert trims == [False]  # nothing freed since: no second trim


def test_rank_0_can_ask_every_worker_for_its_freed_heap_now(remote, idle_server):
    world, worker, theirs = remote
    server, _, trims = idle_server
    server.conn = theirs  # the worker's end of rank 0's connection
    server.heap_to_trim = False  # only the request may trim (rank 0's own trim can take longer than the idle wait)

    def serve_one():
        kind, *rest = server._next_command()
        getattr(server, "on_" + kind)(*rest)
    answering = threading.Thread(target=serve_one)
    answering.start()
    world.release_free_heap()
    answering.join(5)
    assert trims == [False] and not server.heap_to_trim
