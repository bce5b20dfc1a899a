"""Shard Transformer: MODEL + PARALLEL_CONFIG -> MODEL that runs on every rank.

Nothing starts here: the node checks that the model and the config fit together
and puts two wrappers on a clone of the ModelPatcher (a sharded patcher: see
``comfyui_glue/patcher.py``). The workers start when the first sampler runs. LoRA and other
weight patches applied before or after this node reach every rank, merged.
"""
from __future__ import annotations

from comfy_api.latest import io

from ..parallel_runtime.comfyui_glue.patcher import Sharding, sharded_patcher
from ..parallel_runtime.comfyui_glue.wrappers import (DIFFUSION_MODEL, OUTER_SAMPLE, WRAPPER_KEY, ShardedForward,
                                                      ShardedModelForward, ShardedRun, forward_method)
from ..parallel_runtime.config import ConfigError, ParallelConfig
from ..parallel_runtime.plans import find_plan, supported_models_text
from ..parallel_runtime.plans.vocabulary.matching import PlanMismatch
from ..parallel_runtime.world.runtime import RUNTIME
from ..parallel_runtime.layout.refusal import plan_refusal
from ..parallel_runtime.parallel.model_patches import refuse_unknown as refuse_unknown_patches
from ..parallel_runtime.plans.vocabulary.patches import PatchRefused
from ..parallel_runtime.weights.shards import shard_nbytes
from ..parallel_runtime.comfyui_glue.first_step_check import FirstStep, requested
from ..parallel_runtime.comfyui_glue.user_plans import fingerprint as user_plans_fingerprint, plan_folders
from ..parallel_runtime.comfyui_glue.user_plans import refresh as refresh_user_plans
from .parallel_config import ParallelConfigType

NODE = "Shard Transformer"
FORWARD_PATCH = "diffusion_model.forward"  # the object patch of a model whose class has no _forward


def check_model(diffusion_model, config: ParallelConfig):
    """The plan for this model, or a ConfigError a user can act on."""
    broken = refresh_user_plans()  # plan files a user added or changed since the last run
    plan = find_plan(diffusion_model)
    cls = type(diffusion_model)
    if plan is None:
        folders = ", ".join(str(f) for f in plan_folders())
        raise ConfigError(f"{NODE}: the model class {cls.__module__}.{cls.__qualname__} is not supported; "
                          f"supported: {supported_models_text()}. A plan file for it in {folders} adds it "
                          "(docs/user_plans.md)" + "".join(f"; {error}" for error in broken))
    plan = plan.for_module(diffusion_model)
    try:
        plan.check_matches(diffusion_model)  # built the way the plan was written for, or refused now
    except PlanMismatch as exc:
        raise ConfigError(f"{NODE}: {exc}") from exc
    why = plan_refusal(diffusion_model, plan, config.mesh_sizes)  # the one check layout auto reads too
    if why is not None:
        raise ConfigError(f"{NODE}: {why}")
    return plan


def transformer_sharding(model, diffusion_model, plan, config: ParallelConfig) -> Sharding:
    """With tensor parallelism the full weights stay off the device and rank 0 holds its shard."""
    import comfy.model_management

    tp = config.tp_size if plan.tensor_parallel is not None else 1
    return Sharding(paths=("diffusion_model",), keep_off_device=tp > 1,
                    model_bytes=comfy.model_management.module_size(model.model),
                    sharded_bytes=comfy.model_management.module_size(diffusion_model),
                    rank0_bytes=shard_nbytes(diffusion_model, plan.tensor_parallel, tp), release=RUNTIME.release)


class ShardTransformerNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ShardTransformer",
            display_name="Shard Transformer",
            category="parallel",
            description="Runs the diffusion transformer on every rank of the Parallel Config: context "
                        "parallelism (Ulysses, Ring, CFG) and tensor parallelism. Supported: "
                        f"{supported_models_text()}. Works with the stock samplers and LoRA loaders before or "
                        "after it.",
            inputs=[
                io.Model.Input("model"),
                ParallelConfigType.Input("parallel_config"),
                io.Boolean.Input("verify_first_step", default=False, optional=True,
                                 tooltip="Also run the first step of every prompt unsharded on ComfyUI's device and "
                                         "stop if the results differ beyond rounding. For trying a ComfyUI release "
                                         "the pack was not tested with; costs one unsharded step per prompt. Not "
                                         "with tp_size above 1 (the whole model is never on the device then)."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        """A user plan file added, edited or removed runs the node again (its output holds the plan)."""
        return user_plans_fingerprint()

    @classmethod
    def execute(cls, model, parallel_config: ParallelConfig, verify_first_step: bool = False) -> io.NodeOutput:
        if not isinstance(parallel_config, ParallelConfig):
            raise ConfigError(f"{NODE}: parallel_config must come from a Parallel Config node, got "
                              f"{type(parallel_config).__name__}")
        verify = requested(verify_first_step)
        if verify and parallel_config.tp_size > 1 and not verify_first_step:
            verify = False  # the environment switch checks what can be checked; TP runs go unchecked
        elif verify and parallel_config.tp_size > 1:
            raise ConfigError(f"{NODE}: verify_first_step=True is not available with tp_size={parallel_config.tp_size}: "
                              "the whole model is never on the device with tensor parallelism, so there is no "
                              "unsharded step to compare with. Check with tp_size 1 (Ulysses or Ring run the same "
                              "plan), then switch it off and TP back on")
        diffusion_model = model.model.diffusion_model
        plan = check_model(diffusion_model, parallel_config)
        try:  # model patches set before this node (after it: refused at the first step, by the same check)
            refuse_unknown_patches(getattr(model, "model_options", {}).get("transformer_options"), plan)
        except PatchRefused as exc:
            raise ConfigError(f"{NODE}: {exc}") from exc
        if parallel_config.world_size > 1:
            patched = sharded_patcher(model, transformer_sharding(model, diffusion_model, plan, parallel_config))
        else:
            patched = model.clone()
        for kind in (DIFFUSION_MODEL, OUTER_SAMPLE):
            patched.remove_wrappers_with_key(kind, WRAPPER_KEY)  # a second Shard Transformer replaces the first
        if isinstance(patched.object_patches.get(FORWARD_PATCH), ShardedModelForward):
            del patched.object_patches[FORWARD_PATCH]
        if parallel_config.world_size > 1:
            first_step = FirstStep(verify) if verify else None
            patched.add_wrapper_with_key(OUTER_SAMPLE, WRAPPER_KEY, ShardedRun(parallel_config, first_step))
            if forward_method(diffusion_model) == "_forward":
                patched.add_wrapper_with_key(DIFFUSION_MODEL, WRAPPER_KEY,
                                             ShardedForward(parallel_config, plan.family, first_step))
            else:  # the class's forward runs no DIFFUSION_MODEL wrappers: the forward itself is replaced
                patched.add_object_patch(FORWARD_PATCH, ShardedModelForward(
                    parallel_config, plan.family, patched.model.diffusion_model, first_step))
        return io.NodeOutput(patched)
