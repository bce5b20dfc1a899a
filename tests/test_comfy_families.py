"""Every family of the support matrix through a real ComfyUI server: the stock UNETLoader,
KSampler (CFG 3, so cond and uncond) and SaveLatent, on a tiny file of the family
(tools/tiny_families.py), under Ulysses 2 and TP 2 against the same graph without Shard
Transformer, in fp32. TP 2 also reports each rank's weight bytes, measured against the file.
The Hunyuan cases whose side tokens (byt5 glyphs, vision features) join the text stream, and LTX-2
with a denoise mask (per-token timesteps on both streams), also run under Ring 2, CFG 2, USP 2x2
and Ulysses 2 x TP 2.

And never silently wrong: a model changed under its plan the way a ComfyUI update changes one
(tests/comfy_extensions/simulated_comfyui_update) is refused with the family and the release
named, not computed."""
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from comfy_server import PromptFailed
from test_comfy_e2e import status
from test_comfy_tensor_parallel import free_every_rank
from tiny_families import FAMILIES, family_prompt, file_name

pytestmark = pytest.mark.multirank
LAYOUT_MAJOR = True  # conftest runs the tests grouped by layout: the world restarts once per layout
TOL = 1e-4
TP2_BYTES_LIMIT = 0.52
# Ulysses 3 over the tiny families' four heads: 2, 1 and 1 real heads a rank, padded to 2 (parallel/heads.py);
# the image families' 35 image tokens (80 x 112 pixels) do not divide by 3 either.
LAYOUTS = {"ulysses2": {"ulysses_size": 2}, "tp2": {"tp_size": 2},
           "ulysses3": {"ulysses_size": 3, "devices": "cpu,cpu,cpu"}}
ULYSSES3_QUICK = ("wan", "flux")

# TP 2 through the server in the default run: the reference families and those whose TP has no
# in-process case (LTX-2's audio and video, ERNIE-Image's object-patched forward, MiniMax-H3).
TP_QUICK = ("flux", "wan", "qwen_image", "z_image", "ltxav", "ernie_image", "minimax_h3")


def QUICK_TIER(test: str, params: dict) -> bool:
    """The default run (conftest.in_quick_tier): every family under Ulysses 2 through the server (its
    loader, detection and plan), TP 2 for the families named in TP_QUICK (every family's TP plan is also
    checked in process, tests/test_tensor_parallel.py), the four-rank hybrids on Wan, TP 4's share of the
    weights on MiniMax-H3, the other layouts
    for the two-stream families (LTX-2's audio and video, MiniMax-H3's packed segments) and one Hunyuan
    model; ``--full`` runs them all."""
    if test == "test_family_equals_unsharded" and params["layout"] == "ulysses3":
        return params["family"] in ULYSSES3_QUICK
    if test == "test_family_equals_unsharded":
        return params["layout"] != "tp2" or params["family"] in TP_QUICK
    if test == "test_four_rank_hybrids":
        return params["family"] == "wan"
    if test == "test_tp4_weights_per_rank":
        return params["family"] == "minimax_h3"
    if test == "test_family_under_the_other_layouts":
        return params["family"] in ("ltxav_i2v", "minimax_h3") or \
            (params["family"] == "hunyuan_video15" and params["layout"] == "ring2")
    return True
_references = {}


def final_latents(server, prompt) -> list:
    """The latents the prompt saved, in file-name order: one, or one per stream (LTX-2's video
    and audio)."""
    entry = server.run(prompt, timeout=300)
    return [load_file(str(path))["latent_tensor"] for path in sorted(server.outputs(entry, "latents"))]


def max_error(out: list, ref: list) -> float:
    assert [o.shape for o in out] == [r.shape for r in ref]
    return max((o - r).abs().max().item() for o, r in zip(out, ref))


def reference(server, family):
    if family not in _references:
        _references[family] = final_latents(server, family_prompt(family, None))
    return _references[family]


def file_bytes(server, family) -> int:
    path = server.base_dir / "models" / "diffusion_models" / file_name(family)
    with safe_open(str(path), "pt") as f:
        return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())


# Layout-major, so the world restarts once per layout rather than once per test.
@pytest.mark.smoke
@pytest.mark.parametrize("layout,family", [(layout, family) for layout in LAYOUTS for family in FAMILIES],
                         ids=[f"{layout}-{family}" for layout in LAYOUTS for family in FAMILIES])
def test_family_equals_unsharded(tiny_server, layout, family):
    ref = reference(tiny_server, family)
    if layout == "tp2":
        free_every_rank(tiny_server)  # a rank's weights count every model it holds: the earlier ones go
    out = final_latents(tiny_server, family_prompt(family, LAYOUTS[layout]))
    err = max_error(out, ref)
    info = status(tiny_server)
    line = f"\n{family} {layout}: max abs err {err:.2e} (latents up to {max(r.abs().max().item() for r in ref):.2f})"
    if layout == "tp2":
        shares = [r["param_bytes"] / file_bytes(tiny_server, family) for r in info["ranks"]]
        line += f"; weights per rank / file = {[round(s, 3) for s in shares]}"
    print(line)
    assert err <= TOL
    if layout == "ulysses3":  # each rank's share of the heads: a run of real heads, the rest padding
        heads = [r["heads"] for r in info["ranks"]]
        real, total = [h["real"] for h in heads], sum(h["real"] for h in heads)
        assert real == sorted(real, reverse=True) and real[0] - real[-1] <= 1, heads
        assert all(h["attended"] == -(-total // 3) for h in heads), heads
    assert info["mesh"] == {"cfg": 1, "ring": 1, "tp": 1, "ulysses": 1, **{
        name.removesuffix("_size"): size for name, size in LAYOUTS[layout].items() if name.endswith("_size")}}
    if layout == "tp2":
        assert len(shares) == 2 and max(shares) <= TP2_BYTES_LIMIT and min(shares) > 0


HYBRIDS = {"usp2x2": {"ulysses_size": 2, "ring_size": 2}, "ulysses2_tp2": {"ulysses_size": 2, "tp_size": 2},
           # six ranks, Ulysses 3 over the four heads (padded): Ring 2 across; or TP 2 inside (two heads a TP
           # rank: 1, 1 and 0 real heads a Ulysses rank)
           "usp3x2": {"ulysses_size": 3, "ring_size": 2}, "ulysses3_tp2": {"ulysses_size": 3, "tp_size": 2}}
# Wan, and LTX-2 (two streams, cross-stream attention) where this ComfyUI has it.
HYBRID_FAMILIES = [family for family in ("wan", "ltxav") if family in FAMILIES]


@pytest.mark.smoke
@pytest.mark.parametrize("hybrid,family", [(h, f) for h in HYBRIDS for f in HYBRID_FAMILIES],
                         ids=[f"{h}-{f}" if f != "wan" else h for h in HYBRIDS for f in HYBRID_FAMILIES])
def test_four_rank_hybrids(tiny_server, hybrid, family):
    """USP and Ulysses x TP on four ranks (four heads: one per rank under Ulysses 2 x TP 2), and on six
    with Ulysses 3, which does not divide the heads."""
    parallel = HYBRIDS[hybrid]
    ref = reference(tiny_server, family)
    out = final_latents(tiny_server, family_prompt(family, {**parallel, "devices": cpu_ranks(parallel)}))
    err = max_error(out, ref)
    mesh = status(tiny_server)["mesh"]
    print(f"\n{family} {parallel}: max abs err {err:.2e}")
    assert err <= TOL
    assert all(mesh[dim] == parallel.get(f"{dim}_size", 1) for dim in ("ulysses", "ring", "tp"))


def cpu_ranks(parallel: dict) -> str:
    """One 'cpu' per rank of these sizes."""
    return ",".join(["cpu"] * (parallel.get("ulysses_size", 1) * parallel.get("ring_size", 1)
                               * parallel.get("tp_size", 1)))


MORE_LAYOUTS = {"ring2": {"ring_size": 2}, "cfg2": {"cfg_size": 2},
                **{name: {**parallel, "devices": cpu_ranks(parallel)} for name, parallel in HYBRIDS.items()
                   if name in ("usp2x2", "ulysses2_tp2")}}


def encoded_image(server, family, node) -> torch.Tensor:
    """The latent the family's VAE gives the workflow's EmptyImage ``node``, encoded in this process."""
    import comfy.sd
    import comfy.utils

    nodes = FAMILIES[family].latent_nodes
    vae_file = server.base_dir / "models" / "vae" / nodes["40"]["inputs"]["vae_name"]
    sd, metadata = comfy.utils.load_torch_file(str(vae_file), return_metadata=True)
    image = nodes[node]["inputs"]
    rgb = torch.tensor([(image["color"] >> shift) & 0xFF for shift in (16, 8, 0)], dtype=torch.float32) / 255.0
    pixels = rgb.expand(image["batch_size"], image["height"], image["width"], 3)
    return comfy.sd.VAE(sd=sd, metadata=metadata).encode(pixels)


def mask_kept(server, family, ref):
    """The mask reached the model: the kept top-left 3 x 2 latent tokens stay the empty latent's zeros."""
    assert ref[1][..., :2, :3].abs().max() < 1e-6 and ref[1][..., 2:, 3:].abs().max() > 0.1


def images_kept(server, family, ref):
    """Both images reached the model: 3 latent frames and the appended keyframe; the start frame and
    the keyframe are kept as the VAE encodes their images, the frames between are sampled."""
    audio, video = ref  # file-name order: <family>_audio, <family>_video
    assert video.shape[2] == 4 and audio.ndim == 4
    for frame, node in ((0, "41"), (3, "43")):
        assert (video[:, :, frame] - encoded_image(server, family, node)[:, :, 0]).abs().max() < 1e-5
    assert (video[:, :, 1] - encoded_image(server, family, "41")[:, :, 0]).abs().max() > 0.1


def two_streams(server, family, ref):
    assert len(ref) == 2  # the video and the audio latent


# The layouts the per-family runs and the hybrids above leave out, for the families whose inputs
# go further than the per-family graph: family -> (its layouts, a check that the reference run
# really used what the family is here for).
# - HunyuanImage 2.1 with byt5 glyph tokens, HunyuanVideo 1.5 T2V and I2V: byt5 and vision tokens
#   join the text stream.
# - LTX-2 T2V with audio: the two streams and their cross-stream attention (USP and Ulysses x TP
#   run with the hybrids).
# - LTX-2 inpainting through stock nodes (SetLatentNoiseMask before LTXVConcatAVLatent): per-token
#   video timesteps (LTX-2's CompressedTimestep, expanded and cut) and per-token audio timesteps.
# - LTX-2 image-to-video with a keyframe through ComfyUI's own nodes (LTXVImgToVideoInplace, then
#   LTXVAddGuide with the tiny LTX-2 video VAE): the start frame kept by a per-frame denoise mask,
#   the keyframe appended as guide tokens with keyframe_idxs and a full-strength guide attention entry.
# - ERNIE-Image: its attention takes no transformer_options (the plan routes a module global) and
#   its forward runs no DIFFUSION_MODEL wrappers (Shard Transformer replaces the forward).
# - MiniMax-H3: video with audio packed into one sequence (text, audio, video segments with their
#   own RoPE positions and modulation rows).
FURTHER = {
    "hunyuan_image21": (MORE_LAYOUTS, None), "hunyuan_video15": (MORE_LAYOUTS, None),
    "hunyuan_video15_i2v": (MORE_LAYOUTS, None),
    "ltxav": (("ring2", "cfg2"), two_streams), "ltxav_inpaint": (MORE_LAYOUTS, mask_kept),
    "ltxav_i2v": (MORE_LAYOUTS, images_kept),
    "ernie_image": (MORE_LAYOUTS, None), "minimax_h3": (MORE_LAYOUTS, two_streams),
}
FURTHER_CASES = [(layout, family) for layout in MORE_LAYOUTS for family, (layouts, _) in FURTHER.items()
                 if family in FAMILIES and layout in layouts]


@pytest.mark.parametrize("layout,family", FURTHER_CASES, ids=[f"{layout}-{family}" for layout, family in FURTHER_CASES])
def test_family_under_the_other_layouts(tiny_server, layout, family):
    parallel = MORE_LAYOUTS[layout]
    ref = reference(tiny_server, family)
    check = FURTHER[family][1]
    if check is not None:
        check(tiny_server, family, ref)
    err = max_error(final_latents(tiny_server, family_prompt(family, parallel)), ref)
    print(f"\n{family} {layout}: max abs err {err:.2e}")
    assert err <= TOL
    assert all(status(tiny_server)["mesh"][dim] == parallel.get(f"{dim}_size", 1) for dim in ("ulysses", "ring", "cfg", "tp"))


# TP 4 and its share of the weights per rank, for the families issue 32 asks it of.
TP4_FAMILIES = [f for f in ("ernie_image", "minimax_h3") if f in FAMILIES]
TP4_BYTES_LIMIT = 0.27


@pytest.mark.parametrize("family", TP4_FAMILIES)
def test_tp4_weights_per_rank(tiny_server, family):
    ref = reference(tiny_server, family)
    free_every_rank(tiny_server)  # a rank's weights count every model it holds: the earlier ones go
    out = final_latents(tiny_server, family_prompt(family, {"tp_size": 4, "devices": "cpu,cpu,cpu,cpu"}))
    err = max_error(out, ref)
    info = status(tiny_server)
    shares = [r["param_bytes"] / file_bytes(tiny_server, family) for r in info["ranks"]]
    print(f"\n{family} tp4: max abs err {err:.2e}; weights per rank / file = {[round(s, 3) for s in shares]}")
    assert err <= TOL and info["mesh"]["tp"] == 4
    assert len(shares) == 4 and max(shares) <= TP4_BYTES_LIMIT and min(shares) > 0


def updated_prompt(family: str, change: str) -> dict:
    prompt = family_prompt(family, {"ulysses_size": 2})
    prompt["1"] = {"class_type": "SimulatedUpdateUNETLoader", "inputs": {"unet_name": file_name(family),
                                                                        "change": change}}
    return prompt


@pytest.mark.parametrize("family,blocks", [("wan", "blocks.0"), ("ltxv", "transformer_blocks.0")])
def test_a_block_whose_arguments_changed_is_refused_at_the_node(tiny_server, family, blocks):
    with pytest.raises(PromptFailed) as info:
        tiny_server.run(updated_prompt(family, "renamed block argument"), timeout=300)
    message = str(info.value)
    print(f"\n{message[:600]}")
    assert f"plan: {blocks} (Newer" in message and "takes no" in message
    assert "Refused rather than computing a wrong result" in message
    assert "ComfyUI " in message and info.value.error["node_type"] == "ShardTransformer"


def test_a_block_called_with_an_unknown_argument_is_refused(tiny_server):
    with pytest.raises(PromptFailed) as info:
        tiny_server.run(updated_prompt("wan", "new block argument"), timeout=300)
    message = str(info.value)
    print(f"\n{message[:600]}")
    assert "blocks.0 (WanAttentionBlock) was called with 'token_mask'" in message
    assert "Refused rather than computing a wrong result" in message


MINIMAX_FAMILIES = [f for f in ("minimax_h3",) if f in FAMILIES]


# TP must let a model run where it does not fit one GPU (issue 32): rank 0's compute device holds
# at most its shard and what ComfyUI loads besides the transformer, never the full weights.
RANK0_DEVICE_WEIGHTS_LIMIT = 0.6


@pytest.mark.parametrize("family", MINIMAX_FAMILIES)
def test_tp2_rank0_device_weights_stay_under_six_tenths_of_the_model(tiny_server, family):
    """The status's ``device_weight_peak_bytes``: over the prompt, what ComfyUI's loader counts as
    loaded on rank 0's device of the sharded model (``model_loaded_weight_memory``) plus rank 0's
    shard. MiniMax-H3 also runs the token refiner on ComfyUI's own module in ``extra_conds``, after
    ComfyUI loaded the model for sampling."""
    ref = reference(tiny_server, family)
    out = final_latents(tiny_server, family_prompt(family, {"tp_size": 2}))
    err = max_error(out, ref)
    info = status(tiny_server)
    rank0 = info["ranks"][0]
    share = rank0["device_weight_peak_bytes"] / file_bytes(tiny_server, family)
    print(f"\n{family} tp2: max abs err {err:.2e}; rank 0's peak weights on its compute device / file = {share:.3f} "
          f"(its shard {rank0['param_bytes'] / file_bytes(tiny_server, family):.3f})")
    assert err <= TOL and info["mesh"]["tp"] == 2
    assert rank0["param_bytes"] <= rank0["device_weight_peak_bytes"] <= RANK0_DEVICE_WEIGHTS_LIMIT * file_bytes(
        tiny_server, family)
    assert [r["device_weight_peak_bytes"] for r in info["ranks"][1:]] == [None]
