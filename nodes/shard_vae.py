"""Shard VAE: VAE + PARALLEL_CONFIG -> VAE whose decode and encode run on every rank.

Each rank decodes (or encodes) a band of rows; convolutions exchange halo rows with the
neighbouring bands, GroupNorm statistics are summed over all ranks and the mid-block attention
gathers what it needs, so the result equals the untiled single-device decode (unlike tiled
decoding). Works with the stock VAEDecode / VAEEncode and their tiled variants.
"""
from __future__ import annotations

import copy

from comfy_api.latest import io

from ..parallel_runtime.comfy_wrappers import ShardedFirstStage
from ..parallel_runtime.config import ConfigError, ParallelConfig
from ..parallel_runtime.runtime import RUNTIME
from ..parallel_runtime.vae_parallel import check_vae
from .parallel_config import ParallelConfigType

NODE = "Shard VAE"


class ShardVAENode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ShardVAE",
            display_name="Shard VAE",
            category="parallel",
            description="Decodes and encodes on every rank of the Parallel Config, each rank a band of rows, with "
                        "the exact untiled result (halo exchange, shared GroupNorm statistics). KL autoencoders "
                        "(SD, SDXL, SD3, Flux.1, Flux.2), the Wan 2.1 VAE (also Qwen-Image) and the Wan 2.2 VAE.",
            inputs=[io.Vae.Input("vae"), ParallelConfigType.Input("parallel_config")],
            outputs=[io.Vae.Output()],
        )

    @classmethod
    def execute(cls, vae, parallel_config: ParallelConfig) -> io.NodeOutput:
        if not isinstance(parallel_config, ParallelConfig):
            raise ConfigError(f"{NODE}: parallel_config must come from a Parallel Config node")
        try:
            plan = check_vae(vae.first_stage_model)
        except ValueError as exc:
            raise ConfigError(f"{NODE}: {exc}") from exc
        live = RUNTIME.world
        if live is not None and live.state == "ready" and live.config.world_size != parallel_config.world_size:
            raise ConfigError(f"{NODE}: the ranks running now form a world of size {live.config.world_size} "
                              f"({live.config.describe()}), this Parallel Config asks for "
                              f"{parallel_config.world_size}; give Shard VAE the same Parallel Config as Shard "
                              "Transformer")
        if parallel_config.world_size == 1:
            return io.NodeOutput(vae)
        sharded = copy.copy(vae)  # ComfyUI's VAE has no clone(); the copy shares the weights and the patcher
        sharded.first_stage_model = ShardedFirstStage(vae.first_stage_model, parallel_config, plan.family)
        return io.NodeOutput(sharded)
