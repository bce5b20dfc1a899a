"""The optional first-step check (Shard Transformer's verify_first_step): the first step of each
sampling run also runs unsharded on rank 0; a sharded result that differs beyond rounding stops
the prompt. Here in ComfyUI's own sampling, in this process."""
import functools

import pytest

from conftest import PACK
from test_comfy_memory import sample, tiny_patcher

config_mod = PACK.parallel_runtime.config


@pytest.fixture()
def runtime():
    rt = PACK.parallel_runtime.world.runtime.RUNTIME
    yield rt
    rt.shutdown("test done")


def sharded(verify: bool, **sizes):
    config = config_mod.build_config(**sizes, host=config_mod.HostDevices("cpu"))
    return PACK.nodes.ShardTransformerNode.execute(tiny_patcher(seed=4), config, verify_first_step=verify).result[0]


def test_a_correct_sharded_run_passes_the_check_and_reports_it(runtime):
    reference = sample(tiny_patcher(seed=4))
    out = sample(sharded(True, ulysses_size=2))
    check = runtime.status()["first_step_check"]
    print(f"\nfirst-step check: {check}")
    assert (out - reference).abs().max().item() <= 1e-5
    assert check["ok"] and check["model"] == "Wan 2.1 / 2.2" and check["relative_error"] <= 1e-5


def test_a_sharded_step_that_differs_stops_the_prompt(runtime, monkeypatch):
    """Attention that silently stays local on every rank (the classic failure of parallel
    attention: no error, an incoherent image) is caught by the check, not shipped."""
    world_cls = PACK.parallel_runtime.world.world.World
    monkeypatch.setattr(world_cls, "forward", functools.partialmethod(world_cls.forward, distributed_attention=False))
    with pytest.raises(RuntimeError, match=r"^Shard Transformer: the sharded first step of this Wan 2.1 / 2.2 model "
                                           r"differs from the unsharded one by [0-9.e-]+ .*The prompt was stopped") as info:
        sample(sharded(True, ulysses_size=2))
    print(f"\n{info.value}")
    assert not runtime.status()["first_step_check"]["ok"]


def test_the_check_is_refused_with_tensor_parallelism(monkeypatch):
    with pytest.raises(config_mod.ConfigError, match="verify_first_step=True is not available with tp_size=2"):
        sharded(True, tp_size=2)
    # Switched on for every model through the environment, TP models are left unchecked, not refused.
    monkeypatch.setenv("PARALLEL_VERIFY_FIRST_STEP", "1")
    model = sharded(False, tp_size=2)
    forward = model.get_wrappers(PACK.parallel_runtime.comfyui_glue.wrappers.DIFFUSION_MODEL,
                                 PACK.parallel_runtime.comfyui_glue.wrappers.WRAPPER_KEY)[0]
    assert forward.first_step is None
