"""Shard VAE: VAE + PARALLEL_CONFIG -> VAE whose decode and encode run on every rank.

Each rank decodes (or encodes) a band of rows; convolutions exchange halo rows with the
neighbouring bands, GroupNorm statistics are summed over all ranks and the mid-block attention
gathers what it needs, so the result equals the untiled single-device decode (unlike tiled
decoding). Works with the stock VAEDecode / VAEEncode and their tiled variants.
"""
from __future__ import annotations

import copy

from comfy_api.latest import io

from ..parallel_runtime.comfyui_glue.patcher import Sharding, sharded_patcher
from ..parallel_runtime.comfyui_glue.wrappers import ShardedFirstStage
from ..parallel_runtime.config import ConfigError, HostDevices, ParallelConfig, config_from_inputs
from ..parallel_runtime.world.runtime import RUNTIME
from ..parallel_runtime.plans import check_vae
from .host import host_devices
from .parallel_config import ParallelConfigType

NODE = "Shard VAE"


def transformer_world_sizes(prompt: dict | None, host: HostDevices) -> set[int]:
    """World sizes of the Parallel Configs that feed Shard Transformer nodes in this prompt
    (checked before anything runs: the VAE decodes after sampling, on the ranks still up).
    Each is the config Parallel Config builds of its inputs (layout auto included), so its world
    size is the node's own; a config with linked or refused inputs is left to that node."""
    sizes = set()
    for node in (prompt or {}).values():
        if node.get("class_type") != "ShardTransformer":
            continue
        link = node.get("inputs", {}).get("parallel_config")
        config = prompt.get(str(link[0])) if isinstance(link, list) else None
        if not config or config.get("class_type") != "ParallelConfig":
            continue
        try:
            built = config_from_inputs(config.get("inputs", {}), host)
        except ConfigError:
            continue  # Parallel Config refuses it itself, with its own message
        if built is not None:
            sizes.add(built.world_size)
    return sizes


def check_same_world(parallel_config: ParallelConfig, prompt: dict | None, host: HostDevices) -> None:
    """Refuses a Parallel Config whose world size differs from Shard Transformer's in this prompt."""
    others = transformer_world_sizes(prompt, host)
    if others and parallel_config.world_size not in others:
        raise ConfigError(f"{NODE}: its Parallel Config makes a world of size {parallel_config.world_size}, the "
                          f"Shard Transformer of this workflow one of size {', '.join(map(str, sorted(others)))}: "
                          "every change of world size restarts all ranks (and reloads the transformer); give "
                          "Shard VAE the same Parallel Config as Shard Transformer")


class ShardVAENode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ShardVAE",
            display_name="Shard VAE",
            category="parallel",
            description="Decodes and encodes on every rank of the Parallel Config, each rank a band of rows, with "
                        "the exact untiled result (halo exchange, shared GroupNorm statistics). KL autoencoders "
                        "(SD, SDXL, SD3, Flux.1, Flux.2), the HunyuanVideo VAE, the HunyuanImage 2.1 32x VAE, the "
                        "HunyuanVideo 1.5 VAE (also the HunyuanImage 2.1 refiner's), the Wan 2.1 VAE (also "
                        "Qwen-Image), the Wan 2.2 VAE and the LTX-2 video VAE (also LTXV 0.9.0).",
            inputs=[io.Vae.Input("vae"), ParallelConfigType.Input("parallel_config")],
            outputs=[io.Vae.Output()],
            hidden=[io.Hidden.prompt],
        )

    @classmethod
    def execute(cls, vae, parallel_config: ParallelConfig) -> io.NodeOutput:
        if not isinstance(parallel_config, ParallelConfig):
            raise ConfigError(f"{NODE}: parallel_config must come from a Parallel Config node")
        try:
            plan = check_vae(vae.first_stage_model)
        except ValueError as exc:
            raise ConfigError(f"{NODE}: {exc}") from exc
        check_same_world(parallel_config, cls.hidden.prompt, host_devices())
        if parallel_config.world_size == 1:
            return io.NodeOutput(vae)
        import comfy.model_management

        sharded = copy.copy(vae)  # ComfyUI's VAE has no clone(); the copy shares the weights
        # Its own patcher: ComfyUI loads and unloads the VAE through it, and an unload frees every rank.
        sharded.patcher = sharded_patcher(vae.patcher, Sharding(
            paths=("",), keep_off_device=False, model_bytes=comfy.model_management.module_size(vae.first_stage_model),
            release=RUNTIME.release))
        # The module the patcher holds: under ComfyUI 0.33's dynamic VRAM that is the plain
        # delegate's own copy, not ``vae.first_stage_model`` (which carries comfy-aimdo's ctypes
        # state and cannot be sent to the other ranks).
        sharded.first_stage_model = ShardedFirstStage(sharded.patcher.model, parallel_config, plan.family)
        return io.NodeOutput(sharded)
