"""Context parallelism end to end through ComfyUI's HTTP API: meshes, model families and the
stock nodes around Shard Transformer."""
import copy

import pytest

from test_comfy_e2e import TOL, edited, final_latent, status
from workflows import find_nodes, parallel_config_node, remove_passthrough

pytestmark = pytest.mark.comfy_server


def hunyuan_prompt(parallel: dict) -> dict:
    """The Flux-layer stand-in (tiny HunyuanVideo, DESIGN section 5) in API format."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_hunyuan_video.safetensors",
                                                     "weight_dtype": "default"}},
        "2": parallel_config_node(**parallel),
        "3": {"class_type": "ShardTransformer", "inputs": {"model": ["1", 0], "parallel_config": ["2", 0]}},
        "4": {"class_type": "LoadTrainingDataset", "inputs": {"folder_name": "tiny_hunyuan_prompt"}},
        "5": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["4", 1]}},
        "6": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 80, "height": 48, "length": 9,
                                                                  "batch_size": 1}},
        "7": {"class_type": "KSampler", "inputs": {"model": ["3", 0], "positive": ["4", 1], "negative": ["5", 0],
                                                   "latent_image": ["6", 0], "seed": 5, "steps": 3, "cfg": 4.0,
                                                   "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": "latents/tiny_hunyuan"}},
    }


def compare(server, sharded, unsharded, label):
    reference = final_latent(server, unsharded)
    result = final_latent(server, sharded)
    err = (result - reference).abs().max().item()
    print(f"\n{label}: max abs err {err:.2e} (latents up to {reference.abs().max().item():.2f})")
    assert result.shape == reference.shape
    assert err <= TOL
    return reference


@pytest.mark.smoke
@pytest.mark.parametrize("parallel", [{"ring_size": 2}, {"cfg_size": 2}], ids=["ring2", "cfg2"])
def test_wan_workflow(tiny_server, tiny_prompt, parallel):
    sharded = edited(tiny_prompt, ParallelConfig={"ulysses_size": 1, **parallel})
    compare(tiny_server, sharded, remove_passthrough(tiny_prompt, "ShardTransformer", "model"),
            f"tiny Wan, {parallel}")
    info = status(tiny_server)
    assert info["mesh"] == {"cfg": 1, "ring": 1, "ulysses": 1, "tp": 1, **{k[:-5]: v for k, v in parallel.items()}}
    assert all(r["forwards"] > 0 for r in info["ranks"])


@pytest.mark.parametrize("parallel", [{"ring_size": 2}, {"cfg_size": 2}, {"ulysses_size": 2}],
                         ids=["ring2", "cfg2", "ulysses2"])
def test_flux_layer_stand_in_workflow(tiny_server, parallel):
    sharded = hunyuan_prompt(parallel)
    compare(tiny_server, sharded, remove_passthrough(sharded, "ShardTransformer", "model"),
            f"tiny HunyuanVideo, {parallel}")


def custom_sampler(prompt: dict) -> dict:
    """The same graph with SamplerCustomAdvanced + CFGGuider (+ ModelSamplingSD3) instead of KSampler."""
    out = copy.deepcopy(prompt)
    (ks,) = find_nodes(out, "KSampler")
    k = out.pop(ks)["inputs"]
    out["90"] = {"class_type": "ModelSamplingSD3", "inputs": {"model": k["model"], "shift": 5.0}}
    out["91"] = {"class_type": "CFGGuider", "inputs": {"model": ["90", 0], "positive": k["positive"],
                                                       "negative": k["negative"], "cfg": k["cfg"]}}
    out["92"] = {"class_type": "RandomNoise", "inputs": {"noise_seed": 77}}
    out["93"] = {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}}
    out["94"] = {"class_type": "BasicScheduler", "inputs": {"model": ["90", 0], "scheduler": "simple", "steps": 3,
                                                            "denoise": 1.0}}
    out["95"] = {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["92", 0], "guider": ["91", 0],
                                                                   "sampler": ["93", 0], "sigmas": ["94", 0],
                                                                   "latent_image": k["latent_image"]}}
    for node in out.values():
        for name, value in node["inputs"].items():
            if value == [ks, 0]:
                node["inputs"][name] = ["95", 0]
    return out


def test_sampler_custom_advanced_with_cfg_guider_and_model_sampling(tiny_server, tiny_prompt):
    sharded = custom_sampler(tiny_prompt)
    compare(tiny_server, sharded, remove_passthrough(sharded, "ShardTransformer", "model"),
            "SamplerCustomAdvanced + CFGGuider + ModelSamplingSD3, Ulysses 2")


def test_easycache_after_the_shard_node(tiny_server, tiny_prompt):
    """EasyCache decides on rank 0 whether a step runs the model at all; every step that
    does run, runs on all ranks (its wrapper is moved outside ours)."""
    def with_cache(prompt):
        out = copy.deepcopy(prompt)
        (ks,) = find_nodes(out, "KSampler")
        out["80"] = {"class_type": "EasyCache", "inputs": {"model": out[ks]["inputs"]["model"], "reuse_threshold": 2.0,
                                                           "start_percent": 0.0, "end_percent": 1.0,
                                                           "verbose": False}}
        out[ks]["inputs"]["model"] = ["80", 0]
        out[ks]["inputs"]["steps"] = 8
        return out

    sharded = with_cache(tiny_prompt)
    before = status(tiny_server)["ranks"]
    compare(tiny_server, sharded, remove_passthrough(sharded, "ShardTransformer", "model"), "EasyCache, Ulysses 2")
    after = status(tiny_server)["ranks"]
    assert len(after) == 2
    if len(before) == 2 and before[1]["pid"] == after[1]["pid"]:
        ran = [a["forwards"] - b["forwards"] for a, b in zip(after, before)]
    else:  # the world started for this run
        ran = [a["forwards"] for a in after]
    print(f"forwards per rank over 8 steps: {ran}")
    assert ran[0] == ran[1] and 0 < ran[0] < 8  # EasyCache skipped steps, on every rank alike


def test_layout_auto_workflow(tiny_server, tiny_prompt):
    """Parallel Config with layout auto over two CPU ranks: the tiny Wan runs in the layout the cost
    model chose (never cfg at CFG 1 batching: here cond and uncond are batched) and equals the
    unsharded run; the status route shows the probe and the choice."""
    sharded = edited(tiny_prompt, ParallelConfig={"ulysses_size": 1, "devices": "cpu,cpu", "layout": "auto"})
    compare(tiny_server, sharded, remove_passthrough(tiny_prompt, "ShardTransformer", "model"), "tiny Wan, layout auto")
    info = status(tiny_server)
    assert info["layout"] == "auto" and info["world_size"] == 2
    assert len(info["probe"]["ranks"]) == 2
    (choice,) = [c for c in info["layouts"] if c["model"] == "WanModel"]
    assert choice["alternatives"][0]["sizes"] == choice["layout"]
    assert all(r["forwards"] > 0 for r in info["ranks"])
