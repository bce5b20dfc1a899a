"""Shard Text Encoder end to end: a T5 text encoder loaded by the stock CLIPLoader, sharded over
2 ranks, feeding the stock CLIPTextEncode, gives the conditioning of the unsharded one."""
import pytest
import torch

from tiny_models import saved_dataset
from workflows import remove_passthrough, text_encoder_prompt

pytestmark = pytest.mark.comfy_server
TOL = 1e-5


def conditioning(server, graph, folder) -> tuple[torch.Tensor, dict]:
    server.run(graph, timeout=300)
    shard = torch.load(saved_dataset(server.base_dir, folder) / "shard_0000.pkl", weights_only=True)
    (((cond, extra),),) = shard["conditioning"]
    return cond, extra


@pytest.mark.smoke
def test_sharded_t5_gives_the_same_conditioning(tiny_server):
    text = "a lighthouse on a cliff in a storm, waves crashing, oil painting"
    unsharded = remove_passthrough(text_encoder_prompt(text, "te_reference"), "ShardTextEncoder", "clip")
    reference, _ = conditioning(tiny_server, unsharded, "te_reference")
    result, _ = conditioning(tiny_server, text_encoder_prompt(text, "te_sharded"), "te_sharded")
    err = (result - reference).abs().max().item()
    print(f"\nT5 behind Shard Text Encoder (2 ranks): conditioning {tuple(result.shape)}, max abs err {err:.2e}")
    assert result.shape == reference.shape and reference.abs().max().item() > 0
    assert err <= TOL
    ranks = tiny_server.get("/parallel/status")["ranks"]
    assert len(ranks) == 2 and all(r["forwards"] > 0 for r in ranks)


def test_a_world_that_does_not_split_the_encoder_runs_it_whole_on_rank_0(tiny_server):
    """T5-base's 12 heads split over no group that tiles 5 ranks (Ulysses 5, which the transformer
    runs with padded heads): the encoder runs whole on rank 0, the conditioning as unsharded, and
    no rank is started for it."""
    text = "x"
    before = [r["pid"] for r in tiny_server.get("/parallel/status")["ranks"]]
    reference, _ = conditioning(tiny_server, remove_passthrough(text_encoder_prompt(text, "te_ref5"),
                                                                "ShardTextEncoder", "clip"), "te_ref5")
    result, _ = conditioning(tiny_server, text_encoder_prompt(text, "te_five", {
        "ulysses_size": 5, "devices": "cpu,cpu,cpu,cpu,cpu"}), "te_five")
    assert result.shape == reference.shape and (result - reference).abs().max().item() <= TOL
    assert [r["pid"] for r in tiny_server.get("/parallel/status")["ranks"]] == before
