"""How a worker process starts, on this host or on another one (``agent.py``).

A worker runs ``python -m parallel_runtime.world.worker`` in the ComfyUI root: ``-m`` puts that
root first on the worker's ``sys.path`` (ComfyUI's ``comfy`` package and ``nodes.py`` win over
anything of the pack), and the pack root follows it on ``PYTHONPATH`` so that
``parallel_runtime`` imports; the worker then moves the pack root to the end of ``sys.path``.
Not ``multiprocessing``: ComfyUI imports custom nodes under mangled module names that a child
could not import, and spawn would re-import ComfyUI's ``main.py`` there. The bootstrap (with the
control channel's key) goes through stdin, not argv or the environment, which other users could
read. Standard library only: the agent imports it without torch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RUNTIME_DIR = Path(__file__).resolve().parent.parent
PACK_ROOT = RUNTIME_DIR.parent
# The worker's module under the name this process's workers import the runtime by (the runtime's
# folder name), not rank 0's: ComfyUI imports the pack under a mangled name.
WORKER_MODULE = f"{RUNTIME_DIR.name}.world.worker"


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
