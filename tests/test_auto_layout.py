"""layout: auto (issue 19): the probe, the cost model's layouts and refusals, and worlds that run
each model in the layout it chose, against one process."""
import itertools

import pytest
import torch

from conftest import PACK  # the pack as ComfyUI imports it (its nodes)
from parallel_runtime.layout import auto as auto_layout, cost_model
from parallel_runtime.config import ConfigError, HostDevices, build_config
from parallel_runtime.plans import find_plan
from tiny_models import TinyWan, build_wan_model

CPU = HostDevices("cpu", cpu_count=2)
TOL = 1e-5


def fake_probe(ranks=2, flops=1e10, free=1 << 40, all_to_all=1e9, send_recv=1e9, all_reduce=1e9, latency=1e-5):
    """Probe figures as probe.combine returns them, chosen by the test."""
    links = {name: {"latency_s": latency, "bytes_per_s": bw}
             for name, bw in (("all_to_all", all_to_all), ("send_recv", send_recv), ("all_reduce", all_reduce))}
    return {"ranks": [{"rank": r, "matmul_flops_per_s": flops, "op_overhead_s": 0.0, "attention_flops_per_s": flops, "ring_attention_flops_per_s": flops,
                       "memory_bytes_per_s": 1e10, "free_memory_bytes": free} for r in range(ranks)],
            "links": links, "seconds": 0.1}


@pytest.fixture(scope="module")
def wan():
    torch.manual_seed(0)
    model = build_wan_model(TinyWan(), text_dim=64)

    def inputs(batch):
        gen = torch.Generator().manual_seed(batch)
        return (torch.randn(batch, 16, 3, 10, 14, generator=gen), torch.linspace(1.0, 2.0, batch),
                torch.randn(batch, 7, 64, generator=gen))
    return model, inputs


def shape_of(model, args):
    plan = find_plan(model)
    return auto_layout.measure_shape(model, plan, model._forward, args, {"transformer_options": {}})


def test_every_factorisation_of_the_world_is_a_candidate():
    for n in range(1, 9):
        brute = [dict(zip(("cfg", "ring", "ulysses", "tp"), sizes))
                 for sizes in itertools.product(range(1, n + 1), repeat=4) if sizes[0] * sizes[1] * sizes[2] * sizes[3] == n]
        found = cost_model.layouts(n)
        assert sorted(map(lambda d: tuple(d.values()), found)) == sorted(map(lambda d: tuple(d.values()), brute))


def test_the_shape_is_read_from_the_run(wan):
    model, inputs = wan
    x, t, c = inputs(2)
    shape = shape_of(model, (x, t, c))
    # Wan patchifies (1, 2, 2): frames x (height / 2) x (width / 2) tokens.
    assert shape.tokens == 3 * (10 // 2) * (14 // 2)
    assert shape.batch == 2 and shape.hidden == TinyWan().dim and shape.heads == TinyWan().num_heads
    assert shape.blocks == TinyWan().num_layers and shape.attention_sites == TinyWan().num_layers
    # Every block's matmuls, from the first block: per token (batch x tokens rows) or per text token.
    text_rows = 2 * c.shape[1]
    token_macs = sample_macs = 0
    for name, m in model.blocks.named_modules():
        if isinstance(m, torch.nn.Linear):
            if name.split(".")[-2:] in (["cross_attn", "k"], ["cross_attn", "v"]):
                sample_macs += text_rows * m.in_features * m.out_features
            else:
                token_macs += 2 * shape.tokens * m.in_features * m.out_features
    assert shape.token_macs_split + shape.token_macs_whole == token_macs
    assert shape.sample_macs_split + shape.sample_macs_whole == sample_macs
    assert shape.linear_calls == sum(isinstance(m, torch.nn.Linear) for m in model.blocks.modules())


def test_cfg_is_never_chosen_at_cfg_1_and_tp_that_does_not_divide_is_refused(wan):
    model, inputs = wan
    plan = find_plan(model)
    config = build_config(devices="cpu,cpu,cpu,cpu", layout="auto", host=HostDevices("cpu", cpu_count=4))
    one = shape_of(model, inputs(1))
    runnable, refused = auto_layout.choose(model, plan, one, fake_probe(4), config, 4)
    assert runnable and all(p.sizes["cfg"] == 1 for p in runnable)
    assert "nothing to split" in refused["cfg4"] and "nothing to split" in refused["cfg2 x ulysses2"]
    assert "does not divide" in refused["tp4"]  # the tiny Wan has 2 heads
    # Ulysses 4 over 2 heads runs (padded heads): each rank attends one head over every token, as under
    # Ulysses 2, so the cost model predicts the same attention time for both, not half of it.
    predicted = {auto_layout.describe_sizes(p.sizes): p for p in runnable}
    assert "ulysses4" in predicted and "ulysses4" not in refused
    rates = cost_model.Rates.from_probe(fake_probe(4))
    # one head over every query row of the group: 4 * ceil(T / 4) rows against 2 * ceil(T / 2)
    rows = (4 * -(-one.tokens // 4)) / (2 * -(-one.tokens // 2))
    assert cost_model.predict(one, {"ulysses": 4}, rates).parts["attention"] == pytest.approx(
        rows * cost_model.predict(one, {"ulysses": 2}, rates).parts["attention"])
    # One rule: Shard Transformer (the pack as ComfyUI imports it) refuses that layout in the same words.
    pack_config = PACK.parallel_runtime.config
    with pytest.raises(pack_config.ConfigError) as node_refusal:
        PACK.nodes.shard_transformer.check_model(model, pack_config.build_config(
            tp_size=4, devices="cpu,cpu,cpu,cpu", host=pack_config.HostDevices("cpu", cpu_count=4)))
    assert str(node_refusal.value) == f"Shard Transformer: {refused['tp4']}"
    two = shape_of(model, inputs(2))
    runnable, refused = auto_layout.choose(model, plan, two, fake_probe(4), config, 4)
    assert any(p.sizes["cfg"] == 2 for p in runnable) and "cfg2 x ring2" not in refused


def test_the_choice_follows_the_links(wan):
    """The layout whose collective is slow loses: all-to-all (Ulysses), send/recv (Ring),
    all-reduce (TP)."""
    model, inputs = wan
    plan = find_plan(model)
    config = build_config(devices="cpu,cpu", layout="auto", host=CPU)
    shape = shape_of(model, inputs(1))

    def best(**links):
        runnable, _ = auto_layout.choose(model, plan, shape, fake_probe(2, **links), config, 2)
        return auto_layout.describe_sizes(runnable[0].sizes)

    assert best(all_to_all=1e6, all_reduce=1e6) == "ring2"
    assert best(send_recv=1e6, all_reduce=1e6) == "ulysses2"
    assert best(all_to_all=1e6, send_recv=1e6) == "tp2"


def test_a_layout_that_does_not_fit_is_refused(wan):
    model, inputs = wan
    plan = find_plan(model)
    config = build_config(devices="cpu,cpu", layout="auto", host=CPU)
    shape = shape_of(model, inputs(1))
    weights = shape.weight_bytes_split + shape.weight_bytes_whole
    runnable, refused = auto_layout.choose(model, plan, shape, fake_probe(2, free=int(weights * 0.95)), config, 2)
    assert [auto_layout.describe_sizes(p.sizes) for p in runnable] == ["tp2"]
    assert "GiB free" in refused["ulysses2"] and "GiB free" in refused["ring2"]


def test_layout_input_is_checked():
    with pytest.raises(ConfigError, match=r"layout='fast' is not valid; choose one of manual, auto"):
        build_config(ulysses_size=2, layout="fast", host=CPU)
    with pytest.raises(ConfigError, match=r"Parallel Config: layout='auto' .*list one device per rank"):
        build_config(devices="cpu", layout="auto", host=CPU)
    config = build_config(devices="cpu,cpu", layout="auto", host=CPU)
    assert config.world_size == 2 and config.auto_layout and "layout auto over 2 ranks" in config.describe()
    assert build_config(ulysses_size=2, layout="auto", host=CPU).world_size == 2


@pytest.mark.multirank
def test_auto_worlds_run_each_model_in_its_layout_and_equal_one_process(runtime, wan):
    model, inputs = wan
    plan = find_plan(model)
    world = runtime.world_for(build_config(devices="cpu,cpu", layout="auto", host=CPU))
    probe = world.status()["probe"]
    assert len(probe["ranks"]) == 2 and probe["seconds"] < 5
    assert all(link["bytes_per_s"] > 0 for link in probe["links"].values())
    # The same model object is chosen for once; a second model (batch 2 = cond + uncond) may differ.
    other = build_wan_model(TinyWan(), text_dim=64)
    other.load_state_dict(model.state_dict())
    for module, batch in ((model, 1), (other, 2), (model, 1)):
        args = inputs(batch)
        with torch.inference_mode():
            ref = module._forward(*args, transformer_options={})
            out = world.forward(module, plan, module._forward, args, {"transformer_options": {}})
        err = (out - ref).abs().max().item()
        assert err <= TOL, (batch, err)
    layouts = world.status()["layouts"]
    assert len(layouts) == 2
    first, second = layouts
    assert first["batch"] == 1 and first["layout"]["cfg"] == 1
    assert second["batch"] == 2
    for choice in layouts:
        steps = [a["step_ms"] for a in choice["alternatives"]]
        assert steps == sorted(steps) and choice["predicted_step_ms"] == steps[0] > 0
        assert "cfg2" in choice["refused"] or choice["batch"] == 2


@pytest.mark.multirank
def test_a_manual_cfg_dimension_with_nothing_to_split_is_said_in_the_status(runtime, wan):
    model, inputs = wan
    world = runtime.world_for(build_config(cfg_size=2, devices="cpu,cpu", host=CPU))
    args = inputs(1)
    with torch.inference_mode():
        ref = model._forward(*args, transformer_options={})
        out = world.forward(model, find_plan(model), model._forward, args, {"transformer_options": {}})
    assert (out - ref).abs().max().item() <= TOL
    notes = world.status()["notes"]
    assert len(notes) == 1 and "cfg_size 2 has nothing to split" in notes[0] and "batch of 1" in notes[0]


def test_the_cost_model_reproduces_published_results_on_paper():
    """bench/paper_check.py: published peer results predicted from published hardware figures
    (one efficiency fitted per source on its one-GPU time); the README's table."""
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "bench"))
    import paper_check

    rows = paper_check.rows()
    close = [r for r in rows if abs(r["error"]) <= 0.2]
    assert len(close) >= 5
    covered = {(r["source"].split(" (")[0], r["gpus"]) for r in close}
    assert {("cache-dit Flux L20", 2), ("cache-dit Flux L20", 4), ("xDiT HunyuanVideo H20", 8)} <= covered
    assert any(r["source"].startswith("raylight") for r in close)  # two consumer-class GPUs over PCIe
    best = paper_check.consumer_pcie()[0]
    assert best["speedup"] > 1


@pytest.mark.multirank
def test_every_family_under_layout_auto_equals_one_process(runtime):
    """The families' exactness cases (tests/families.py) in one auto world of 2 ranks: every model
    runs in the layout chosen for it and equals the single-process run."""
    from conftest import check_every_family, single_process_references
    from families import CASES

    world = runtime.world_for(build_config(devices="cpu,cpu", layout="auto", host=CPU))
    built = single_process_references(CASES)  # held: the choices are kept per model object, weakly
    checked = check_every_family(world, built, CASES, TOL)
    chosen = world.status()["layouts"]
    assert checked >= 5 and len(chosen) == checked
    assert all(c["layout"]["cfg"] == 1 or c["batch"] % c["layout"]["cfg"] == 0 for c in chosen)


def _prediction(step_ms: float, **sizes) -> cost_model.Prediction:
    full = {"cfg": 1, "ring": 1, "ulysses": 1, "tp": 1, **sizes}
    return cost_model.Prediction(full, step_ms / 1e3, step_ms / 1e3, 0.0, 0, 0)


def test_a_model_keeps_its_layout_for_a_new_size_unless_another_is_clearly_faster():
    best, ring, tp = _prediction(100, ulysses=2), _prediction(104, ring=2), _prediction(110, tp=2)
    runnable = [best, ring, tp]
    assert auto_layout.keep_or_best(runnable, None) is best
    assert auto_layout.keep_or_best(runnable, ring.sizes) is ring  # within 5 %: no switch
    assert auto_layout.keep_or_best(runnable, tp.sizes) is best  # 10 % slower: switch
    assert auto_layout.keep_or_best(runnable, _prediction(1, cfg=2).sizes) is best  # refused now: switch


def test_the_choice_is_per_input_size():
    x, t, ctx = torch.zeros(1, 16, 3, 10, 14), torch.zeros(1), torch.zeros(1, 7, 64)
    options = {"transformer_options": {"sigmas": torch.zeros(5)}}
    assert auto_layout.input_sizes((x, t, ctx), options) == ((1, 16, 3, 10, 14), (1,), (1, 7, 64))
    assert auto_layout.input_sizes((x, t), {"context": [ctx]}) == ((1, 16, 3, 10, 14), (1,), (1, 7, 64))


@pytest.mark.multirank
def test_a_new_resolution_is_chosen_for_and_layouts_share_the_weights_sent(runtime, wan):
    """A model run at two sizes gets a choice for each (the second measured at its own size), the
    first size again chooses nothing new; and context-parallel layouts of one model share the
    weights the ranks hold (only another TP size sends them again)."""
    from parallel_runtime.distributed.mesh import MeshLayout

    model, inputs = wan
    plan = find_plan(model)
    world = runtime.world_for(build_config(devices="cpu,cpu", layout="auto", host=CPU))
    small = inputs(1)
    large = (torch.randn(1, 16, 5, 20, 28, generator=torch.Generator().manual_seed(9)), *small[1:])
    for args in (small, large, small):
        with torch.inference_mode():
            ref = model._forward(*args, transformer_options={})
            out = world.forward(model, plan, model._forward, args, {"transformer_options": {}})
        assert (out - ref).abs().max().item() <= TOL
    choices = [c for c in world.status()["layouts"] if c["model"] == type(model).__name__]
    assert sorted(c["tokens"] for c in choices) == [3 * 5 * 7, 5 * 10 * 14]  # one per size, patches of 1x2x2
    sends = world.copies.sends
    args = small
    for sizes in ({"ulysses": 2}, {"ring": 2}, {"ulysses": 2}, {"tp": 2}, {"ring": 2}):
        with torch.inference_mode():
            ref = model._forward(*args, transformer_options={})
            out = world.forward(model, plan, model._forward, args, {"transformer_options": {}},
                                layout=MeshLayout.from_sizes(sizes))
        assert (out - ref).abs().max().item() <= 1e-4
    # Ulysses 2 and Ring 2 hold the same weights as auto's choice for the small size if it has no
    # TP (else the first one sends them); TP 2 sends its slices, and Ring 2 after it the whole model.
    (small_choice,) = [c for c in choices if c["tokens"] == 3 * 5 * 7]
    assert world.copies.sends - sends == (1 if small_choice["layout"]["tp"] > 1 else 0) + 2


def test_a_link_the_probe_cannot_resolve_is_a_lower_bound_said_so():
    """The Parallel tab showed 'all-reduce 4190208.0 GB/s' where the larger probe message took no longer
    than the smaller (a fit dividing by about zero); the cost model took that figure as it was."""
    from parallel_runtime.layout import probe

    mib = 1 << 20
    fit = probe._fit((mib, 1e-3), (5 * mib, 3e-3))  # 4 MiB more in 2 ms more: 2 GiB/s, 0.5 ms latency
    assert fit["resolved"] and fit["bytes_per_s"] == pytest.approx(4 * mib / 2e-3)
    assert fit["latency_s"] == pytest.approx(0.5e-3)
    for t_large in (1e-3, 0.9e-3, 1.02e-3):  # no longer, shorter, or within noise of the small message
        fit = probe._fit((mib, 1e-3), (5 * mib, t_large))
        assert not fit["resolved"] and fit["bytes_per_s"] == pytest.approx(5 * mib / t_large)
        assert fit["bytes_per_s"] < 1e11 and fit["latency_s"] >= 0
