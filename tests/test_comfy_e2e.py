"""End to end through a real ComfyUI server and its HTTP API (POST /prompt), CPU and gloo."""
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from comfy_server import PromptFailed, PromptRejected
from workflows import edited, find_nodes, remove_passthrough

pytestmark = pytest.mark.comfy_server
# fp32 rounding of a sharded run against one process: the tiny Wan's latents reach ~21, where the
# order of sums alone gives 1.2e-5 under Ulysses 2 on AVX-512 CPUs; the issues ask for 1e-4.
TOL = 1e-4


def final_latent(server, prompt) -> torch.Tensor:
    entry = server.run(prompt, timeout=300)
    (path,) = server.outputs(entry, "latents")
    return load_file(str(path))["latent_tensor"]


def status(server) -> dict:
    return server.get("/parallel/status")


def settled_status(server, quiet_s: float = 0.3, timeout: float = 10.0) -> dict:
    """/parallel/status once no rank's forward count moved over ``quiet_s``: a worker counts its
    forward after its part of the output has left it, so a prompt can end a moment before the last
    worker's count lands. For tests that compare counts exactly."""
    deadline = time.monotonic() + timeout
    last = status(server)
    while True:
        time.sleep(quiet_s)
        now = status(server)
        if [r["forwards"] for r in now["ranks"]] == [r["forwards"] for r in last["ranks"]] \
                or time.monotonic() > deadline:
            return now
        last = now


@pytest.mark.smoke
def test_sharded_workflow_equals_unsharded(tiny_server, tiny_prompt):
    """Ulysses 2 on 2 ranks, stock KSampler at cfg 3, one LoRA before and one after the node."""
    ksampler = tiny_prompt[find_nodes(tiny_prompt, "KSampler")[0]]["inputs"]
    assert ksampler["cfg"] > 1
    assert len(find_nodes(tiny_prompt, "LoraLoaderModelOnly")) == 2
    assert tiny_prompt[find_nodes(tiny_prompt, "ParallelConfig")[0]]["inputs"]["ulysses_size"] == 2

    unsharded = remove_passthrough(tiny_prompt, "ShardTransformer", "model")
    assert not find_nodes(unsharded, "ShardTransformer")
    reference = final_latent(tiny_server, unsharded)
    result = final_latent(tiny_server, tiny_prompt)
    err = (result - reference).abs().max().item()
    print(f"\nthrough the HTTP API: max abs err {err:.2e} over latents up to {reference.abs().max().item():.2f}")
    assert result.shape == reference.shape
    assert err <= TOL

    ranks = status(tiny_server)["ranks"]
    assert len(ranks) == 2 and all(r["forwards"] > 0 for r in ranks), ranks

    # The LoRAs must matter, or the comparison above would not show that they reach every rank.
    no_lora = final_latent(tiny_server, edited(unsharded, LoraLoaderModelOnly={"strength_model": 0.0}))
    assert (no_lora - reference).abs().max().item() > 1e-3


def test_status_lists_every_rank(tiny_server, tiny_prompt):
    prompt_id = tiny_server.queue(edited(tiny_prompt, KSampler={"seed": 7}))
    tiny_server.wait(prompt_id, timeout=300)
    info = status(tiny_server)
    assert info["world_size"] == 2 and info["mesh"] == {"cfg": 1, "ring": 1, "ulysses": 2, "tp": 1}
    assert [r["rank"] for r in info["ranks"]] == [0, 1]
    for r in info["ranks"]:
        assert r["alive"] is True and r["device"] == "cpu" and r["pid"] > 0
        assert r["param_bytes"] > 10_000_000  # the tiny transformer is about 13 MB in fp32
        assert r["rss_bytes"] > 0 and r["pss_bytes"] > 0 and r["last_forward_ms"] > 0
        # Memory now and at its peak during the prompt; CPU ranks: no GPU figures, nothing pinned.
        assert r["rss_peak_bytes"] >= r["rss_bytes"] > 0 and r["uss_peak_bytes"] >= r["uss_bytes"] > 0, r
        assert r["gpu_peak_allocated_bytes"] is None and r["gpu_peak_reserved_bytes"] is None
        assert r["host_pinned_bytes"] == 0 and r["host_kept_bytes"] == 0
    assert info["ranks"][1]["pid"] != os.getpid()
    assert info["peaks_prompt"] == prompt_id  # the peaks are this prompt's


def test_bad_config_is_refused_before_anything_runs(tiny_server, tiny_prompt):
    with pytest.raises(PromptRejected) as info:
        tiny_server.queue(edited(tiny_prompt, ParallelConfig={"ulysses_size": 3}))  # 3 ranks on 2 cores
    assert "Parallel Config: devices='auto'" in str(info.value) and "2 cores" in str(info.value)
    with pytest.raises(PromptRejected) as info:
        tiny_server.queue(edited(tiny_prompt, ParallelConfig={"backend": "nccl"}))
    assert "backend='nccl'" in str(info.value) and "NCCL needs CUDA" in str(info.value)


def test_tp_size_that_does_not_divide_the_heads_is_refused_at_the_node(tiny_server, tiny_prompt):
    """Only TP keeps the divisibility rule (Ulysses pads heads it does not divide: parallel/heads.py)."""
    before = {r["pid"] for r in status(tiny_server)["ranks"]}
    bad = edited(tiny_prompt, ParallelConfig={"ulysses_size": 1, "tp_size": 4, "devices": "cpu,cpu,cpu,cpu"})
    with pytest.raises(PromptFailed) as info:
        tiny_server.run(bad, timeout=120)
    message = str(info.value)
    assert "Shard Transformer: tp_size=4 does not divide this Wan" in message and "2 attention heads" in message
    assert "valid tp_size values: 1, 2" in message
    assert {r["pid"] for r in status(tiny_server)["ranks"]} == before  # no worker was started


def test_workers_exit_when_comfyui_is_killed(tiny_base, comfyui_path, tiny_prompt):
    import sys

    import psutil

    from comfy_server import ComfyServer

    server = ComfyServer(comfyui_path, tiny_base, python=sys.executable,
                         log_path=tiny_base / "killed_comfyui.log").start()
    try:
        server.run(tiny_prompt, timeout=300)
        workers = [r["pid"] for r in status(server)["ranks"][1:]]
        assert workers and all(psutil.pid_exists(p) for p in workers)
    finally:
        server.stop(sig=signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(p) for p in workers):
        time.sleep(0.1)
    assert not any(_running(p) for p in workers), "a worker outlived the ComfyUI that started it"


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
