#!/usr/bin/env bash
# What the peer benchmark (bench/peers.py) and the plots need, in the host venv: the peers' packages
# (bench/peer_packages.py: diffusers, cache-dit, einops), which tools/host.py installs with every
# test host anyway, and matplotlib for bench/plots.py (--plots). Both are installed with everything
# already in the venv held at its version (torch, transformers, what ComfyUI needs), and ComfyUI must
# still import afterwards; a failure stops here.
#
#   bash bench/setup_peers.sh            # idempotent: quick when all is in place
#   PARALLEL_COMFYUI_VERSION=0.33.0 bash bench/setup_peers.sh    # the other host (tools/host.py's environment)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec python3 tools/host.py --plots
