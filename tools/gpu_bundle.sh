#!/usr/bin/env bash
# Prepare .gpu/ (ignored by git) for tools/gpu_check.sh on a GPU box that cannot reach a package
# registry, such as the device tool's machines (Python 3.12, a PyTorch 2.11 + CUDA image, at most
# 64 MiB carried with the project). Run it where the registry is reachable; carry .gpu along.
#
#   .gpu/ComfyUI-0.3.75.tar.xz, .gpu/ComfyUI-0.33.0.tar.xz  both test hosts' ComfyUI (tools/host.py sets
#       them up here), without models, tests, custom nodes, caches or git data; xz, since the trees
#       (37 + 24 MB, mostly tokenizer files and source) would not fit the carry limit beside the wheels
#   .gpu/whl/             the wheels both releases need beyond that image, for CPython 3.12 manylinux,
#       at the versions the hosts here run (one version of each)
#   .gpu/whl-if-missing/  torchaudio matching the image's torch (0.33 imports it unconditionally):
#       installed only where the image lacks it
#   .gpu/stubs/           ../shared/gpu/stubs: import stand-ins for PyAV and the front-end package
#       (headless runs never touch video files or the web page)
#
# Left out on purpose: comfy-kitchen's CUDA and HIP kernels (its manylinux wheel is 58 MB; the pure
# Python wheel runs its eager and Triton back-ends, the check's models are bf16); the front-end,
# workflow-template and embedded-docs packages (ComfyUI logs their absence and serves no page);
# PyOpenGL and comfy-angle (only 0.33's GLSL node); PyAV (stubbed); ComfyUI-GGUF (the check loads
# no GGUF file). Prints the folder's size and checks project + folder against the carry limit.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSIONS=(0.3.75 0.33.0)
TORCH_VERSION="${GPU_TORCH_VERSION:-2.11.0}"  # the device image's torch; torchaudio must match it
PYTHON_VERSION="${GPU_PYTHON_VERSION:-3.12}"  # the device image's Python (wheels for CPython of this version)
CARRY_LIMIT=$((64 * 1024 * 1024))
# Both releases (0.3.75's list; 0.33 adds comfy-aimdo, comfy-kitchen, simpleeval, blake3), with the
# packages they pull in that the image lacks. The image has numpy, einops, transformers, tokenizers,
# sentencepiece, safetensors, aiohttp, yarl, pyyaml, pillow, scipy, tqdm, psutil, filelock, requests,
# markupsafe, packaging, typing-extensions (see the device's KINDS.md).
WHEELS=(torchsde trampoline pydantic pydantic_core pydantic_settings python_dotenv typing_inspection annotated_types
        alembic sqlalchemy mako greenlet kornia kornia_rs spandrel comfy_aimdo simpleeval blake3)
PURE_WHEELS=(comfy_kitchen)  # the py3-none-any wheel, not the one with CUDA kernels
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux2010_x86_64
           --platform manylinux_2_12_x86_64 --platform manylinux1_x86_64)
download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp "$@" 2>&1 |
        grep -v "^WARNING: Location" || true
}

rm -rf .gpu && mkdir -p .gpu/whl .gpu/whl-if-missing
declare -A pins=()
for version in "${VERSIONS[@]}"; do
    eval "$(PARALLEL_COMFYUI_VERSION="$version" python3 tools/host.py --print-env)"
    echo "[gpu_bundle] ComfyUI $version from $COMFYUI_PATH" >&2
    tar -C "$COMFYUI_PATH" --exclude=./models --exclude='./tests*' --exclude=./custom_nodes --exclude='__pycache__' \
        --exclude=./user --exclude=./output --exclude=./input --exclude=./temp --exclude=./.git --exclude=./.github \
        --exclude='*.pyc' -cf - . | xz -T2 -6 >".gpu/ComfyUI-$version.tar.xz"
    # The versions this host runs here (the newer release's win where both have one).
    while read -r name ver; do
        pins[$name]="$ver"
    done < <("$HOST_PYTHON" - "${WHEELS[@]}" "${PURE_WHEELS[@]}" <<'EOF'
import importlib.metadata as m, sys
for name in sys.argv[1:]:
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        pass
EOF
)
done
spec() { echo "$1${pins[$1]:+==${pins[$1]}}"; }
download "${PLATFORMS[@]}" -d .gpu/whl $(for n in "${WHEELS[@]}"; do spec "$n"; done)
download --platform any -d .gpu/whl $(for n in "${PURE_WHEELS[@]}"; do spec "$n"; done)
download "${PLATFORMS[@]}" -d .gpu/whl-if-missing "torchaudio==$TORCH_VERSION"
cp -r ../shared/gpu/stubs .gpu/stubs && chmod -R u+w .gpu/stubs

# Every wheel named, one version of each (two would stop the install there).
missing=()
for n in "${WHEELS[@]}" "${PURE_WHEELS[@]}"; do
    ls .gpu/whl/ | grep -qi "^${n//_/[-_]}-" || missing+=("$n")
done
ls .gpu/whl-if-missing/ | grep -q '^torchaudio-' || missing+=(torchaudio)
if [ ${#missing[@]} -gt 0 ]; then
    echo "[gpu_bundle] no wheel for: ${missing[*]}" >&2
    exit 1
fi
dupes="$(ls .gpu/whl | cut -d- -f1 | tr A-Z a-z | sort | uniq -d)"
[ -z "$dupes" ] || { echo "[gpu_bundle] two versions of: $dupes" >&2; exit 1; }

bundle=$(du -sb .gpu | cut -f1)
project=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
total=$((bundle + project + ${untracked:-0}))
ls -l .gpu .gpu/whl .gpu/whl-if-missing | sed 's/^/[gpu_bundle] /' >&2
echo "[gpu_bundle] .gpu: $bundle bytes ($((bundle / 1048576)) MiB); project ${project} + untracked ${untracked:-0} bytes;" \
     "together $((total / 1048576)) MiB of the ${CARRY_LIMIT} bytes (64 MiB) a device call carries"
if [ "$total" -ge "$CARRY_LIMIT" ]; then
    echo "[gpu_bundle] over the carry limit" >&2
    exit 1
fi
du -sh .gpu
