"""Where user plans come from (plans/vocabulary/user.py reads them): the folders a user puts plan files in.

- ``parallel_plans/`` in ComfyUI's user directory (``ComfyUI/user/parallel_plans/`` by default,
  or under ``--user-directory``);
- the folders in ``PARALLEL_PLANS_DIR`` (several separated by ``os.pathsep``), for example one
  that another custom node pack ships its plans in.

Shard Transformer reads them each time it runs (only new or changed files are built again), and
runs again when they change (``fingerprint``: ComfyUI would otherwise keep its cached output, made
with the old plan).
"""
from __future__ import annotations

import os
from pathlib import Path

from ..plans import refresh_user_plans

PLANS_DIR_ENV = "PARALLEL_PLANS_DIR"
USER_SUBFOLDER = "parallel_plans"


def plan_folders() -> list[Path]:
    import folder_paths

    folders = [Path(folder_paths.get_user_directory()) / USER_SUBFOLDER]
    folders += [Path(p) for p in os.environ.get(PLANS_DIR_ENV, "").split(os.pathsep) if p.strip()]
    return folders


def refresh() -> list[str]:
    """Read the user plan files that are new or changed; the errors of files that give no plan."""
    return refresh_user_plans(plan_folders())


def fingerprint() -> tuple:
    """What changes when a plan file is added, edited or removed (name, size, modification time)."""
    found = []
    for folder in plan_folders():
        if folder.is_dir():
            for path in sorted(folder.glob("*.py")):
                stat = path.stat()
                found.append((str(path), stat.st_size, stat.st_mtime_ns))
    return tuple(found)
