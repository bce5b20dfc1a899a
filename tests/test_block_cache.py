"""Block Cache (parallel_runtime/parallel/block_cache.py) through a real ComfyUI server on the tiny
families: the node sharded under each layout (USP, a weighted split and layout auto included) equals
the same node unsharded (fp32) with the same steps cached, at settings where at least a third of the
steps are cached, with TaylorSeer too and with the node placed before Shard Transformer, and every
rank takes one decision even where the ranks' own measures straddle the threshold."""
import pytest
import torch
from safetensors.torch import load_file

from comfy_server import ComfyServer, PromptFailed
from test_comfy_e2e import status
import tiny_families
from tiny_families import ALL_FAMILIES, FAMILIES, family_prompt

pytestmark = pytest.mark.multirank
TOL = 1e-4
STEPS = 10
# Per family: blocks first and last (the tiny models have 2 to 4 blocks) and a threshold at which the
# tiny random models cache a third of the steps or more.
CACHE = {"flux": dict(front_blocks=1, back_blocks=1, threshold=0.6),
         "wan": dict(front_blocks=1, back_blocks=0, threshold=0.3),
         "qwen_image": dict(front_blocks=1, back_blocks=0, threshold=0.7)}
COMMON = dict(warmup_steps=2, max_cached_steps=3, taylor_order=0)
LAYOUTS = {"ulysses2": {"ulysses_size": 2}, "tp2": {"tp_size": 2}, "ring2": {"ring_size": 2},
           "cfg2": {"cfg_size": 2}, "ulysses2_tp2": {"ulysses_size": 2, "tp_size": 2, "devices": "cpu,cpu,cpu,cpu"}}
CACHED_FAMILIES = [f for f in CACHE if f in FAMILIES]
_references: dict = {}


def cached_prompt(family: str, parallel: dict | None, cache: dict | None = None, steps: int = STEPS) -> dict:
    """The family's tiny graph with ``steps`` steps and Block Cache (COMMON and ``cache``) after Shard
    Transformer (None: no cache)."""
    return tiny_families.cached_prompt(family, parallel, None if cache is None else {**COMMON, **cache}, steps)


def run(server, prompt) -> tuple[torch.Tensor, dict]:
    """The final latent (the streams' latents flattened back to back where the graph saves one per
    stream, in file-name order) and the status route's Block Cache row of this prompt."""
    prompt_id = server.queue(prompt)
    entry = server.wait(prompt_id, timeout=600)
    latents = [load_file(str(path))["latent_tensor"] for path in sorted(server.outputs(entry, "latents"))]
    rows = [r for r in status(server)["block_cache"] if r["prompt_id"] == prompt_id]
    latent = latents[0] if len(latents) == 1 else torch.cat([t.flatten() for t in latents])
    return latent, (rows[0] if rows else {})


def reference(server, family: str):
    """(unsharded uncached latent, unsharded cached latent, its Block Cache row)."""
    if family not in _references:
        plain, _ = run(server, cached_prompt(family, None))
        cached, row = run(server, cached_prompt(family, None, CACHE[family]))
        print(f"\n{family} unsharded: {row}")
        _references[family] = plain, cached, row
    return _references[family]


@pytest.mark.parametrize("layout,family", [(layout, f) for layout in LAYOUTS for f in CACHED_FAMILIES],
                         ids=[f"{layout}-{f}" for layout in LAYOUTS for f in CACHED_FAMILIES])
def test_sharded_block_cache_equals_unsharded(tiny_server, layout, family):
    plain, ref, ref_row = reference(tiny_server, family)
    assert ref_row["computed"] + ref_row["cached"] == STEPS
    assert ref_row["cached"] * 3 >= STEPS, f"the settings cache too little to test anything: {ref_row}"
    assert (ref - plain).abs().max().item() > 1e-3  # the cache really skipped blocks
    out, row = run(tiny_server, cached_prompt(family, LAYOUTS[layout], CACHE[family]))
    err = (out - ref).abs().max().item()
    worst = max((abs(a - b) for a, b in zip(row["measures"], ref_row["measures"]) if a is not None and b is not None),
                default=0.0)
    print(f"\n{family} {layout}: max abs err {err:.2e} against unsharded Block Cache; computed {row['computed']}, "
          f"cached {row['cached']} (unsharded {ref_row['computed']} / {ref_row['cached']}); largest measure "
          f"difference {worst:.1e}")
    assert row["cached"] == ref_row["cached"] and row["computed"] == ref_row["computed"]
    assert [m is None for m in row["measures"]] == [m is None for m in ref_row["measures"]]
    assert worst <= 1e-4
    assert err <= TOL * max(1.0, ref.abs().max().item())
    mesh = status(tiny_server)["mesh"]
    assert all(mesh[dim] == LAYOUTS[layout].get(f"{dim}_size", 1) for dim in ("ulysses", "ring", "cfg", "tp"))


# The families declared since (issue 34): one layout each (Ulysses 2), and TP 2 for Z-Image. Per family
# the blocks first and last and a threshold at which its tiny model caches a third of the steps or more,
# with computed steps among the cached ones. The tiny CogVideoX, Chroma Radiance and MiniMax-H3 depend
# little on a fresh middle residual: no cap on cached steps in a row for them, one warm-up step for the
# first two, and every step after it cached for Chroma Radiance (6 of 10 cached move its result by 5e-6).
MORE_CACHE = {"hunyuan_video": dict(front_blocks=1, back_blocks=1, threshold=0.5),
              "ltxv": dict(front_blocks=1, back_blocks=1, threshold=0.3),
              "ltxav": dict(front_blocks=1, back_blocks=1, threshold=0.3),
              "z_image": dict(front_blocks=1, back_blocks=0, threshold=0.9),
              "cogvideox": dict(front_blocks=1, back_blocks=0, threshold=0.42, warmup_steps=1, max_cached_steps=0),
              "kandinsky5": dict(front_blocks=1, back_blocks=0, threshold=0.5),
              "krea2": dict(front_blocks=1, back_blocks=0, threshold=0.5),
              "joyimage": dict(front_blocks=1, back_blocks=0, threshold=0.5),
              "chroma_radiance": dict(front_blocks=1, back_blocks=0, threshold=1.0, warmup_steps=1, max_cached_steps=0),
              "minimax_h3": dict(front_blocks=1, back_blocks=0, threshold=0.02, max_cached_steps=0)}
# A cache that never skips leaves the result bit for bit the uncached one. Cached, those three differ
# from the uncached run by 3e-5 to 6e-5 (the others by 5e-3 to 5e-2), their sharded errors under 1e-6.
DIFFERS = 1e-5
MORE_CASES = [("ulysses2", f) for f in MORE_CACHE] + [("tp2", "z_image")]


def QUICK_TIER(test: str, params: dict) -> bool:
    """The default run (conftest.in_quick_tier): Flux under every layout, Wan and Qwen-Image under
    Ulysses 2, and of the other families Z-Image (also TP 2) and HunyuanVideo (LTX-2's two streams, the
    slowest case, in ``--full``); of the other settings TaylorSeer order 2 (its terms of every order up to 2) and the node placed
    before Shard Transformer. ``--full``: every family under every layout it has here, TaylorSeer
    order 1, and the four-rank USP (Ulysses 2 x Ring 2), the weighted split and layout auto (Ulysses 3, which
    pads the heads, in both)."""
    if test == "test_sharded_block_cache_equals_unsharded":
        return params["family"] == "flux" or params["layout"] == "ulysses2"
    if test == "test_more_families_sharded_block_cache_equals_unsharded":
        return params["family"] in ("z_image", "hunyuan_video")
    if test == "test_taylor_seer_sharded_equals_unsharded":
        return params["order"] == 2
    if test == "test_block_cache_under_more_layouts_equals_unsharded":
        return params["layout"] == "ulysses3"
    return True


@pytest.mark.parametrize("layout,family", MORE_CASES, ids=[f"{layout}-{f}" for layout, f in MORE_CASES])
def test_more_families_sharded_block_cache_equals_unsharded(tiny_server, layout, family):
    """Each family's block stacks as its plan declares them (tuple outputs, a tuple argument's items,
    a token dimension other than 1): sharded equals unsharded with the same steps cached, and the
    cache really skips blocks."""
    if family not in FAMILIES:
        pytest.skip(f"{family}: this ComfyUI has no {ALL_FAMILIES[family].needs} (a later release brings the model)")
    cache = MORE_CACHE[family]
    if family not in _references:
        plain, _ = run(tiny_server, cached_prompt(family, None))
        cached, ref_row = run(tiny_server, cached_prompt(family, None, cache))
        print(f"\n{family} unsharded: {ref_row}; differs {(cached - plain).abs().max().item():.2e}, "
              f"latents up to {plain.abs().max().item():.2f}")
        _references[family] = plain, cached, ref_row
    plain, ref, ref_row = _references[family]
    forwards = ref_row["computed"] + ref_row["cached"]  # one per step, or two where cond and uncond run apart
    assert forwards in (STEPS, 2 * STEPS), ref_row
    assert ref_row["cached"] * 3 >= forwards, f"the settings cache too little to test anything: {ref_row}"
    differs = (ref - plain).abs().max().item()
    out, row = run(tiny_server, cached_prompt(family, LAYOUTS[layout], cache))
    err = (out - ref).abs().max().item()
    worst = max((abs(a - b) for a, b in zip(row["measures"], ref_row["measures"]) if a is not None and b is not None),
                default=0.0)
    print(f"\n{family} {layout}: max abs err {err:.2e} against unsharded Block Cache (latents up to "
          f"{ref.abs().max().item():.2f}); computed {row['computed']}, cached {row['cached']} (unsharded "
          f"{ref_row['computed']} / {ref_row['cached']}); cached differs from uncached by {differs:.2e}; "
          f"largest measure difference {worst:.1e}")
    assert row["cached"] == ref_row["cached"] and row["computed"] == ref_row["computed"]
    assert [m is None for m in row["measures"]] == [m is None for m in ref_row["measures"]]
    assert worst <= 1e-4
    assert err <= TOL
    assert differs > DIFFERS, f"the cached run is the uncached one ({differs:.1e}): no step skipped its blocks"
    mesh = status(tiny_server)["mesh"]
    assert all(mesh[dim] == LAYOUTS[layout].get(f"{dim}_size", 1) for dim in ("ulysses", "ring", "cfg", "tp"))


def sharded_run(server, prompt) -> tuple[torch.Tensor, dict, dict, list[int]]:
    """``run`` and the status after it, with the forwards each rank ran for this prompt."""
    before = status(server)["ranks"]
    out, row = run(server, prompt)
    info = status(server)
    after = info["ranks"]
    if len(before) == len(after) and all(b["pid"] == a["pid"] for b, a in zip(before, after)):
        ran = [a["forwards"] - b["forwards"] for a, b in zip(after, before)]
    else:  # the world started for this prompt
        ran = [a["forwards"] for a in after]
    return out, row, info, ran


def check_same_as_unsharded(label: str, out, row, plain, ref, ref_row, ran: list[int]) -> None:
    """The sharded run equals the unsharded one with the same steps cached, at settings that cache a
    third of the steps or more and move the result."""
    assert ref_row["computed"] + ref_row["cached"] == STEPS, ref_row
    assert ref_row["cached"] * 3 >= STEPS, f"the settings cache too little to test anything: {ref_row}"
    differs = (ref - plain).abs().max().item()
    err = (out - ref).abs().max().item()
    worst = max((abs(a - b) for a, b in zip(row["measures"], ref_row["measures"]) if a is not None and b is not None),
                default=0.0)
    print(f"\n{label}: max abs err {err:.2e} against unsharded Block Cache (latents up to {ref.abs().max().item():.2f}); "
          f"computed {row['computed']}, cached {row['cached']} (unsharded {ref_row['computed']} / {ref_row['cached']}); "
          f"cached differs from uncached by {differs:.2e}; largest measure difference {worst:.1e}; "
          f"forwards per rank {ran}")
    assert len(ran) > 1 and ran == [STEPS] * len(ran)  # every step ran on every rank, cached or not
    assert row["cached"] == ref_row["cached"] and row["computed"] == ref_row["computed"]
    assert [m is None for m in row["measures"]] == [m is None for m in ref_row["measures"]]
    assert worst <= 1e-4
    assert err <= TOL
    assert differs > 1e-3, f"the cached run is the uncached one ({differs:.1e}): no step skipped its blocks"


# Issue 34's layouts beyond the five above, each on one family: the four-rank USP (Ulysses 2 x Ring 2),
# a weighted split (rank 1 holds half rank 0's tokens, so the ranks' parts differ in length) and
# layout auto over two ranks (the layout the cost model picks at the first forward), and a Ulysses size
# that does not divide the heads (issue 50).
MORE_LAYOUTS = {"usp": ("flux", {"ulysses_size": 2, "ring_size": 2, "devices": "cpu,cpu,cpu,cpu"}),
                "weighted": ("wan", {"ulysses_size": 2, "weights": "1,0.5"}),
                "auto": ("flux", {"ulysses_size": 1, "devices": "cpu,cpu", "layout": "auto"}),
                # Ulysses 3 over Flux's four heads (padded to 2 a rank) and its 35 image tokens
                "ulysses3": ("flux", {"ulysses_size": 3, "devices": "cpu,cpu,cpu"})}


@pytest.mark.parametrize("layout", list(MORE_LAYOUTS))
def test_block_cache_under_more_layouts_equals_unsharded(tiny_server, layout):
    family, parallel = MORE_LAYOUTS[layout]
    plain, ref, ref_row = reference(tiny_server, family)
    out, row, info, ran = sharded_run(tiny_server, cached_prompt(family, parallel, CACHE[family]))
    check_same_as_unsharded(f"{family} {layout} (mesh {info['mesh']})", out, row, plain, ref, ref_row, ran)
    if layout == "auto":
        assert info["layout"] == "auto" and info["world_size"] == 2
        (choice,) = [c for c in info["layouts"] if c["model"] == "Flux"]
        print(f"layout auto chose {choice['layout']}")
    else:
        assert all(info["mesh"][dim] == parallel.get(f"{dim}_size", 1) for dim in ("ulysses", "ring", "cfg", "tp"))


@pytest.mark.parametrize("order", [1, 2])
def test_taylor_seer_sharded_equals_unsharded(tiny_server, order):
    """TaylorSeer: the cached residual extrapolated from the last full steps (each rank its own part
    of the terms) under Ulysses 2 equals the unsharded run of the same order, and differs from the
    residual reused as it was (order 0)."""
    cache = {**CACHE["flux"], "taylor_order": order}
    plain, order0, _ = reference(tiny_server, "flux")
    key = ("flux", "taylor", order)
    if key not in _references:
        _references[key] = run(tiny_server, cached_prompt("flux", None, cache))
        print(f"\nflux TaylorSeer order {order} unsharded: {_references[key][1]}")
    ref, ref_row = _references[key]
    out, row, _, ran = sharded_run(tiny_server, cached_prompt("flux", {"ulysses_size": 2}, cache))
    check_same_as_unsharded(f"flux TaylorSeer order {order}, ulysses2", out, row, plain, ref, ref_row, ran)
    from_order0 = (ref - order0).abs().max().item()
    print(f"order {order} differs from order 0 by {from_order0:.2e}")
    assert from_order0 > 1e-3  # the extrapolation changed the cached steps


def test_block_cache_before_shard_transformer_equals_unsharded(tiny_server):
    """model -> Block Cache -> Shard Transformer -> KSampler under Ulysses 2: Shard Transformer keeps
    the node's settings and wrapper (its own wrapper runs innermost), so every rank caches as with the
    node after it; equal to the node unsharded."""
    plain, ref, ref_row = reference(tiny_server, "wan")
    prompt = family_prompt("wan", {"ulysses_size": 2})
    prompt["7"]["inputs"]["steps"] = STEPS
    prompt["30"] = {"class_type": "HybridBlockCache", "inputs": {"model": ["1", 0], **COMMON, **CACHE["wan"]}}
    prompt["3"]["inputs"]["model"] = ["30", 0]
    assert prompt["7"]["inputs"]["model"] == ["3", 0]
    out, row, info, ran = sharded_run(tiny_server, prompt)
    check_same_as_unsharded("wan, Block Cache before Shard Transformer, ulysses2", out, row, plain, ref, ref_row, ran)
    assert info["mesh"]["ulysses"] == 2


# Each rank's own measure scaled by 1.5 on rank 0 and 0.5 on rank 1 (PARALLEL_TEST_BLOCK_CACHE_SKEW):
# a rounding difference near the threshold, exaggerated so that it happens at most steps. At this
# threshold the tiny Wan's measures (0.12 to 0.18) make rank 0 cache some steps and rank 1 all of them.
SKEW = "0.5"
SKEWED_CACHE = dict(front_blocks=1, back_blocks=0, threshold=0.2)


def _server(tiny_base, comfyui_path, name: str, env: dict):
    import sys

    return ComfyServer(comfyui_path, tiny_base, python=sys.executable, log_path=tiny_base / f"{name}.log",
                       env=env).start()


@pytest.fixture(scope="module")
def skewed_server(tiny_base, comfyui_path):
    server = _server(tiny_base, comfyui_path, "block_cache_skew", {"PARALLEL_TEST_BLOCK_CACHE_SKEW": SKEW,
                                                                  "PARALLEL_COLLECTIVE_TIMEOUT_S": "20"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def every_rank_for_itself(tiny_base, comfyui_path):
    """The same, with each rank following its own wish instead of rank 0's decision: the rule removed."""
    server = _server(tiny_base, comfyui_path, "block_cache_local", {"PARALLEL_TEST_BLOCK_CACHE_SKEW": SKEW,
                                                                   "PARALLEL_TEST_BLOCK_CACHE_LOCAL": "1",
                                                                   "PARALLEL_COLLECTIVE_TIMEOUT_S": "6"})
    yield server
    server.stop()


def test_ranks_whose_measures_straddle_the_threshold_take_one_decision(skewed_server):
    """Rank 0 and rank 1 see the measure on opposite sides of the threshold at several steps: the run
    completes (no rank waits in a collective the other skipped) and equals the unsharded run that
    decides as rank 0 does, step for step."""
    alone, alone_row = run(skewed_server, cached_prompt("wan", None, SKEWED_CACHE))
    out, row = run(skewed_server, cached_prompt("wan", {"ulysses_size": 2}, SKEWED_CACHE))
    plain, _ = run(skewed_server, cached_prompt("wan", None))
    err = (out - alone).abs().max().item()
    print(f"\nskewed measures, Ulysses 2: {row}\nunsharded as rank 0: {alone_row}\nmax abs err {err:.2e}; "
          f"differs from the uncached run by {(out - plain).abs().max().item():.2e}")
    assert row.get("disagreements", 0) >= 2  # the ranks' own wishes differed at several steps
    assert 0 < row["cached"] < STEPS - 2 and row["cached"] == alone_row["cached"]
    assert err <= TOL * max(1.0, alone.abs().max().item())
    assert (out - plain).abs().max().item() > 1e-3


def test_without_one_decision_the_ranks_diverge(every_rank_for_itself):
    """What the broadcast of rank 0's decision prevents: with each rank deciding alone, rank 1 skips
    blocks whose collectives rank 0 runs, and the prompt fails (a hang or a mismatched collective)."""
    with pytest.raises(PromptFailed) as info:
        run(every_rank_for_itself, cached_prompt("wan", {"ulysses_size": 2}, SKEWED_CACHE))
    print(f"\neach rank deciding alone: {str(info.value)[:300]}")


def test_settings_that_leave_nothing_to_cache_are_refused_at_the_node(tiny_server):
    with pytest.raises(PromptFailed) as info:
        run(tiny_server, cached_prompt("flux", None, dict(front_blocks=1, back_blocks=3, threshold=0.5)))
    assert ("Block Cache: front_blocks=1 + back_blocks=3 leave none of the model's 4 blocks to cache; valid: "
            "front_blocks >= 1 and front_blocks + back_blocks <= 3") in str(info.value)
