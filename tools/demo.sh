#!/usr/bin/env bash
# Main job: set up the ComfyUI host if needed, then run the bundled tiny workflow at world size 1 and 2.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(python3 tools/host.py --print-env)"
exec "$HOST_PYTHON" tools/demo.py "$@"
