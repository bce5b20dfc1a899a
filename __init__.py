"""ComfyUI Hybrid Parallel: run big diffusion models on several devices from ComfyUI.

Importing the pack is light: it registers the nodes and the status route and
starts no process; workers start on the first sharded sampling run.
"""
WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .nodes import HybridParallelExtension

    _register_routes()
    return HybridParallelExtension()


def _register_routes() -> None:
    try:
        from server import PromptServer
    except ImportError:  # imported outside ComfyUI (tests, tools)
        return
    if getattr(PromptServer, "instance", None) is None:
        return
    from .nodes.host import host_devices
    from .parallel_runtime.comfyui_glue.routes import register

    register(PromptServer.instance.routes, host_devices)


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
