"""What the first prompt on a big model costs: host memory and time, sharded against unsharded.

A real ComfyUI server per layout, as a new user meets it: the server starts, the tiny Wan demo
runs first (so a sharded world's workers are up, as they are after any earlier prompt), then the
first prompt on a big Wan 2.1-shaped model (2 steps). Host memory is the proportional set size
(PSS: a page mapped by n processes counts 1/n in each) of ComfyUI and every process it started,
summed: before the big prompt, sampled during it (the peak) and after it, once every rank idles
(CPU workers hand their freed heap back after ``IDLE_TRIM_S``). Each layout's growth is
set against the unsharded run's, measured in the same call.

    tools/run.sh python bench/load.py --out bench/results/load.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))

from parallel_runtime.comfyui_location import comfyui_path  # noqa: E402

sys.path.insert(0, comfyui_path("run the load benchmark with tools/run.sh (it sets up the host)"))
import comfy.options  # noqa: E402,F401  (the model files are built with ComfyUI's classes, on the CPU)
import comfy.cli_args  # noqa: E402

comfy.cli_args.args.cpu = True

from comfy_server import ComfyServer  # noqa: E402
from parallel_runtime.world import settings  # noqa: E402
from tiny_models import TinyWan, wan_state_dict, write_tiny_wan_files  # noqa: E402
from workflows import find_nodes, load, remove_passthrough, ui_to_api  # noqa: E402

DEMO = REPO / "example_workflows" / "tiny_wan_ulysses2_demo.json"
BIG_FILE = "big_wan.safetensors"
SETTLE_S = settings.IDLE_TRIM_S + 1.5  # "after the prompt": once every rank idles
LAYOUTS = {"unsharded": None, "tp2": {"tp_size": 2, "ulysses_size": 1},
           "ulysses2": {"ulysses_size": 2, "tp_size": 1}, "ulysses2_tp2": {"ulysses_size": 2, "tp_size": 2, "devices": "cpu,cpu,cpu,cpu"}}


def big_spec(gigabytes: float) -> TinyWan:
    """A Wan 2.1-shaped model of about ``gigabytes`` in fp32 (1536 wide, as Wan 1.3B)."""
    per_layer = 4 * (4 * 1536 * 1536 + 2 * 1536 * 8960 + 2 * 1536 * 1536)  # self + cross attention, FFN
    return TinyWan(dim=1536, ffn_dim=8960, num_layers=max(1, round(gigabytes * 1e9 / per_layer)))


def tree_pss(root_pid: int) -> int:
    """Summed PSS of ``root_pid`` and every process below it (bytes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [root_pid]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return total


class PeakSampler:
    """The highest tree_pss seen while the block runs (sampled every ``every`` seconds)."""

    def __init__(self, pid: int, every: float = 0.1):
        self.pid, self.every, self.peak = pid, every, 0
        self._stop = threading.Event()

    def __enter__(self):
        def loop():
            while not self._stop.is_set():
                self.peak = max(self.peak, tree_pss(self.pid))
                self._stop.wait(self.every)
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_pss(self.pid))


def prompts(server, sizes: dict | None) -> tuple[dict, dict]:
    """The demo prompt (sharded: starts the workers of ``sizes``) and the big model's prompt in
    ``sizes`` (None: unsharded)."""
    info = server.object_info()
    demo = ui_to_api(load(DEMO), info)
    big = json.loads(json.dumps(demo))
    for node_id in find_nodes(big, "UNETLoader"):
        big[node_id]["inputs"]["unet_name"] = BIG_FILE
    for node_id in find_nodes(big, "LoraLoaderModelOnly"):
        big[node_id]["inputs"]["strength_model"] = 0.0  # the demo's LoRAs are shaped for the tiny model
    for node_id in find_nodes(big, "KSampler"):
        big[node_id]["inputs"]["steps"] = 2
    if sizes is None:
        big = remove_passthrough(big, "ShardTransformer", "model")
    else:  # the demo starts the world the big prompt runs in
        for prompt in (demo, big):
            for node_id in find_nodes(prompt, "ParallelConfig"):
                prompt[node_id]["inputs"].update(sizes)
    return demo, big


def measure(comfyui_path, base: Path, name: str, sizes: dict | None, env: dict | None = None) -> dict:
    with ComfyServer(comfyui_path, base, python=sys.executable, env=env) as server:
        demo, big = prompts(server, sizes)
        server.run(demo, timeout=600)
        time.sleep(0.5)
        before = tree_pss(server.proc.pid)
        started = time.perf_counter()
        with PeakSampler(server.proc.pid) as sampler:
            server.run(big, timeout=900)
        seconds = time.perf_counter() - started
        time.sleep(SETTLE_S)  # CPU workers hand their step's freed heap back once idle
        after = tree_pss(server.proc.pid)
        status = server.get("/parallel/status")
    return {"layout": name, "sizes": sizes, "seconds": round(seconds, 3), "pss_before": before,
            "pss_after": after, "pss_peak": sampler.peak, "growth": after - before, "peak_growth": sampler.peak - before,
            "ranks": [{k: r.get(k) for k in ("rank", "param_bytes", "pss_bytes", "load")} for r in status["ranks"]],
            "last_weight_send": status.get("last_weight_send"), "transport": status.get("transport")}


def run(comfyui_path, layouts=tuple(LAYOUTS), gigabytes: float = 1.2, workdir: Path | None = None,
        env: dict | None = None) -> list[dict]:
    """Every layout's figures, ratios against the unsharded run's growth and time (run first)."""
    from safetensors.torch import save_file

    layouts = ["unsharded", *[n for n in layouts if n != "unsharded"]]
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        base = Path(tmp)
        write_tiny_wan_files(base)
        save_file(wan_state_dict(big_spec(gigabytes)), str(base / "models" / "diffusion_models" / BIG_FILE))
        rows = [measure(comfyui_path, base, n, LAYOUTS[n], env) for n in layouts]
    ref = rows[0]
    for row in rows:
        row["growth_ratio"] = round(row["growth"] / ref["growth"], 3)
        row["peak_ratio"] = round(row["peak_growth"] / ref["peak_growth"], 3)  # ComfyUI's own load peaks too
        row["time_ratio"] = round(row["seconds"] / ref["seconds"], 3)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH"))
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    parser.add_argument("--gigabytes", type=float, default=1.2)
    parser.add_argument("--out")
    opts = parser.parse_args()
    rows = run(opts.comfyui or comfyui_path(""), opts.layouts, opts.gigabytes)
    for row in rows:
        print(f"{row['layout']:>14}: growth {row['growth'] / 1e6:8.0f} MB ({row['growth_ratio']:.2f}x), "
              f"peak {row['peak_growth'] / 1e6:8.0f} MB ({row['peak_ratio']:.2f}x the unsharded peak), "
              f"first prompt {row['seconds']:.2f} s ({row['time_ratio']:.2f}x)")
    if opts.out:
        Path(opts.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
