"""tools/test_workers.py: how many pytest workers tools/test.sh starts."""
from __future__ import annotations

import os

import pytest

import test_workers as tw


def test_one_worker_per_core_capped_by_memory_and_the_maximum(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(tw, "available_memory_bytes", lambda: 1000 << 30)
    assert tw.test_workers({}) == min(cores, tw.MAX_WORKERS)
    monkeypatch.setattr(tw, "available_memory_bytes", lambda: (tw.GIB_PER_WORKER << 30) - 1)
    assert tw.test_workers({}) == 1  # too little memory for a second server: one process
    monkeypatch.setattr(tw.os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(tw, "available_memory_bytes", lambda: 1000 << 30)
    assert tw.test_workers({}) == 1  # taskset to one core


def test_the_environment_decides_and_a_bad_value_is_refused():
    assert tw.test_workers({tw.ENV: "3"}) == 3
    for bad in ("0", "two", "-1"):
        with pytest.raises(SystemExit, match=f"{tw.ENV}="):
            tw.test_workers({tw.ENV: bad})
