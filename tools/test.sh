#!/usr/bin/env bash
# Test suite: set up the ComfyUI host if needed, then run pytest in it. Without a test path among
# the arguments pytest runs the whole suite (pyproject's testpaths: tests/); with paths only those.
# Where the host has pytest-xdist and the machine has the cores and memory (tools/test_workers.py),
# the tests run in that many pytest workers; `-n <k>` among the arguments, or
# PARALLEL_TEST_WORKERS=1, decides instead.
set -euo pipefail
cd "$(dirname "$0")/.."
# In two steps: a failed set-up (say, the peers' packages would not install) stops here with its
# message; eval of a failed command substitution would go on.
host_env="$(python3 tools/host.py --browser --print-env)"
eval "$host_env"
export COMFYUI_PATH
workers=()
case " $* " in
    *" -n "* | *" --numprocesses"* | *" -n"[0-9]* | *"no:xdist"*) ;;
    *)
        n=$(python3 tools/test_workers.py)
        if [ "$n" -gt 1 ] && "$HOST_PYTHON" -c "import xdist" 2>/dev/null; then
            workers=(-n "$n" --dist worksteal)
        fi
        ;;
esac
exec "$HOST_PYTHON" -m pytest ${workers[@]+"${workers[@]}"} "$@"
