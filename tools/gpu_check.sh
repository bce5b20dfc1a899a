#!/usr/bin/env bash
# GPU check: a real ComfyUI on this machine's GPU, several ranks sharing it (test-only switch
# PARALLEL_SHARE_DEVICE=1), in parts that each take under 8 minutes on an H100 (one command of a
# lent GPU machine): tools/gpu_check.py says what, docs/gpu_check.md how.
#
#   bash tools/gpu_check.sh [--host 0.3.75|0.33.0] --part tiny|tiny-no-cuda-malloc|big|features|compile|1-5|all [...]
#   bash tools/gpu_check.sh --list
#
# Which ComfyUI: COMFYUI_PATH (with HOST_PYTHON or python3) if set; else the bundle in .gpu/ that
# tools/gpu_bundle.sh prepares for a GPU box without network (its python3 must hold a CUDA torch),
# for the release --host (or PARALLEL_COMFYUI_VERSION) names, 0.3.75 by default; else the host
# tools/host.py sets up (downloads torch, so it needs the network).
set -euo pipefail
cd "$(dirname "$0")/.."
version="${PARALLEL_COMFYUI_VERSION:-0.3.75}"
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --host) version="$2"; shift 2 ;;
        --host=*) version="${1#--host=}"; shift ;;
        --list|-h|--help) exec python3 tools/gpu_check.py "$1" ;;  # needs no ComfyUI
        *) args+=("$1"); shift ;;
    esac
done
case "$version" in 0.3.75|0.33.0) ;; *) echo "gpu_check.sh: --host must be 0.3.75 or 0.33.0, not $version" >&2; exit 2 ;; esac
export PARALLEL_COMFYUI_VERSION="$version"

if [ -n "${COMFYUI_PATH:-}" ]; then
    HOST_PYTHON="${HOST_PYTHON:-${COMFYUI_PYTHON:-python3}}"
elif [ -f ".gpu/ComfyUI-$version.tar.xz" ]; then
    # The wheels ComfyUI needs beyond the box's PyTorch image, once per machine (the stamp names the
    # bundle's wheels); whl-if-missing/ only for what the image lacks (torchaudio matching its torch).
    site=/tmp/hybrid-parallel-gpu-site
    stamp="$(cd .gpu && ls whl whl-if-missing | md5sum | cut -c1-32)"
    if [ "$(cat "$site/.bundle" 2>/dev/null)" != "$stamp" ]; then
        rm -rf "$site"
        wheels=(.gpu/whl/*.whl)
        for w in .gpu/whl-if-missing/*.whl; do
            [ -e "$w" ] || continue
            dist="$(basename "$w" | cut -d- -f1)"
            python3 -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" 2>/dev/null || wheels+=("$w")
        done
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}"
        echo "$stamp" >"$site/.bundle"
    fi
    export PYTHONPATH="$site:$PWD/.gpu/stubs${PYTHONPATH:+:$PYTHONPATH}"
    # ComfyUI writes next to itself (caches, user settings): a fresh copy each run.
    export COMFYUI_PATH="/tmp/hybrid-parallel-gpu-comfyui-$version"
    rm -rf "$COMFYUI_PATH" && mkdir -p "$COMFYUI_PATH"
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
        ".gpu/ComfyUI-$version.tar.xz" "$COMFYUI_PATH"
    HOST_PYTHON=python3
else
    eval "$(python3 tools/host.py --print-env)"
    export COMFYUI_PATH
fi
exec "$HOST_PYTHON" -u tools/gpu_check.py "${args[@]}"
