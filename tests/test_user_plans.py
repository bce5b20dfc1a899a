"""User plans (docs/user_plans.md): a plan file for a model class the pack does not ship.

Through a real server: the plan printed in docs/user_plans.md, put in the server's user plan
folder, runs the test extension's own model (tests/comfy_extensions/user_plan_model) under
Ulysses 2 and TP 2 equal to the unsharded run; a plan naming a module the model lacks is refused
at the node, naming the plan and the module; a broken plan file is named when a model finds no
plan. In process: what a plan file may not do, and how a user plan travels to the workers."""
from __future__ import annotations

import re

import pytest
from safetensors.torch import load_file

from comfy_server import PromptFailed
from conftest import REPO
from test_comfy_e2e import status
from tiny_families import IMAGE_LATENT, PROMPT
from workflows import parallel_config_node

TOL = 1e-4
DOC = REPO / "docs" / "user_plans.md"


def documented_plan() -> str:
    (code,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    return code


def user_prompt(parallel: dict | None, seed: int = 11) -> dict:
    model = ["1", 0]
    prompt = {
        "1": {"class_type": "TinyUserDiTLoader", "inputs": {"seed": 3}},
        "4": {"class_type": "LoadTrainingDataset", "inputs": {"folder_name": PROMPT}},
        "5": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["4", 1]}},
        "6": IMAGE_LATENT,
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": "latents/user_plan"}},
    }
    if parallel is not None:
        prompt["2"] = parallel_config_node(**parallel)
        prompt["3"] = {"class_type": "ShardTransformer", "inputs": {"model": ["1", 0], "parallel_config": ["2", 0]}}
        model = ["3", 0]
    prompt["7"] = {"class_type": "KSampler", "inputs": {"model": model, "positive": ["4", 1], "negative": ["5", 0],
                                                        "latent_image": ["6", 0], "seed": seed, "steps": 3, "cfg": 3.0,
                                                        "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}
    return prompt


def latent(server, prompt):
    entry = server.run(prompt, timeout=300)
    (path,) = server.outputs(entry, "latents")
    return load_file(str(path))["latent_tensor"]


@pytest.fixture
def plan_folder(tiny_server):
    folder = tiny_server.base_dir / "user" / "parallel_plans"
    folder.mkdir(parents=True, exist_ok=True)
    written = []

    def write(name: str, text: str):
        path = folder / name
        path.write_text(text)
        written.append(path)
        return path

    yield write
    for path in written:
        path.unlink(missing_ok=True)


@pytest.mark.comfy_server
@pytest.mark.parametrize("parallel", [{"ulysses_size": 2}, {"tp_size": 2}], ids=["ulysses2", "tp2"])
def test_documented_user_plan_runs_a_model_the_pack_does_not_ship(tiny_server, plan_folder, parallel):
    with pytest.raises(PromptFailed, match="TinyUserDiT is not supported.*docs/user_plans.md"):
        tiny_server.run(user_prompt(parallel), timeout=300)  # no plan file yet
    plan_folder("tiny_user_dit.py", documented_plan())
    ref = latent(tiny_server, user_prompt(None))
    out = latent(tiny_server, user_prompt(parallel))
    err = (out - ref).abs().max().item()
    print(f"\nuser plan {parallel}: max abs err {err:.2e} (latents up to {ref.abs().max().item():.2f})")
    assert out.shape == ref.shape and ref.abs().max() > 0.1
    assert err <= TOL
    dim = next(iter(parallel))[: -len("_size")]
    assert status(tiny_server)["mesh"][dim] == 2


@pytest.mark.comfy_server
@pytest.mark.parametrize("wrong,missing,parallel", [
    ('"blocks.*.attn": (MAIN_STREAM,)', "blocks.*.attention", {"ulysses_size": 2}),
    ('"blocks.*.fc1": Colwise()', "blocks.*.mlp_in", {"tp_size": 2}),
], ids=["attention-site", "tp-layer"])
def test_user_plan_naming_a_module_the_model_lacks_is_refused_at_the_node(tiny_server, plan_folder, wrong, missing,
                                                                           parallel):
    text = documented_plan()
    assert wrong in text
    pattern = wrong.split('"')[1]
    plan_folder("tiny_user_dit.py", text.replace(f'"{pattern}"', f'"{missing}"'))
    with pytest.raises(PromptFailed) as info:
        tiny_server.run(user_prompt(parallel), timeout=300)
    message = str(info.value)
    assert "Shard Transformer" in message and "Tiny user DiT plan" in message and missing in message, message


@pytest.mark.comfy_server
def test_a_plan_file_changed_between_prompts_reaches_the_workers(tiny_server, plan_folder):
    """TP 2 with the documented plan, then with the MLP left whole: rank 0 runs the new plan, and so
    must the workers (a worker still cutting the MLP would hold other shapes than rank 0)."""
    text = documented_plan()
    mlp_cuts = '"blocks.*.fc1": Colwise(), "blocks.*.fc2": Rowwise(),'
    assert mlp_cuts in text
    plan_folder("tiny_user_dit.py", text)
    first = latent(tiny_server, user_prompt({"tp_size": 2}, seed=12))
    cut_mlp = [r["param_bytes"] for r in status(tiny_server)["ranks"]]
    plan_folder("tiny_user_dit.py", text.replace(mlp_cuts, "").replace(
        'divisible={"MLP width": "blocks.0.fc2.in_features"},', ""))
    # Straight after (no unsharded run between, which would unload the sharded copy), and another
    # seed: the same prompt again would be ComfyUI's cached result, not a new run.
    second = latent(tiny_server, user_prompt({"tp_size": 2}, seed=13))
    whole_mlp = [r["param_bytes"] for r in status(tiny_server)["ranks"]]
    print(f"\nweights per rank with the MLP cut {cut_mlp}, whole {whole_mlp}")
    assert all(w > c * 1.1 for w, c in zip(whole_mlp, cut_mlp))  # both ranks run the changed plan
    errors = [(out - latent(tiny_server, user_prompt(None, seed=seed))).abs().max().item()
              for out, seed in ((first, 12), (second, 13))]
    print(f"\nuser plan TP 2 before / after the change: max abs err {errors}")
    assert max(errors) <= TOL


@pytest.mark.comfy_server
def test_a_broken_plan_file_is_named_when_the_model_finds_no_plan(tiny_server, plan_folder):
    path = plan_folder("broken_plan.py", "PLAN = ModelPlan(family='x',\n")
    with pytest.raises(PromptFailed) as info:
        tiny_server.run(user_prompt({"ulysses_size": 2}), timeout=300)
    message = str(info.value)
    assert "TinyUserDiT is not supported" in message and "broken_plan.py" in message and "SyntaxError" in message


def _build(text: str):
    from parallel_runtime.plans import _BY_FAMILY, PLANS
    from parallel_runtime.plans.vocabulary.user import build

    return build(text, "/plans/test.py", set(_BY_FAMILY), {c: p.family for p in PLANS for c in p.classes})


def test_a_plan_file_may_not_take_a_built_in_family_or_class():
    from parallel_runtime.plans.vocabulary.user import UserPlanError

    text = documented_plan()
    with pytest.raises(UserPlanError, match="'wan' is a built-in plan's"):
        _build(text.replace('family="tiny_user_dit"', 'family="wan"'))
    with pytest.raises(UserPlanError, match="covered by the built-in plan 'wan'"):
        _build(text.replace('"*user_plan_model.model.TinyUserDiT"', '"comfy.ldm.wan.model.WanModel"'))
    with pytest.raises(UserPlanError, match="sets neither PLAN"):
        _build("X = 1")
    with pytest.raises(UserPlanError, match="is not a ModelPlan"):  # user plans are for transformers only
        _build("PLAN = TensorParallelPlan(layers={})")


def test_a_user_plan_travels_as_its_text_and_a_worker_builds_the_same_plan():
    from parallel_runtime.plans import plan_for_family
    from parallel_runtime.plans.vocabulary import user

    (plan,) = _build(documented_plan())
    wire = user.wire(plan)
    assert wire == ("tiny_user_dit", "/plans/test.py", documented_plan())
    assert user.wire(plan_for_family("wan")) == "wan"  # built-in plans travel by name
    built = user.from_wire(wire, {"wan": plan_for_family("wan")})
    assert built == plan and built.source == ("/plans/test.py", documented_plan())
    assert user.find("/x/custom_nodes/user_plan_model.model.TinyUserDiT") is built
    assert user.find("other_pack.model.TinyUserDiT") is None
