"""The worker fork server: started by rank 0 (``spawn.ForkServer``) with ``python -m`` exactly as
a worker is, it imports torch and the worker's modules once, then forks a worker for each request.

A forked child must be able to use CUDA, so this process never may: it notes every call into the
CUDA driver's device count while it imports the worker, and refuses to fork after one, or once
PyTorch initialised CUDA (rank 0 then spawns). Nothing
else runs here: no torch operation (no thread pool), no ComfyUI import (``comfy`` initialises
CUDA when imported, and the worker sets ComfyUI's arguments before importing it).

One thread, a loop over the socket to rank 0 and SIGCHLD's wake-up pipe; it exits when rank 0's end
of the socket closes, and its workers then exit too (each watches its parent, this process).
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import traceback

import torch

TOUCH_CUDA_ENV = "PARALLEL_TEST_FORK_SERVER_TOUCH_CUDA"  # tests: act as if an import had asked the CUDA driver

# Importing torch does not initialise the CUDA driver; what the runtime's imports do is watched:
# every call into the driver's device count while the worker's module is imported is noted.
_driver_queries: list[bool] = []
_real_device_count = getattr(torch._C, "_cuda_getDeviceCount", None)
if _real_device_count is not None:
    def _counted_device_count():
        _driver_queries.append(True)
        return _real_device_count()
    torch._C._cuda_getDeviceCount = _counted_device_count
from . import worker  # noqa: E402  (after the watch above, so that it sees these imports)
if _real_device_count is not None:
    torch._C._cuda_getDeviceCount = _real_device_count


def cuda_touched() -> str | None:
    """Why a child forked now could not use CUDA, or None."""
    if torch.cuda.is_initialized():
        return "CUDA was initialised in the fork server"
    if _driver_queries or os.environ.get(TOUCH_CUDA_ENV) == "1":
        return "the fork server asked the CUDA driver for its devices while importing the worker"
    return None


def _child(sock: socket.socket, wake: tuple[int, int], out_w: int, boot: dict) -> None:
    """In the forked child: become a worker whose parent is this fork server. Never returns."""
    code = 1
    try:
        sock.close()
        signal.set_wakeup_fd(-1)
        for fd in wake:
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(out_w, 1)
        os.dup2(out_w, 2)
        os.close(out_w)
        boot["parent_pid"] = os.getppid()
        code = worker.run(boot)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _send(sock: socket.socket, msg: list, fds: list[int] = ()) -> None:
    socket.send_fds(sock, [json.dumps(msg).encode()], list(fds))


def serve(sock: socket.socket) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ComfyUI's Ctrl-C is for ComfyUI: we end when it does
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        while True:  # every child that ended, reported as Popen reports it
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _send(sock, ["exit", pid, os.waitstatus_to_exitcode(status)])
        if sock not in ready:
            continue
        data = sock.recv(1 << 20)
        if not data:
            return 0  # rank 0 is gone
        kind, request, boot = json.loads(data)
        reason = cuda_touched()
        if reason is not None:
            _send(sock, ["refused", request, reason])
            continue
        out_r, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(out_r)
            _child(sock, (wake_r, wake_w), out_w, boot)
        os.close(out_w)
        _send(sock, ["started", request, pid], [out_r])
        os.close(out_r)


def main() -> int:
    sock = socket.socket(fileno=int(sys.argv[1]))
    try:
        return serve(sock)
    except (BrokenPipeError, ConnectionError):
        return 0  # rank 0 is gone


if __name__ == "__main__":
    sys.exit(main())
