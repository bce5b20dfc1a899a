"""Shard VAE end to end: the tiny Wan 2.1 VAE behind Shard VAE feeding the stock VAEDecode and
VAEEncode gives the same images and latents as without the node."""
import copy

import numpy as np
import pytest
from PIL import Image

from comfy_server import PromptFailed
from test_comfy_e2e import TOL, edited, status
from workflows import find_nodes, parallel_config_node, remove_passthrough, with_shard_vae

pytestmark = pytest.mark.comfy_server


def outputs(server, prompt):
    entry = server.run(prompt, timeout=300)
    images = [np.asarray(Image.open(path)).astype(np.int16) for path in server.outputs(entry, "images")]
    from safetensors.torch import load_file

    (latent,) = server.outputs(entry, "latents")
    return images, load_file(str(latent))["latent_tensor"]


@pytest.mark.smoke
def test_shard_vae_decodes_and_encodes_like_one_device(tiny_server, tiny_prompt):
    sharded = with_shard_vae(edited(tiny_prompt, KSampler={"seed": 303}), {"ulysses_size": 2})
    images_ref, latent_ref = outputs(tiny_server, remove_passthrough(sharded, "ShardVAE", "vae"))
    images, latent = outputs(tiny_server, sharded)
    assert len(images) == len(images_ref) == 9
    pixel_diff = max(int(np.abs(a - b).max()) for a, b in zip(images, images_ref))
    err = (latent - latent_ref).abs().max().item()
    print(f"\nShard VAE (2 ranks): images differ by at most {pixel_diff} of 255; re-encoded latents by {err:.2e}")
    assert pixel_diff <= 1  # a float difference of ~1e-6 can flip one rounding
    assert err <= TOL
    ranks = status(tiny_server)["ranks"]
    assert len(ranks) == 2 and ranks[1]["forwards"] > 0


def test_a_shard_vae_config_of_another_world_size_than_the_transformer_is_refused(tiny_server, tiny_prompt):
    bad = copy.deepcopy(tiny_prompt)  # Shard Transformer on 2 ranks, Shard VAE on 3
    (vae_loader,) = find_nodes(bad, "VAELoader")
    (decode,) = find_nodes(bad, "VAEDecode")
    bad["60"] = parallel_config_node(tp_size=3, devices="cpu,cpu,cpu")
    bad["61"] = {"class_type": "ShardVAE", "inputs": {"vae": [vae_loader, 0], "parallel_config": ["60", 0]}}
    bad[decode]["inputs"]["vae"] = ["61", 0]
    before = {r["pid"] for r in status(tiny_server)["ranks"]}
    with pytest.raises(PromptFailed, match="Shard VAE: its Parallel Config makes a world of size 3, the Shard "
                                           "Transformer of this workflow one of size 2"):
        tiny_server.run(bad, timeout=120)
    assert {r["pid"] for r in status(tiny_server)["ranks"]} <= before | {None}


def test_one_parallel_config_with_layout_auto_feeds_shard_transformer_and_shard_vae(tiny_server, tiny_prompt):
    """Issue 30: a Parallel Config with layout auto, sizes 1 and devices cpu,cpu is a world of 2 for
    both nodes it feeds; Shard VAE once took the transformer's world for 1 (the raw sizes multiplied)
    and refused the workflow. Accepted now, and the decode equals the one without Shard VAE."""
    prompt = edited(tiny_prompt, KSampler={"seed": 307, "steps": 2},
                    ParallelConfig={"ulysses_size": 1, "ring_size": 1, "tp_size": 1, "cfg_size": 1,
                                    "devices": "cpu,cpu", "layout": "auto"})
    (config,) = find_nodes(prompt, "ParallelConfig")
    (vae_loader,) = find_nodes(prompt, "VAELoader")
    (decode,) = find_nodes(prompt, "VAEDecode")
    sharded = copy.deepcopy(prompt)
    sharded["61"] = {"class_type": "ShardVAE", "inputs": {"vae": [vae_loader, 0], "parallel_config": [config, 0]}}
    sharded[decode]["inputs"]["vae"] = ["61", 0]
    reference = [np.asarray(Image.open(p)).astype(np.int16)
                 for p in tiny_server.outputs(tiny_server.run(prompt, timeout=300), "images")]
    images = [np.asarray(Image.open(p)).astype(np.int16)
              for p in tiny_server.outputs(tiny_server.run(sharded, timeout=300), "images")]
    assert len(images) == len(reference) > 0
    pixel_diff = max(int(np.abs(a - b).max()) for a, b in zip(images, reference))
    print(f"\nlayout auto over cpu,cpu, Shard Transformer and Shard VAE: images differ by at most {pixel_diff} of 255")
    assert pixel_diff <= 1
    ranks = status(tiny_server)["ranks"]
    assert len(ranks) == 2 and ranks[1]["forwards"] > 0
