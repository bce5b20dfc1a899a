"""Never silently wrong after a ComfyUI update: a model built differently from what its plan
was written for is refused, naming the family and the ComfyUI release, instead of computed.

Two ways a release can change a model under a plan, both simulated on a tiny Wan: a block that
no longer takes an argument the plan cuts (refused when the node checks the model), and a block
that is called with an argument the plan does not know (refused at that call, on rank 0, before
the block computes with it).

Plans are typed by what they describe (transformer, text encoder, VAE, a patch's model): no type
carries a field only another type uses, and no code decides on a plan's kind."""
import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from conftest import PACK, cpu_world
from families import available
from parallel_runtime.plans import find_plan
from parallel_runtime.plans.vocabulary.matching import PlanMismatch, comfyui_release
from parallel_runtime.plans.vocabulary.plan import Plan
from parallel_runtime.plans.vocabulary.vae import VaePlan
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


# ---------------------------------------------------------------- plans typed by what they describe
RUNTIME = Path(__file__).resolve().parent.parent / "parallel_runtime"
ENGINE_SOURCES = {path: path.read_text() for folder in (RUNTIME, RUNTIME.parent / "nodes")
                  for path in sorted(folder.rglob("*.py"))}
KIND_WORDS = {"transformer", "vae", "encoder", "text_encoder", "patch"}


def plan_types() -> list[type]:
    """The plan types of the runtime (subclasses of ``Plan`` in its modules)."""
    found, todo = [], [Plan]
    while todo:
        cls = todo.pop()
        found += [sub for sub in cls.__subclasses__() if sub.__module__.startswith("parallel_runtime.plans.")]
        todo += cls.__subclasses__()
    return found


def unused_fields(cls: type, sources: dict) -> list[str]:
    """Fields ``cls`` declares (not its parent) that no module naming ``cls`` reads (``.field``): a
    field read only where another plan type is handled is a stand-in this type carries for it."""
    parent = {f.name for f in dataclasses.fields(cls.__mro__[1])} if dataclasses.is_dataclass(cls.__mro__[1]) else set()
    reads = set()
    for text in sources.values():
        if re.search(rf"\b{cls.__name__}\b", text):
            reads |= {n.attr for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Attribute)
                      and isinstance(n.ctx, ast.Load)}
    return [f.name for f in dataclasses.fields(cls) if f.name not in parent and f.name not in reads]


def kind_decisions(text: str, path: str = "") -> list[str]:
    """Where code compares a plan's kind (``plan.kind``, or a ``kind`` with a word like "vae") or tells
    plan types apart with isinstance (user plan files excepted: that is checking what a user wrote)."""
    names = {cls.__name__ for cls in plan_types()}
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            kind = [p for p in parts if isinstance(p, ast.Attribute) and p.attr == "kind" and "plan" in ast.unparse(p)]
            words = [p for p in ast.walk(node) if isinstance(p, ast.Constant) and p.value in KIND_WORDS
                     and "kind" in ast.unparse(node)]
            if kind or words:
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
                and names & {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                and not path.endswith("vocabulary/user.py")):
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_plan_type_carries_a_field_it_does_not_use():
    types = plan_types()
    assert {"TransformerPlan", "TextEncoderPlan", "VaePlan", "PatchModelPlan"} <= {t.__name__ for t in types}
    unused = {t.__name__: unused_fields(t, ENGINE_SOURCES) for t in types}
    assert not any(unused.values()), f"plan fields nothing reads for their type: {unused}"
    assert all("kind" not in {f.name for f in dataclasses.fields(t)} for t in types)

    # The check itself: a VAE plan carrying a transformer's field (the stand-in of old) is found.
    spare = dataclasses.make_dataclass("SpareVaePlan", [("heads_attr", str, "decoder.ch")], bases=(VaePlan,),
                                       frozen=True)
    assert unused_fields(spare, ENGINE_SOURCES) == ["heads_attr"]


def test_no_module_decides_on_a_plan_kind():
    found = [hit for path, text in ENGINE_SOURCES.items() for hit in kind_decisions(text, str(path))]
    assert not found, "code that decides on a plan's kind (ask the plan instead):\n" + "\n".join(found)
    assert kind_decisions('if plan.kind == "transformer":\n    pass\n')  # the check itself finds one
    assert kind_decisions('if kind in ("vae", "encoder"):\n    pass\n')
    assert kind_decisions('if isinstance(plan, VaePlan):\n    pass\n')
