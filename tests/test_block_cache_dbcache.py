"""Block Cache against an independent implementation: cache-dit's DBCache on the same Flux.

The same network (ComfyUI's Flux for Block Cache, the same weights converted to diffusers'
``FluxTransformer2DModel`` for cache-dit: ``bench/peers.prepare_case``), the same noise, the same
flow-matching Euler loop and the same settings (Fn, Bn, threshold, warm-up, cached steps in a row).
cache-dit runs in a process of its own (``bench/peers.run_dbcache``), so that its hooks never touch
this one. The peers' packages come with the test host (``tools/host.py``, pins in
``bench/peer_packages.py``): missing, this test fails; ``PARALLEL_NO_PEERS=1`` skips it.

The two change measures differ by design: cache-dit's is the relative L1 change of the Fn blocks'
image-stream residual, Block Cache's sums the image and text streams (docs/block_cache.md). On this
network they are 1-4 % apart, so the thresholds here sit where both measures fall on the same side;
at 0.17 they do not (step 5: 0.168 here, 0.171 in cache-dit) and the cached steps differ.
"""
import os
import sys
from importlib.util import find_spec

import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import peer_packages  # noqa: E402  (bench/: the peers' list and the switch that leaves them out)
import peers  # noqa: E402
import scenarios  # noqa: E402

from parallel_runtime.parallel import block_cache  # noqa: E402
from parallel_runtime.parallel.block_cache import OPTION, BlockCacheSettings, cached_blocks  # noqa: E402
from parallel_runtime.plans import find_plan  # noqa: E402

STEPS = 8
SETTINGS = dict(front_blocks=1, back_blocks=0, warmup_steps=2, max_cached_steps=3)
# Different cached steps at each (2, 3, 5 and 2, 3, 4, 6, 7: the second hits the cap of 3 in a row).
THRESHOLDS = (0.18, 0.25)
# The same fp32 network computed by two libraries: their uncached latents are 5e-7 apart here. One step
# decided differently moves the latent by 1e-4 or more (asserted below), far outside this.
LATENT_TOL = 1e-5
# How far the two change measures may be apart (relative): 4 % measured, from the text stream.
MEASURE_TOL = 0.06


def need_peers() -> None:
    """Skip only where the set-up was told to leave the peers out; otherwise their absence fails."""
    wanted = peer_packages.REQUIREMENTS
    if os.environ.get(peer_packages.NO_PEERS_ENV) == "1":
        pytest.skip(f"{peer_packages.NO_PEERS_ENV}=1: the peers' packages are left out")
    missing = [m for m in map(peer_packages.module_name, wanted) if find_spec(m) is None]
    assert not missing, (f"{missing} not installed: tools/host.py installs {wanted} into the test host "
                         f"(tools/test.sh runs it); {peer_packages.NO_PEERS_ENV}=1 skips this test instead")


def sample_block_cache(model, plan, noise, context, kwargs, threshold):
    """Block Cache unsharded as ComfyUI runs it (settings, ``sigmas`` and ``sample_sigmas`` in
    ``transformer_options``), the Euler loop the benchmark samples: the final latent, the 0-based
    steps it cached and its change measure at each step it measured."""
    sigmas = torch.linspace(1.0, 0.0, STEPS + 1)
    option = None if threshold is None else BlockCacheSettings(threshold=threshold, **SETTINGS).as_option()
    x, cached, measures = noise.clone(), [], {}
    for i in range(STEPS):
        options = {"sigmas": sigmas[i:i + 1], "sample_sigmas": sigmas}
        if option is not None:
            options[OPTION] = option
        block_cache.last_outcome()
        with cached_blocks(model, plan, options):
            out = model._forward(x, torch.full((x.shape[0],), float(sigmas[i])), context, **kwargs,
                                 transformer_options=options)
        outcome = block_cache.last_outcome()
        if outcome.get("cached"):
            cached.append(i)
        if outcome.get("measure") is not None:
            measures[i] = outcome["measure"]
        x = x + (sigmas[i + 1] - sigmas[i]) * out
    return x, cached, measures


def test_block_cache_caches_the_steps_cache_dits_dbcache_caches():
    """Uncached and at each threshold: the same cached steps and final latents within LATENT_TOL;
    the change measures within MEASURE_TOL of each other; the thresholds cache different steps, and
    a cached run is far (> 10 x LATENT_TOL) from the uncached one, so agreeing says something."""
    need_peers()
    shape = scenarios.FLUX_SMOKE
    theirs = peers.run_dbcache(shape, THRESHOLDS, STEPS, threads=1, rounds=1, fn=SETTINGS["front_blocks"],
                               bn=SETTINGS["back_blocks"], warmup=SETTINGS["warmup_steps"],
                               max_continuous=SETTINGS["max_cached_steps"], world=1)
    assert not theirs.get("failure"), theirs.get("failure")
    model, (noise, _, context), kwargs = scenarios.build_flux(shape, seed=0, batch=1, device="cpu")
    plan = find_plan(model)
    ours = {}
    with torch.inference_mode():
        for variant in theirs["world1"]["variants"]:
            threshold = variant["threshold"]
            latent, cached, measures = ours[threshold] = sample_block_cache(model, plan, noise, context, kwargs,
                                                                            threshold)
            err = (latent - variant["latent"]).abs().max().item()
            print(f"\nthreshold {threshold}: Block Cache cached {cached}, cache-dit {variant['cached_step_indices']}; "
                  f"latents {err:.1e} apart; measures {[round(m, 4) for m in measures.values()]} here, "
                  f"{[round(m, 4) for m in variant['residual_diffs'].values()]} in cache-dit")
            assert cached == variant["cached_step_indices"], (threshold, measures, variant["residual_diffs"])
            assert err <= LATENT_TOL, (threshold, err)
            for step, theirs_measure in variant["residual_diffs"].items():
                assert abs(measures[int(step)] - theirs_measure) <= MEASURE_TOL * theirs_measure, (step, measures)
    assert [ours[t][1] for t in (None, *THRESHOLDS)] == [[], [2, 3, 5], [2, 3, 4, 6, 7]]
    for threshold in THRESHOLDS:
        assert (ours[threshold][0] - ours[None][0]).abs().max().item() > 10 * LATENT_TOL
