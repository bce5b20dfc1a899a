"""Attention called without transformer_options (ERNIE-Image, ComfyUI 0.33 on): the plan names the
module global the model calls (``ContextParallelPlan.attention_globals``), and for one sharded
forward the engine routes it to the distributed attention, on every rank, restoring it afterwards.
Never silently local-only: a ComfyUI whose module no longer holds that global is refused at the
node, and a site whose attention did not reach the distributed path is refused at that forward.
The server-level runs of every layout are in test_comfy_families.py."""
import pytest
import torch

from conftest import PACK, cpu_world
from families import available
from parallel_runtime.plans import find_plan
from parallel_runtime.plans.vocabulary.matching import PlanMismatch

pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(not available("comfy.ldm.ernie.model"), reason="ERNIE-Image exists from ComfyUI 0.33 on")]
config_mod = PACK.parallel_runtime.config


def tiny_ernie():
    from tiny_families import FAMILIES, family_state_dict

    model = FAMILIES["ernie_image"].build()
    model.load_state_dict(family_state_dict("ernie_image")[0])
    return model.eval()


def inputs():
    g = torch.Generator().manual_seed(5)
    # 5 x 7 image tokens + 7 text tokens: 42, uneven over 4 chunks of a USP run, even over Ulysses 2.
    return (torch.randn(2, 128, 7, 5, generator=g), torch.tensor([0.6, 0.2]), torch.randn(2, 7, 64, generator=g))


def test_ulysses_routes_the_global_and_restores_it(runtime):
    import comfy.ldm.ernie.model as ernie

    original = ernie.optimized_attention
    model = tiny_ernie()
    args = inputs()
    world = cpu_world(runtime, dict(ulysses_size=2))
    with torch.inference_mode():
        ref = model(*args, transformer_options={})
        out = world.forward(model, find_plan(model), model.forward, args, {"transformer_options": {}})
        local = world.forward(model, find_plan(model), model.forward, args, {"transformer_options": {}},
                              distributed_attention=False)
    err, local_err = (out - ref).abs().max().item(), (local - ref).abs().max().item()
    print(f"\nERNIE-Image Ulysses 2 in process: {err:.2e}; attention local-only: {local_err:.2e}")
    assert err <= 1e-5 and local_err > 100 * max(err, 1e-7)
    assert ernie.optimized_attention is original


def test_a_comfyui_without_the_global_is_refused_at_the_node(monkeypatch):
    import comfy.ldm.ernie.model as ernie

    model = tiny_ernie()
    monkeypatch.delattr(ernie, "optimized_attention")
    patcher = type("P", (), {"model": type("M", (), {"diffusion_model": model})()})()
    config = config_mod.build_config(ulysses_size=2, host=config_mod.HostDevices("cpu"))
    with pytest.raises(config_mod.ConfigError) as info:
        PACK.nodes.ShardTransformerNode.execute(patcher, config)
    message = str(info.value)
    print(f"\n{message}")
    assert "comfy.ldm.ernie.model.optimized_attention" in message and "Refused rather than computing" in message


def test_attention_that_bypasses_the_global_is_refused(runtime, monkeypatch):
    """A release that calls attention some other way (here on rank 0, after the model was sent):
    the site's attention never reaches the distributed path, so the forward is refused."""
    import comfy.ldm.ernie.model as ernie
    import comfy.ldm.modules.attention as attention

    original = ernie.optimized_attention
    model = tiny_ernie()
    args = inputs()
    world = cpu_world(runtime, dict(ulysses_size=2))
    with torch.inference_mode():
        world.forward(model, find_plan(model), model.forward, args, {"transformer_options": {}})
    cls = type(model.layers[0].self_attention)
    stock = cls.forward

    def forward(self, x, attention_mask=None, image_rotary_emb=None):  # ComfyUI's attention, not the global
        routed, ernie.optimized_attention = ernie.optimized_attention, attention.optimized_attention
        try:
            return stock(self, x, attention_mask, image_rotary_emb)
        finally:
            ernie.optimized_attention = routed

    monkeypatch.setattr(cls, "forward", forward)
    with torch.inference_mode(), pytest.raises(PlanMismatch) as info:
        world.forward(model, find_plan(model), model.forward, args, {"transformer_options": {}})
    message = str(info.value)
    print(f"\n{message}")
    assert message.startswith("ERNIE-Image: the attention of layers.0 (ErnieImageSharedAdaLNBlock) did not go")
    monkeypatch.undo()
    assert ernie.optimized_attention is original
