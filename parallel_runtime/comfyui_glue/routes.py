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

from ..config import CONFIG_INPUTS, ConfigError, config_from_inputs, read_inputs, world_size_of
from ..world.runtime import RUNTIME

STATUS_ROUTE = "/parallel/status"
VALIDATE_ROUTE = "/parallel/validate"


def validate(values: dict, host) -> dict:
    """{ok, world_size, devices, message} for Parallel Config inputs: the config the node would
    build of the same values (``config.config_from_inputs``), so the canvas refuses exactly what
    the node refuses, with the same message. Every input of ``config.CONFIG_INPUTS`` counts
    (missing ones at their defaults); a null value is an input linked from another node."""
    try:
        config = config_from_inputs(values, host)
    except ConfigError as exc:
        inputs = read_inputs(values)
        sizes = [inputs[spec.name] for spec in CONFIG_INPUTS if spec.kind == "int"]
        valid = all(isinstance(v, int) and not isinstance(v, bool) for v in sizes)
        return {"ok": False, "world_size": world_size_of(max(v, 0) for v in sizes) if valid else None,
                "message": str(exc)}
    if config is None:
        return {"ok": True, "world_size": None,
                "message": "an input comes from another node: checked when the prompt runs"}
    return {"ok": True, "world_size": config.world_size, "devices": list(config.devices), "backend": config.backend,
            "message": f"world size {config.world_size}: {config.describe()}"}


def register(routes, host_devices) -> None:
    from aiohttp import web  # ComfyUI's server: only there

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
