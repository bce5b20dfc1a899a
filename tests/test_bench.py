"""The benchmark suite's smallest scenario produces a complete, valid record."""
import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.multirank
FIELDS = ("scenario", "family", "mode", "mesh", "world_size", "device", "threads_per_rank", "tokens",
          "step_ms_median", "step_ms_min", "step_ms_max", "speedup_vs_world1", "param_bytes_per_rank_max",
          "rss_bytes_per_rank_max", "comm_bytes_per_step", "max_abs_err", "dispatch_overhead_ms",
          "activation_peak_bytes_per_rank")


def test_smoke_scenario_writes_a_valid_record(tmp_path):
    out = tmp_path / "records.jsonl"
    result = subprocess.run([sys.executable, str(REPO / "bench" / "run.py"), "--suite", "smoke", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    missing = [f for f in FIELDS if f not in record]
    assert not missing, missing
    assert record["world_size"] == 2 and record["mesh"]["ulysses"] == 2 and record["device"] == "cpu"
    assert record["step_ms_min"] <= record["step_ms_median"] <= record["step_ms_max"]
    assert record["max_abs_err"] <= 1e-5 and record["comm_bytes_per_step"] > 0
    assert 0 < record["param_bytes_per_rank_max"] and record["rss_bytes_per_rank_max"] > record["param_bytes_per_rank_max"]
