#!/usr/bin/env bash
# Test suite: set up the ComfyUI host if needed, then run pytest in it.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(python3 tools/host.py --browser --print-env)"
export COMFYUI_PATH
exec "$HOST_PYTHON" -m pytest tests "$@"
