#!/usr/bin/env bash
# Prepare .gpu/ (ignored by git) for tools/gpu_check.sh on a GPU box that cannot reach a package
# registry, such as the device tool's machines: a copy of the host's ComfyUI without models, tests,
# custom nodes or caches (about 25 MB), the wheels ComfyUI needs beyond that box's PyTorch image
# (Python 3.12, about 16 MB), and the import stubs for PyAV and the front-end package from
# ../shared/gpu/stubs (headless runs never touch video files or the web page). Carry .gpu along.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(python3 tools/host.py --print-env)"
rm -rf .gpu && mkdir -p .gpu/whl
tar -C "$COMFYUI_PATH" --exclude=./models --exclude='./tests*' --exclude=./custom_nodes --exclude='__pycache__' \
    --exclude=./user --exclude=./output --exclude=./input --exclude=./temp -cf - . | (mkdir -p .gpu/ComfyUI && tar -C .gpu/ComfyUI -xf -)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d .gpu/whl torchsde trampoline pydantic pydantic_core pydantic_settings python_dotenv typing_inspection \
    annotated_types alembic sqlalchemy mako greenlet kornia kornia_rs spandrel
cp -r ../shared/gpu/stubs .gpu/stubs
du -sh .gpu
