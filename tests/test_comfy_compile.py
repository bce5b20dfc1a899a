"""TorchCompileModel together with Shard Transformer, through ComfyUI's HTTP API: every layout
compiled equals the eager unsharded run, and no rank compiles again after the first step."""
import copy
import threading

import pytest

from test_comfy_e2e import edited, final_latent, settled_status, status
from tiny_families import family_prompt
from workflows import find_nodes, remove_passthrough

pytestmark = pytest.mark.comfy_server

# Inductor fuses and reorders fp32 arithmetic: the compiled run equals the eager one to fp32
# rounding relative to the latents' size, not bit for bit.
REL_TOL = 2e-6


class StatusPoller:
    """GET /parallel/status every 0.2 s while a prompt runs (what the Parallel tab shows)."""

    def __init__(self, server):
        self.server = server
        self.seen: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.wait(0.2):
            try:
                self.seen.append(status(self.server))
            except Exception:  # the server busy for a moment
                pass

    def __enter__(self):
        self._thread.start()
        return self.seen

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def compiled(prompt: dict, before_shard: bool) -> dict:
    """``prompt`` with TorchCompileModel right before Shard Transformer (on the model it gets) or
    right after it (every node that took the shard node's model takes the compiled one)."""
    out = copy.deepcopy(prompt)
    (shard,) = find_nodes(out, "ShardTransformer")
    out["90"] = {"class_type": "TorchCompileModel", "inputs": {"backend": "inductor"}}
    if before_shard:
        out["90"]["inputs"]["model"] = out[shard]["inputs"]["model"]
        out[shard]["inputs"]["model"] = ["90", 0]
        return out
    for node in out.values():
        for name, value in node["inputs"].items():
            if value == [shard, 0]:
                node["inputs"][name] = ["90", 0]
    out["90"]["inputs"]["model"] = [shard, 0]
    return out


# layout -> (Parallel Config inputs, TorchCompileModel before the shard node, the graph: the
# bundled tiny workflow (a LoRA after the shard node), or a family's plain graph (4 heads, for
# Ulysses 2 x TP 2)).
LAYOUTS = {
    "ulysses2": ({"ulysses_size": 2}, True, None),
    "ring2": ({"ring_size": 2}, False, None),
    "cfg2": ({"cfg_size": 2}, True, None),
    "tp2": ({"tp_size": 2}, False, None),
    "usp2x2": ({"ulysses_size": 2, "ring_size": 2, "devices": "cpu,cpu,cpu,cpu"}, True, None),
    "ulysses2_tp2": ({"ulysses_size": 2, "tp_size": 2, "devices": "cpu,cpu,cpu,cpu"}, False, "wan"),
}


def QUICK_TIER(test: str, params: dict) -> bool:
    """The default run (conftest.in_quick_tier): compiled Ulysses 2 (TorchCompileModel before the shard
    node) and compiled Ulysses 2 x TP 2; ``--full``: every layout."""
    return test != "test_compiled_layout_equals_eager_unsharded" or params["layout"] in ("ulysses2", "ulysses2_tp2")


def graphs(tiny_prompt: dict, parallel: dict, family):
    """(sharded graph, the same graph without Shard Transformer)."""
    if family is not None:
        return family_prompt(family, parallel), family_prompt(family, None)
    sharded = edited(tiny_prompt, ParallelConfig={"ulysses_size": 1, **parallel})
    return sharded, remove_passthrough(tiny_prompt, "ShardTransformer", "model")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_layout_equals_eager_unsharded(tiny_server, tiny_prompt, layout):
    parallel, before_shard, family = LAYOUTS[layout]
    sharded, eager_unsharded = graphs(tiny_prompt, parallel, family)
    before = settled_status(tiny_server)["ranks"]
    reference = final_latent(tiny_server, eager_unsharded)
    with StatusPoller(tiny_server) as seen:
        result = final_latent(tiny_server, compiled(sharded, before_shard))
    err = (result - reference).abs().max().item()
    rel = err / reference.abs().max().item()
    print(f"\ntiny {family or 'Wan workflow'}, compiled ({'before' if before_shard else 'after'} the shard node), "
          f"{parallel}: max abs err {err:.2e}, relative {rel:.2e}")
    info = settled_status(tiny_server)
    ranks = info["ranks"]
    same_world = len(before) == len(ranks) and all(b["pid"] == a["pid"] for a, b in zip(ranks, before))
    delta = {k: [a[k] - (b[k] if same_world else 0) for a, b in zip(ranks, before if same_world else ranks)]
             for k in ("forwards", "compiles")}
    print("compiles / recompiles per rank:", [(r["compiles"], r["recompiles"]) for r in ranks], delta)
    assert result.shape == reference.shape
    assert rel <= REL_TOL
    assert not info["compiling"]
    if not same_world:  # fresh workers compiled for seconds: the status route said so meanwhile
        assert any(polled.get("compiling") for polled in seen), f"{len(seen)} polls, none said compiling"
    assert delta["forwards"][1:] == [3] * (len(ranks) - 1)  # three steps, cond and uncond in one batch
    # Every worker compiled during this prompt (its first compiled one), and no rank ever compiled
    # again for inputs it had already run.
    assert all(n > 0 for n in delta["compiles"][1:])
    assert all(r["recompiles"] == 0 for r in ranks)


def test_a_new_prompt_of_the_same_size_compiles_nothing(tiny_server, tiny_prompt):
    sharded = compiled(edited(tiny_prompt, ParallelConfig={"ulysses_size": 2}), before_shard=True)
    tiny_server.run(edited(sharded, KSampler={"seed": 1}), timeout=300)  # compiles, unless an earlier test did
    before = settled_status(tiny_server)["ranks"]
    tiny_server.run(edited(sharded, KSampler={"seed": 2}), timeout=300)
    after = settled_status(tiny_server)["ranks"]
    assert [r["pid"] for r in after] == [r["pid"] for r in before]
    assert [a["forwards"] - b["forwards"] for a, b in zip(after, before)] == [3, 3]
    assert [a["compiles"] - b["compiles"] for a, b in zip(after, before)] == [0, 0]
