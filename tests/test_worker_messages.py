"""Rank 0's handle on a worker: a message read by one thread (the status route draining a remote
worker's connection) must still reach the thread that waits for it (the prompt thread's expect)."""
import multiprocessing
import threading
import time

import pytest
import torch

from parallel_runtime.distributed import messages
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
    theirs.send(messages.wire(messages.Stats(row)))
    theirs.send(messages.wire(messages.Loaded("m7")))
    worker.drain()  # what /parallel/status does for a worker on another host
    assert worker.stats == row
    assert world.expect(worker, messages.Loaded, time.monotonic() + 2) == messages.Loaded("m7")
    assert worker.recv(0) is None  # consumed once


def test_an_error_drained_by_the_status_route_still_fails_the_wait_at_once(remote):
    world, worker, theirs = remote
    theirs.send(messages.wire(messages.Error(1, "Traceback: out of memory on rank 1")))
    worker.drain()
    assert worker.reported_error.endswith("out of memory on rank 1")
    started = time.monotonic()
    with pytest.raises(WorkerFailure, match="out of memory on rank 1"):
        world.expect(worker, messages.Loaded, time.monotonic() + 30)
    assert time.monotonic() - started < 5


def test_drain_keeps_replies_in_order_and_notes_a_release(remote):
    world, worker, theirs = remote
    for record in (messages.BucketDone(), messages.Released(1), messages.Loaded("m0")):
        theirs.send(messages.wire(record))
    worker.drain()
    worker.drain()  # twice: nothing is read twice or lost
    assert worker.released
    assert world.expect(worker, messages.BucketDone, time.monotonic() + 2) == messages.BucketDone()
    assert world.expect(worker, messages.Loaded, time.monotonic() + 2) == messages.Loaded("m0")


def test_a_worker_answering_something_else_fails_the_wait_by_name(remote):
    world, worker, theirs = remote
    theirs.send(messages.wire(messages.Pong(1)))
    with pytest.raises(Exception, match="rank 1 answered Pong where .*Loaded.* was expected"):
        world.expect(worker, messages.Loaded, time.monotonic() + 2)


def test_every_record_crosses_the_connection_as_plain_data_and_back():
    """A worker cannot unpickle the pack's classes by rank 0's module names: on the wire a record
    is a tuple of builtins (a nested record too), and unwire rebuilds the very record."""
    import dataclasses

    def plain(value):
        return value is None or isinstance(value, (str, int, float, bool, bytes)) or \
            (isinstance(value, (tuple, list)) and all(plain(v) for v in value)) or \
            (isinstance(value, dict) and all(plain(k) and plain(v) for k, v in value.items()))

    def sample(cls):
        values = {}
        for f in dataclasses.fields(cls):
            values[f.name] = (messages.RunSettings(True, None, [1, 2, 1, 1], (1.0, 2.0), (1, True))
                              if f.name == "settings" else f"{cls.__name__}.{f.name}")
        return cls(**values)

    for cls in messages.RECORDS.values():
        record = sample(cls)
        wired = messages.wire(record)
        assert plain(wired) and wired[0] == cls.__name__, wired
        assert messages.unwire(wired) == record


def test_no_tuple_message_is_built_or_read_outside_the_records():
    """Rank 0 and the workers speak records only: no `.send((...` of a tuple and no `msg[0]` tag
    test in the runtime's modules that talk to workers."""
    import re
    from pathlib import Path

    runtime = Path(__file__).resolve().parent.parent / "parallel_runtime"
    # The fork server speaks JSON over its own socket (world/spawn.py, world/forkserver.py).
    others = {"spawn.py", "forkserver.py"}
    found = []
    for path in runtime.rglob("*.py"):
        if path.name in others:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.send\(\(|msg\[0\]|getattr\(self, \"on_\"", line):
                found.append(f"{path.relative_to(runtime)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


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
    theirs.send(messages.wire(messages.Ping()))
    assert server._next_command() == messages.Ping()
    assert trims == [] and server.heap_to_trim  # mid-run: the freed heap is reused by the next forward


def test_a_worker_that_idles_gives_its_freed_heap_back_once(idle_server):
    server, theirs, trims = idle_server
    threading.Timer(0.6, theirs.send, args=(messages.wire(messages.Ping()),)).start()
    started = time.monotonic()
    assert server._next_command() == messages.Ping()
    assert time.monotonic() - started >= 0.5  # it still waited for the command after trimming
    assert trims == [False] and not server.heap_to_trim
    theirs.send(messages.wire(messages.Ping()))
    server._next_command()
    assert trims == [False]  # nothing freed since: no second trim


def test_rank_0_can_ask_every_worker_for_its_freed_heap_now(remote, idle_server):
    world, worker, theirs = remote
    server, _, trims = idle_server
    server.conn = theirs  # the worker's end of rank 0's connection
    server.heap_to_trim = False  # only the request may trim (rank 0's own trim can take longer than the idle wait)

    def serve_one():
        server.on_trim(server._next_command())
    answering = threading.Thread(target=serve_one)
    answering.start()
    world.release_free_heap()
    answering.join(5)
    assert trims == [False] and not server.heap_to_trim
