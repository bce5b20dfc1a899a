"""Start a real headless ComfyUI with this pack and talk to its HTTP API (stdlib only).

Used by the demo, the tests and the headless client. The server gets its own
base directory (models, input, output, user, custom_nodes), so runs never touch
each other's files, and listens on loopback only.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACK_NAME = "comfyui-hybrid-parallel"


class PromptRejected(RuntimeError):
    """POST /prompt answered 400: the prompt failed validation."""

    def __init__(self, body: dict):
        self.body = body
        super().__init__(format_rejection(body))


class PromptFailed(RuntimeError):
    """The prompt ran and ended in an error."""

    def __init__(self, prompt_id: str, status: dict):
        self.prompt_id = prompt_id
        self.status = status
        self.error = next((m[1] for m in status.get("messages", []) if m[0] == "execution_error"), {})
        super().__init__(f"prompt {prompt_id} failed in node {self.error.get('node_type')} "
                         f"#{self.error.get('node_id')}: {self.error.get('exception_message', status)}")


def format_rejection(body: dict) -> str:
    lines = [body.get("error", {}).get("message", "prompt rejected")]
    for node_id, info in (body.get("node_errors") or {}).items():
        for err in info.get("errors", []):
            lines.append(f"  node #{node_id} {info.get('class_type')}: {err.get('message')}: {err.get('details')}")
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_base_dir(base_dir: Path, extra_custom_nodes=()) -> Path:
    """A ComfyUI base directory whose custom_nodes holds a link to this checkout (and to any
    ``extra_custom_nodes`` folders, such as the tests' own extension)."""
    base_dir = Path(base_dir)
    for sub in ("models", "input", "output", "user", "custom_nodes", "temp"):
        (base_dir / sub).mkdir(parents=True, exist_ok=True)
    for name, target in [(PACK_NAME, REPO), *((Path(p).name, Path(p)) for p in extra_custom_nodes)]:
        link = base_dir / "custom_nodes" / name
        if not link.exists():
            link.symlink_to(Path(target).resolve(), target_is_directory=True)
    return base_dir


class ComfyServer:
    def __init__(self, comfyui_path: str | Path, base_dir: str | Path, python: str = sys.executable,
                 port: int | None = None, extra_args=(), env: dict | None = None, log_path: Path | None = None,
                 extra_custom_nodes=(), cpu: bool = True):
        self.comfyui_path = Path(comfyui_path)
        self.base_dir = prepare_base_dir(Path(base_dir), extra_custom_nodes)
        self.python = python
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.cpu = cpu  # False: ComfyUI computes on its GPU
        self.env = env
        self.log_path = Path(log_path) if log_path else self.base_dir / "comfyui.log"
        self.proc: subprocess.Popen | None = None
        self.client_id = uuid.uuid4().hex

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 180) -> "ComfyServer":
        cmd = [self.python, "-u", str(self.comfyui_path / "main.py"), *(["--cpu"] if self.cpu else []), "--listen",
               "127.0.0.1", "--port", str(self.port), "--base-directory", str(self.base_dir), *self.extra_args]
        env = dict(os.environ, **(self.env or {}))
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, cwd=self.comfyui_path, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with code {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                self.get("/system_stats", timeout=2)
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"ComfyUI did not answer within {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 20) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ------------------------------------------------------------- HTTP
    def get(self, path: str, timeout: float = 30):
        with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
            return json.loads(resp.read() or b"null")

    def post(self, path: str, payload=None, timeout: float = 30):
        data = json.dumps({} if payload is None else payload).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
            return json.loads(body) if body else None

    def object_info(self) -> dict:
        return self.get("/object_info", timeout=60)

    def queue(self, prompt: dict) -> str:
        try:
            answer = self.post("/prompt", {"prompt": prompt, "client_id": self.client_id})
        except urllib.error.HTTPError as err:
            body = err.read()
            try:
                parsed = json.loads(body)
            except ValueError:
                raise RuntimeError(f"POST /prompt failed with {err.code}: {body[:500]!r}") from err
            raise PromptRejected(parsed) from err
        return answer["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 600, poll: float = 0.2) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            history = self.get(f"/history/{prompt_id}")
            entry = history.get(prompt_id) if history else None
            if entry and entry.get("status", {}).get("completed") is not None:
                status = entry["status"]
                if status.get("status_str") == "error":
                    raise PromptFailed(prompt_id, status)
                if status.get("completed"):
                    return entry
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with code {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(poll)
        raise TimeoutError(f"prompt {prompt_id} did not finish within {timeout:.0f}s:\n{self.log_tail()}")

    def run(self, prompt: dict, timeout: float = 600) -> dict:
        return self.wait(self.queue(prompt), timeout)

    def interrupt(self) -> None:
        self.post("/interrupt")

    def outputs(self, entry: dict, kind: str = "images") -> list[Path]:
        """Files a finished prompt wrote, from its history entry."""
        found = []
        for node_out in entry.get("outputs", {}).values():
            for item in node_out.get(kind, []):
                folder = {"output": "output", "temp": "temp", "input": "input"}[item.get("type", "output")]
                found.append(self.base_dir / folder / item.get("subfolder", "") / item["filename"])
        return found
