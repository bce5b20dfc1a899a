#!/usr/bin/env python
"""Rewrite the support matrix in README.md from the per-family plans (``--check``: only compare)."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))

from parallel_runtime.plans.matrix import BEGIN, END, render  # noqa: E402


def updated(readme: str) -> str:
    start, stop = readme.index(BEGIN), readme.index(END) + len(END)
    return readme[:start] + render() + readme[stop:]


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
