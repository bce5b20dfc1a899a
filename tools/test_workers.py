#!/usr/bin/env python3
"""How many pytest workers `tools/test.sh` runs the suite with (pytest-xdist's ``-n``).

Most of the suite's time is process start-up and waiting (ComfyUI servers, rank processes
importing torch, HTTP round trips): one pytest process keeps a 2-core machine about 60 % busy,
two keep it busy. The rule: one worker per core this process may run on (taskset, cpuset), at
most one per ``GIB_PER_WORKER`` GiB of available memory (each worker starts its own ComfyUI
server, and its tests start up to four ranks), at most ``MAX_WORKERS``; 1 means no xdist.
``PARALLEL_TEST_WORKERS=<n>`` overrides it. Standard library only: it runs before the host's
packages are known.
"""
from __future__ import annotations

import os

ENV = "PARALLEL_TEST_WORKERS"
GIB_PER_WORKER = 6
MAX_WORKERS = 4


def available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def test_workers(environ=os.environ) -> int:
    wanted = environ.get(ENV, "").strip()
    if wanted:
        if not wanted.isdigit() or int(wanted) < 1:
            raise SystemExit(f"{ENV}={wanted!r}: expected a whole number of pytest workers, 1 or more")
        return int(wanted)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    memory = available_memory_bytes()
    by_memory = cores if memory is None else max(1, memory // (GIB_PER_WORKER << 30))
    return max(1, min(cores, by_memory, MAX_WORKERS))


if __name__ == "__main__":
    print(test_workers())
