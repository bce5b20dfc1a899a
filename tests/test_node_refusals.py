"""Bad input is refused by the nodes themselves, before any worker starts, with a message that
names the node, the value and what would be valid."""
import types

import pytest
import torch

from conftest import PACK

config_mod = PACK.parallel_runtime.config
CPU = config_mod.HostDevices("cpu", cpu_count=2)
ConfigError = config_mod.ConfigError


def config(**kw):
    return config_mod.build_config(host=CPU, **kw)


def fake_model(diffusion_model):
    """Enough of a ModelPatcher for the node's checks (they read model.model.diffusion_model)."""
    return types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=diffusion_model))


def no_world_started():
    world = PACK.parallel_runtime.world.runtime.RUNTIME.world
    return world is None


def test_unsupported_model_is_named_with_the_supported_ones():
    with pytest.raises(ConfigError) as info:
        PACK.nodes.ShardTransformerNode.execute(fake_model(torch.nn.Linear(4, 4)), config(ulysses_size=2))
    message = str(info.value)
    assert message.startswith("Shard Transformer: the model class torch.nn.modules.linear.Linear is not supported")
    assert "Wan 2.1 / 2.2" in message and "Flux.1" in message
    assert no_world_started()


def test_sizes_that_do_not_divide_list_the_valid_ones():
    from tiny_models import TinyWan, build_wan_model

    model = fake_model(build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=1), text_dim=64))  # 2 heads
    # Ulysses takes any size (heads padded): only TP keeps the rule, with the valid sizes listed.
    assert PACK.nodes.shard_transformer.check_model(model.model.diffusion_model, config(
        ulysses_size=4, devices="cpu,cpu,cpu,cpu")).family == "wan"
    with pytest.raises(ConfigError, match=r"tp_size=4 does not divide .* valid tp_size values: 1, 2"):
        PACK.nodes.ShardTransformerNode.execute(model, config(tp_size=4, devices="cpu,cpu,cpu,cpu"))
    assert no_world_started()


def test_unsupported_text_encoder_is_refused():
    clip = types.SimpleNamespace(cond_stage_model=torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ConfigError) as info:
        PACK.nodes.ShardTextEncoderNode.execute(clip, config(ulysses_size=2))
    assert str(info.value).startswith("Shard Text Encoder: this CLIP") and "T5 / UMT5" in str(info.value)
    assert no_world_started()


def test_unsupported_vae_is_refused():
    vae = types.SimpleNamespace(first_stage_model=torch.nn.Conv2d(3, 3, 3))
    with pytest.raises(ConfigError) as info:
        PACK.nodes.ShardVAENode.execute(vae, config(ulysses_size=2))
    assert str(info.value).startswith("Shard VAE: ") and "Conv2d" in str(info.value)
    assert no_world_started()


@pytest.mark.parametrize("devices", ["0,1", "cuda:0", "gpu", "cpu,,cpu"])
def test_malformed_or_unavailable_devices_are_refused(devices):
    with pytest.raises(ConfigError, match=r"^Parallel Config: devices="):
        config(ulysses_size=2, devices=devices)


def test_quantized_weights_are_cut_for_tp_and_a_cut_that_cannot_be_exact_is_refused_naming_why(monkeypatch):
    """ComfyUI's QuantizedTensor layouts (fp8 / NVFP4 checkpoints; since 0.33 also scaled fp8 files):
    TP cuts them with their scales (parallel_runtime/weights/quantized.py); where a layout's blocks
    do not allow an exact cut, Shard Transformer refuses before any rank starts, naming the layer,
    the layout's reason and what to do."""
    import importlib

    import comfy.quant_ops
    from tiny_models import TinyWan, build_wan_model

    comfy_quantized = importlib.import_module(f"{PACK.__name__}.parallel_runtime.weights.quantized")

    dm = build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=1), text_dim=64)
    layer = dm.blocks[0].self_attn.q
    quantized = comfy.quant_ops.QuantizedTensor.from_float(layer.weight.detach(), "TensorCoreFP8Layout",
                                                           scale=torch.tensor(0.01))
    layer.weight = torch.nn.Parameter(quantized, requires_grad=False)
    assert PACK.nodes.shard_transformer.check_model(dm, config(tp_size=2)).family == "wan"
    monkeypatch.setattr(comfy_quantized, "why_not_cut", lambda t, cut, size: "ComfyUI's quantized layout "
                        "TensorCoreFP8Layout: a test's reason")
    with pytest.raises(ConfigError, match=r"^Shard Transformer: this Wan 2.1 / 2.2 model's layer blocks.0.self_attn.q "
                                          r"cannot be cut for tensor parallelism: ComfyUI's quantized layout "
                                          r"TensorCoreFP8Layout: a test's reason.*tp_size 1"):
        PACK.nodes.ShardTransformerNode.execute(fake_model(dm), config(tp_size=2))
    assert no_world_started()
    assert PACK.nodes.shard_transformer.check_model(dm, config(ulysses_size=2)).family == "wan"

# The canvas (POST /parallel/validate) and the node read one list of inputs and build the config
# one way: for a bad value of every input, both refuse with the same message.
BAD_VALUE_OF = {
    "ulysses_size": dict(ulysses_size=0),
    "ring_size": dict(ring_size="two"),
    "tp_size": dict(tp_size=-1),
    "cfg_size": dict(cfg_size=0, devices="cpu,cpu"),
    "devices": dict(ulysses_size=2, devices="gpu"),
    "backend": dict(ulysses_size=2, devices="cpu,cpu", backend="nccl"),
    "hosts": dict(ulysses_size=2, devices="cpu", hosts="local:1,gpu-b:2"),
    "rendezvous": dict(ulysses_size=2, devices="cpu", hosts="local:1,gpu-b:1", rendezvous="nowhere"),
    "layout": dict(ulysses_size=2, devices="cpu,cpu", layout="sideways"),
    "weights": dict(ulysses_size=2, devices="cpu,cpu", weights="1,0.5,0.25"),
}


def canvas_check(values: dict) -> dict:
    """What the canvas shows for these values: the route's answer, on the node's own host."""
    import importlib

    routes = importlib.import_module("hybrid_parallel_pack.parallel_runtime.comfyui_glue.routes")
    return routes.validate(dict(values), PACK.nodes.host.host_devices())


def test_every_parallel_config_input_has_a_refusal_case():
    assert set(BAD_VALUE_OF) == {spec.name for spec in config_mod.CONFIG_INPUTS}


@pytest.mark.parametrize("name", sorted(BAD_VALUE_OF))
def test_the_canvas_refuses_what_the_node_refuses_with_the_same_message(name):
    values = BAD_VALUE_OF[name]
    message = PACK.nodes.ParallelConfigNode.validate_inputs(**values)
    assert isinstance(message, str) and message.startswith(f"Parallel Config: {name}="), message
    answer = canvas_check(values)
    assert (answer["ok"], answer["message"]) == (False, message)
    with pytest.raises(ConfigError) as info:
        PACK.nodes.ParallelConfigNode.execute(**values)
    assert str(info.value) == message


@pytest.mark.parametrize("values", [
    dict(ulysses_size=2, devices="cpu,cpu", weights="1,0.5"),
    dict(layout="auto", devices="cpu,cpu"),
    dict(ulysses_size=2, devices="cpu,cpu", layout="manual", hosts="", rendezvous=""),
])
def test_the_canvas_accepts_what_the_node_accepts_with_its_world_size(values):
    assert PACK.nodes.ParallelConfigNode.validate_inputs(**values) is True
    answer = canvas_check(values)
    assert (answer["ok"], answer["world_size"]) == (True, 2), answer["message"]
    config = PACK.nodes.ParallelConfigNode.execute(**values).args[0]
    assert config.world_size == 2 and answer["message"] == f"world size 2: {config.describe()}"


def test_a_linked_input_is_left_to_the_run_by_node_and_canvas_alike():
    # ComfyUI passes None for an input fed by another node while it validates; the canvas sends null.
    assert PACK.nodes.ParallelConfigNode.validate_inputs(ulysses_size=None, devices="gpu") is True
    answer = canvas_check(dict(ulysses_size=None, devices="gpu"))
    assert answer["ok"] is True and answer["world_size"] is None


def shard_vae_prompt(config_inputs: dict) -> dict:
    """Shard Transformer and Shard VAE fed by one Parallel Config (API format)."""
    return {
        "1": {"class_type": "ParallelConfig", "inputs": config_inputs},
        "2": {"class_type": "ShardTransformer", "inputs": {"model": ["9", 0], "parallel_config": ["1", 0]}},
        "3": {"class_type": "ShardVAE", "inputs": {"vae": ["8", 0], "parallel_config": ["1", 0]}},
    }


def run_shard_vae(monkeypatch, parallel_config, prompt):
    """Shard VAE's execute with this prompt as its hidden input, on a tiny real VAE; the sharded
    wrapper and patcher are stubs (nothing starts)."""
    from vae_cases import VAES

    shard_vae = PACK.nodes.shard_vae
    module = VAES["kl_sd"]()[0]
    monkeypatch.setattr(shard_vae, "sharded_patcher",
                        lambda patcher, sharding: types.SimpleNamespace(of=patcher, model=module))
    monkeypatch.setattr(shard_vae, "ShardedFirstStage", lambda module, config, family: ("sharded", config))
    vae = types.SimpleNamespace(first_stage_model=module, patcher="vae patcher")

    class WithPrompt(PACK.nodes.ShardVAENode):
        hidden = types.SimpleNamespace(prompt=prompt)

    return WithPrompt.execute(vae, parallel_config).args[0]


def test_shard_vae_takes_the_transformer_world_size_from_the_config_builder(monkeypatch):
    # layout auto, sizes 1, two devices: one Parallel Config of world size 2 for both nodes.
    inputs = dict(ulysses_size=1, ring_size=1, tp_size=1, cfg_size=1, devices="cpu,cpu", backend="auto",
                  layout="auto")
    shared = config(**{k: v for k, v in inputs.items()})
    assert shared.world_size == 2
    sharded = run_shard_vae(monkeypatch, shared, shard_vae_prompt(inputs))
    assert sharded.first_stage_model == ("sharded", shared) and sharded.patcher.of == "vae patcher"
    assert no_world_started()


def test_shard_vae_refuses_a_world_size_other_than_the_transformers(monkeypatch):
    inputs = dict(ulysses_size=1, devices="cpu,cpu", backend="auto", layout="auto")
    with pytest.raises(ConfigError) as info:
        run_shard_vae(monkeypatch, config(ring_size=3, devices="cpu,cpu,cpu"), shard_vae_prompt(inputs))
    message = str(info.value)
    assert message.startswith("Shard VAE: ") and "size 3" in message and "one of size 2" in message
    assert no_world_started()
