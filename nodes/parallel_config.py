"""Parallel Config: the mesh sizes, devices and backend, validated before anything runs.

Its inputs are ``config.CONFIG_INPUTS``, the list the /parallel/validate route (the canvas) and
Shard VAE read too, and every path builds the config with ``config.config_from_inputs``: the
node, the canvas and Shard VAE cannot disagree about what a set of values means.
"""
from __future__ import annotations

from comfy_api.latest import io

from ..parallel_runtime.config import CONFIG_INPUTS, NODE, SIZE_MAX, ConfigError, ConfigInput, config_from_inputs
from .host import host_devices

ParallelConfigType = io.Custom("PARALLEL_CONFIG")


def _schema_input(spec: ConfigInput):
    common = dict(default=spec.default, tooltip=spec.tooltip, optional=spec.optional)
    if spec.kind == "int":
        return io.Int.Input(spec.name, min=1, max=SIZE_MAX, **common)
    if spec.kind == "choice":
        return io.Combo.Input(spec.name, options=list(spec.choices), **common)
    return io.String.Input(spec.name, **common)


class ParallelConfigNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ParallelConfig",
            display_name="Parallel Config",
            category="parallel",
            description="How to spread the models over several devices. The world size (number of ranks) is "
                        "the product of the sizes; ComfyUI itself is rank 0. Feed it to Shard Transformer.",
            inputs=[_schema_input(spec) for spec in CONFIG_INPUTS],
            outputs=[ParallelConfigType.Output(display_name="parallel_config")],
        )

    @classmethod
    def validate_inputs(cls, **values):
        # **values: ComfyUI then passes every input and leaves all range and choice checks to
        # build_config, whose messages name the node, the value and the valid choices.
        try:
            config_from_inputs(values, host_devices())  # None: linked from another node, checked when it runs
        except ConfigError as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, **values) -> io.NodeOutput:
        config = config_from_inputs(values, host_devices())
        if config is None:
            missing = ", ".join(s.name for s in CONFIG_INPUTS if values.get(s.name, s.default) is None)
            raise ConfigError(f"{NODE}: {missing} came from another node without a value; give it a value")
        return io.NodeOutput(config)
