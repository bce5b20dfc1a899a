"""``GET /parallel/status``: the mesh and, per rank, device, pid, liveness, weights, memory
and the last forward time. It shows nothing that ComfyUI's own /system_stats does not
already reveal about this machine (no paths, no keys, no prompt contents)."""
from __future__ import annotations

import asyncio

from .runtime import RUNTIME

ROUTE = "/parallel/status"


def register(routes) -> None:
    from aiohttp import web

    @routes.get(ROUTE)
    async def parallel_status(request):
        # psutil reads /proc/<pid>/smaps for PSS: keep it off the event loop.
        status = await asyncio.get_running_loop().run_in_executor(None, RUNTIME.status)
        return web.json_response(status)
