"""ComfyUI's ControlNets computed under the transformer's layout, through a real server.

ComfyUI runs a ControlNet before each forward of the transformer and hands its residuals to it.
With a plan for the ControlNet's model (the Flux ControlNet: plans/flux.py ``CONTROLNET``), Shard
Transformer runs it on every rank too, each on its share of the tokens (whole on each rank of a TP
group); without one it runs on rank 0 alone as before. The tiny Flux ControlNet is a file in XLabs'
layout that the stock ControlNetLoader detects as a Flux model. Each sharded run must equal the
unsharded one, the ControlNet must change the result, and the workers must run it.
"""
from __future__ import annotations

import pytest

from test_comfy_e2e import settled_status, status
from test_comfy_families import final_latents, max_error
from test_comfy_gguf_loaders import NARROW_FLUX, flux_heads_detected
from tiny_families import FAMILIES, family_prompt
from tiny_families import controlnet_prompt as controlled_prompt

pytestmark = [pytest.mark.comfy_server,
              # ControlNetLoader detects the file as a Flux model; ComfyUI 0.3.75 fixes that at 24 heads.
              pytest.mark.skipif(not flux_heads_detected(), reason=f"{NARROW_FLUX} (the tiny ControlNet is 256 wide)")]
TOL = 1e-4
LAYOUTS = {"ulysses2": {"ulysses_size": 2}, "ring2": {"ring_size": 2}, "cfg2": {"cfg_size": 2},
           "tp2": {"tp_size": 2},
           "ulysses2_tp2": {"ulysses_size": 2, "tp_size": 2, "devices": "cpu,cpu,cpu,cpu"}}


def QUICK_TIER(test: str, params: dict) -> bool:
    """The default run (conftest.in_quick_tier): Ulysses 2 and Ulysses 2 x TP 2 (the ControlNet whole on
    each rank of a TP group); ``--full``: every layout."""
    return params.get("layout", "ulysses2") in ("ulysses2", "ulysses2_tp2")


_references: dict = {}


def reference(server):
    if not _references:
        _references["with"] = final_latents(server, controlled_prompt(None))
        _references["without"] = final_latents(server, family_prompt("flux", None))
    return _references["with"], _references["without"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_flux_controlnet_sharded_equals_unsharded(tiny_server, layout):
    ref, plain = reference(tiny_server)
    assert max_error(ref, plain) > 1e-3  # the ControlNet changes the result
    out = final_latents(tiny_server, controlled_prompt(LAYOUTS[layout]))
    err = max_error(out, ref)
    print(f"\nFlux with the stock ControlNet under {layout}: max abs err {err:.2e}")
    assert err <= TOL


def test_the_workers_run_the_controlnet(tiny_server):
    """Under Ulysses 2 rank 1 runs a forward of the ControlNet before each of the transformer: twice the
    forwards of the same graph without it (it ran its share; on rank 0 alone it would count none)."""
    def forwards(prompt) -> int:
        before = settled_status(tiny_server)["ranks"][1]["forwards"]
        final_latents(tiny_server, prompt)
        return settled_status(tiny_server)["ranks"][1]["forwards"] - before

    def seeded(prompt, seed):  # a prompt ComfyUI has not run yet (it would serve a repeat from its cache)
        prompt["7"]["inputs"]["seed"] = seed
        return prompt

    final_latents(tiny_server, seeded(family_prompt("flux", {"ulysses_size": 2}), 1001))  # the world up, this layout
    plain = forwards(seeded(family_prompt("flux", {"ulysses_size": 2}), 1002))
    controlled = forwards(seeded(controlled_prompt({"ulysses_size": 2}), 1003))
    print(f"\nrank 1 ran {plain} forwards without the ControlNet, {controlled} with it")
    assert plain > 0 and controlled == 2 * plain


def test_free_releases_the_controlnet_on_every_rank(tiny_server):
    """ComfyUI's /free unloads the ControlNet too: every rank lets its copy go (nothing left held)."""
    from test_comfy_tensor_parallel import free_every_rank

    prompt = controlled_prompt({"ulysses_size": 2})
    prompt["7"]["inputs"]["seed"] = 1004  # not served from ComfyUI's cache
    final_latents(tiny_server, prompt)
    assert status(tiny_server)["ranks"][1]["param_bytes"] > 0
    assert free_every_rank(tiny_server) == [0, 0]
