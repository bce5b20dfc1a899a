"""Weights reach the workers through shared memory: two CPU ranks must not cost two copies.

Measured as PSS (proportional set size: a shared page counts 1/n in each of the n
processes mapping it), on a model large enough (1.2 GB in fp32) that the weights,
not the Python and torch runtime of each process, dominate.
"""
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
