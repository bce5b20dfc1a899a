"""Model patches (ControlNets that patch the transformer's forward) sharded under every layout.

ComfyUI's own patch nodes on the tiny transformers, through a real server: Qwen-Image with
``QwenImageDiffsynthControlnet`` (a per-token patch: each rank runs it on its tokens), Z-Image with
``ZImageFunControlnet`` (the Fun ControlNet 2.1: its own attention blocks, run on the whole sequence)
and Wan with ``WanUni3CControlnetApply`` (likewise). Each sharded run must equal the same graph
unsharded, and the patch must change the result (a patch silently dropped would not). The patch
models are tiny stand-ins of ComfyUI's own classes (tests/comfy_extensions/tiny_model_patches).
"""
from __future__ import annotations

import pytest
import torch

from comfy_server import PromptFailed
from conftest import PACK  # the pack imported as ComfyUI imports it
from test_comfy_families import final_latents, max_error
from tiny_families import PATCH_CASES as CASES
from tiny_families import FAMILIES, _available, family_prompt, latent_pixels, patched_prompt

TOL = 1e-4
LAYOUTS = {"ulysses2": {"ulysses_size": 2}, "ring2": {"ring_size": 2}, "cfg2": {"cfg_size": 2},
           "tp2": {"tp_size": 2},
           "ulysses2_tp2": {"ulysses_size": 2, "tp_size": 2, "devices": "cpu,cpu,cpu,cpu"}}


def QUICK_TIER(test: str, params: dict) -> bool:
    """The default run (conftest.in_quick_tier): each patch under Ulysses 2 (one per-token patch and two
    whole-sequence ones), and Ring 2, TP 2, CFG 2 and Ulysses 2 x TP 2 on one of each kind; ``--full``: all."""
    if test == "test_a_declared_block_replacement_equals_unsharded":
        return params["layout"] in ("ulysses2", "ulysses2_tp2")
    if test != "test_patched_model_equals_unsharded":
        return True
    return params["layout"] == "ulysses2" or params["family"] == ("qwen_image" if params["layout"] in ("tp2", "cfg2")
                                                                  else "z_image")


# The module each patch model class lives in where it is not in every tested ComfyUI (0.3.75 has neither).
NEEDS = {"z_image": "comfy.ldm.lumina.controlnet", "wan": "comfy.ldm.wan.uni3c"}
_references: dict = {}


def reference(server, family: str, strength: float = 1.0):
    key = (family, strength)
    if key not in _references:
        _references[key] = final_latents(server, patched_prompt(family, None, strength))
    return _references[key]


@pytest.mark.comfy_server
@pytest.mark.parametrize("family", sorted(CASES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_patched_model_equals_unsharded(tiny_server, family, layout):
    if not _available(NEEDS.get(family)):
        pytest.skip(f"{CASES[family][0]} comes with a later ComfyUI: this one has no {NEEDS[family]}")
    ref = reference(tiny_server, family)
    out = final_latents(tiny_server, patched_prompt(family, LAYOUTS[layout]))
    err = max_error(out, ref)
    unpatched = max_error(final_latents(tiny_server, family_prompt(family, None)), ref) \
        if layout == "ulysses2" else None
    print(f"\n{family} with {CASES[family][0]} under {layout}: max abs err {err:.2e}"
          + (f" (the patch changes the result by {unpatched:.2e})" if unpatched is not None else ""))
    if unpatched is not None:
        assert unpatched > 1e-3, "the patch does not change the result: the test would not see it dropped"
    assert err <= TOL


@pytest.mark.comfy_server
def test_a_changed_strength_reaches_every_rank(tiny_server):
    strong = reference(tiny_server, "qwen_image", 1.0)
    weak = reference(tiny_server, "qwen_image", 0.3)
    assert max_error(weak, strong) > 1e-3
    for strength, ref in ((1.0, strong), (0.3, weak)):
        out = final_latents(tiny_server, patched_prompt("qwen_image", {"ulysses_size": 2}, strength))
        assert max_error(out, ref) <= TOL, strength
    changed = final_latents(tiny_server, patched_prompt("qwen_image", {"ulysses_size": 2}, 1.0, image_seed=9))
    assert max_error(changed, strong) > 1e-3  # another control image, sent with the next prompt
    assert max_error(changed, final_latents(tiny_server, patched_prompt("qwen_image", None, 1.0, image_seed=9))) <= TOL


@pytest.mark.comfy_server
def test_a_control_image_of_another_size_is_refused_with_the_size_to_use(tiny_server):
    width, height = latent_pixels("qwen_image")
    with pytest.raises(PromptFailed) as info:
        final_latents(tiny_server, patched_prompt("qwen_image", {"ulysses_size": 2}, size=(width + 16, height)))
    assert f"the latent needs {width}x{height}" in str(info.value)
    assert f"Scale the control image (and inpaint image, mask) to {width}x{height}" in str(info.value)


def test_an_undeclared_patch_class_is_refused_by_name():
    from_pack = PACK.parallel_runtime
    plans = from_pack.plans

    class SomeoneElsesPatch:
        def __call__(self, kwargs):
            return kwargs

    options = {"patches": {"double_block": [SomeoneElsesPatch()]}}
    with pytest.raises(from_pack.plans.vocabulary.patches.PatchRefused) as info:
        from_pack.parallel.model_patches.encode(options, plans.qwen_image.PLAN, torch.zeros(1, 16, 1, 8, 8))
    message = str(info.value)
    assert f"{__name__}.test_an_undeclared_patch_class_is_refused_by_name.<locals>.SomeoneElsesPatch" in message
    assert "Qwen-Image DiffSynth / Fun ControlNet (DiffSynthCnetPatch)" in message  # what it does run
    assert options["patches"]["double_block"][0].__class__ is SomeoneElsesPatch  # ComfyUI's options untouched


def test_a_patch_on_a_hook_the_model_plan_does_not_describe_is_refused():
    from_pack = PACK.parallel_runtime
    fake = type("DiffSynthCnetPatch", (), {"__module__": from_pack.plans.model_patches.NODES})()  # a declared class
    with pytest.raises(from_pack.plans.vocabulary.patches.PatchRefused, match=r"\['noise_refiner'\] of Qwen-Image"):
        from_pack.parallel.model_patches.encode({"patches": {"noise_refiner": [fake]}},
                                                from_pack.plans.qwen_image.PLAN, None)


def test_shard_transformer_refuses_a_model_carrying_an_undeclared_patch():
    """A patch set before Shard Transformer is refused by the node itself, before any worker starts."""
    from tiny_models import TinyWan, build_wan_model
    from test_node_refusals import config, fake_model, no_world_started

    class StyleInjector:
        def __call__(self, kwargs):
            return kwargs

    model = fake_model(build_wan_model(TinyWan(dim=256, ffn_dim=512, num_layers=1), text_dim=64))
    model.model_options = {"transformer_options": {"patches": {"double_block": [StyleInjector()]}}}
    with pytest.raises(PACK.parallel_runtime.config.ConfigError) as info:
        PACK.nodes.ShardTransformerNode.execute(model, config(ulysses_size=2))
    message = str(info.value)
    assert message.startswith("Shard Transformer: Wan 2.1 / 2.2: a node set a model patch of class ")
    assert "StyleInjector on transformer_options['patches']['double_block']" in message
    assert no_world_started()


# A user plan file's declaration for the test extension's Flux double-block replacement (docs/model_patches.md).
REPLACE_PLAN = """PATCH_PLANS = (
    PatchPlan(classes=("*tiny_model_patches.TinyDoubleBlockBoost",), title="Tiny double-block boost",
              tokens="local", replaces=("double_block",), models=()),
)
"""


def replaced_prompt(parallel: dict | None, strength: float = 0.5) -> dict:
    """The tiny Flux graph with TinyBlockReplace (patches_replace on double block 0) before Shard Transformer."""
    prompt = family_prompt("flux", parallel)
    prompt["80"] = {"class_type": "TinyBlockReplace", "inputs": {"model": ["1", 0], "strength": strength, "seed": 2}}
    prompt["3" if "3" in prompt else "7"]["inputs"]["model"] = ["80", 0]
    return prompt


@pytest.fixture
def replace_plan_file(tiny_server):
    path = tiny_server.base_dir / "user" / "parallel_plans" / "tiny_block_replace.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(REPLACE_PLAN)
    yield path
    path.unlink()


@pytest.mark.comfy_server
def test_an_undeclared_block_replacement_is_refused_by_name(tiny_server):
    with pytest.raises(PromptFailed) as info:
        final_latents(tiny_server, replaced_prompt({"ulysses_size": 2}))
    message = str(info.value)
    assert "TinyDoubleBlockBoost on transformer_options['patches_replace']['dit']" in message
    assert "declare it in a plan file" in message


@pytest.mark.comfy_server
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_declared_block_replacement_equals_unsharded(tiny_server, replace_plan_file, layout):
    key = ("flux_replace", 0.5)
    if key not in _references:
        _references[key] = final_latents(tiny_server, replaced_prompt(None))
    ref = _references[key]
    assert max_error(ref, final_latents(tiny_server, family_prompt("flux", None))) > 1e-3  # the replacement matters
    out = final_latents(tiny_server, replaced_prompt(LAYOUTS[layout]))
    err = max_error(out, ref)
    print(f"\nFlux with a declared double-block replacement under {layout}: max abs err {err:.2e}")
    assert err <= TOL


@pytest.mark.comfy_server
def test_free_releases_a_patch_model_on_every_rank(tiny_server):
    """ComfyUI's /free unloads the patch's model too: every rank lets its copy go."""
    from test_comfy_e2e import status
    from test_comfy_tensor_parallel import free_every_rank

    prompt = patched_prompt("qwen_image", {"ulysses_size": 2}, image_seed=13)  # not served from the cache
    final_latents(tiny_server, prompt)
    assert status(tiny_server)["ranks"][1]["param_bytes"] > 0
    assert free_every_rank(tiny_server) == [0, 0]
