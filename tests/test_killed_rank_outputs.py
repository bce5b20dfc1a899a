"""A worker killed in the middle of a Shard VAE decode or a sharded text encode (issue 29):
the prompt fails naming the rank and nothing is saved. Run with the test fake of NCCL
(PARALLEL_TEST_NCCL_ABORT), where an aborted collective returns as if it had completed, the
case gloo alone would never show: there only the watchdog's verdict stops the result. (Without
that verdict the text encode saves a conditioning computed from nothing; the decode happens to trip
over a garbage row count of its own first, on this model.)"""
import sys

import pytest

from comfy_server import ComfyServer, PromptFailed
from test_comfy_e2e import edited
from tiny_models import saved_dataset
from workflows import text_encoder_prompt, with_shard_vae

pytestmark = pytest.mark.comfy_server


@pytest.fixture(scope="module")
def killing_server(tiny_base, comfyui_path):
    """Every worker dies by SIGKILL in its first forward, after receiving its inputs."""
    server = ComfyServer(comfyui_path, tiny_base, python=sys.executable, log_path=tiny_base / "killing.log",
                         env={"PARALLEL_FAULT_INJECT": "kill:1:1", "PARALLEL_TEST_NCCL_ABORT": "1"}).start()
    yield server
    server.stop()


def saved_images(server):
    return sorted((server.base_dir / "output").rglob("*.png"))


def test_a_rank_killed_during_a_shard_vae_decode_fails_the_prompt(killing_server, tiny_prompt):
    before = saved_images(killing_server)
    prompt = with_shard_vae(edited(tiny_prompt, KSampler={"seed": 404, "steps": 1}), {"ulysses_size": 2})
    del prompt["62"], prompt["63"]  # the decode alone: no later sharded call could fail in its place
    with pytest.raises(PromptFailed) as info:
        killing_server.run(prompt, timeout=300)
    message = str(info.value)
    assert "rank 1" in message and "killed by signal 9" in message, message[-2000:]
    assert saved_images(killing_server) == before  # no image from aborted collectives
    assert "parallel watchdog: rank 1 died during the forward" in killing_server.log_tail(400)


def test_a_rank_killed_during_a_text_encode_fails_the_prompt(killing_server):
    with pytest.raises(PromptFailed) as info:
        killing_server.run(text_encoder_prompt("a red fox in the snow", "te_killed"), timeout=300)
    message = str(info.value)
    assert "rank 1" in message and "killed by signal 9" in message, message[-2000:]
    with pytest.raises(FileNotFoundError):
        saved_dataset(killing_server.base_dir, "te_killed")  # nothing written
