"""The optional first-step check (Shard Transformer's verify_first_step): the first step of each
sampling run also runs unsharded on rank 0; a sharded result that differs beyond rounding stops
the prompt. Here in ComfyUI's own sampling, in this process."""
import functools
import json
import re
from pathlib import Path

import pytest
import torch

from conftest import PACK, REPO
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


# ---------------------------------------------------------------- the bf16 tolerance, derived
RESULTS = REPO / "bench" / "results"


def documented_bf16_multiple() -> float:
    """The multiple of the measured bf16 rounding that docs/gpu_check.md#tolerances states."""
    docs = " ".join((REPO / "docs" / "gpu_check.md").read_text().split())
    (multiple,) = re.findall(r"In bf16 the tolerance is a stated multiple, (\d+(?:\.\d+)?), of the measured rounding",
                             docs)
    return float(multiple)


def stored_roundings() -> list[tuple[str, bool, Path, float]]:
    """(date, run on a GPU, file, rounding) of every stored run with the GPU check's case bf16_rounding
    (the tiny Wan, unsharded, bf16 against fp32), newest last (a GPU's after a CPU's of the same day)."""
    found = []
    for path in [*RESULTS.glob("*.json"), *RESULTS.glob("gpu_check_*/*.json")]:
        report = json.loads(path.read_text())
        for row in report.get("rows", []) if isinstance(report, dict) else []:
            if row.get("case", "").startswith("bf16 rounding") and row.get("ok"):
                found.append((report["date"], not report["device"].startswith("CPU"), path,
                              row["data"]["bf16_rounding"]))
    return sorted(found, key=lambda f: (f[0], f[1], f[2].name))


def test_verify_first_steps_bf16_tolerance_is_the_stated_multiple_of_the_newest_stored_rounding():
    """verify_first_step cannot measure the rounding inside a user's prompt: its r is the newest
    stored bf16_rounding measurement, named in the module, and the tolerance is the multiple the docs
    state of it. Fails when a newer run (a GPU's) is stored and the module's figure does not follow."""
    first_step_check = PACK.parallel_runtime.comfyui_glue.first_step_check
    roundings = stored_roundings()
    assert roundings, "no stored run measures the bf16 rounding"
    date, _, path, rounding = roundings[-1]
    assert (REPO / first_step_check.BF16_ROUNDING_SOURCE).resolve() == path.resolve(), (date, path)
    assert f"{first_step_check.BF16_ROUNDING:.1e}" == f"{rounding:.1e}"
    expected = documented_bf16_multiple() * float(f"{rounding:.1e}")
    for dtype in (torch.bfloat16, torch.float16):
        assert first_step_check.tolerance(dtype) == pytest.approx(expected, rel=1e-9)
    assert first_step_check.tolerance(torch.float32) == 1e-4  # fixed, docs/gpu_check.md#tolerances
    # A measured rounding given: the same multiple of it; none measured is no tolerance.
    assert first_step_check.tolerance("bfloat16", 0.01) == pytest.approx(documented_bf16_multiple() * 0.01)
    with pytest.raises(ValueError):
        first_step_check.tolerance(torch.bfloat16, 0.0)


def perturbed(reference: torch.Tensor, rel: float, seed: int) -> torch.Tensor:
    """``reference`` moved by a random direction of relative L2 size ``rel``, in its dtype."""
    direction = torch.randn(reference.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ref = reference.double()
    return (ref + direction / direction.norm() * ref.norm() * rel).to(reference.dtype)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_step_just_beyond_the_derived_tolerance_is_refused_and_one_within_passes(runtime, dtype):
    """A sharded first step 15 % beyond the derived tolerance stops the prompt; 15 % within it
    passes (the flat 3e-2 allowed before would have let the first through)."""
    first_step_check = PACK.parallel_runtime.comfyui_glue.first_step_check
    documented = documented_bf16_multiple() * float(f"{stored_roundings()[-1][3]:.1e}")
    reference = torch.randn(1, 16, 2, 8, 10, generator=torch.Generator().manual_seed(5)).to(dtype)
    within, beyond = perturbed(reference, 0.85 * documented, 6), perturbed(reference, 1.15 * documented, 7)
    assert rel_l2(within, reference) < documented < rel_l2(beyond, reference) < 3e-2  # as meant, after rounding
    check = first_step_check.FirstStep(True)
    check.check("Wan 2.1 / 2.2", within, lambda: reference)
    assert runtime.status()["first_step_check"]["ok"]
    assert runtime.status()["first_step_check"]["tolerance"] == pytest.approx(documented, rel=1e-9)
    with pytest.raises(RuntimeError, match=r"differs from the unsharded one by [0-9.e-]+ \(relative L2; rounding "
                                           rf"stays below {documented:.1e}\)"):
        check.check("Wan 2.1 / 2.2", beyond, lambda: reference)
    assert not runtime.status()["first_step_check"]["ok"]
