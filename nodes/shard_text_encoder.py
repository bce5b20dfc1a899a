"""Shard Text Encoder: CLIP + PARALLEL_CONFIG -> CLIP whose big encoder runs on every rank.

The large encoder of the CLIP (T5-XXL, UMT5-XXL, Mistral 3, Qwen2.5-VL, Qwen3, Gemma)
is tensor-parallel over all ranks of the world; small encoders next to it (CLIP-L,
CLIP-G) stay on rank 0. Its full weights stay where ComfyUI offloads them: each rank
receives only its slice, cut one weight at a time. The conditioning comes back to
rank 0 for the stock CLIPTextEncode and the model-specific encode nodes.
"""
from __future__ import annotations

from comfy_api.latest import io

from ..parallel_runtime.comfyui_glue.patcher import Sharding, sharded_patcher
from ..parallel_runtime.comfyui_glue.wrappers import ShardedEncoderForward
from ..parallel_runtime.config import ConfigError, ParallelConfig
from ..parallel_runtime.plans import find_encoder_plan, supported_encoders_text
from ..parallel_runtime.world.runtime import RUNTIME
from ..parallel_runtime.weights.shards import encoder_valid_sizes, shard_nbytes
from .parallel_config import ParallelConfigType

NODE = "Shard Text Encoder"


def sharded_encoders(cond_stage_model, config: ParallelConfig):
    """(path, module, plan) of every encoder this config shards, or a ConfigError."""
    found = [(name, mod, plan) for name, mod in cond_stage_model.named_modules()
             for plan in [find_encoder_plan(mod)] if plan is not None]
    if not found:
        classes = sorted({type(m).__name__ for _, m in cond_stage_model.named_children()})
        raise ConfigError(f"{NODE}: this CLIP ({type(cond_stage_model).__name__}: {', '.join(classes)}) has no "
                          f"encoder this pack can shard; supported: {supported_encoders_text()}")
    n = config.world_size
    for name, mod, plan in found:
        valid = encoder_valid_sizes(mod, plan)
        if n not in valid:
            raise ConfigError(f"{NODE}: the world size {n} (product of the Parallel Config sizes) does not split "
                              f"this {plan.title} encoder ({name}); world sizes that do: "
                              f"{', '.join(map(str, valid))}")
    return found


def encoder_sharding(clip, found, config: ParallelConfig) -> Sharding:
    import comfy.model_management

    size = comfy.model_management.module_size
    return Sharding(paths=tuple(name for name, _, _ in found), keep_off_device=True,
                    model_bytes=size(clip.cond_stage_model), sharded_bytes=sum(size(m) for _, m, _ in found),
                    rank0_bytes=sum(shard_nbytes(m, plan.tensor_parallel, config.world_size) for _, m, plan in found),
                    release=RUNTIME.release)


class ShardTextEncoderNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ShardTextEncoder",
            display_name="Shard Text Encoder",
            category="parallel",
            description="Splits the big text encoder of this CLIP over every rank of the Parallel Config (tensor "
                        "parallelism, N = world size); small encoders next to it (CLIP-L, CLIP-G) stay on "
                        f"ComfyUI's device. Supported: {supported_encoders_text()}.",
            inputs=[io.Clip.Input("clip"), ParallelConfigType.Input("parallel_config")],
            outputs=[io.Clip.Output()],
        )

    @classmethod
    def execute(cls, clip, parallel_config: ParallelConfig) -> io.NodeOutput:
        if not isinstance(parallel_config, ParallelConfig):
            raise ConfigError(f"{NODE}: parallel_config must come from a Parallel Config node")
        found = sharded_encoders(clip.cond_stage_model, parallel_config)
        clip = clip.clone()
        if parallel_config.world_size > 1:
            clip.patcher = sharded_patcher(clip.patcher, encoder_sharding(clip, found, parallel_config))
            for name, module, plan in found:
                clip.patcher.add_object_patch(f"{name}.forward",
                                              ShardedEncoderForward(parallel_config, plan.family, module))
        return io.NodeOutput(clip)
