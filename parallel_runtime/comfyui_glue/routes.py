"""HTTP routes next to ComfyUI's own.

- ``GET /parallel/status``: the mesh and, per rank, device, pid, liveness, weights,
  memory and the last forward time. It shows nothing that ComfyUI's own
  /system_stats does not already reveal about this machine (no paths, no keys, no
  prompt contents). Memory figures are read from /proc at most every
  ``memory.MEMORY_MAX_AGE_S`` per process, however often the route is polled.
- ``POST /parallel/validate``: what Parallel Config would say about these inputs
  (the front end shows it on the node before the prompt is queued): 200 with ``ok`` true or
  false for values the node's widgets can hold; 400 with ``ok`` false and a short message for a
  body that is not a JSON object of such values (not JSON, over ``BODY_MAX`` bytes, a value of
  a type no input takes, a size beyond its widget's range, a number that is not finite, a text
  too long or with control characters). Every answer is bounded: the message stays under
  ``config.MESSAGE_MAX`` characters and nothing is built from a size before it is bounded.
"""
from __future__ import annotations

import asyncio
import json

from ..config import CONFIG_INPUTS, ConfigError, InputError, config_from_inputs, read_inputs, world_size_of
from ..world.runtime import RUNTIME

STATUS_ROUTE = "/parallel/status"
VALIDATE_ROUTE = "/parallel/validate"
BODY_MAX = 128 * 1024  # bytes of a validate request: six inputs of at most config.TEXT_MAX characters


def _world_size(values: dict) -> int | None:
    """The product of the sizes where they are all whole numbers (also when the config is refused)."""
    try:
        inputs = read_inputs(values)
    except ConfigError:
        return None
    if inputs is None:
        return None
    sizes = [inputs[spec.name] for spec in CONFIG_INPUTS if spec.kind == "int"]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
        return world_size_of(max(v, 0) for v in sizes)
    return None


def validate(values: dict, host) -> dict:
    """{ok, world_size, devices, message} for Parallel Config inputs: the config the node would
    build of the same values (``config.config_from_inputs``), so the canvas refuses exactly what the
    node refuses, with the same message. Every input of ``config.CONFIG_INPUTS`` counts (missing ones at their defaults);
    a null value is an input linked from another node. ``malformed``: the refusal is of a value no
    widget can hold (``config.InputError``)."""
    try:
        config = config_from_inputs(values, host)
    except ConfigError as exc:
        return {"ok": False, "world_size": _world_size(values), "message": str(exc),
                "malformed": isinstance(exc, InputError)}
    if config is None:
        return {"ok": True, "world_size": None,
                "message": "an input comes from another node: checked when the prompt runs"}
    return {"ok": True, "world_size": config.world_size, "devices": list(config.devices), "backend": config.backend,
            "message": f"world size {config.world_size}: {config.describe()}"}


def parse_body(raw: bytes) -> tuple[dict | None, str | None]:
    """The validate route's body as a dict of input values, or why it is not one."""
    if len(raw) > BODY_MAX:
        return None, f"the request body is over {BODY_MAX} bytes; Parallel Config's inputs fit in far less"
    try:
        values = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, "expected a JSON object of Parallel Config's input values"
    if not isinstance(values, dict):
        return None, "expected a JSON object of Parallel Config's input values"
    names = {spec.name for spec in CONFIG_INPUTS}
    for name, value in values.items():
        if name in names and isinstance(value, (list, dict)):
            return None, f"Parallel Config: {name} is a JSON {type(value).__name__}; give a number or a text"
    return values, None


def register(routes, host_devices) -> None:
    from aiohttp import web  # ComfyUI's server: only there

    @routes.get(STATUS_ROUTE)
    async def parallel_status(request):
        # psutil reads /proc/<pid>/smaps for PSS: keep it off the event loop.
        status = await asyncio.get_running_loop().run_in_executor(None, RUNTIME.status)
        return web.json_response(status)

    @routes.post(VALIDATE_ROUTE)
    async def parallel_validate(request):
        values, problem = parse_body(await request.content.read(BODY_MAX + 1))
        if problem:
            return web.json_response({"ok": False, "world_size": None, "message": problem, "malformed": True},
                                     status=400)
        result = validate(values, host_devices())
        return web.json_response(result, status=400 if result.get("malformed") else 200)
