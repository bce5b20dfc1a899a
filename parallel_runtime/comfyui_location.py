"""Which ComfyUI this checkout runs with: ``COMFYUI_PATH`` if set, else the one ``tools/host.py`` set up.

Read by the tests, the benchmarks, the demo, the GPU check and the remote-host agent, so that all
of them agree on one answer. (Inside ComfyUI the runtime asks ComfyUI itself; see ``world/world.py``.)

Two test hosts can be set up side by side: ComfyUI 0.3.75 (the default, in ``.host/``) and
0.33.0 (``PARALLEL_COMFYUI_VERSION=0.33.0``, in ``.host-0.33.0/``). Standard library only:
``tools/host.py`` imports this before any environment exists.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VERSION_ENV = "PARALLEL_COMFYUI_VERSION"
VERSIONS = ("0.3.75", "0.33.0")
DEFAULT_VERSION = VERSIONS[0]


def comfyui_version() -> str:
    """The ComfyUI release the host is (to be) set up with."""
    version = os.environ.get(VERSION_ENV, "").strip() or DEFAULT_VERSION
    if version not in VERSIONS:
        raise LookupError(f"{VERSION_ENV}={version!r}: the test hosts are ComfyUI {' and '.join(VERSIONS)}")
    return version


def host_dir() -> Path:
    """Where the host's virtual environment and ComfyUI live (``PARALLEL_HOST_DIR`` overrides)."""
    if os.environ.get("PARALLEL_HOST_DIR"):
        return Path(os.environ["PARALLEL_HOST_DIR"]).resolve()
    version = comfyui_version()
    return REPO / (".host" if version == DEFAULT_VERSION else f".host-{version}")


def host_record(hint: str) -> dict:
    """What ``tools/host.py`` wrote: ``comfyui_path`` and the ``python`` of its environment.
    ``hint`` tells the user how to get one when there is none."""
    record = host_dir() / "host.json"
    if not record.exists():
        raise LookupError(f"no ComfyUI set up: {record} does not exist; {hint}")
    return json.loads(record.read_text())


def comfyui_path(hint: str) -> str:
    """The ComfyUI root: ``COMFYUI_PATH``, else the one ``tools/host.py`` set up."""
    return os.environ.get("COMFYUI_PATH") or host_record(f"set COMFYUI_PATH or {hint}")["comfyui_path"]
