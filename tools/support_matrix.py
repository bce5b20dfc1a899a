#!/usr/bin/env python
"""Rewrite the support matrix in README.md from the per-family plans and the record of which
families each ComfyUI release's tests run, tests/tested_on.json (``--check``: only compare). The
record is written on each release by tests/test_tested_on.py (PARALLEL_RECORD_TESTED_ON=1)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))

from parallel_runtime.plans.matrix import BEGIN, END, render  # noqa: E402

RECORD = REPO / "tests" / "tested_on.json"


def load_record() -> dict[str, list[str]]:
    """release -> the plan families its tests ran when the record was last written."""
    return json.loads(RECORD.read_text()) if RECORD.exists() else {}


def save_record(release: str, families: list[str]) -> None:
    """This release's families into the record, the other releases' kept."""
    record = {**load_record(), release: sorted(families)}
    RECORD.write_text(json.dumps(dict(sorted(record.items())), indent=1) + "\n")


def updated(readme: str) -> str:
    start, stop = readme.index(BEGIN), readme.index(END) + len(END)
    return readme[:start] + render(load_record()) + readme[stop:]


def main() -> int:
    path = REPO / "README.md"
    text = path.read_text()
    new = updated(text)
    if "--check" in sys.argv:
        if new != text:
            print("README.md support matrix is stale: run tools/run.sh python tools/support_matrix.py")
            return 1
        return 0
    path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
