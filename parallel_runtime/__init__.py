"""The runtime behind the pack's nodes, in wings; each imports only the wings below it.

- ``config.py``: the parallel configuration that travels through the graph (pure Python).
- ``distributed/``: collectives on every backend, the rank mesh and its process groups.
- ``plans/``: declarations, one file per model family (what is split, gathered, cut).
- ``parallel/``: applying plans to one forward: context parallel, attention, CFG, TP hooks, VAE bands.
- ``weights/``: how a rank's weights are cut and travel (pickling, byte streams, quantized / GGUF).
- ``layout/``: ``layout: auto``, its cost model and the probe.
- ``world/``: rank 0's World, the worker processes, their protocol, watchdog and memory figures.
- ``comfyui_glue/``: where ComfyUI meets the runtime (wrappers, patcher, routes, first-step check).

docs/architecture.md draws it; tests/test_import_graph.py keeps the order.
"""
