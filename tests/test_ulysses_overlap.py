"""Ulysses with its exchange in head groups that overlap the attention (attention.ulysses_pipelined,
PARALLEL_ULYSSES_CHUNKS): the same result as one exchange, for every family with heads to spare,
with uneven and weighted token splits too; the return exchange overlapped with each rank's own
attention (attention.attend_and_gather, PARALLEL_ULYSSES_OVERLAP) against the ranks in lockstep;
and the clock that measures how much communication a step waits for (comm.CLOCK, read by
bench/profile_step.py --overlap)."""
import sys

import pytest
import torch

from conftest import REPO, cpu_world, single_process_references
from families import TP_CASES
from parallel_runtime.distributed import comm
from parallel_runtime.parallel.attention import chunk_count
from parallel_runtime.plans import find_plan

pytestmark = pytest.mark.multirank
TOL = 1e-5
# Cases whose attention calls round differently by the calls' shape on some machines: Lumina 2 with
# grouped-query attention differed by 7.2e-7 between one exchange and two head groups (and between
# the overlapped and the lockstep return) on this project's machine of 2026-11-28, at the session's
# start commit too (found by the first --full CI run); every other case stays bit for bit.
ROUNDS_BY_CALL_SHAPE = {"lumina2_8heads_gqa": 1e-6}


def same_computation(case: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, or within the rounding measured for the few cases above."""
    return torch.equal(a, b) or (a - b).abs().max().item() <= ROUNDS_BY_CALL_SHAPE.get(case, 0.0)


@pytest.fixture(scope="module")
def world(runtime):
    return cpu_world(runtime, {"ulysses_size": 2})


def run(world, model, args, kwargs, **kw):
    with torch.inference_mode():
        return world.forward(model, find_plan(model), model._forward, args, {**kwargs, "transformer_options": {}},
                             **kw)


def test_chunk_count_divides_the_heads_of_a_rank():
    assert [chunk_count(4, w) for w in (1, 2, 3, 4, 8)] == [1, 2, 2, 4, 4]
    assert chunk_count(6, 4) == 3 and chunk_count(1, 4) == 1 and chunk_count(5, 2) == 1


def test_every_family_with_two_heads_a_rank_equals_one_process_in_head_groups(world):
    """The four-head cases (two heads per Ulysses rank, one per group): every family's attention
    sites, padding where the tokens do not divide, and a weighted split."""
    built = single_process_references(TP_CASES)
    checked = []
    for case in TP_CASES:
        model, args, kwargs, ref = built(case)
        one = run(world, model, args, kwargs, ulysses_chunks=1)
        grouped = run(world, model, args, kwargs, ulysses_chunks=2)
        weighted = run(world, model, args, kwargs, ulysses_chunks=2, weights=(1.0, 0.5))
        err = (grouped - ref).abs().max().item()
        assert grouped.shape == ref.shape and err <= TOL, (case, err)
        assert (weighted - ref).abs().max().item() <= TOL, case
        # Each head's attention is the same computation in a group as in the whole exchange.
        assert same_computation(case, grouped, one), (case, (grouped - one).abs().max().item())
        checked.append(case)
    print(f"\n{len(checked)} families in two head groups under Ulysses 2: equal to one exchange, bit for bit")
    assert len(checked) >= 8


def test_the_overlapped_return_equals_the_lockstep_one_and_one_process_for_every_family(world, monkeypatch):
    """attend_and_gather (other ranks' query rows first, the rank's own while they travel) against
    gather_heads (the ranks in lockstep): every family's attention sites, both layouts attention is
    called with, padding where the tokens do not divide, a weighted split; bit for bit, since each
    query row's attention is the same computation in one call or in two."""
    from parallel_runtime.parallel import attention

    overlapped_calls = []  # rank 0's: which path ran
    real = attention.attend_and_gather
    monkeypatch.setattr(attention, "attend_and_gather", lambda *a, **k: overlapped_calls.append(1) or real(*a, **k))
    built = single_process_references(TP_CASES)
    checked = []
    for case in TP_CASES:
        model, args, kwargs, ref = built(case)
        for weights in ((), (1.0, 0.5)):
            overlapped_calls.clear()
            lockstep = run(world, model, args, kwargs, ulysses_overlap=False, weights=weights)
            assert not overlapped_calls, case
            overlapped = run(world, model, args, kwargs, ulysses_overlap=True, weights=weights)
            assert overlapped_calls, case
            err = (overlapped - ref).abs().max().item()
            assert overlapped.shape == ref.shape and err <= TOL, (case, weights, err)
            assert same_computation(case, overlapped, lockstep), (case, weights,
                                                                  (overlapped - lockstep).abs().max().item())
        checked.append(case)
    print(f"\n{len(checked)} families under Ulysses 2: the overlapped return equals the lockstep one, bit for bit")
    assert len(checked) >= 8


def test_the_overlap_is_on_where_ranks_do_not_share_cores(monkeypatch):
    from parallel_runtime.world import settings

    monkeypatch.delenv(settings.ULYSSES_OVERLAP_ENV, raising=False)
    monkeypatch.delenv("PARALLEL_CPU_THREADS_PER_RANK", raising=False)
    monkeypatch.setattr(settings, "available_cores", lambda: [0, 1])
    assert settings.ulysses_overlap_setting(("cpu", "cpu"))          # a core each
    assert not settings.ulysses_overlap_setting(("cpu",) * 4)        # 4 ranks on 2 cores: lockstep
    assert settings.ulysses_overlap_setting(("cuda:0", "cuda:1"))    # a device each
    monkeypatch.setenv("PARALLEL_CPU_THREADS_PER_RANK", "2")
    assert not settings.ulysses_overlap_setting(("cpu", "cpu"))      # 4 threads on 2 cores
    monkeypatch.setenv(settings.ULYSSES_OVERLAP_ENV, "1")
    assert settings.ulysses_overlap_setting(("cpu",) * 4)
    monkeypatch.setenv(settings.ULYSSES_OVERLAP_ENV, "0")
    assert not settings.ulysses_overlap_setting(("cuda:0", "cuda:1"))
    monkeypatch.setenv(settings.ULYSSES_OVERLAP_ENV, "sometimes")
    with pytest.raises(ValueError, match="PARALLEL_ULYSSES_OVERLAP='sometimes'.*auto"):
        settings.ulysses_overlap_setting(("cpu", "cpu"))


@pytest.mark.parametrize("chunks", [2, 3, 4])
def test_a_flux_of_eight_heads_in_head_groups(world, chunks):
    """Four heads per rank: 2 and 4 groups, and 3, which does not divide them (2 groups run)."""
    sys.path.insert(0, str(REPO / "bench"))
    from scenarios import FluxShape, build_flux

    model, args, kwargs = build_flux(FluxShape(hidden=256, heads=8, double=1, single=1, image_side=18,
                                               text_tokens=7, context_dim=64, vec_dim=32), seed=5)
    with torch.inference_mode():
        ref = model._forward(*args, **kwargs, transformer_options={})
    out = run(world, model, args, kwargs, ulysses_chunks=chunks)
    err = (out - ref).abs().max().item()
    print(f"\nFlux of 8 heads, Ulysses 2 in {chunk_count(4, chunks)} head groups: max abs err {err:.1e}")
    assert err <= TOL


def test_the_clock_counts_the_time_a_forward_waits_for_communication(world):
    model, args, kwargs, _ = single_process_references(TP_CASES)("wan21_t2v_4heads")
    for chunks in (1, 2):
        with comm.CLOCK.measuring() as clock:
            run(world, model, args, kwargs, ulysses_chunks=chunks)
        print(f"\n{chunks} head group(s): rank 0 waited {clock.seconds * 1e3:.1f} ms in {clock.calls} calls")
        assert clock.seconds > 0 and clock.calls > 0
    # One all-to-all pair per attention site and group: the grouped forward waits more often.
    with comm.CLOCK.measuring() as one:
        run(world, model, args, kwargs, ulysses_chunks=1)
    with comm.CLOCK.measuring() as two:
        run(world, model, args, kwargs, ulysses_chunks=2)
    assert two.calls > one.calls
    assert not comm.CLOCK.enabled  # off outside a measurement


def test_the_setting_is_a_whole_number(monkeypatch):
    from parallel_runtime.world.settings import ULYSSES_CHUNKS_ENV, ulysses_chunks_setting

    monkeypatch.delenv(ULYSSES_CHUNKS_ENV, raising=False)
    assert ulysses_chunks_setting() == 1
    monkeypatch.setenv(ULYSSES_CHUNKS_ENV, "4")
    assert ulysses_chunks_setting() == 4
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(ULYSSES_CHUNKS_ENV, bad)
        with pytest.raises(ValueError, match=ULYSSES_CHUNKS_ENV):
            ulysses_chunks_setting()
