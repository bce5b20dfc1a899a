"""Where ComfyUI meets the runtime: the wrappers on its ModelPatcher, the sharded patchers, Cancel, the routes, the first-step check.

Not named ``comfy``: that is ComfyUI's own package."""
