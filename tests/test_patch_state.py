"""Model patches that keep state from one forward to the next, sharded (issue 49).

ComfyUI's ``ZImageControlPatch`` keeps its control stream in ``temp_data`` and resets it only after
its last control block: with the Fun ControlNet 2.1 lite (3 control layers) on a Z-Image of fewer
than 21 main layers, each forward starts from the state the previous one left, across steps and
across prompts (until the patch moves device). The sharded run must start every forward from the
state ComfyUI's own object would hold, so each sequence here is 3 steps and two prompts in a row
(another seed, the same patch object: ComfyUI's cache keeps the patch node's output), compared with
the same sequence unsharded. ``TinyModelTag`` gives each sequence a fresh patch object.

The tests' ``TinyCountingBoost`` (a Flux block replacement that counts its calls) is refused by name
when its declaration does not say it keeps ``calls``, and carried where it can be.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from comfy_server import PromptFailed
from conftest import PACK  # the pack imported as ComfyUI imports it
from test_comfy_families import final_latents, max_error
from test_model_patches import LAYOUTS, NEEDS, TOL
from test_tiny_model_patches import extension, sample, tiny_transformer, z_image_case  # noqa: F401 (a fixture)
from tiny_families import _available, family_prompt, patched_prompt


def QUICK_TIER(test: str, params: dict) -> bool:
    """The default run: the lite ControlNet under Ulysses 2, the counting patch under CFG 2; ``--full``:
    every layout."""
    if test == "test_lite_controlnet_state_equals_unsharded":
        return params["layout"] == "ulysses2"
    if test == "test_a_declared_counting_patch_is_carried":
        return params["layout"] == "cfg2"
    return True


_tags = itertools.count(1000)
SEEDS = (11, 12)  # two prompts in a row: the second starts from the state the first left


def lite_prompt(parallel: dict | None, tag: int, seed: int) -> dict:
    """Z-Image (3 main layers) with ZImageFunControlnet and the tiny Fun ControlNet 2.1 lite."""
    prompt = patched_prompt("z_image", parallel)
    prompt["60"]["inputs"]["kind"] = "z_image_fun_2_1_lite"
    prompt["64"] = {"class_type": "TinyModelTag", "inputs": {"model": ["1", 0], "tag": tag}}
    prompt["63"]["inputs"]["model"] = ["64", 0]
    prompt["7"]["inputs"]["seed"] = seed
    return prompt


def sequence(server, make, parallel: dict | None) -> list:
    """The final latents of the prompts of SEEDS in a row, on one fresh patch object."""
    tag = next(_tags)
    return [final_latents(server, make(parallel, tag, seed)) for seed in SEEDS]


_references: dict = {}


def lite_reference(server) -> list:
    if "lite" not in _references:
        _references["lite"] = sequence(server, lite_prompt, None)
    return _references["lite"]


@pytest.mark.comfy_server
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_lite_controlnet_state_equals_unsharded(tiny_server, layout):
    if not _available(NEEDS["z_image"]):
        pytest.skip(f"ZImageFunControlnet comes with a later ComfyUI: this one has no {NEEDS['z_image']}")
    ref = lite_reference(tiny_server)
    out = sequence(tiny_server, lite_prompt, LAYOUTS[layout])
    errors = [max_error(o, r) for o, r in zip(out, ref)]
    print(f"\nZ-Image + Fun ControlNet lite, 3 steps x {len(SEEDS)} prompts under {layout}: max abs err "
          + ", ".join(f"{e:.2e}" for e in errors))
    assert max(errors) <= TOL


def counting_plan(state: bool) -> str:
    return ("PATCH_PLANS = (\n    PatchPlan(classes=(\"*tiny_model_patches.TinyCountingBoost\",), "
            "title=\"Tiny counting boost\", tokens=\"local\", replaces=(\"double_block\",), models=()"
            + (", state=(\"calls\",)" if state else "") + "),\n)\n")


def counting_prompt(parallel: dict | None, tag: int, seed: int) -> dict:
    """The tiny Flux graph with TinyCountingBlockReplace (double block 0) before Shard Transformer."""
    prompt = family_prompt("flux", parallel)
    prompt["64"] = {"class_type": "TinyModelTag", "inputs": {"model": ["1", 0], "tag": tag}}
    prompt["80"] = {"class_type": "TinyCountingBlockReplace",
                    "inputs": {"model": ["64", 0], "strength": 0.2, "seed": 2}}
    prompt["3" if "3" in prompt else "7"]["inputs"]["model"] = ["80", 0]
    prompt["7"]["inputs"]["seed"] = seed
    return prompt


@pytest.fixture
def plan_file(tiny_server):
    path = tiny_server.base_dir / "user" / "parallel_plans" / "tiny_counting_boost.py"
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(state: bool):
        path.write_text(counting_plan(state))

    yield write
    path.unlink(missing_ok=True)


def refusal(server, plan_file, state: bool, parallel: dict) -> str:
    """The message the counting patch's prompt fails with, its plan written with or without its state."""
    plan_file(state=state)
    with pytest.raises(PromptFailed) as info:
        final_latents(server, counting_prompt(parallel, next(_tags), SEEDS[0]))
    message = str(info.value)
    print(f"\n{message}")
    assert "TinyCountingBoost" in message and "'calls'" in message
    return message


@pytest.mark.comfy_server
def test_a_counting_patch_without_its_state_declared_is_refused_by_name(tiny_server, plan_file):
    assert "state=" in refusal(tiny_server, plan_file, False, {"tp_size": 2})  # what to do: declare it


@pytest.mark.comfy_server
def test_a_counting_patch_under_a_sequence_split_is_refused_by_name(tiny_server, plan_file):
    """Each rank runs a per-token patch on its own tokens: its state is that rank's, not ComfyUI's."""
    refusal(tiny_server, plan_file, True, {"ulysses_size": 2})


@pytest.mark.comfy_server
@pytest.mark.parametrize("layout", ["cfg2", "tp2"])
def test_a_declared_counting_patch_is_carried(tiny_server, plan_file, layout):
    plan_file(state=True)
    if "counting" not in _references:
        _references["counting"] = sequence(tiny_server, counting_prompt, None)
        fresh = final_latents(tiny_server, counting_prompt(None, next(_tags), SEEDS[1]))
        assert max_error(fresh, _references["counting"][1]) > 1e-3  # the count carried across prompts matters
    ref = _references["counting"]
    out = sequence(tiny_server, counting_prompt, LAYOUTS[layout])
    errors = [max_error(o, r) for o, r in zip(out, ref)]
    print(f"\nFlux with the counting patch, 3 steps x {len(SEEDS)} prompts under {layout}: max abs err "
          + ", ".join(f"{e:.2e}" for e in errors))
    assert max(errors) <= TOL


def test_the_lite_patch_keeps_state_between_forwards(extension):
    """What makes the comparisons above able to fail: in process, the lite patch's second forward on
    the tiny Z-Image differs from its first, which a fresh patch object repeats."""
    if not _available(NEEDS["z_image"]):
        pytest.skip(f"ZImageFunControlnet comes with a later ComfyUI: this one has no {NEEDS['z_image']}")
    model = tiny_transformer("z_image")
    loader = extension.TinyModelPatchLoader()
    _, args, kwargs, patches = z_image_case(extension, loader.load_model_patch("z_image_fun_2_1_lite", 3)[0])
    first, second = (sample(model, args, kwargs, patches) for _ in range(2))
    assert patches["double_block"][0].temp_data is not None  # what the first forward left
    _, _, _, fresh = z_image_case(extension, loader.load_model_patch("z_image_fun_2_1_lite", 3)[0])
    assert torch.equal(sample(model, args, kwargs, fresh), first)
    print(f"\nthe state the first forward left changes the second by {(second - first).abs().max().item():.2e}")
    assert (second - first).abs().max().item() > 1e-3


def test_a_change_in_place_is_seen():
    """Rank 0 tells what a forward changed by identity and by contents: a tensor changed in place, an
    attribute set anew or added, a list appended to; a tensor read or replaced by itself is no change."""
    from_pack = PACK.parallel_runtime
    spec = from_pack.plans.vocabulary.patches.PatchPlan(classes=("x.Patch",), title="A patch", tokens="whole", state=("kept",))

    class Patch:
        pass

    def rebuilt(**attrs):
        patch = Patch()
        patch.__dict__.update(attrs)
        return from_pack.parallel.model_patches.Rebuilt(patch, 0, "x.Patch", spec, judge=True)

    done = rebuilt(weights=torch.ones(3), log=[], kept=None, n=1)
    done.patch.weights.add_(1.0)
    done.patch.log.append(2)
    done.patch.kept = torch.zeros(2)
    done.patch.extra = 5
    assert sorted(done.changed()) == ["extra", "kept", "log", "weights"]
    same = rebuilt(weights=torch.full((3,), float("nan")), n=1)
    same.patch.weights.mul_(1.0)
    same.patch.n = 1
    assert same.changed() == []
