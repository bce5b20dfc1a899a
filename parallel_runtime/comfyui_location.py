"""Which ComfyUI this checkout runs with: ``COMFYUI_PATH`` if set, else the one ``tools/host.py`` set up.

Read by the tests, the benchmarks, the demo and the remote-host agent, so that all of them
agree on one answer. (Inside ComfyUI the runtime asks ComfyUI itself; see ``world.py``.)
"""
from __future__ import annotations

import json
import os
from pathlib import Path

HOST_RECORD = Path(__file__).resolve().parent.parent / ".host" / "host.json"


def host_record(hint: str) -> dict:
    """What ``tools/host.py`` wrote: ``comfyui_path`` and the ``python`` of its environment.
    ``hint`` tells the user how to get one when there is none."""
    if not HOST_RECORD.exists():
        raise LookupError(f"no ComfyUI set up: {HOST_RECORD} does not exist; {hint}")
    return json.loads(HOST_RECORD.read_text())


def comfyui_path(hint: str) -> str:
    """The ComfyUI root: ``COMFYUI_PATH``, else the one ``tools/host.py`` set up."""
    return os.environ.get("COMFYUI_PATH") or host_record(f"set COMFYUI_PATH or {hint}")["comfyui_path"]
