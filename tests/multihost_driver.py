"""Runs inside network namespace A for tests/test_multihost.py: a ComfyUI whose rank 1 is on
"host" B (another namespace, reached over a veth pair). Writes its findings as JSON."""
import json
import os
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

from comfy_server import ComfyServer, PromptFailed  # noqa: E402
from workflows import find_nodes, load, remove_passthrough, ui_to_api  # noqa: E402


def latent(server, prompt):
    from safetensors.torch import load_file

    entry = server.run(prompt, timeout=600)
    (path,) = server.outputs(entry, "latents")
    return load_file(str(path))["latent_tensor"]


def main():
    base, comfyui, rendezvous, out = sys.argv[1:5]
    result = {}
    with ComfyServer(comfyui, base, python=sys.executable, log_path=Path(base) / "multihost_comfyui.log") as server:
        prompt = ui_to_api(load(REPO / "example_workflows" / "tiny_wan_ulysses2_demo.json"), server.object_info())
        (pc,) = find_nodes(prompt, "ParallelConfig")
        prompt[pc]["inputs"].update({"ulysses_size": 2, "devices": "cpu", "hosts": "local:1,hostb:1",
                                     "rendezvous": rendezvous})
        reference = latent(server, remove_passthrough(prompt, "ShardTransformer", "model"))
        sharded = latent(server, prompt)
        status = server.get("/parallel/status")
        result["max_abs_err"] = (sharded - reference).abs().max().item()
        result["status"] = status
        # Lose the other host mid-run: its worker dies; ComfyUI must say which rank, not hang.
        (ks,) = find_nodes(prompt, "KSampler")
        long_run = json.loads(json.dumps(prompt))
        long_run[ks]["inputs"].update({"steps": 400, "seed": 5})
        prompt_id = server.queue(long_run)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ranks = server.get("/parallel/status")["ranks"]
            if len(ranks) == 2 and (ranks[1].get("forwards") or 0) >= status["ranks"][1]["forwards"] + 2:
                break
            time.sleep(0.1)
        os.kill(ranks[1]["pid"], signal.SIGKILL)  # same pid namespace, another network namespace
        killed = time.monotonic()
        try:
            server.wait(prompt_id, timeout=120)
            result["lost_host_error"] = None
        except PromptFailed as exc:
            result["lost_host_error"] = str(exc)
        result["lost_host_seconds"] = time.monotonic() - killed
    Path(out).write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
