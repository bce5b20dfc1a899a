"""Shard Text Encoder: CLIP + PARALLEL_CONFIG -> CLIP whose big encoder runs on every rank.

The large encoder of the CLIP (T5-XXL, UMT5-XXL, Mistral 3, Qwen2.5-VL, Qwen3, Gemma)
is tensor-parallel over all ranks of the world, or where its heads do not split over that many,
over the largest group that they split over and that tiles the world (``encoder_group_size``;
the other groups compute the same; a group of one: the encoder stays on rank 0, as unsharded);
small encoders next to it (CLIP-L, CLIP-G) stay on rank 0. Its full weights stay where ComfyUI offloads them: each rank
receives only its slice, cut one weight at a time. The conditioning comes back to
rank 0 for the stock CLIPTextEncode and the model-specific encode nodes.
"""
from __future__ import annotations

import logging

from comfy_api.latest import io

from ..parallel_runtime.comfyui_glue.patcher import Sharding, sharded_patcher
from ..parallel_runtime.comfyui_glue.wrappers import ShardedEncoderForward
from ..parallel_runtime.config import ConfigError, ParallelConfig
from ..parallel_runtime.plans import find_encoder_plan, supported_encoders_text
from ..parallel_runtime.world.runtime import RUNTIME
from ..parallel_runtime.distributed.mesh import MeshLayout
from ..parallel_runtime.weights.shards import encoder_group_size, encoder_layout_sizes, encoder_valid_sizes, \
    shard_nbytes
from .parallel_config import ParallelConfigType

NODE = "Shard Text Encoder"
log = logging.getLogger("parallel")


def sharded_encoders(cond_stage_model, config: ParallelConfig):
    """(path, module, plan, group) of every encoder this config shards (``group``: the ranks it is
    tensor parallel over, ``encoder_group_size``), or a ConfigError."""
    found = [(name, mod, plan) for name, mod in cond_stage_model.named_modules()
             for plan in [find_encoder_plan(mod)] if plan is not None]
    if not found:
        classes = sorted({type(m).__name__ for _, m in cond_stage_model.named_children()})
        raise ConfigError(f"{NODE}: this CLIP ({type(cond_stage_model).__name__}: {', '.join(classes)}) has no "
                          f"encoder this pack can shard; supported: {supported_encoders_text()}")
    out = []
    for name, mod, plan in found:
        group = encoder_group_size(encoder_valid_sizes(mod, plan), config.world_size)
        if group < config.world_size:
            log.warning("%s: the %s encoder (%s) splits over %d of the %d ranks%s", NODE, plan.title, name, group,
                        config.world_size, "; it runs whole on ComfyUI's device" if group == 1 else
                        f"; {config.world_size // group} groups of {group} compute it")
        out.append((name, mod, plan, group))
    return out


def encoder_sharding(clip, found, config: ParallelConfig) -> Sharding:
    import comfy.model_management

    size = comfy.model_management.module_size
    return Sharding(paths=tuple(name for name, _, _, _ in found), keep_off_device=True,
                    model_bytes=size(clip.cond_stage_model), sharded_bytes=sum(size(m) for _, m, _, _ in found),
                    rank0_bytes=sum(shard_nbytes(m, plan.tensor_parallel, group) for _, m, plan, group in found),
                    release=RUNTIME.release)


class ShardTextEncoderNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ShardTextEncoder",
            display_name="Shard Text Encoder",
            category="parallel",
            description="Splits the big text encoder of this CLIP over every rank of the Parallel Config (tensor "
                        "parallelism, N = world size; where its heads do not split over N, over the largest group "
                        "of ranks they split over); small encoders next to it (CLIP-L, CLIP-G) stay on "
                        f"ComfyUI's device. Supported: {supported_encoders_text()}.",
            inputs=[io.Clip.Input("clip"), ParallelConfigType.Input("parallel_config")],
            outputs=[io.Clip.Output()],
        )

    @classmethod
    def execute(cls, clip, parallel_config: ParallelConfig) -> io.NodeOutput:
        if not isinstance(parallel_config, ParallelConfig):
            raise ConfigError(f"{NODE}: parallel_config must come from a Parallel Config node")
        found = [f for f in sharded_encoders(clip.cond_stage_model, parallel_config) if f[3] > 1]
        clip = clip.clone()
        if found:
            n = parallel_config.world_size
            clip.patcher = sharded_patcher(clip.patcher, encoder_sharding(clip, found, parallel_config))
            for name, module, plan, group in found:
                layout = MeshLayout.from_sizes(encoder_layout_sizes(group, n))
                clip.patcher.add_object_patch(f"{name}.forward",
                                              ShardedEncoderForward(parallel_config, plan.family, module, layout))
        return io.NodeOutput(clip)
