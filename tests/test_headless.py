"""The headless client (tools/headless.py) against a running ComfyUI: UI-format workflow in,
progress over the websocket, outputs saved; failures end with exit code 1 and the error."""
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.comfy_server
CLIENT = REPO / "tools" / "headless.py"
WORKFLOW = REPO / "example_workflows" / "tiny_wan_ulysses2_demo.json"


def run_client(server, *args, tmp_path):
    return subprocess.run([sys.executable, str(CLIENT), str(WORKFLOW), "--server", server.url,
                           "--out", str(tmp_path / "out"), *args], capture_output=True, text=True, timeout=600)


def test_client_runs_a_workflow_and_saves_its_outputs(tiny_server, tmp_path):
    result = run_client(tiny_server, "--set", "KSampler.seed=777", "--set", "KSampler.steps=4", tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step 4/4" in result.stdout  # live progress from the websocket
    # The per-rank summary from /parallel/status: memory now and at its peak during the prompt.
    summary = result.stdout[result.stdout.index("ranks: world size 2"):]
    for rank in (0, 1):
        line = next(ln for ln in summary.splitlines() if ln.startswith(f"  rank {rank} cpu: "))
        assert "RSS " in line and "USS " in line and "(peak " in line and "GPU" not in line, line
    saved = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert any(n.endswith(".png") for n in saved) and any(n.endswith(".latent") for n in saved), saved


def test_client_reports_a_refused_prompt(tiny_server, tmp_path):
    result = run_client(tiny_server, "--set", "ParallelConfig.backend=nccl", tmp_path=tmp_path)
    assert result.returncode == 1
    assert "NCCL needs CUDA" in result.stderr
