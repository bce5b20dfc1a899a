"""Context parallelism for every supported family and mesh, against one process, in fp32.

Multi-rank: rank 0 is this process, the other ranks are real worker processes.
Meshes: Ulysses 2, Ring 2, USP 2x2 (4 ranks), cfg 2 x Ulysses 2 (4 ranks).
"""
import pytest
import torch

from conftest import cpu_world, single_process_references
from families import CASES
from parallel_runtime.plans import find_plan

pytestmark = pytest.mark.multirank
TOL = 1e-5
MESHES = {
    "ulysses2": dict(ulysses_size=2),
    "ring2": dict(ring_size=2),
    "usp2x2": dict(ring_size=2, ulysses_size=2),
    "cfg2_ulysses2": dict(cfg_size=2, ulysses_size=2),
}


@pytest.fixture(scope="module", params=list(MESHES))
def world(request, runtime):
    return cpu_world(runtime, MESHES[request.param])


@pytest.fixture(scope="module")
def built():
    return single_process_references(CASES)


def run(world, model, args, kwargs, **kw):
    with torch.inference_mode():
        return world.forward(model, find_plan(model), model._forward, args, {**kwargs, "transformer_options": {}},
                             **kw)


def refused_input(model, kwargs) -> str | None:
    """An input of this call that the plan, as it reads this model, declines (on some ComfyUI
    releases a model cuts absolute token ranges a chunk cannot follow): it must say so."""
    plan = find_plan(model).for_module(model)
    return next((name for name in plan.context_parallel.unsupported if kwargs.get(name) is not None), None)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process(world, built, case):
    model, args, kwargs, ref = built(case)
    refused = refused_input(model, kwargs)
    if refused:
        with pytest.raises(RuntimeError, match=f"'{refused}' is not supported with context parallelism"):
            run(world, model, args, kwargs)
        return
    out = run(world, model, args, kwargs)
    err = (out - ref).abs().max().item()
    rel = err / ref.abs().max().item()
    print(f"\n{case} on {world.config.describe()}: max abs err {err:.2e}, rel {rel:.2e}")
    assert out.shape == ref.shape
    assert err <= TOL


@pytest.mark.parametrize("case", list(CASES))
def test_attention_really_crosses_ranks(world, built, case):
    """With communication in attention switched off the result must be wrong."""
    model, args, kwargs, ref = built(case)
    refused = refused_input(model, kwargs)
    if refused:  # refused before any rank computes, communication or not
        with pytest.raises(RuntimeError, match=f"'{refused}' is not supported with context parallelism"):
            run(world, model, args, kwargs, distributed_attention=False)
        return
    out = run(world, model, args, kwargs, distributed_attention=False)
    rel = (out - ref).abs().max().item() / ref.abs().max().item()
    if world.config.ring_size == 1 and world.config.ulysses_size == 1:
        pytest.skip("no sequence parallelism in this mesh")
    assert rel > 1e-3
