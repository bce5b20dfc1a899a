"""What the first prompt on a big model costs: host memory and time, sharded against unsharded.

A real ComfyUI server per case, as a new user meets it: the server starts, the tiny Wan demo runs
first (so a sharded world's workers are up, as they are after any earlier prompt), then the first
prompt on a big Wan 2.1-shaped model (2 steps). A case is a layout (unsharded, TP 2, Ulysses 2,
Ulysses 2 x TP 2), the way the weights reach the workers (``shared``: CPU ranks map rank 0's pages;
``process_group``: the way GPU ranks get them, a stream, each worker reading its unpatched tensors
from the .safetensors file itself) and the page cache (warm, or ``cold``: the file's pages evicted
with ``posix_fadvise(DONTNEED)`` before the prompt).

Measured per case: the time from queueing the prompt to its first sampling step done (ComfyUI's
progress message over the websocket: the step that carries the weights to the ranks) and to the
prompt's end; host memory as the proportional set size (PSS: a page mapped by n processes counts
1/n in each) of ComfyUI and every process it started, summed, before the prompt, sampled during it
(the peak) and after it, once every rank idles (CPU workers hand their freed heap back after
``IDLE_TRIM_S``); per rank, the bytes it read from the file and the bytes it received (the status
route's ``load`` and ``last_weight_send``). Each time and memory figure is set against the unsharded
run's of the same page-cache state, measured in the same call; the times also against reading the
file once (warm and cold, ``reference_reads``). With follow-ups, after the first prompt: two models
in turn (a second big file, Wan 2.2's two experts in one prompt, run twice: the second run sends
nothing) and a LoRA behind Shard Transformer, applied and then at another strength.

    PARALLEL_COMFYUI_VERSION=0.33.0 tools/run.sh python bench/load.py --out bench/results/load.json
    tools/run.sh python bench/plots.py bench/results bench/results/load.json    # its picture: load.png
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
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
from tiny_models import DEMO_FILES, TinyWan, lora_state_dict, wan_state_dict, write_tiny_wan_files  # noqa: E402
from workflows import edited, find_nodes, load, remove_passthrough, two_model_prompt, ui_to_api  # noqa: E402

DEMO = REPO / "example_workflows" / "tiny_wan_ulysses2_demo.json"
BIG_FILE, SECOND_FILE, LORA_FILE = "big_wan.safetensors", "big_wan_second.safetensors", "big_wan_lora.safetensors"
SETTLE_S = settings.IDLE_TRIM_S + 1.5  # "after the prompt": once every rank idles
STEPS = 2
LOADING = "weights loading"  # the timeline's name for the runtime's load bar (percent, on the sampler node)
LORA_TARGETS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o")  # an attention-only LoRA, every block
LORA_STRENGTHS = (0.8, 0.5)  # applied, then changed
LAYOUTS = {"unsharded": None, "tp2": {"tp_size": 2, "ulysses_size": 1},
           "ulysses2": {"ulysses_size": 2, "tp_size": 1}, "ulysses2_tp2": {"ulysses_size": 2, "tp_size": 2, "devices": "cpu,cpu,cpu,cpu"}}
TRANSPORTS = {"shared": None, "process_group": {"PARALLEL_WEIGHT_TRANSPORT": "process_group"}}
DEFAULT_GIGABYTES = 2.0
# Every layout over shared memory; the stream (and its file reads) on two ranks only, to keep a run
# near 15 minutes at 2 GB on 2 busy cores; cold: the unsharded run and the stream's Ulysses 2. The
# follow-ups (two models in turn, the LoRA) in the unsharded run, TP 2 over shared memory and both
# stream cases.
DEFAULT_CASES = ("unsharded", "tp2", "ulysses2", "ulysses2_tp2", "tp2/process_group", "ulysses2/process_group",
                 "unsharded/cold", "ulysses2/process_group/cold")
FOLLOW_UP_CASES = ("unsharded", "tp2", "tp2/process_group", "ulysses2/process_group")


@dataclass(frozen=True)
class Case:
    layout: str
    transport: str = "shared"
    cold: bool = False

    @classmethod
    def parse(cls, text: str) -> "Case":
        """``layout[/transport][/cold]``, e.g. ``tp2``, ``ulysses2/process_group/cold``, ``unsharded/cold``."""
        parts = text.split("/")
        cold = parts[-1] == "cold"
        parts = parts[:-1] if cold else parts
        if parts[0] not in LAYOUTS or len(parts) > 2 or (len(parts) == 2 and parts[1] not in TRANSPORTS):
            raise ValueError(f"case {text!r}: layout[/transport][/cold] with a layout of {list(LAYOUTS)} "
                             f"and a transport of {list(TRANSPORTS)}")
        return cls(parts[0], parts[1] if len(parts) == 2 else "shared", cold)

    @property
    def name(self) -> str:
        return "/".join([self.layout] + ([self.transport] if self.layout != "unsharded" and self.transport != "shared"
                                         else []) + (["cold"] if self.cold else []))


def big_spec(gigabytes: float) -> TinyWan:
    """A Wan 2.1-shaped model of about ``gigabytes`` in fp32 (1536 wide, as Wan 1.3B)."""
    per_layer = 4 * (4 * 1536 * 1536 + 2 * 1536 * 8960 + 2 * 1536 * 1536)  # self + cross attention, FFN
    return TinyWan(dim=1536, ffn_dim=8960, num_layers=max(1, round(gigabytes * 1e9 / per_layer)))


# ---------------------------------------------------------------- host memory
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


# ---------------------------------------------------------------- the file: read once, evicted
def read_once(path: Path) -> float:
    """Seconds to read ``path`` once, start to end, in 64 MiB reads."""
    buf = bytearray(64 << 20)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return round(time.perf_counter() - started, 3)


def resident_bytes(path: Path) -> int | None:
    """Bytes of ``path`` in the page cache (util-linux ``fincore``; None without it)."""
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", str(path)],
                             capture_output=True, text=True, timeout=30)
        return int(out.stdout.split()[0]) if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def evict(path: Path) -> dict:
    """Drop ``path``'s pages from the page cache: written back first, then ``posix_fadvise(DONTNEED)``
    from a child process without root's rights (user nobody where this runs as root), as any user can."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # dirty pages are not dropped
        before = resident_bytes(path)
        pid = os.fork()
        if pid == 0:  # only system calls here, then out
            try:
                if os.getuid() == 0:
                    os.setgid(65534)
                    os.setuid(65534)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os._exit(0)
            except BaseException:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    return {"fadvise_ok": os.waitstatus_to_exitcode(status) == 0, "as_uid": 65534 if os.getuid() == 0 else os.getuid(),
            "resident_before": before, "resident_after": resident_bytes(path)}


def reference_reads(path: Path) -> dict:
    """Reading the file once, page cache warm (the second of two reads) and cold (after ``evict``),
    and whether the eviction took: the file's resident bytes (``fincore``) and the two reads' times."""
    size = path.stat().st_size
    read_once(path)
    warm = read_once(path)
    evicted = evict(path)
    cold = read_once(path)
    took = (evicted["resident_after"] < 0.05 * size if evicted["resident_after"] is not None
            else cold > 1.5 * warm)
    return {"file_bytes": size, "warm_s": warm, "cold_s": cold, "warm_gb_s": round(size / warm / 1e9, 2),
            "cold_gb_s": round(size / cold / 1e9, 2), "evicted": bool(took and evicted["fadvise_ok"]), **evicted}


# ---------------------------------------------------------------- the model files
def write_models(base: Path, gigabytes: float, follow_ups: bool) -> dict:
    """The tiny demo's files, the big model and, for the follow-ups, a second big model (other
    weights) and an attention-only LoRA for it; the bytes of the model and of what the LoRA patches."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    write_tiny_wan_files(base, only=DEMO_FILES)
    models = base / "models" / "diffusion_models"
    spec = big_spec(gigabytes)
    save_file(wan_state_dict(spec), str(models / BIG_FILE))
    with safe_open(str(models / BIG_FILE), framework="pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    model_bytes = (models / BIG_FILE).stat().st_size
    out = {"path": models / BIG_FILE, "model_bytes": model_bytes, "layers": spec.num_layers}
    if follow_ups:
        save_file(wan_state_dict(spec, seed=11), str(models / SECOND_FILE))
        targets = [f"blocks.{i}.{name}" for i in range(spec.num_layers) for name in LORA_TARGETS]
        save_file(lora_state_dict(shapes, targets, rank=16), str(base / "models" / "loras" / LORA_FILE))
        out["lora_patched_bytes"] = sum(4 * shapes[f"{t}.weight"][0] * shapes[f"{t}.weight"][1] for t in targets)
    return out


# ---------------------------------------------------------------- the prompts
def prompts(server, sizes: dict | None) -> dict:
    """The demo prompt (sharded: starts the workers of ``sizes``), the big model's prompt in
    ``sizes`` (None: unsharded), the LoRA prompts (a LoRA behind Shard Transformer at each of
    LORA_STRENGTHS) and the two-model prompt (the big model for the first step, the second big
    model for the second, each behind its Shard Transformer), twice with another seed."""
    demo = ui_to_api(load(DEMO), server.object_info())
    for node_id in find_nodes(demo, "VAELoader") + find_nodes(demo, "VAEDecode") + find_nodes(demo, "SaveImage"):
        del demo[node_id]  # the latents are saved: the decode (seconds on 2 cores) would only add time and noise
    big = edited(demo, UNETLoader={"unet_name": BIG_FILE}, KSampler={"steps": STEPS},
                 LoraLoaderModelOnly={"strength_model": 0.0})  # the demo's LoRAs are shaped for the tiny model
    if sizes is not None:  # the demo starts the world the big prompt runs in
        demo, big = edited(demo, ParallelConfig=sizes), edited(big, ParallelConfig=sizes)
    (shard,) = find_nodes(big, "ShardTransformer")
    (after,) = [n for n in find_nodes(big, "LoraLoaderModelOnly") if big[n]["inputs"]["model"][0] == shard]
    loras = []
    for strength in LORA_STRENGTHS:
        loras.append(json.loads(json.dumps(big)))
        loras[-1][after]["inputs"].update(lora_name=LORA_FILE, strength_model=strength)
    pair = two_model_prompt(big, {}, {})
    pair["70"]["inputs"]["unet_name"] = SECOND_FILE
    first, second = find_nodes(pair, "KSamplerAdvanced")
    pair[first]["inputs"].update(steps=STEPS, end_at_step=1)
    pair[second]["inputs"].update(steps=STEPS, start_at_step=1, end_at_step=STEPS)
    out = {"demo": demo, "big": big, "lora": loras,
           "two_models": [pair, edited(pair, KSamplerAdvanced={"noise_seed": 7})]}
    if sizes is None:
        for key in ("big", "lora", "two_models"):
            out[key] = (remove_passthrough(out[key], "ShardTransformer", "model") if key == "big" else
                        [remove_passthrough(p, "ShardTransformer", "model") for p in out[key]])
    return out


def run_timed(server, prompt: dict, timeout: float = 900) -> dict:
    """Run ``prompt``: seconds from queueing it to its first sampling step done (ComfyUI's
    ``progress`` message of a sampler node, over the websocket) and to its end (``execution_success``)."""
    import websocket

    steps = {n: prompt[n]["inputs"]["steps"] for n in find_nodes(prompt, "KSampler") + find_nodes(prompt, "KSamplerAdvanced")}
    # A sampler's steps report at most its step count; the runtime's bar for a weight load, in percent, more.
    ws = websocket.create_connection(server.url.replace("http", "ws", 1) + f"/ws?clientId={server.client_id}",
                                     timeout=timeout)
    # [seconds, what, value]: each node as it starts (value None), each sampling step as it ends (the
    # step), and the first and last update of the weights' load bar on the sampler (LOADING: percent).
    timeline, bar = [], []
    try:
        started = time.perf_counter()
        prompt_id = server.queue(prompt)
        while True:
            raw = ws.recv()
            msg = json.loads(raw) if isinstance(raw, str) else {}  # bytes: previews
            kind, data = msg.get("type"), msg.get("data") or {}
            if data.get("prompt_id") != prompt_id:
                continue
            at = round(time.perf_counter() - started, 3)
            if kind == "executing" and data.get("node") is not None:
                timeline.append([at, prompt.get(data["node"], {}).get("class_type", data["node"]), None])
            elif kind == "progress" and data.get("node") in steps:
                if data.get("max", 0) <= steps[data["node"]]:
                    timeline.append([at, prompt[data["node"]]["class_type"], data.get("value")])
                else:  # the runtime's load bar on the running node, in percent: its first and last update
                    bar = [bar[0] if bar else [at, LOADING, data.get("value")], [at, LOADING, data.get("value")]]
            elif kind in ("execution_success", "execution_error", "execution_interrupted"):
                break
        seconds = time.perf_counter() - started
    finally:
        ws.close()
    timeline = sorted(timeline + bar, key=lambda entry: entry[0])
    server.wait(prompt_id, timeout)  # raises if it failed
    return {"seconds": round(seconds, 3), **phases(timeline), "timeline": timeline}


def phases(timeline: list) -> dict:
    """From a prompt's timeline: its first sampling step done; ComfyUI's own load of the model (its
    UNETLoader, to the next node's start: rank 0 reading the file); the second step (what a step
    costs once the weights are in place)."""
    steps = [at for at, what, step in timeline if step is not None and what != LOADING]
    loads = [nxt[0] - at for (at, kind, step), nxt in zip(timeline, timeline[1:]) if kind == "UNETLoader" and step is None]
    return {"first_step_s": steps[0] if steps else None, "comfyui_load_s": round(loads[0], 3) if loads else None,
            "second_step_s": round(steps[1] - steps[0], 3) if len(steps) > 1 else None}


# ---------------------------------------------------------------- what the ranks report
def rank_rows(before: dict, after: dict) -> list[dict]:
    """Per rank: its weights, PSS and ``load`` after; the bytes it read from checkpoint files since
    ``before``; on a worker, where a send came between, the bytes it received (the stream's, or with
    ``shared`` the pages it mapped) and the bytes it kept from an earlier read of the same file. A
    worker's ``load`` counts all three as done; the send's ``file_reads`` names what it reads or keeps."""
    was = {r["rank"]: (r.get("load") or {}).get("file_read_bytes", 0) for r in before.get("ranks", [])}
    sent = after.get("weight_sends", 0) > before.get("weight_sends", 0)
    planned = ((after.get("last_weight_send") or {}).get("file_reads") or {}).get("bytes_per_worker") or []
    rows = []
    for r in after.get("ranks", []):
        load_ = r.get("load")
        row = {"rank": r["rank"], "param_bytes": r.get("param_bytes"), "pss_bytes": r.get("pss_bytes"), "load": load_,
               "file_read_bytes": None if load_ is None else load_.get("file_read_bytes", 0) - was.get(r["rank"], 0)}
        if r["rank"] > 0:
            from_file = planned[r["rank"] - 1] if sent and len(planned) >= r["rank"] else 0
            row["received_bytes"] = load_["done_bytes"] - from_file if sent and load_ else 0
            row["kept_bytes"] = from_file - (row["file_read_bytes"] or 0)
        rows.append(row)
    return rows


def sends(before: dict, after: dict) -> dict:
    """The weight sends between two status answers: how many, the last one's figures, what the ranks hold."""
    count = after.get("weight_sends", 0) - before.get("weight_sends", 0)
    return {"weight_sends": count, "last_weight_send": after.get("last_weight_send") if count else None,
            "models_held": len(after.get("models") or []), "transport": after.get("transport")}


# ---------------------------------------------------------------- one case, one server
def first_prompt(server, prompt: dict, settle_s: float) -> dict:
    """The first prompt on the big model: its times, the summed PSS before, at its peak and after,
    and what travelled to each rank."""
    time.sleep(0.5)
    before, status_before = tree_pss(server.proc.pid), server.get("/parallel/status")
    with PeakSampler(server.proc.pid) as sampler:
        timed = run_timed(server, prompt)
    time.sleep(settle_s)  # CPU workers hand their step's freed heap back once idle
    after, status = tree_pss(server.proc.pid), server.get("/parallel/status")
    return {**timed, "pss_before": before, "pss_after": after, "pss_peak": sampler.peak, "growth": after - before,
            "peak_growth": sampler.peak - before, "ranks": rank_rows(status_before, status),
            **sends(status_before, status)}


def follow_up(server, prompt: dict) -> dict:
    """One more prompt: its times, the weight sends it took and the bytes each rank read and received."""
    before = server.get("/parallel/status")
    timed = run_timed(server, prompt)
    after = server.get("/parallel/status")
    return {**timed, **sends(before, after), "ranks": rank_rows(before, after)}


def measure(comfyui_path, base: Path, case: Case, env: dict | None = None, follow_ups: bool = False,
            settle_s: float = SETTLE_S) -> dict:
    """One case in a fresh server: the demo, then the first prompt on the big model (its file
    evicted first where ``case.cold``), then with ``follow_ups`` the two models in turn and the LoRA."""
    env = {**(env or {}), **(TRANSPORTS[case.transport] or {})} or None
    row = {"case": case.name, "layout": case.layout, "sizes": LAYOUTS[case.layout], "transport_asked": case.transport,
           "cache": "cold" if case.cold else "warm", "load_average_start": _load_average()}
    started = time.perf_counter()
    with ComfyServer(comfyui_path, base, python=sys.executable, env=env) as server:
        todo = prompts(server, LAYOUTS[case.layout])
        server.run(todo["demo"], timeout=600)
        if case.cold:
            row["evicted"] = evict(base / "models" / "diffusion_models" / BIG_FILE)
        row.update(first_prompt(server, todo["big"], settle_s))
        if follow_ups:
            row["two_models"] = [follow_up(server, p) for p in todo["two_models"]]
            row["lora"] = [{"strength": s, **follow_up(server, p)} for s, p in zip(LORA_STRENGTHS, todo["lora"])]
    row.update(load_average_end=_load_average(), case_s=round(time.perf_counter() - started, 1))
    return row


def _load_average() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def ratios(rows: list[dict], reads: dict | None) -> None:
    """Each row's growth, peak and times against the unsharded row of its page-cache state (None
    without one), and its first step against reading the file once in that state."""
    refs = {r["cache"]: r for r in rows if r["layout"] == "unsharded"}
    for row in rows:
        ref = refs.get(row["cache"])
        for key, of in (("growth_ratio", "growth"), ("peak_ratio", "peak_growth"), ("time_ratio", "seconds"),
                        ("first_step_ratio", "first_step_s")):
            row[key] = round(row[of] / ref[of], 3) if ref is not None and ref[of] and row[of] is not None else None
        read = (reads or {}).get(f"{row['cache']}_s")
        row["first_step_over_read"] = round(row["first_step_s"] / read, 2) if read and row["first_step_s"] else None


# ---------------------------------------------------------------- the run
def comfyui_version(path) -> str | None:
    try:
        return re.search(r'__version__ = "([^"]+)"', (Path(path) / "comfyui_version.py").read_text()).group(1)
    except (OSError, AttributeError):
        return None


def source_state() -> dict:
    """The commit the pack ran at and the files changed since, outside bench/: what was measured."""
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30).stdout

    try:
        return {"commit": git("rev-parse", "--short", "HEAD").strip() or None,
                "changed_outside_bench": [line[3:] for line in git("status", "--porcelain", "--", ".", ":!bench").splitlines()]}
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None}


def benchmark(comfyui_path, cases=DEFAULT_CASES, gigabytes: float = DEFAULT_GIGABYTES, workdir: Path | None = None,
              env: dict | None = None, follow_ups=FOLLOW_UP_CASES, reference: bool = True,
              settle_s: float = SETTLE_S) -> dict:
    """Every case (``Case`` or its text) in turn, each page-cache state's unsharded run first (added
    where missing: the ratios' reference); the cases named in ``follow_ups`` also run the two models
    and the LoRA; with ``reference`` the file is read once warm and once cold first. One record."""
    follow_ups = {Case.parse(c).name for c in follow_ups or ()}
    cases = [c if isinstance(c, Case) else Case.parse(c) for c in cases]
    states = sorted({c.cold for c in cases})
    cases = [Case("unsharded", cold=cold) for cold in states] + [c for c in cases if c.layout != "unsharded"]
    started, load_start = time.perf_counter(), _load_average()
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        base = Path(tmp)
        files = write_models(base, gigabytes, bool(follow_ups))
        reads = reference_reads(files["path"]) if reference else None
        rows = []
        for case in cases:
            rows.append(measure(comfyui_path, base, case, env, case.name in follow_ups, settle_s))
            print(f"[load] {summary(rows[-1])}", file=sys.stderr, flush=True)
    ratios(rows, reads)
    return {"suite": "load", "comfyui": comfyui_version(comfyui_path), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            **source_state(),
            "gigabytes": gigabytes, "layers": files["layers"], "model_bytes": files["model_bytes"],
            "lora_patched_bytes": files.get("lora_patched_bytes"), "lora_targets": list(LORA_TARGETS),
            "steps": STEPS, "settle_s": settle_s, "follow_up_cases": sorted(follow_ups), "reference_reads": reads,
            "load_average_start": load_start, "load_average_end": _load_average(), "cpu_count": os.cpu_count(),
            "run_s": round(time.perf_counter() - started, 1), "rows": rows}


def run(comfyui_path, layouts=tuple(LAYOUTS), gigabytes: float = 1.2, workdir: Path | None = None,
        env: dict | None = None) -> list[dict]:
    """Every layout over the shared transport, page cache warm, no follow-ups: the rows, ratios
    against the unsharded run's growth and time (run first). The memory test's call."""
    return benchmark(comfyui_path, [Case(n) for n in layouts], gigabytes, workdir, env, follow_ups=(),
                     reference=False)["rows"]


def summary(row: dict) -> str:
    first = "-" if row.get("first_step_s") is None else f"{row['first_step_s']:.2f} s"
    line = (f"{row['case']:>28}: growth {row['growth'] / 1e6:6.0f} MB, peak {row['peak_growth'] / 1e6:6.0f} MB, "
            f"first step {first}, prompt {row['seconds']:.2f} s, sends {row['weight_sends']}")
    reads = [r["file_read_bytes"] for r in row["ranks"][1:] if r["file_read_bytes"]]
    return line + (f", workers read {' + '.join(f'{b / 1e6:.0f}' for b in reads)} MB" if reads else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH"))
    parser.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES),
                        help="layout[/transport][/cold]: layouts " + ", ".join(LAYOUTS) + "; transports "
                             + ", ".join(TRANSPORTS) + " (default shared)")
    parser.add_argument("--gigabytes", type=float, default=DEFAULT_GIGABYTES, help="the big model's size in fp32")
    parser.add_argument("--follow-ups", nargs="*", default=list(FOLLOW_UP_CASES),
                        help="the cases that also run two models in turn and the LoRA (none: no argument)")
    parser.add_argument("--out", help="the record, as JSON (its picture: bench/plots.py OUT_DIR this file)")
    opts = parser.parse_args()
    result = benchmark(opts.comfyui or comfyui_path(""), opts.cases, opts.gigabytes, follow_ups=opts.follow_ups)
    for row in result["rows"]:
        print(summary(row))
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
