"""Never silently wrong after a ComfyUI update: a model built differently from what its plan
was written for is refused, naming the family and the ComfyUI release, instead of computed.

Two ways a release can change a model under a plan, both simulated on a tiny Wan: a block that
no longer takes an argument the plan cuts (refused when the node checks the model), and a block
that is called with an argument the plan does not know (refused at that call, on rank 0, before
the block computes with it)."""
import pytest
import torch

from conftest import PACK, cpu_world
from families import available
from parallel_runtime.plans import find_plan
from parallel_runtime.plans.base import PlanMismatch, comfyui_release
from tiny_models import TinyWan, build_wan_model

pytestmark = pytest.mark.multirank
config_mod = PACK.parallel_runtime.config


def tiny_wan(seed=0):
    return build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=2), seed=seed, text_dim=64)


def inputs():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(2, 16, 2, 8, 10, generator=g), torch.tensor([600.0, 200.0]), torch.randn(2, 7, 64, generator=g))


def newer_blocks(model, forward):
    """Give every block a subclass whose forward is ``forward`` (what a ComfyUI update does)."""
    for block in model.blocks:
        block.__class__ = type("NewerWanAttentionBlock", (type(block),), {"forward": forward})
    return model


def test_a_block_that_no_longer_takes_an_argument_the_plan_cuts_is_refused_at_the_node():
    base = type(tiny_wan().blocks[0])

    def forward(self, x, e, rope, context, context_img_len=257, transformer_options={}):  # freqs renamed
        return base.forward(self, x, e, rope, context, context_img_len, transformer_options=transformer_options)

    model = newer_blocks(tiny_wan(), forward)
    patcher = type("P", (), {"model": type("M", (), {"diffusion_model": model})()})()
    config = config_mod.build_config(ulysses_size=2, host=config_mod.HostDevices("cpu"))
    with pytest.raises(config_mod.ConfigError) as info:
        PACK.nodes.ShardTransformerNode.execute(patcher, config)
    message = str(info.value)
    print(f"\n{message}")
    assert message.startswith("Shard Transformer: Wan 2.1 / 2.2 plan: blocks.0 (NewerWanAttentionBlock)")
    assert "takes no 'freqs'" in message and comfyui_release() in message
    assert PACK.parallel_runtime.world.runtime.RUNTIME.world is None  # refused before any worker started


def test_a_block_called_with_an_argument_the_plan_does_not_know_is_refused(runtime):
    model = tiny_wan(seed=1)
    plan = find_plan(model)
    world = cpu_world(runtime, dict(ulysses_size=2))
    args = inputs()
    with torch.inference_mode():
        ref = model(*args, transformer_options={})
        out = world.forward(model, plan, model._forward, args, {"transformer_options": {}})
    assert (out - ref).abs().max().item() <= 1e-5  # the ranks hold the model now

    # A newer release passing a per-token argument to the blocks (after the model was sent:
    # rank 0 refuses before its block runs, whatever the workers do).
    tokens = 2 * 4 * 5
    hook = model.blocks[1].register_forward_pre_hook(
        lambda module, a, kw: (a, {**kw, "token_mask": torch.rand(2, tokens)}), with_kwargs=True)
    try:
        with torch.inference_mode(), pytest.raises(PlanMismatch) as info:
            world.forward(model, plan, model._forward, args, {"transformer_options": {}})
    finally:
        hook.remove()
    message = str(info.value)
    print(f"\n{message}")
    assert message.startswith("Wan 2.1 / 2.2: blocks.1 (WanAttentionBlock) was called with 'token_mask'")
    assert comfyui_release() in message and "Refused rather than computing a wrong result" in message


@pytest.mark.skipif(not available("comfy.ldm.krea2.model"), reason="Krea 2 exists from ComfyUI 0.33 on")
def test_an_absolute_token_position_is_refused_by_name(runtime):
    """Krea 2's index_timestep_zero reference method switches the modulation at an absolute
    token position, which no chunk can follow: refused at the first block, never computed."""
    from families_krea2 import krea2_reference

    model, args, kwargs = krea2_reference("index_timestep_zero")
    world = cpu_world(runtime, dict(ulysses_size=2))
    # Every rank refuses at its first block; rank 0's own refusal or a worker's is reported first.
    with torch.inference_mode(), pytest.raises(RuntimeError) as info:
        world.forward(model, find_plan(model), model._forward, args, {**kwargs, "transformer_options": {}})
    message = str(info.value)
    print(f"\n{message[-600:]}")
    assert "Krea 2: blocks.0 (SingleStreamBlock) was called with 'timestep_zero_index'" in message
    assert "Refused rather than computing a wrong result" in message
