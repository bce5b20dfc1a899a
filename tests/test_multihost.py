"""Ranks on two "hosts": two network namespaces joined by a veth pair on this machine. Rank 0
(a real ComfyUI) runs in one, the agent and rank 1 in the other; they meet over TCP on the veth
addresses only (no shared memory across them: the weights go through the process group)."""
import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from conftest import COMFYUI_PATH, REPO

pytestmark = pytest.mark.comfy_server
NS_A, NS_B = "hp_rank0", "hp_rank1"
IF_A, IF_B = "hpveth0", "hpveth1"
ADDR_A, ADDR_B = "10.213.7.1", "10.213.7.2"
TOL = 1e-4  # as test_comfy_e2e: the tiny Wan's latents reach ~21 (fp32 order of sums ~1e-5 there)


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture()
def namespaces():
    if shutil.which("ip") is None:
        pytest.skip("the two-host test builds network namespaces with iproute2's `ip`, which is not installed")
    if os.geteuid() != 0:
        pytest.skip("the two-host test builds network namespaces, which needs root; run the suite as root")
    for ns in (NS_A, NS_B):
        ip("netns", "del", ns, check=False)
    probe = ip("netns", "add", NS_A, check=False)
    if probe.returncode != 0:
        pytest.skip(f"creating network namespaces is not permitted here: {probe.stderr.strip()}")
    try:
        ip("netns", "add", NS_B)
        ip("link", "add", IF_A, "type", "veth", "peer", "name", IF_B)
        ip("link", "set", IF_A, "netns", NS_A)
        ip("link", "set", IF_B, "netns", NS_B)
        for ns, dev, addr in ((NS_A, IF_A, ADDR_A), (NS_B, IF_B, ADDR_B)):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in (NS_A, NS_B):
            ip("netns", "del", ns, check=False)


def test_tiny_wan_workflow_with_rank_1_on_another_host(namespaces, tiny_base, tmp_path):
    key = uuid.uuid4().hex
    rendezvous = f"{ADDR_A}:29611"
    env = dict(os.environ, PARALLEL_CLUSTER_KEY=key, COMFYUI_PATH=COMFYUI_PATH, PYTHONUNBUFFERED="1")
    agent_log = open(tmp_path / "agent.log", "w")
    agent = subprocess.Popen(["ip", "netns", "exec", NS_B, "env", f"GLOO_SOCKET_IFNAME={IF_B}", sys.executable,
                              "-m", "parallel_runtime.world.agent", "--rendezvous", rendezvous,
                              "--name", "hostb", "--devices", "cpu"],
                             env=env, stdout=agent_log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        out = tmp_path / "result.json"
        driver = subprocess.run(["ip", "netns", "exec", NS_A, "env", f"GLOO_SOCKET_IFNAME={IF_A}", sys.executable,
                                 str(REPO / "tests" / "multihost_driver.py"), str(tiny_base), COMFYUI_PATH,
                                 rendezvous, str(out)], env=env, capture_output=True, text=True, timeout=900)
        assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-3000:]
        result = json.loads(out.read_text())
    finally:
        agent.terminate()
        agent.wait(20)
        agent_log.close()
    ranks = result["status"]["ranks"]
    print(f"\ntwo hosts: max abs err {result['max_abs_err']:.2e}; ranks on "
          f"{[(r['rank'], r['host']) for r in ranks]}; lost host reported after {result['lost_host_seconds']:.1f}s")
    assert [r["host"] for r in ranks] == ["local", "hostb"] and ranks[1]["forwards"] > 0
    assert result["max_abs_err"] <= TOL
    assert result["lost_host_error"] and "rank 1 on host hostb" in result["lost_host_error"]
    assert result["lost_host_seconds"] < 30
