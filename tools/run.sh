#!/usr/bin/env bash
# Run a command with the host's interpreter, e.g. tools/run.sh python bench/run.py quick out.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(python3 tools/host.py --print-env)"
export COMFYUI_PATH
if [ "${1:-}" = "python" ]; then shift; exec "$HOST_PYTHON" "$@"; fi
exec "$@"
