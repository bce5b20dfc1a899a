"""The peers' packages: cache-dit's DBCache and diffusers' Flux, for the test that compares Block Cache
with an independent implementation (tests/test_block_cache_dbcache.py) and for the peer benchmark
(bench/peers.py). This is the one list of their pins: tools/host.py installs them into every test host
it sets up, holding everything already installed there at its version (bench/setup_peers.sh runs
tools/host.py). Standard library only: tools/host.py imports it before any venv exists.
"""
from __future__ import annotations

REQUIREMENTS = [
    "diffusers==0.42.1",
    "cache-dit==1.5.3",
    # cache-dit imports einops without declaring it (its planner registry hides the ImportError);
    # ComfyUI requires it too, so the host's version stays.
    "einops",
]
# What the comparison takes from them (diffusers loads its models lazily: importing the package alone
# would not find a broken one); "module:name".
ENTRY_POINTS = ["diffusers:FluxTransformer2DModel", "cache_dit:DBCacheConfig"]
# 1: the host is set up without them and the tests that need them skip (CI never sets it).
NO_PEERS_ENV = "PARALLEL_NO_PEERS"


def distribution_name(requirement: str) -> str:
    """The distribution name of a requirement line, normalized (PEP 503)."""
    name = requirement
    for sign in "<>=!~[; ":
        name = name.split(sign, 1)[0]
    return name.strip().lower().replace("_", "-").replace(".", "-")


def module_name(requirement: str) -> str:
    """The module a requirement's package is imported as (true of the packages listed here)."""
    return distribution_name(requirement).replace("-", "_")
