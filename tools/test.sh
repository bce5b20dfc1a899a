#!/usr/bin/env bash
# Test suite: set up the ComfyUI host if needed, then run pytest in it. Without a test path among
# the arguments pytest runs the whole suite (pyproject's testpaths: tests/); with paths only those.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(python3 tools/host.py --browser --print-env)"
export COMFYUI_PATH
exec "$HOST_PYTHON" -m pytest "$@"
