"""Multi-rank: ComfyUI's WanModel run on 2 real processes (rank 0 here, rank 1 a worker)
against the same model run in this process alone, in fp32."""
import pytest
import torch

from parallel_runtime.config import HostDevices, build_config
from parallel_runtime.plans import find_plan
from parallel_runtime.world.world import World
from parallel_runtime.world.workers import WorkerFailure
from conftest import VersionedSource, counted_forwards
from tiny_models import TinyWan, build_wan_model

pytestmark = pytest.mark.multirank
TEXT_DIM = 64
TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=2), seed=0, text_dim=TEXT_DIM)


@pytest.fixture()
def world(comfyui_path):
    w = World(build_config(ulysses_size=2, host=HostDevices("cpu")), comfyui_path=comfyui_path).start()
    yield w
    w.shutdown("test done")


def inputs(frames=3, height=10, width=14, batch=2, seed=0, per_frame_t=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 16, frames, height, width, generator=g)
    t = torch.rand(batch, frames, generator=g) * 1000 if per_frame_t else torch.tensor([700.0, 300.0][:batch])
    context = torch.randn(batch, 7, TEXT_DIM, generator=g)
    return x, t, context


def reference(model, x, t, context):
    with torch.inference_mode():
        return model(x, t, context, transformer_options={})


def sharded(world, model, x, t, context, **kw):
    with torch.inference_mode():
        return world.forward(model, find_plan(model), model._forward, (x, t, context), {"transformer_options": {}}, **kw)


def errors(out, ref):
    err = (out - ref).abs().max().item()
    return err, err / ref.abs().max().item()


def test_uneven_sequence_matches_single_process(world, model):
    x, t, context = inputs()  # 3 x 5 x 7 = 105 tokens: odd, so rank 1 holds a padded chunk
    ref = reference(model, x, t, context)
    out = sharded(world, model, x, t, context)
    err, rel = errors(out, ref)
    print(f"\nWan Ulysses 2, 105 tokens: max abs err {err:.2e}, rel {rel:.2e}")
    assert out.shape == ref.shape
    assert err <= TOL
    assert counted_forwards(world, [1, 1]) == [1, 1]  # rank 1 really ran it


def test_attention_really_crosses_ranks(world, model):
    """With the all-to-all switched off each rank attends to its own tokens only:
    the result must then be wrong, or the real path could be local-only too."""
    x, t, context = inputs()
    ref = reference(model, x, t, context)
    local_only = sharded(world, model, x, t, context, distributed_attention=False)
    err, rel = errors(local_only, ref)
    print(f"\nlocal-only attention: max abs err {err:.2e} (rel {rel:.2e})")
    assert rel > 1e-2


def test_per_frame_timesteps_follow_the_split(world, model):
    """Wan 2.2 TI2V gives each latent frame its own timestep; the model repeats the
    modulation per token, so the plan must expand it before cutting it."""
    x, t, context = inputs(frames=3, per_frame_t=True)
    ref = reference(model, x, t, context)
    err, _ = errors(sharded(world, model, x, t, context), ref)
    assert err <= TOL


def test_image_to_video_keeps_image_cross_attention_local(world):
    """Wan I2V attends to 257 CLIP image tokens next to the text: local on every rank."""
    model = build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=2), seed=4, text_dim=TEXT_DIM,
                            model_type="i2v")
    x, t, context = inputs(frames=2, height=6, width=10)  # 2 x 3 x 5 = 30 tokens
    clip_fea = torch.randn(2, 257, 1280, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        ref = model(x, t, context, clip_fea=clip_fea, transformer_options={})
        out = world.forward(model, find_plan(model), model._forward, (x, t, context),
                            {"clip_fea": clip_fea, "transformer_options": {}})
    err, _ = errors(out, ref)
    assert err <= TOL


def test_changed_weights_reach_the_workers_when_their_version_changes(world, model):
    source = VersionedSource()
    x, t, context = inputs(seed=1)
    sharded(world, model, x, t, context, source=source)
    block = model.blocks[0].self_attn.v  # (q and k go through RMSNorm, which hides a scale)
    original = block.weight
    try:
        # What ComfyUI's LoRA patching does: a new tensor replaces the parameter, and a new patch uuid says so.
        block.weight = torch.nn.Parameter(original.detach() * 1.5, requires_grad=False)
        ref = reference(model, x, t, context)
        stale, _ = errors(sharded(world, model, x, t, context, source=source), ref)
        source.number += 1
        err, _ = errors(sharded(world, model, x, t, context, source=source), ref)
        print(f"\nchanged weights: {stale:.2e} while the version stays, {err:.2e} after it changed")
        assert stale > 1e-3  # the same version is never sent again (no tensor comparisons)
        assert err <= TOL
    finally:
        block.weight = original


def test_worker_error_arrives_with_rank_and_traceback(world, model):
    x, t, context = inputs()
    sharded(world, model, x, t, context)
    world.copies._drop_everywhere(world.copies._copies[model].key)  # rank 1 forgets the model: its next forward raises
    with pytest.raises(WorkerFailure) as info:
        sharded(world, model, x, t, context)
    message = str(info.value)
    assert "rank 1" in message and "Traceback" in message and "KeyError" in message
    assert world.state == "stopped" and all(not w.alive for w in world.workers)


def test_a_worker_that_cannot_start_is_reported(tmp_path):
    w = World(build_config(ulysses_size=2, host=HostDevices("cpu")), comfyui_path=str(tmp_path))
    with pytest.raises(Exception) as info:
        w.start()
    assert "rank 1" in str(info.value) and "comfy" in str(info.value)
    assert w.state == "stopped"
