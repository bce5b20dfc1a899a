"""The agent another host runs so that ComfyUI can place ranks on it (``python -m
parallel_runtime.world.agent`` from the pack's folder; ``tools/remote_worker.sh --rendezvous
10.0.0.1:29600 --name gpu-b`` does it).

It connects to rank 0's rendezvous address (retrying until ComfyUI listens), says which host it
is, and for every world that has ranks here starts one worker process per rank with the
bootstrap rank 0 sends. It serves until ComfyUI ends: when the connection closes it stops its
workers and exits. ``PARALLEL_CLUSTER_KEY`` must hold the same key as ComfyUI's.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from multiprocessing.connection import Client

from .spawn import PACK_ROOT, start_worker
from ..config import CLUSTER_KEY_ENV, cluster_key_problem
from ..distributed import messages
from ..comfyui_location import comfyui_path as find_comfyui

try:
    import torch  # to list this host's GPUs; an agent without torch serves CPU ranks
except ImportError:
    torch = None


def log(msg: str) -> None:
    print(f"[agent] {msg}", file=sys.stderr, flush=True)


def local_devices(spec: str) -> list[str]:
    if spec == "cpu":
        return ["cpu"] * 1024
    if spec == "auto" and torch is not None and torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if spec not in ("auto", "cpu"):
        return [d if d == "cpu" else f"cuda:{int(d.split(':')[-1])}" for d in spec.split(",")]
    return ["cpu"] * 1024


def comfyui_path() -> str:
    try:
        return find_comfyui("set COMFYUI_PATH to this host's ComfyUI (tools/remote_worker.sh does it)")
    except LookupError as exc:
        raise SystemExit(str(exc)) from None


def connect(address: str, key: bytes, name: str, info: dict):
    host, _, port = address.rpartition(":")
    while True:
        try:
            conn = Client((host.strip("[]"), int(port)), family="AF_INET", authkey=key)
            conn.send(messages.wire(messages.AgentHello(name, info)))
            return conn
        except (ConnectionError, OSError) as exc:
            log(f"waiting for ComfyUI on {address} ({exc.__class__.__name__})")
            time.sleep(1.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rendezvous", required=True, help="ComfyUI's 'rendezvous' address, e.g. 10.0.0.1:29600")
    parser.add_argument("--name", required=True, help="this host's name in Parallel Config's 'hosts'")
    parser.add_argument("--devices", default="auto", help="'auto', 'cpu' or a list such as 0,1")
    parser.add_argument("--once", action="store_true", help="exit when ComfyUI goes away instead of waiting again")
    opts = parser.parse_args()
    problem = cluster_key_problem()
    if problem:
        raise SystemExit(problem)
    key = os.environ[CLUSTER_KEY_ENV].encode()
    devices = local_devices(opts.devices)
    root = comfyui_path()
    info = {"pid": os.getpid(), "cpu_count": os.cpu_count(), "devices": devices[:16]}
    while True:
        conn = connect(opts.rendezvous, key, opts.name, info)
        log(f"joined {opts.rendezvous} as {opts.name}")
        workers: list[subprocess.Popen] = []
        try:
            while True:
                msg = messages.unwire(conn.recv())
                if isinstance(msg, messages.Spawn):
                    workers = [w for w in workers if w.poll() is None]  # those of an earlier world that exited
                    for slot, boot in enumerate(msg.boots):
                        boot.update(comfyui_path=root, pack_root=str(PACK_ROOT), parent_pid=os.getpid())
                        boot["devices"][boot["rank"]] = devices[slot]
                        proc = start_worker(boot, root)
                        workers.append(proc)
                        log(f"started rank {boot['rank']} on {devices[slot]} (pid {proc.pid})")
        except (EOFError, OSError):
            log("ComfyUI went away")
        finally:
            for w in workers:
                if w.poll() is None:
                    w.terminate()
            for w in workers:
                try:
                    w.wait(10)
                except subprocess.TimeoutExpired:
                    w.kill()
        if opts.once:
            return 0


if __name__ == "__main__":
    sys.exit(main())
