#!/usr/bin/env python
"""Run a workflow on a running ComfyUI, headless: submit it, follow the progress over ComfyUI's
websocket, and save what it outputs.

    python tools/headless.py example_workflows/wan21_t2v_ulysses2.json --server http://127.0.0.1:8188 \\
        --set KSampler.seed=7 --set ParallelConfig.ulysses_size=4 --out outputs/

The workflow may be in the UI format (what ComfyUI saves and its template browser lists) or the
API format ("Save (API Format)"); UI files are converted with the server's /object_info. ``--set``
changes an input of every node of a class (or of one node: ``--set 9.seed=7``). Exit code 0 when the
prompt succeeded, 1 when it failed (the error, with the failing rank's traceback, is printed).
When the run ends it prints one line per rank from /parallel/status: GPU allocated and reserved
memory, RSS and USS, each now and at its peak during the prompt, as the seeds' --track-memory does.
Needs only the standard library; with the ``websocket-client`` package it shows live progress,
without it it polls /history.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workflows import load, ui_to_api  # noqa: E402


def http(server: str, path: str, payload=None, timeout: float = 60):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(server + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
        return json.loads(body) if body[:1] in (b"{", b"[") else body


def apply_sets(prompt: dict, sets: list[str]) -> None:
    for item in sets:
        target, _, value = item.partition("=")
        node_ref, _, name = target.rpartition(".")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        matched = [nid for nid, node in prompt.items() if nid == node_ref or node["class_type"] == node_ref]
        if not matched:
            raise SystemExit(f"--set {item}: no node with id or class '{node_ref}'")
        for nid in matched:
            prompt[nid]["inputs"][name] = parsed


def follow(server: str, client_id: str, prompt_id: str, timeout: float) -> None:
    """Print progress until the prompt ends (websocket when available, else polling)."""
    try:
        import websocket
    except ImportError:
        websocket = None
    if websocket is not None:
        url = server.replace("http", "ws", 1) + f"/ws?clientId={client_id}"
        ws = websocket.create_connection(url, timeout=timeout)
        try:
            while True:
                raw = ws.recv()
                if not isinstance(raw, str):
                    continue  # preview images
                msg = json.loads(raw)
                kind, data = msg.get("type"), msg.get("data", {})
                if data.get("prompt_id") not in (None, prompt_id):
                    continue
                if kind == "progress":
                    print(f"\r  node {data.get('node')}: step {data['value']}/{data['max']}", end="", flush=True)
                elif kind == "executing" and data.get("node") is not None:
                    print(f"\n  running node {data['node']}", flush=True)
                elif kind in ("execution_success", "execution_error", "execution_interrupted"):
                    print()
                    break
        finally:
            ws.close()
    # ComfyUI announces the end before it files the prompt in its history (0.33 does so later
    # than 0.3.75): wait for the entry either way.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if http(server, f"/history/{prompt_id}").get(prompt_id, {}).get("status", {}).get("completed") is not None:
            return
        time.sleep(0.5)
    raise SystemExit(f"prompt {prompt_id} did not finish within {timeout:.0f}s")


MB = 2**20


def _mb(value) -> str:
    return "-" if value is None else f"{value / MB:.0f} MB"


def _now_and_peak(name: str, now, peak) -> str | None:
    if now is None and peak is None:
        return None
    return f"{name} {_mb(now)} (peak {_mb(peak)})"


def rank_summary(status: dict) -> list[str]:
    """One line per rank of GET /parallel/status: memory now and its peak during the last prompt
    (GPU allocated / reserved on accelerator ranks, RSS and USS on every rank), the staging pool's
    pinned host memory, weights held and steps run."""
    lines = [f"ranks: world size {status.get('world_size')}, {status.get('state')} "
             "(peaks: since the prompt's first sharded step)"]
    for r in status.get("ranks", []):
        parts = [_now_and_peak("GPU allocated", r.get("gpu_allocated_bytes"), r.get("gpu_peak_allocated_bytes")),
                 _now_and_peak("reserved", r.get("gpu_reserved_bytes"), r.get("gpu_peak_reserved_bytes")),
                 _now_and_peak("RSS", r.get("rss_bytes"), r.get("rss_peak_bytes")),
                 _now_and_peak("USS", r.get("uss_bytes"), r.get("uss_peak_bytes"))]
        if r.get("host_pinned_bytes"):
            parts.append(f"pinned {_mb(r['host_pinned_bytes'])}")
        parts.append(f"weights {_mb(r.get('param_bytes'))}, {r.get('forwards', 0)} steps")
        alive = "" if r.get("alive", True) else " (exited)"
        lines.append(f"  rank {r.get('rank')} {r.get('device') or '-'}{alive}: " + ", ".join(p for p in parts if p))
    return lines


def print_rank_summary(server: str) -> None:
    """The per-rank summary at the end of a run (nothing when the server has no parallel pack)."""
    try:
        status = http(server, "/parallel/status", timeout=30)
    except (urllib.error.URLError, OSError, ValueError):
        return
    if isinstance(status, dict) and status.get("ranks"):
        print("\n".join(rank_summary(status)), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workflow", help="workflow JSON (UI or API format)")
    parser.add_argument("--server", default="http://127.0.0.1:8188")
    parser.add_argument("--set", action="append", default=[], metavar="NODE.INPUT=VALUE")
    parser.add_argument("--out", default="outputs", help="directory for the files the workflow outputs")
    parser.add_argument("--timeout", type=float, default=3600)
    opts = parser.parse_args()

    server = opts.server.rstrip("/")
    prompt = ui_to_api(load(opts.workflow), http(server, "/object_info"))
    apply_sets(prompt, opts.set)
    client_id = uuid.uuid4().hex
    try:
        answer = http(server, "/prompt", {"prompt": prompt, "client_id": client_id})
    except urllib.error.HTTPError as err:
        print(f"rejected: {err.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    prompt_id = answer["prompt_id"]
    print(f"queued {prompt_id}")
    follow(server, client_id, prompt_id, opts.timeout)
    entry = http(server, f"/history/{prompt_id}")[prompt_id]
    print_rank_summary(server)
    status = entry["status"]
    if status.get("status_str") == "error":
        for kind, data in status.get("messages", []):
            if kind == "execution_error":
                print(f"failed in {data.get('node_type')} #{data.get('node_id')}:\n{data.get('exception_message')}",
                      file=sys.stderr)
        return 1
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = 0
    for node_out in entry.get("outputs", {}).values():
        for items in node_out.values():
            for item in items if isinstance(items, list) else []:
                if not isinstance(item, dict) or "filename" not in item:
                    continue
                query = urllib.parse.urlencode({k: item.get(k, "") for k in ("filename", "subfolder", "type")})
                (out / item["filename"]).write_bytes(http(server, f"/view?{query}"))
                saved += 1
    print(f"done: {saved} file(s) in {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
