#!/usr/bin/env bash
# On another host: serve ranks of a ComfyUI that runs elsewhere, until that ComfyUI ends.
#   PARALLEL_CLUSTER_KEY=<same key as ComfyUI's> bash tools/remote_worker.sh --rendezvous 10.0.0.1:29600 --name gpu-b
# Sets up this checkout's ComfyUI host first (same as the other commands), then runs the agent.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(python3 tools/host.py --print-env)"
export COMFYUI_PATH
exec "$HOST_PYTHON" -u -m parallel_runtime.world.agent "$@"
