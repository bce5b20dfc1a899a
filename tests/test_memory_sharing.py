"""Weights reach the workers through shared memory: two CPU ranks must not cost two copies.

Measured as PSS (proportional set size: a shared page counts 1/n in each of the n
processes mapping it), on a model large enough (1.2 GB in fp32) that the weights,
not the Python and torch runtime of each process, dominate.
"""
import json
import sys

import pytest

from comfy_server import ComfyServer
from tiny_models import TinyWan, wan_state_dict, write_tiny_wan_files
from workflows import find_nodes, load, remove_passthrough, ui_to_api

pytestmark = pytest.mark.comfy_server
LIMIT = 1.5
BIG = TinyWan(dim=1536, ffn_dim=8960, num_layers=6)  # about 305M parameters


def test_two_cpu_ranks_share_one_copy_of_the_weights(tmp_path, comfyui_path):
    from safetensors.torch import save_file

    from conftest import REPO

    base = tmp_path / "base"
    write_tiny_wan_files(base)
    save_file(wan_state_dict(BIG), str(base / "models" / "diffusion_models" / "big_wan.safetensors"))
    with ComfyServer(comfyui_path, base, python=sys.executable) as server:
        prompt = ui_to_api(load(REPO / "example_workflows" / "tiny_wan_ulysses2_demo.json"), server.object_info())
        for node_id in find_nodes(prompt, "UNETLoader"):
            prompt[node_id]["inputs"]["unet_name"] = "big_wan.safetensors"
        for node_id in find_nodes(prompt, "LoraLoaderModelOnly"):
            prompt[node_id]["inputs"]["strength_model"] = 0.0  # the LoRAs are shaped for the tiny model

        server.run(remove_passthrough(prompt, "ShardTransformer", "model"), timeout=300)
        single = server.get("/parallel/status")["ranks"][0]["pss_bytes"]
        server.run(prompt, timeout=300)
        ranks = server.get("/parallel/status")["ranks"]

    weights = ranks[0]["param_bytes"]
    summed = sum(r["pss_bytes"] for r in ranks)
    ratio = summed / single
    per_rank = " + ".join(f"{r['pss_bytes'] / 1e9:.2f}" for r in ranks)
    print(f"\nweights {weights / 1e9:.2f} GB; PSS one process {single / 1e9:.2f} GB; "
          f"2 ranks {per_rank} = {summed / 1e9:.2f} GB; ratio {ratio:.2f} (limit {LIMIT})")
    assert len(ranks) == 2 and ranks[1]["param_bytes"] == weights > 1e9
    assert ratio <= LIMIT


GROWTH_LIMIT, PEAK_LIMIT = 1.15, 1.3  # against the unsharded run's growth and its peak. Issue 48 aims at 1.10:
# measured 1.07-1.10 (2026-11-28, 2 cores shared); about 100 MB a layout is not yet accounted for


@pytest.mark.parametrize("layouts", [("tp2", "ulysses2", "ulysses2_tp2")])
def test_the_first_prompt_on_a_big_model_costs_one_copy_of_the_weights(tmp_path, comfyui_path, layouts):
    """A fresh server per layout with its workers started on the tiny demo, then the first prompt on
    a 1 GB model: the summed PSS of ComfyUI and every process it started grows at most 1.15x what the
    unsharded run's grows (issue 48 aims at 1.10x), and peaks at most 1.3x its peak; every worker holds its weights through
    the shared transport (its ``load`` says so, bytes done of its total)."""
    from conftest import REPO

    sys.path.insert(0, str(REPO / "bench"))
    import load

    rows = {r["layout"]: r for r in load.run(comfyui_path, layouts, gigabytes=1.0, workdir=tmp_path)}
    print()
    for row in rows.values():
        print(f"{row['layout']:>14}: growth {row['growth'] / 1e6:6.0f} MB ({row['growth_ratio']:.2f}x), "
              f"peak {row['peak_growth'] / 1e6:6.0f} MB ({row['peak_ratio']:.2f}x), {row['seconds']:.1f} s")
    assert rows["unsharded"]["growth"] > 0.9e9  # the model, as ComfyUI holds it
    for name in layouts:
        row = rows[name]
        assert row["transport"] == "shared", row
        for rank in row["ranks"][1:]:
            load_ = rank["load"]
            assert load_ is not None and load_["via"] == "shared", rank
            assert load_["done_bytes"] == load_["total_bytes"] == rank["param_bytes"] > 0, rank
        assert row["growth_ratio"] <= GROWTH_LIMIT, row
        assert row["peak_ratio"] <= PEAK_LIMIT, row


@pytest.mark.parametrize("sizes", [{"ulysses_size": 2, "tp_size": 1}, {"ulysses_size": 1, "tp_size": 2}],
                         ids=["ulysses2", "tp2"])
def test_a_lora_strength_change_moves_only_the_patched_tensors(tiny_server, tiny_prompt, tiny_base, sizes):
    """CPU ranks: after a strength change of the LoRA behind the node, the send copies into shared
    memory only the tensors the demo's LoRAs patch (counted from the LoRA and model files); every
    other tensor travels as a handle to the pages the ranks already map."""
    from safetensors import safe_open

    from workflows import edited, find_nodes

    prompt = edited(tiny_prompt, ParallelConfig=sizes)
    tiny_server.run(prompt, timeout=300)
    (after,) = [n for n in find_nodes(prompt, "LoraLoaderModelOnly")
                if prompt[n]["inputs"]["model"][0] in find_nodes(prompt, "ShardTransformer")]
    loras = [prompt[n]["inputs"]["lora_name"] for n in find_nodes(prompt, "LoraLoaderModelOnly")]
    changed = json.loads(json.dumps(prompt))
    changed[after]["inputs"]["strength_model"] = 0.3
    tiny_server.run(changed, timeout=300)
    send = tiny_server.get("/parallel/status")["last_weight_send"]

    models = tiny_base / "models"
    targets = set()
    for name in loras:
        with safe_open(str(models / "loras" / name), framework="pt") as f:
            targets |= {k[len("diffusion_model."):-len(".lora_up.weight")] + ".weight"
                        for k in f.keys() if k.endswith(".lora_up.weight")}
    unet = prompt[find_nodes(prompt, "UNETLoader")[0]]["inputs"]["unet_name"]
    with safe_open(str(models / "diffusion_models" / unet), framework="pt") as f:
        patched = sum(f.get_tensor(k).nbytes for k in targets)
        total = sum(f.get_tensor(k).nbytes for k in f.keys())
    print(f"\n{sizes}: the strength change copied {send['shared_bytes']} bytes; patched tensors {patched}, "
          f"model {total}")
    assert send["transport"] == "shared" and 0 < patched < total / 2
    assert send["shared_bytes"] <= patched * 1.01 + (0.02 * total if sizes["tp_size"] > 1 else 0)
    assert send["shared_bytes"] >= patched * 0.99 / max(1, sizes["tp_size"])
