"""Block Cache: MODEL -> MODEL whose middle blocks are skipped at steps that change little (DBCache).

Before or after Shard Transformer, or without it. The first ``front_blocks`` blocks run at every
step; when their residual changed less than ``threshold`` (relative L1) since the last fully
computed step, the middle blocks are skipped and their residual of that step is reused; the last
``back_blocks`` blocks run again. Sharded, every rank takes the same decision (measured over all
ranks, decided by rank 0) and caches only its own part: see parallel_runtime/parallel/block_cache.py.
"""
from __future__ import annotations

from comfy_api.latest import io

from ..parallel_runtime.comfyui_glue.cached_steps import WRAPPER_KEY, BlockCacheForward
from ..parallel_runtime.comfyui_glue.wrappers import DIFFUSION_MODEL
from ..parallel_runtime.config import ConfigError
from ..parallel_runtime.parallel.block_cache import LIMITS, OPTION, BlockCacheSettings, block_count
from ..parallel_runtime.plans import find_plan

NODE = "Block Cache"


def check_settings(diffusion_model, settings: BlockCacheSettings):
    """The model's plan, or a ConfigError naming the node, the value and the valid range."""
    plan = find_plan(diffusion_model)
    if plan is None or not plan.for_module(diffusion_model).cached_blocks:
        cls = type(diffusion_model)
        what = f"the {plan.title} plan declares no block stacks to cache" if plan is not None else "no plan covers it"
        raise ConfigError(f"{NODE}: the model class {cls.__module__}.{cls.__qualname__} cannot be block-cached: {what}")
    plan = plan.for_module(diffusion_model)
    why = settings.refusal(NODE, block_count(diffusion_model, plan))
    if why:
        raise ConfigError(why)
    return plan


def _int(name: str, default: int, tooltip: str) -> io.Int.Input:
    low, high = LIMITS[name]
    return io.Int.Input(name, default=default, min=low, max=high if high is not None else 1000, tooltip=tooltip)


class BlockCacheNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        d = BlockCacheSettings()
        return io.Schema(
            node_id="HybridBlockCache",
            display_name="Block Cache",
            category="parallel",
            description="Skips the middle transformer blocks at steps where the first blocks' residual changed "
                        "little since the last full step, reusing the middle's residual (DBCache, optional "
                        "TaylorSeer). Before or after Shard Transformer, or without it: sharded, every rank takes "
                        "the same decision and caches only its own tokens.",
            inputs=[
                io.Model.Input("model"),
                _int("front_blocks", d.front_blocks, "Blocks computed at every step, first (Fn); their residual's "
                                                     "change decides whether the middle is skipped."),
                _int("back_blocks", d.back_blocks, "Blocks computed at every step, last (Bn)."),
                io.Float.Input("threshold", default=d.threshold, min=LIMITS["threshold"][0],
                               max=LIMITS["threshold"][1], step=0.01,
                               tooltip="Relative L1 change of the first blocks' residual under which the middle "
                                       "blocks are skipped. Higher: faster, further from the uncached result."),
                _int("warmup_steps", d.warmup_steps, "Steps computed fully at the start of every run."),
                _int("max_cached_steps", d.max_cached_steps, "Cached steps in a row at most (0: no limit)."),
                _int("taylor_order", d.taylor_order, "TaylorSeer: the reused residual extrapolated from the last "
                                                     "full steps to this order (0: reused as it was)."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, front_blocks: int = 1, back_blocks: int = 0, threshold: float = 0.08,
                warmup_steps: int = 2, max_cached_steps: int = 3, taylor_order: int = 0) -> io.NodeOutput:
        settings = BlockCacheSettings(front_blocks=front_blocks, back_blocks=back_blocks, threshold=threshold,
                                      warmup_steps=warmup_steps, max_cached_steps=max_cached_steps,
                                      taylor_order=taylor_order)
        check_settings(model.model.diffusion_model, settings)
        patched = model.clone()
        options = dict(patched.model_options.get("transformer_options", {}))
        options[OPTION] = settings.as_option()
        patched.model_options["transformer_options"] = options
        patched.remove_wrappers_with_key(DIFFUSION_MODEL, WRAPPER_KEY)  # a second Block Cache replaces the first
        patched.add_wrapper_with_key(DIFFUSION_MODEL, WRAPPER_KEY, BlockCacheForward())
        return io.NodeOutput(patched)
