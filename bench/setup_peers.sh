#!/usr/bin/env bash
# Installs what the peer benchmark (bench/peers.py) and the plots need into the host venv:
# diffusers 0.42.x, cache-dit 1.5.3, einops (cache-dit imports it without declaring it, and
# its planner registry hides the ImportError) and matplotlib.
#
#   bash bench/setup_peers.sh            # idempotent: does nothing when all is in place
#
# torch and torchvision are pinned on the same pip command line so that no peer's
# requirements can move them; afterwards the script checks that they did not move and that
# ComfyUI still imports.
set -euo pipefail

BENCH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$BENCH")"
VENV="${VENV:-$REPO/.host/venv}"
PY="$VENV/bin/python"
COMFYUI_PATH="${COMFYUI_PATH:-$REPO/.host/ComfyUI}"

TORCH_PIN="torch==2.14.1"
TORCHVISION_PIN="torchvision==0.29.1"
PEERS=("diffusers==0.42.1" "cache-dit==1.5.3" "einops" "matplotlib")

[ -x "$PY" ] || { echo "setup_peers: no venv python at $PY" >&2; exit 1; }

# Which of the wanted packages are missing or at another version (empty when all are in place).
missing() {
    "$PY" - "$@" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
from packaging.specifiers import SpecifierSet
for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        have = None
    # PEP 440 matching, so that a local tag (2.14.1+cu130) still satisfies ==2.14.1.
    if have is None or (want and not SpecifierSet("==" + want).contains(have, prereleases=True)):
        print(spec)
EOF
}

# Pins must hold before we start: if torch is already something else, installing the peers
# with these pins would replace it, which is not this script's business.
if [ -n "$(missing "$TORCH_PIN" "$TORCHVISION_PIN")" ]; then
    echo "setup_peers: the venv's torch/torchvision are not $TORCH_PIN / $TORCHVISION_PIN; not touching them" >&2
    "$PY" -c 'import torch, torchvision; print("have", torch.__version__, torchvision.__version__)' >&2 || true
    exit 1
fi

todo="$(missing "${PEERS[@]}")"
if [ -n "$todo" ]; then
    echo "setup_peers: installing $(echo $todo)" >&2
    "$PY" -m pip install --disable-pip-version-check "${PEERS[@]}" "$TORCH_PIN" "$TORCHVISION_PIN"
else
    echo "setup_peers: peers already installed" >&2
fi

# Check the result: versions, pins, and that ComfyUI and both peers still import.
left="$(missing "${PEERS[@]}" "$TORCH_PIN" "$TORCHVISION_PIN")"
[ -z "$left" ] || { echo "setup_peers: still not in place: $left" >&2; exit 1; }
COMFYUI_PATH="$COMFYUI_PATH" "$PY" - <<'EOF'
import os, sys
sys.path.insert(0, os.environ["COMFYUI_PATH"])
import comfy.options  # noqa: F401
import comfy.cli_args
comfy.cli_args.args.cpu = True
import comfy.ldm.flux.model  # noqa: F401
import comfy.utils  # noqa: F401
import torch, torchvision, diffusers, cache_dit, einops, matplotlib  # noqa: E401,F401
from importlib.metadata import version
print(f"setup_peers: ok: torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"diffusers {diffusers.__version__}, cache-dit {version('cache-dit')}, einops {einops.__version__}, "
      f"matplotlib {matplotlib.__version__}; ComfyUI imports", file=sys.stderr)
EOF
