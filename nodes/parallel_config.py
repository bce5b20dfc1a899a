"""Parallel Config: the mesh sizes, devices and backend, validated before anything runs."""
from __future__ import annotations

from comfy_api.latest import io

from ..parallel_runtime.config import BACKENDS, LAYOUTS, ConfigError, build_config
from .host import host_devices

ParallelConfigType = io.Custom("PARALLEL_CONFIG")

_SIZE_TOOLTIPS = {
    "ulysses_size": "Context parallelism by heads (Ulysses): ranks that split the tokens and exchange "
                    "attention heads. Must divide the model's attention head count.",
    "ring_size": "Context parallelism by key/value blocks passed around a ring (Ring attention).",
    "tp_size": "Tensor parallelism: ranks that split each layer's weights.",
    "cfg_size": "2 runs the conditional and unconditional passes on different ranks (needs CFG above 1).",
}


class ParallelConfigNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ParallelConfig",
            display_name="Parallel Config",
            category="parallel",
            description="How to spread the models over several devices. The world size (number of ranks) is "
                        "the product of the sizes; ComfyUI itself is rank 0. Feed it to Shard Transformer.",
            inputs=[
                *[io.Int.Input(name, default=1, min=1, max=1024, tooltip=tip) for name, tip in _SIZE_TOOLTIPS.items()],
                io.String.Input("devices", default="auto", tooltip="'auto' (ComfyUI's device type, as many as the "
                                "world size), 'cpu', or one device per rank: '0,1,2,3', 'cuda:0,cuda:1', "
                                "'cpu,cpu'. The first device is ComfyUI's own."),
                io.Combo.Input("backend", options=list(BACKENDS), default="auto",
                               tooltip="auto: NCCL on CUDA devices, gloo on the CPU."),
                io.String.Input("hosts", default="", optional=True,
                                tooltip="Several machines: ranks per host in rank order, this one first, e.g. "
                                        "'local:2,gpu-b:2' ('devices' then lists this machine's ranks). Every other "
                                        "host runs tools/remote_worker.sh. Empty: one machine."),
                io.String.Input("rendezvous", default="", optional=True,
                                tooltip="With several hosts: this machine's address and a free port that the other "
                                        "hosts can reach, e.g. '10.0.0.1:29600'."),
                io.Combo.Input("layout", options=list(LAYOUTS), default="manual", optional=True,
                               tooltip="manual: the sizes above are the layout. auto: they (or the devices list, or "
                                       "every GPU) only give the number of ranks, and each model runs in the "
                                       "layout a measured cost model predicts fastest for its size, chosen at its "
                                       "first step (shown in the Parallel tab and the log)."),
                io.String.Input("weights", default="", optional=True,
                                tooltip="Ranks of different speed: one relative speed per rank, e.g. '1,0.5' for a "
                                        "second GPU half as fast. Context parallelism then gives each rank a share "
                                        "of the tokens in proportion (still exact). Empty: an even split."),
            ],
            outputs=[ParallelConfigType.Output(display_name="parallel_config")],
        )

    @classmethod
    def validate_inputs(cls, ulysses_size=1, ring_size=1, tp_size=1, cfg_size=1, devices="auto", backend="auto",
                        hosts="", rendezvous="", layout="manual", weights=""):
        values = dict(ulysses_size=ulysses_size, ring_size=ring_size, tp_size=tp_size, cfg_size=cfg_size,
                      devices=devices, backend=backend, hosts=hosts or "", rendezvous=rendezvous or "",
                      layout=layout or "manual", weights=weights or "")
        if any(v is None for v in values.values()):
            return True  # linked from another node: checked when the node runs
        try:
            build_config(**values, host=host_devices())
        except ConfigError as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, ulysses_size, ring_size, tp_size, cfg_size, devices, backend, hosts="",
                rendezvous="", layout="manual", weights="") -> io.NodeOutput:
        config = build_config(ulysses_size=ulysses_size, ring_size=ring_size, tp_size=tp_size, cfg_size=cfg_size,
                              devices=devices, backend=backend, hosts=hosts or "", rendezvous=rendezvous or "",
                              host=host_devices(), layout=layout or "manual", weights=weights or "")
        return io.NodeOutput(config)
