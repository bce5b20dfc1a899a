"""HTTP routes next to ComfyUI's own.

- ``GET /parallel/status``: the mesh and, per rank, device, pid, liveness, weights,
  memory and the last forward time. It shows nothing that ComfyUI's own
  /system_stats does not already reveal about this machine (no paths, no keys, no
  prompt contents).
- ``POST /parallel/validate``: what Parallel Config would say about these inputs
  (the front end shows it on the node before the prompt is queued).
"""
from __future__ import annotations

import asyncio

from .runtime import RUNTIME

STATUS_ROUTE = "/parallel/status"
VALIDATE_ROUTE = "/parallel/validate"
SIZE_INPUTS = ("ulysses_size", "ring_size", "tp_size", "cfg_size")


def validate(values: dict, host) -> dict:
    """{ok, world_size, devices, message} for Parallel Config inputs."""
    from .config import ConfigError, build_config

    inputs = {}
    for name in SIZE_INPUTS:
        try:
            inputs[name] = int(values.get(name, 1))
        except (TypeError, ValueError):
            return {"ok": False, "world_size": None, "message": f"Parallel Config: {name}={values.get(name)!r} is not "
                                                                 "a whole number"}
    inputs["devices"] = str(values.get("devices", "auto"))
    inputs["backend"] = str(values.get("backend", "auto"))
    inputs["hosts"] = str(values.get("hosts") or "")
    inputs["rendezvous"] = str(values.get("rendezvous") or "")
    try:
        config = build_config(**inputs, host=host)
    except ConfigError as exc:
        world = 1
        for name in SIZE_INPUTS:
            world *= max(inputs[name], 0)
        return {"ok": False, "world_size": world, "message": str(exc)}
    return {"ok": True, "world_size": config.world_size, "devices": list(config.devices), "backend": config.backend,
            "message": f"world size {config.world_size}: {config.describe()}"}


def register(routes, host_devices) -> None:
    from aiohttp import web

    @routes.get(STATUS_ROUTE)
    async def parallel_status(request):
        # psutil reads /proc/<pid>/smaps for PSS: keep it off the event loop.
        status = await asyncio.get_running_loop().run_in_executor(None, RUNTIME.status)
        return web.json_response(status)

    @routes.post(VALIDATE_ROUTE)
    async def parallel_validate(request):
        try:
            values = await request.json()
        except ValueError:
            return web.json_response({"ok": False, "message": "expected a JSON object"}, status=400)
        if not isinstance(values, dict):
            return web.json_response({"ok": False, "message": "expected a JSON object"}, status=400)
        return web.json_response(validate(values, host_devices()))
