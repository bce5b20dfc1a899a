#!/usr/bin/env bash
# GPU check: a real ComfyUI on this machine's GPU, several ranks sharing it (test-only switch
# PARALLEL_SHARE_DEVICE=1), every case against its unsharded twin, then a Flux.1-dev-sized model
# (tools/gpu_check.py says what and how). Needs Linux and an NVIDIA GPU; under 10 minutes on an H100.
#
# Which ComfyUI: COMFYUI_PATH (with COMFYUI_PYTHON) if set; else the bundle in .gpu/ that
# tools/gpu_bundle.sh prepares for a GPU box without network (its python3 must hold a CUDA torch);
# else the host tools/host.py sets up (downloads torch, so it needs the network).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${COMFYUI_PATH:-}" ] && [ -d .gpu/ComfyUI ]; then
    site=/tmp/hybrid-parallel-gpu-site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gpu/whl/*.whl
    export PYTHONPATH="$site:$PWD/.gpu/stubs${PYTHONPATH:+:$PYTHONPATH}"
    # ComfyUI writes next to itself (caches, user settings): run a copy.
    rm -rf /tmp/hybrid-parallel-gpu-comfyui && cp -r .gpu/ComfyUI /tmp/hybrid-parallel-gpu-comfyui
    export COMFYUI_PATH=/tmp/hybrid-parallel-gpu-comfyui
    HOST_PYTHON=python3
else
    eval "$(python3 tools/host.py --print-env)"
    export COMFYUI_PATH
fi
exec "$HOST_PYTHON" -u tools/gpu_check.py "$@"
