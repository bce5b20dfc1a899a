"""ComfyUI's own step caches, EasyCache and LazyCache (comfy_extras/nodes_easycache.py), around a
sharded model through a real ComfyUI server on the tiny families: placed before or after Shard
Transformer, under TP 2, Ulysses 2 x TP 2 and CFG 2, each equals the same cache node unsharded
(fp32), skipping the same steps, at thresholds where at least a third of the steps are skipped.

Both decide on rank 0 whether a step runs the model at all (EasyCache as a forward wrapper, which
Shard Transformer's sampling wrapper moves outside its own; LazyCache around ComfyUI's
predict_noise), on the whole latent; every step that does run, runs on every rank. The skipped
steps are read from the line ComfyUI logs at the end of each sampling run ("EasyCache - skipped
4/10 steps") and checked against the forwards each rank ran (status route)."""
import re

import pytest
import torch
from safetensors.torch import load_file

from test_comfy_e2e import settled_status, status
from tiny_families import FAMILIES, family_prompt

pytestmark = pytest.mark.multirank
TOL = 1e-4
STEPS = 10
# reuse_threshold per node and family at which the tiny random models skip a third of the steps or
# more (the whole schedule is eligible: start_percent 0, end_percent 1).
THRESHOLD = {"EasyCache": {"flux": 0.2, "wan": 0.2, "qwen_image": 0.2},
             "LazyCache": {"flux": 0.2, "wan": 0.2, "qwen_image": 0.2}}
LAYOUTS = {"tp2": {"tp_size": 2}, "cfg2": {"cfg_size": 2},
           "ulysses2_tp2": {"ulysses_size": 2, "tp_size": 2, "devices": "cpu,cpu,cpu,cpu"}}
# Places: the cache node after Shard Transformer (model -> shard -> cache) or before it (see CASES).
FAMILY_LIST = [f for f in ("flux", "wan", "qwen_image") if f in FAMILIES]
SKIPPED = re.compile(r"(EasyCache|LazyCache) - skipped (\d+)/(\d+) steps")
_references: dict = {}


def cache_prompt(family: str, parallel: dict | None, node: str | None, place: str = "after") -> dict:
    """The family's tiny graph with STEPS steps and ``node`` (None: no cache) between the model and
    KSampler, after Shard Transformer or between the loader and Shard Transformer."""
    prompt = family_prompt(family, parallel)
    sampler = prompt["7"]["inputs"]
    sampler["steps"] = STEPS
    if node is None:
        return prompt
    cache = {"class_type": node, "inputs": {"reuse_threshold": THRESHOLD[node][family], "start_percent": 0.0,
                                            "end_percent": 1.0, "verbose": False}}
    if place == "before" and parallel is not None:
        cache["inputs"]["model"] = prompt["3"]["inputs"]["model"]
        prompt["3"]["inputs"]["model"] = ["30", 0]
    else:
        cache["inputs"]["model"] = sampler["model"]
        sampler["model"] = ["30", 0]
    prompt["30"] = cache
    return prompt


def forwards(server) -> list[tuple[int, int]]:
    return [(r["pid"], r["forwards"]) for r in settled_status(server)["ranks"]]


def run(server, prompt) -> tuple[torch.Tensor, int | None, list[int]]:
    """The final latent, the steps the cache node logged as skipped (None: no such line) and the
    forwards each rank ran for this prompt (empty when unsharded)."""
    start = server.log_path.stat().st_size if server.log_path.exists() else 0
    before = dict(forwards(server))
    entry = server.wait(server.queue(prompt), timeout=600)
    (path,) = server.outputs(entry, "latents")
    with open(server.log_path, "rb") as log:
        log.seek(start)
        lines = SKIPPED.findall(log.read().decode(errors="replace"))
    skipped = None
    if lines:
        (name, count, total), = lines
        assert int(total) == STEPS
        skipped = int(count)
    after = forwards(server)
    # rank 0 is the server's own process: its count starts again with a new world, as the workers' do
    fresh = [pid for pid, _ in after[1:]] != list(before)[1:]
    ran = [n - (0 if fresh else before.get(pid, 0)) for pid, n in after] if "2" in prompt else []
    return load_file(str(path))["latent_tensor"], skipped, ran


def reference(server, family: str, node: str):
    """(unsharded uncached latent, unsharded cached latent, the steps it skipped)."""
    if (family, node) not in _references:
        plain, none, _ = run(server, cache_prompt(family, None, None))
        assert none is None
        cached, skipped, _ = run(server, cache_prompt(family, None, node))
        print(f"\n{family} {node} unsharded: skipped {skipped}/{STEPS}, differs from uncached by "
              f"{(cached - plain).abs().max().item():.2e}")
        _references[family, node] = plain, cached, skipped
    return _references[family, node]


# Every node, layout and family with the cache after Shard Transformer; before it (the same code path
# on rank 0, the cache wrapping the sharded model) for one family and layout: the CI's time is shared.
CASES = [(node, layout, family, "after") for node in THRESHOLD for layout in LAYOUTS for family in FAMILY_LIST] + \
    [(node, "tp2", "wan", "before") for node in THRESHOLD if "wan" in FAMILY_LIST]


def QUICK_TIER(test: str, params: dict) -> bool:
    """The default run (conftest.in_quick_tier): each node under each layout on one family (Wan), and the
    node before Shard Transformer; ``--full``: every family."""
    return params.get("family", "wan") == "wan"


@pytest.mark.parametrize("node,layout,family,place", CASES, ids=["-".join(c) for c in CASES])
def test_sharded_core_cache_equals_unsharded(tiny_server, node, layout, family, place):
    plain, ref, ref_skipped = reference(tiny_server, family, node)
    assert ref_skipped is not None and ref_skipped * 3 >= STEPS, f"{node} skips too little to test anything"
    assert (ref - plain).abs().max().item() > 1e-3  # the cache really skipped steps
    out, skipped, ran = run(tiny_server, cache_prompt(family, LAYOUTS[layout], node, place))
    err = (out - ref).abs().max().item()
    print(f"\n{node} {place} Shard Transformer, {family} {layout}: max abs err {err:.2e} against unsharded "
          f"{node}; skipped {skipped}/{STEPS} (unsharded {ref_skipped}); forwards per rank {ran}")
    assert skipped == ref_skipped
    # every step that ran, ran on every rank: CFG 1 batching runs one forward per step that is not skipped
    assert len(set(ran)) == 1 and ran[0] == STEPS - skipped
    assert err <= TOL * max(1.0, ref.abs().max().item())
    mesh = status(tiny_server)["mesh"]
    assert all(mesh[dim] == LAYOUTS[layout].get(f"{dim}_size", 1) for dim in ("ulysses", "ring", "cfg", "tp"))
