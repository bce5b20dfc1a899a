"""Shard Text Encoder: every supported encoder family, tensor parallel over 2 and 4 ranks,
against the same CLIP on one process (fp32: max abs error and the error relative to the largest
value of the conditioning, both at most 1e-5)."""
import pytest
import torch

from conftest import PACK, counted_forwards
from text_encoder_cases import ENCODERS

# The pack as ComfyUI loads it: node, runtime and config must come from the same copy.
HostDevices = PACK.parallel_runtime.config.HostDevices
build_config = PACK.parallel_runtime.config.build_config
Runtime = PACK.parallel_runtime.world.runtime.Runtime

pytestmark = pytest.mark.multirank
TOL = 1e-5


@pytest.fixture(scope="module")
def runtime(comfyui_path):
    # Overrides conftest's: the pack's own Runtime, so node and runtime agree.
    rt = Runtime()
    rt.comfyui_path = comfyui_path
    yield rt
    rt.shutdown("tests done")


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def world_size(request):
    return request.param


def shard(clip, config, runtime, monkeypatch):
    """What the Shard Text Encoder node does, with this test's runtime behind it."""
    monkeypatch.setattr(PACK.parallel_runtime.comfyui_glue.wrappers, "RUNTIME", runtime)
    (out,) = PACK.nodes.ShardTextEncoderNode.execute(clip, config).result
    return out


def encode(clip, toks):
    cond, pooled = clip.encode_from_tokens(toks, return_pooled=True)
    return cond, pooled


@pytest.mark.parametrize("name", list(ENCODERS))
def test_conditioning_matches_one_process(name, world_size, runtime, monkeypatch):
    clip, toks = ENCODERS[name]()
    ref_cond, ref_pooled = encode(clip, toks)
    config = build_config(tp_size=world_size, devices=",".join(["cpu"] * world_size), host=HostDevices("cpu"))
    sharded = shard(clip, config, runtime, monkeypatch)
    cond, pooled = encode(sharded, toks)
    assert cond.shape == ref_cond.shape
    err = (cond - ref_cond).abs().max().item()
    rel = err / ref_cond.abs().max().item()
    if ref_pooled is not None:
        assert (pooled - ref_pooled).abs().max().item() <= TOL
    world = runtime.world
    (module,) = [m for _, m in clip.cond_stage_model.named_modules() if PACK.parallel_runtime.plans.find_encoder_plan(m)]
    entry = world.copies._copies[module]
    held = entry.param_bytes
    full = sum(p.numel() * p.element_size() for n, p in clip.cond_stage_model.named_parameters())
    layers_full = sum(p.numel() * p.element_size() for n, p in clip.cond_stage_model.named_parameters()
                      if ".block." in n or ".layers." in n)
    shard_module = entry.run_module
    layers_held = sum(p.numel() * p.element_size() for n, p in shard_module.named_parameters()
                      if ".block." in n or ".layers." in n)
    print(f"\n{name} over {world_size} ranks: max abs err {err:.2e}, relative {rel:.2e}; rank 0 holds "
          f"{layers_held / layers_full:.3f} of the layer weights ({held / 1e6:.1f} of {full / 1e6:.1f} MB with the "
          f"embedding table)")
    assert err <= TOL and rel <= TOL
    assert all(c > 0 for c in counted_forwards(world, [1] * world_size))
    # At 4 ranks these configs have fewer KV heads (2) than ranks: each rank keeps one KV head.
    limit = {2: 0.55, 4: 0.35}[world_size]
    assert layers_held / layers_full <= limit
    # The unsharded CLIP is untouched: the node patched a clone.
    again, _ = encode(clip, toks)
    assert torch.equal(again, ref_cond)


@pytest.mark.parametrize("world, group", [(3, 1), (6, 2)], ids=["3ranks-whole", "6ranks-groups-of-2"])
def test_a_world_the_encoder_does_not_split_runs_it_on_the_largest_group(world, group, runtime, monkeypatch):
    """T5 with 4 heads splits over 1, 2 or 4 ranks. A world of 3 (Ulysses 3, which a transformer runs
    with padded heads) is not refused: the encoder runs whole on rank 0, as unsharded. A world of 6
    runs it over groups of 2 (the largest size that splits the heads and tiles the world), every
    group computing the same; rank 0 holds half the layers."""
    clip, toks = ENCODERS["t5xxl"]()
    ref_cond, _ = encode(clip, toks)
    config = build_config(ulysses_size=world, devices=",".join(["cpu"] * world), host=HostDevices("cpu"))
    sharded = shard(clip, config, runtime, monkeypatch)
    cond, _ = encode(sharded, toks)
    err = (cond - ref_cond).abs().max().item()
    print(f"\nT5 (4 heads) in a world of {world}: groups of {group}, max abs err {err:.2e}")
    assert cond.shape == ref_cond.shape and err <= TOL
    patched = [key for key in sharded.patcher.object_patches if key.endswith(".forward")]
    if group == 1:
        assert not patched  # nothing to split: ComfyUI's own encoder on rank 0
        return
    (module,) = [m for _, m in clip.cond_stage_model.named_modules() if PACK.parallel_runtime.plans.find_encoder_plan(m)]
    shard_module = runtime.world.copies._copies[module].run_module
    held = sum(p.numel() for n, p in shard_module.named_parameters() if ".block." in n)
    full = sum(p.numel() for n, p in module.named_parameters() if ".block." in n)
    assert patched and 0.45 <= held / full <= 0.55, held / full
    assert all(c > 0 for c in counted_forwards(runtime.world, [1] * world))
