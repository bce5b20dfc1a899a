"""Tensor parallelism through ComfyUI's HTTP API: LoRA-patched shards, what each rank holds, and
ComfyUI's /free reaching every rank."""
import time

import pytest

from test_comfy_e2e import TOL, edited, final_latent, status
from workflows import find_nodes, remove_passthrough

pytestmark = pytest.mark.comfy_server


def with_lora_strengths(prompt, first, second):
    out = edited(prompt)
    before, after = find_nodes(out, "LoraLoaderModelOnly")
    out[before]["inputs"]["strength_model"] = first
    out[after]["inputs"]["strength_model"] = second
    return out


@pytest.mark.smoke
def test_tp2_with_lora_and_a_changed_strength(tiny_server, tiny_prompt):
    """The shards are cut from the LoRA-patched weights, and cut again when the strength changes."""
    tp2 = edited(tiny_prompt, ParallelConfig={"ulysses_size": 1, "tp_size": 2})
    results = {}
    for strengths in ((0.8, 0.6), (0.3, 1.2)):
        sharded = with_lora_strengths(tp2, *strengths)
        reference = final_latent(tiny_server, remove_passthrough(sharded, "ShardTransformer", "model"))
        result = final_latent(tiny_server, sharded)
        err = (result - reference).abs().max().item()
        print(f"\nTP 2 with LoRA strengths {strengths}: max abs err {err:.2e}")
        assert err <= TOL
        results[strengths] = (reference, result)
    (ref_a, out_a), (ref_b, out_b) = results.values()
    change_ref, change_out = ref_b - ref_a, out_b - out_a
    assert change_ref.abs().max().item() > 1e-2  # the strengths matter
    assert (change_out - change_ref).abs().max().item() <= 2 * TOL
    assert status(tiny_server)["mesh"]["tp"] == 2


def free_every_rank(server) -> list[int]:
    """ComfyUI's /free (unload models), then what each rank still holds once it has reached them.

    Only when a rank holds something: ComfyUI acts on /free's flags when its prompt worker next
    wakes, and a prompt queued right after it can win that race, so the flags would unload the
    prompt's own models once it ends (its ranks then report nothing held). With weights held,
    the wait below sees the unload happen before it returns."""
    if not any(r["param_bytes"] for r in status(server)["ranks"]):
        return [0 for _ in status(server)["ranks"]]
    server.post("/free", {"unload_models": True, "free_memory": True})
    deadline = time.monotonic() + 30
    while any(r["param_bytes"] for r in status(server)["ranks"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [r["param_bytes"] for r in status(server)["ranks"]]


def QUICK_TIER(test: str, params: dict) -> bool:
    """The default run (conftest.in_quick_tier) checks TP 2's share of the weights; ``--full`` TP 4's too."""
    return test != "test_each_rank_holds_its_share_of_the_weights" or params["tp"] == 2


@pytest.mark.parametrize("tp,limit", [(2, 0.55), (4, 0.30)])
def test_each_rank_holds_its_share_of_the_weights(tiny_server, tiny_prompt, tp, limit):
    free_every_rank(tiny_server)  # the session's earlier models in this world would count too
    prompt = edited(tiny_prompt, ParallelConfig={"ulysses_size": 1, "tp_size": tp, "devices": ",".join(["cpu"] * tp)},
                    UNETLoader={"unet_name": "tiny_wan21_t2v_4heads.safetensors"},
                    LoraLoaderModelOnly={"strength_model": 0.0})  # the LoRAs are shaped for the 2-head model
    tiny_server.run(prompt, timeout=300)
    info = status(tiny_server)
    from safetensors import safe_open

    path = tiny_server.base_dir / "models" / "diffusion_models" / "tiny_wan21_t2v_4heads.safetensors"
    with safe_open(str(path), "pt") as f:
        full = sum(f.get_tensor(k).numel() * 4 for k in f.keys())
    shares = [r["param_bytes"] / full for r in info["ranks"]]
    print(f"\nTP {tp}: weights per rank / whole model = {[round(s, 3) for s in shares]}")
    assert len(shares) == tp and info["mesh"]["tp"] == tp
    assert max(shares) <= limit and min(shares) > 0


def test_free_unloads_every_rank_and_the_next_prompt_sends_again(tiny_server, tiny_prompt):
    tp2 = edited(tiny_prompt, ParallelConfig={"ulysses_size": 1, "tp_size": 2}, KSampler={"seed": 17})
    reference = final_latent(tiny_server, remove_passthrough(tp2, "ShardTransformer", "model"))
    assert (final_latent(tiny_server, tp2) - reference).abs().max().item() <= TOL
    assert all(r["param_bytes"] > 0 for r in status(tiny_server)["ranks"])
    held = free_every_rank(tiny_server)
    print(f"\nweights per rank after /free: {held}")
    assert held == [0, 0]
    assert (final_latent(tiny_server, tp2) - reference).abs().max().item() <= TOL
