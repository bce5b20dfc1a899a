"""The pack's ComfyUI nodes (V3 schema)."""
from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .block_cache import BlockCacheNode
from .parallel_config import ParallelConfigNode
from .shard_text_encoder import ShardTextEncoderNode
from .shard_transformer import ShardTransformerNode
from .shard_vae import ShardVAENode

NODES = [ParallelConfigNode, ShardTransformerNode, ShardTextEncoderNode, ShardVAENode, BlockCacheNode]


class HybridParallelExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)
