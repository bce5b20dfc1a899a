"""tools/gpu_check.py, the GPU check, run here on CPU ranks: the script is only run by hand on a
GPU, so the suite keeps it from rotting in between. Every case with code of its own runs; of the
plain layouts (one helper, Check.layout) USP 2x2 and TP after Ulysses stand for all, the others
run through the same server in tests/test_comfy_context_parallel.py and test_comfy_tensor_parallel.py.
The compiled comparison runs on the bench's smallest Flux."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.comfy_server
CASES = ("usp2x2", "tp_after_ulysses", "lora_change", "two_models", "vae2", "text_encoder2", "killed_worker",
         "interrupt")


def test_every_gpu_check_case_passes_on_cpu_ranks(tmp_path, comfyui_path):
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "--cpu", "--big", "none",
                           "--out", str(tmp_path), "--cases", ",".join(CASES),
                           "--compile", "flux_smoke_ulysses2_compiled"], env=dict(os.environ, COMFYUI_PATH=comfyui_path),
                          capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    report = json.loads((tmp_path / "results.json").read_text())
    rows = report["rows"]
    print(f"\nGPU check on CPU ranks: {len(rows)} cases in {report['seconds']} s")
    assert len(rows) == len(CASES) + 1 and all(r["ok"] for r in rows)
    compiled = rows[-1]  # issue 18's comparison, compiled against eager at one and two ranks
    assert compiled["case"] == "compiled against eager: flux_smoke_ulysses2_compiled"
    assert compiled["data"]["compiles_per_rank"][1] > 0 and compiled["data"]["compile_speedup_ratio"] > 0
    assert {"Wan USP 2x2 (4 ranks)", "killed worker, then the next prompt", "interrupt"} <= {r["case"] for r in rows}
    assert "| Wan TP 2, LoRA strength changed | pass |" in proc.stdout  # the table for the README
