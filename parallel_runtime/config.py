"""The parallel configuration that travels through the graph, and its validation.

Pure Python: importing this module starts nothing and touches no
``torch.distributed`` state, so the nodes can validate inputs cheaply.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

# Outermost to innermost; tp innermost keeps each TP group on neighbouring devices.
MESH_DIMS = ("cfg", "ring", "ulysses", "tp")
SIZE_INPUTS = {"cfg": "cfg_size", "ring": "ring_size", "ulysses": "ulysses_size", "tp": "tp_size"}
BACKENDS = ("auto", "nccl", "gloo")
# manual: the sizes are the layout. auto: the sizes (or the devices) only give the number of
# ranks; each model gets the layout the cost model predicts fastest at its first forward.
LAYOUTS = ("manual", "auto")

# What this version of the runtime can run. Every other size must be 1, and a
# config asking for more is refused at the node instead of being ignored.
IMPLEMENTED_DIMS = ("cfg", "ring", "ulysses", "tp")

NODE = "Parallel Config"
SIZE_MAX = 1024  # the node's widgets stop here
# Bounds on what any input can make the pack build, checked before anything is built from it:
# ComfyUI skips a node's min and max where the node takes its inputs as **kwargs, and the HTTP
# route takes any JSON, so every size, count, list and text is bounded here, in one place.
WORLD_MAX = 1024        # the most ranks the pack starts, on one host or several
TEXT_MAX = 16384        # characters of a text input (a devices list of WORLD_MAX CPU ranks fits)
NUMBER_DIGITS_MAX = 6   # digits of a number inside a text input (a device index, a rank count, a port)
MESSAGE_MAX = 1000      # characters of one of the pack's messages; an echoed input is cut to fit
SHOWN_MAX = 80          # characters of an input echoed in a message
CLUSTER_KEY_ENV = "PARALLEL_CLUSTER_KEY"  # the shared key of several hosts (world/cluster.py)
CLUSTER_KEY_MIN = 16


@dataclass(frozen=True)
class ConfigInput:
    """One input of the Parallel Config node."""

    name: str
    kind: str                        # "int" (a mesh size), "string" or "choice"
    default: object
    tooltip: str
    optional: bool = False
    choices: tuple[str, ...] = ()


# The Parallel Config inputs, in the node's order: the one list that the node's schema, its
# validation and execute, the /parallel/validate route (hence the canvas) and Shard VAE read.
# A new input is added here (optional, with a default) and in build_config; nothing else lists them.
CONFIG_INPUTS = (
    ConfigInput("ulysses_size", "int", 1, "Context parallelism by heads (Ulysses): ranks that split the tokens "
                "and exchange attention heads. Any size: heads it does not divide are padded (each rank "
                "attends the largest share)."),
    ConfigInput("ring_size", "int", 1, "Context parallelism by key/value blocks passed around a ring "
                "(Ring attention)."),
    ConfigInput("tp_size", "int", 1, "Tensor parallelism: ranks that split each layer's weights."),
    ConfigInput("cfg_size", "int", 1, "2 runs the conditional and unconditional passes on different ranks "
                "(needs CFG above 1)."),
    ConfigInput("devices", "string", "auto", "'auto' (ComfyUI's device type, as many as the world size), 'cpu', "
                "or one device per rank: '0,1,2,3', 'cuda:0,cuda:1', 'cpu,cpu'. The first device is ComfyUI's own."),
    ConfigInput("backend", "choice", "auto", "auto: NCCL on CUDA devices, gloo on the CPU.", choices=BACKENDS),
    ConfigInput("hosts", "string", "", "Several machines: ranks per host in rank order, this one first, e.g. "
                "'local:2,gpu-b:2' ('devices' then lists this machine's ranks). Every other host runs "
                "tools/remote_worker.sh. Empty: one machine.", optional=True),
    ConfigInput("rendezvous", "string", "", "With several hosts: this machine's address and a free port that the "
                "other hosts can reach, e.g. '10.0.0.1:29600'.", optional=True),
    ConfigInput("layout", "choice", "manual", "manual: the sizes above are the layout. auto: they (or the devices "
                "list, or every GPU) only give the number of ranks, and each model runs in the layout a measured "
                "cost model predicts fastest for its size, chosen at its first step (shown in the Parallel tab "
                "and the log).", optional=True, choices=LAYOUTS),
    ConfigInput("weights", "string", "", "Ranks of different speed: one relative speed per rank, e.g. '1,0.5' for "
                "a second GPU half as fast. Context parallelism then gives each rank a share of the tokens in "
                "proportion (still exact). Empty: an even split.", optional=True),
)


def world_size_of(sizes) -> int:
    """The world size: the product of the mesh sizes (the one place it is multiplied out)."""
    world = 1
    for value in sizes:
        world *= value
    return world


@dataclass(frozen=True)
class ParallelConfig:
    """A validated, resolved parallel configuration (output type PARALLEL_CONFIG)."""

    cfg_size: int = 1
    ring_size: int = 1
    ulysses_size: int = 1
    tp_size: int = 1
    devices: tuple[str, ...] = ("cpu",)  # one resolved torch device string per rank ("@host" on other hosts)
    backend: str = "gloo"                 # resolved: "gloo" or "nccl"
    devices_spec: str = field(default="auto", compare=False)
    # Several hosts: (name, ranks) in rank order, ComfyUI's host first; empty for one host.
    hosts: tuple[tuple[str, int], ...] = ()
    rendezvous: str = ""                  # "address:port" rank 0 listens on for the other hosts
    layout: str = "manual"                # "auto": the sizes above are only the starting layout
    weights: tuple[float, ...] = ()      # relative speed per rank: token shares of a weighted split

    @property
    def auto_layout(self) -> bool:
        return self.layout == "auto"

    @property
    def multi_host(self) -> bool:
        return len(self.hosts) > 1

    def host_of(self, rank: int) -> str | None:
        """The host a rank runs on (None: ComfyUI's own)."""
        start = 0
        for index, (name, count) in enumerate(self.hosts):
            if start <= rank < start + count:
                return None if index == 0 else name
            start += count
        return None

    @property
    def world_size(self) -> int:
        return world_size_of(self.mesh_sizes.values())

    @property
    def mesh_sizes(self) -> dict[str, int]:
        return {dim: getattr(self, SIZE_INPUTS[dim]) for dim in MESH_DIMS}

    @property
    def device_type(self) -> str:
        return self.devices[0].split(":", 1)[0]

    def describe(self) -> str:
        dims = describe_sizes(self.mesh_sizes)
        note = "; gloo on CUDA works but is slower than NCCL" if self.backend == "gloo" and \
            self.device_type == "cuda" else ""
        if self.auto_layout:
            dims = f"layout auto over {self.world_size} ranks"
        return f"{dims} on {', '.join(self.devices)} ({self.backend}{note})"


def describe_sizes(sizes: dict[str, int]) -> str:
    """'ring2 x ulysses2': the dimensions above 1, outermost first."""
    return " x ".join(f"{d}{sizes.get(d, 1)}" for d in MESH_DIMS if sizes.get(d, 1) > 1) or "single rank"


def shown(value) -> str:
    """An input as a message shows it: its repr, cut to SHOWN_MAX characters with its length said
    (a 400 KB devices list must not come back as a 400 KB message)."""
    text = repr(value)
    if len(text) <= SHOWN_MAX:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters written out"
    return f"{text[:SHOWN_MAX - 20]}... ({size})"


def _fail(input_name: str, value, valid: str, node: str = NODE, error=None) -> ConfigError:
    return (error or ConfigError)(f"{node}: {input_name}={shown(value)} is not valid; {valid}")


def example_list(item: str, count: int) -> str:
    """'cpu,cpu,cpu' for a few ranks; 'cpu,cpu,...' with the count said for many."""
    if count <= 8:
        return ",".join([item] * count)
    return f"{item},{item},... ({count} entries)"


def validate_sizes(sizes: dict[str, int], node: str = NODE) -> None:
    """Sizes must be whole numbers from 1 to SIZE_MAX, only implemented dimensions may exceed 1,
    and their product, the world size, is at most WORLD_MAX (refused by its number, not built)."""
    for dim in MESH_DIMS:
        value = sizes.get(dim, 1)
        name = SIZE_INPUTS[dim]
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= SIZE_MAX:
            raise _fail(name, value, f"sizes are whole numbers from 1 to {SIZE_MAX}", node, InputError)
    for dim in MESH_DIMS:
        value = sizes.get(dim, 1)
        if value > 1 and dim not in IMPLEMENTED_DIMS:
            implemented = ", ".join(SIZE_INPUTS[d] for d in IMPLEMENTED_DIMS)
            raise _fail(SIZE_INPUTS[dim], value,
                        f"this version of the pack runs {implemented} only, so {SIZE_INPUTS[dim]} must be 1", node)
    check_world_size(world_size_of(sizes.get(dim, 1) for dim in MESH_DIMS), node)


def check_world_size(world_size: int, node: str = NODE) -> None:
    """A world beyond WORLD_MAX ranks is refused by its number before anything is built for it."""
    if world_size > WORLD_MAX:
        raise ConfigError(f"{node}: the sizes multiply to a world size of {world_size}; the pack starts at most "
                          f"{WORLD_MAX} ranks: reduce ulysses_size, ring_size, tp_size or cfg_size so that "
                          f"their product is at most {WORLD_MAX}")


_CUDA_ITEM = re.compile(r"^(?:cuda:)?(\d{1,%d})$" % NUMBER_DIGITS_MAX)


def parse_devices(spec: str, node: str = NODE, share: bool = False) -> list[str] | str:
    """Parse the ``devices`` input.

    Returns "auto" or "cpu" (to be resolved against the world size), or an
    explicit per-rank list of torch device strings.
    """
    valid = ("use 'auto', 'cpu', or a comma-separated list of devices with one entry per rank, "
             "such as '0,1,2,3', 'cuda:0,cuda:1' or 'cpu,cpu'")
    text = (spec or "").strip().lower()
    if text in ("auto", "cpu"):
        return text
    if not text:
        raise _fail("devices", spec, valid, node)
    items = [item.strip() for item in text.split(",")]
    resolved = []
    for item in items:
        if item == "cpu":
            resolved.append("cpu")
            continue
        match = _CUDA_ITEM.match(item)
        if not match:
            raise _fail("devices", spec, f"entry {shown(item)} is neither 'cpu' nor a CUDA index; {valid}", node)
        resolved.append(f"cuda:{int(match.group(1))}")
    kinds = {d.split(":")[0] for d in resolved}
    if len(kinds) > 1:
        raise _fail("devices", spec, "all ranks must use the same kind of device (all CPU or all CUDA)", node)
    cuda = [d for d in resolved if d != "cpu"]
    if len(set(cuda)) != len(cuda) and not share:
        raise _fail("devices", spec, "each CUDA device may appear once (one rank per device)", node)
    return resolved


def available_cores() -> list[int]:
    """The cores this process may run on (a ``taskset`` or a cgroup's cpuset narrows them): what CPU
    ranks may have, for the refusal of too many and for their threads (world/settings.py)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class HostDevices:
    """What the machine offers; taken from ComfyUI's own device choice."""

    main_device: str      # the device ComfyUI computes on (rank 0), e.g. "cpu" or "cuda:0"
    cuda_count: int = 0
    cpu_count: int = field(default_factory=lambda: len(available_cores()))
    nccl: bool = True     # torch was built with NCCL (not on native Windows, not in CPU-only builds)
    # Test-only (PARALLEL_SHARE_DEVICE=1): several ranks may share one GPU, through gloo (NCCL
    # refuses two ranks on one device). Checks memory, transport and exactness on one GPU.
    share_devices: bool = False


SHARE_DEVICE_ENV = "PARALLEL_SHARE_DEVICE"


def share_devices_requested() -> bool:
    return os.environ.get(SHARE_DEVICE_ENV, "") not in ("", "0")


def _ranks_here(ranks: int, world: int | None) -> str:
    """'the world size 3 (product of the sizes)', or where other hosts run some ranks, 'this host's
    1 rank of the world's 2'."""
    if world is None or world == ranks:
        return f"the world size {ranks} (product of the sizes)"
    return f"this host's {ranks} rank{'s' if ranks != 1 else ''} of the world's {world} (see hosts)"


def resolve_devices(parsed, world_size: int, host: HostDevices, node: str = NODE,
                    world: int | None = None) -> tuple[str, ...]:
    """One device per rank of this host: ``world_size`` ranks here, of ``world`` in all (several hosts)."""
    main_is_cuda = host.main_device.startswith("cuda")
    typed = parsed if isinstance(parsed, str) else ",".join(parsed)
    here = _ranks_here(world_size, world)
    if parsed == "auto":
        parsed = "cuda" if main_is_cuda else "cpu"
        if parsed == "cuda":
            first = int(host.main_device.split(":")[1]) if ":" in host.main_device else 0
            order = [first] + [i for i in range(host.cuda_count) if i != first]
            if host.share_devices:  # test-only: ranks wrap around the GPUs there are
                return tuple(f"cuda:{order[r % len(order)]}" for r in range(world_size))
            if world_size > len(order):
                raise _fail("devices", "auto", f"{here} needs {world_size} devices but this machine has "
                            f"{host.cuda_count} CUDA devices; reduce the sizes so that this machine runs at most "
                            f"{host.cuda_count} ranks", node)
            return tuple(f"cuda:{i}" for i in order[:world_size])
    if parsed == "cpu":
        if main_is_cuda:
            raise _fail("devices", typed, f"ComfyUI computes on {host.main_device}; start ComfyUI with --cpu "
                        "to run CPU ranks, or use 'auto'", node)
        if world_size > host.cpu_count:
            raise _fail("devices", typed, f"{here} needs {world_size} CPU ranks but ComfyUI may run on "
                        f"{host.cpu_count} cores; reduce the sizes so that this machine runs at most "
                        f"{host.cpu_count} ranks, or list the CPU ranks explicitly (for example "
                        f"'{example_list('cpu', world_size)}') to oversubscribe on purpose", node)
        return tuple(["cpu"] * world_size)
    devices = list(parsed)
    spec = ",".join(devices)
    if len(devices) != world_size:
        what = (f"the sizes multiply to a world size of {world_size}" if world in (None, world_size)
                else f"this host runs {world_size} of the world's {world} ranks (see hosts)")
        raise _fail("devices", spec, f"it lists {len(devices)} devices but {what}; give exactly one device per "
                    "rank" + ("" if world in (None, world_size) else " of this host"), node)
    if devices[0] == "cpu":
        if main_is_cuda:
            raise _fail("devices", spec, f"ComfyUI computes on {host.main_device}; CPU ranks need ComfyUI "
                        "started with --cpu", node)
        return tuple(devices)
    if not main_is_cuda:
        raise _fail("devices", spec, "ComfyUI runs on the CPU here, so CUDA ranks are not available; "
                    "use 'cpu' or 'auto'", node)
    missing = [d for d in devices if int(d.split(":")[1]) >= host.cuda_count]
    if missing:
        raise _fail("devices", spec, f"{', '.join(missing)} not present: this machine has {host.cuda_count} "
                    f"CUDA devices (cuda:0 to cuda:{host.cuda_count - 1})", node)
    if devices[0] != _canonical(host.main_device):
        raise _fail("devices", spec, f"the first device is rank 0, which is ComfyUI itself, so it must be "
                    f"ComfyUI's device {host.main_device}", node)
    return tuple(devices)


def _canonical(device: str) -> str:
    return "cuda:0" if device == "cuda" else device


def resolve_backend(spec: str, device_type: str, node: str = NODE, nccl_available: bool = True,
                    shared_device: bool = False) -> str:
    """``auto``: NCCL on CUDA where torch has it and every rank has a GPU of its own, else gloo
    (slower on CUDA: accelerator tensors go through host memory, see ``comm``)."""
    spec = (spec or "auto").strip().lower()
    if spec not in BACKENDS:
        raise _fail("backend", spec, f"choose one of {', '.join(BACKENDS)}", node)
    if spec == "auto":
        return "nccl" if device_type == "cuda" and nccl_available and not shared_device else "gloo"
    if spec == "nccl" and device_type != "cuda":
        raise _fail("backend", spec, "NCCL needs CUDA devices; use 'gloo' or 'auto' for CPU ranks", node)
    if spec == "nccl" and not nccl_available:
        raise _fail("backend", spec, "this PyTorch has no NCCL (native Windows and CPU-only builds have none); "
                    "use 'gloo' or 'auto'", node)
    if spec == "nccl" and shared_device:
        raise _fail("backend", spec, "NCCL refuses two ranks on one GPU; use 'gloo' or 'auto'", node)
    return spec


_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def parse_hosts(spec: str, world_size: int, tp_size: int, node: str = NODE) -> tuple[tuple[str, int], ...]:
    """``"local:2,gpu-b:2"``: ranks per host in rank order, ComfyUI's host first."""
    text = (spec or "").strip()
    if not text:
        return ()
    valid = "use 'name:ranks' entries separated by commas, this machine first, e.g. 'local:2,gpu-b:2'"
    hosts = []
    for item in text.split(","):
        name, _, count = item.strip().partition(":")
        count = count.strip()
        if (not _HOST_NAME.match(name) or len(name) > 255 or not count.isdigit()
                or len(count) > NUMBER_DIGITS_MAX or int(count) < 1):
            raise _fail("hosts", spec, f"entry {shown(item.strip())} is not 'name:ranks'; {valid}", node)
        hosts.append((name, int(count)))
    names = [n for n, _ in hosts]
    if len(set(names)) != len(names):
        raise _fail("hosts", spec, "each host may appear once", node)
    total = sum(c for _, c in hosts)
    if total != world_size:
        raise _fail("hosts", spec, f"it places {total} ranks but the sizes multiply to a world size of "
                    f"{world_size}", node)
    for name, count in hosts:
        if count % tp_size:
            raise _fail("hosts", spec, f"host {name} has {count} ranks, not a multiple of tp_size {tp_size}: "
                        "tensor-parallel groups stay inside a host (they talk every layer)", node)
    return tuple(hosts)


def parse_rendezvous(spec: str, node: str = NODE) -> str:
    text = (spec or "").strip()
    address, _, port = text.rpartition(":")
    if not address or not port.isdigit() or len(port) > NUMBER_DIGITS_MAX or not 0 < int(port) < 65536:
        raise _fail("rendezvous", spec, "give the address of this machine that the other hosts can reach, "
                    "with a free port, e.g. '10.0.0.1:29600'", node)
    return text


def auto_world_size(sizes: dict[str, int], parsed_devices, host: HostDevices, node: str = NODE) -> int:
    """layout auto: the number of ranks is the product of the sizes when it is above 1, else one
    rank per listed device, else every GPU of this machine."""
    product = world_size_of(sizes.values())
    if product > 1:
        return product
    if isinstance(parsed_devices, list):
        return len(parsed_devices)
    if host.main_device.startswith("cuda") and parsed_devices == "auto":
        return host.cuda_count
    raise _fail("layout", "auto", "give the number of ranks: list one device per rank in 'devices' (for example "
                "'cpu,cpu'), or set a size such as ulysses_size to the number of ranks; the layout is then "
                "chosen for you", node)


def parse_weights(spec: str, world_size: int, node: str = NODE) -> tuple[float, ...]:
    """``weights``: empty (even split) or one positive number per rank, e.g. '1,0.5'."""
    text = (spec or "").strip()
    if not text:
        return ()
    example = ",".join(["1"] * (world_size - 1) + ["0.5"]) if world_size <= 8 else "1,1,...,0.5"
    valid = (f"give one finite positive number per rank ({world_size} here), each rank's relative speed, e.g. "
             f"'{example}', or leave it empty for an even split")
    try:
        values = tuple(float(item) for item in text.split(","))
    except ValueError:
        raise _fail("weights", spec, valid, node) from None
    if len(values) != world_size or any(not (v > 0 and math.isfinite(v)) for v in values):
        raise _fail("weights", spec, valid, node)
    return values


def build_config(*, ulysses_size=1, ring_size=1, tp_size=1, cfg_size=1, devices="auto", backend="auto",
                 host: HostDevices, node: str = NODE, hosts: str = "", rendezvous: str = "",
                 layout: str = "manual", weights: str = "") -> ParallelConfig:
    sizes = {"cfg": cfg_size, "ring": ring_size, "ulysses": ulysses_size, "tp": tp_size}
    validate_sizes(sizes, node)
    layout = (layout or "manual").strip().lower()
    if layout not in LAYOUTS:
        raise _fail("layout", layout, f"choose one of {', '.join(LAYOUTS)}", node)
    if layout == "auto":
        n = auto_world_size(sizes, parse_devices(devices, node, share=host.share_devices), host, node)
        if n < 2:
            raise _fail("layout", "auto", f"it needs at least 2 ranks and this gives {n}; list more devices or "
                        "use a size above 1", node)
        if n != world_size_of(sizes.values()):  # start as Ring over every rank: any model fits
            cfg_size, ring_size, ulysses_size, tp_size = 1, n, 1, 1
    world_size = world_size_of((cfg_size, ring_size, ulysses_size, tp_size))
    check_world_size(world_size, node)
    host_list = parse_hosts(hosts, world_size, tp_size, node)
    local_ranks = host_list[0][1] if host_list else world_size
    resolved = resolve_devices(parse_devices(devices, node, share=host.share_devices), local_ranks, host, node,
                               world=world_size)
    if len(host_list) > 1:
        address = parse_rendezvous(rendezvous, node)
        problem = cluster_key_problem()
        if problem:
            raise _fail("hosts", hosts, problem, node)
        resolved = resolved + tuple(f"@{name}" for name, count in host_list[1:] for _ in range(count))
    else:
        address, host_list = "", ()
    device_type = resolved[0].split(":")[0]
    local = [d for d in resolved if not d.startswith("@")]
    shared = device_type == "cuda" and len(set(local)) < len(local)
    return ParallelConfig(cfg_size=cfg_size, ring_size=ring_size, ulysses_size=ulysses_size, tp_size=tp_size,
                          devices=resolved, backend=resolve_backend(backend, device_type, node, host.nccl, shared),
                          devices_spec=str(devices), hosts=host_list, rendezvous=address, layout=layout,
                          weights=parse_weights(weights, world_size, node))


def read_inputs(values) -> dict | None:
    """Every Parallel Config input from a node's, a prompt's or the canvas's values: a missing
    one at its default, a size given as text or an integral float as an int, unknown names
    ignored. None where an input comes from another node (None at validation, a link in a
    prompt): the node checks it when it runs."""
    inputs = {}
    for spec in CONFIG_INPUTS:
        value = values.get(spec.name, spec.default)
        if value is None or isinstance(value, (list, tuple)):
            return None
        if spec.kind == "int":
            digits = value.strip().lstrip("-") if isinstance(value, str) else ""
            if digits.isdigit() and len(digits) <= 2 * NUMBER_DIGITS_MAX:
                value = int(value)
            elif isinstance(value, float) and value.is_integer():
                value = int(value)
            # anything else stays as it is: validate_sizes refuses it, naming the input
        else:
            check_text(spec.name, value)
        inputs[spec.name] = value
    return inputs


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def check_text(name: str, value, node: str = NODE) -> None:
    """A text input is a string of at most TEXT_MAX characters without control characters (tabs and
    line ends count as spaces): anything else is no widget's value, refused before it is parsed."""
    if not isinstance(value, str):
        raise _fail(name, value, f"it is a {type(value).__name__}; give a text", node, InputError)
    if len(value) > TEXT_MAX:
        raise _fail(name, value, f"it is {len(value)} characters long; at most {TEXT_MAX}", node, InputError)
    if _CONTROL.search(value):
        raise _fail(name, value, "it holds control characters", node, InputError)


def cluster_key_problem() -> str | None:
    """Why ranks on other hosts cannot be authenticated from this process, or None: the one check
    that Parallel Config, the validate route, rank 0's listener and the remote agent read."""
    if len(os.environ.get(CLUSTER_KEY_ENV, "")) >= CLUSTER_KEY_MIN:
        return None
    return (f"ranks on other hosts need a shared key of at least {CLUSTER_KEY_MIN} characters in the environment "
            f"variable {CLUSTER_KEY_ENV}, the same for ComfyUI and every host's remote worker (it authenticates "
            "every connection; nothing listens on the network without it); set it and restart ComfyUI")


def config_from_inputs(values, host: HostDevices, node: str = NODE) -> ParallelConfig | None:
    """The config Parallel Config makes of these input values (None: an input is linked; see
    read_inputs). The node, the route and Shard VAE all build it here."""
    inputs = read_inputs(values)
    return None if inputs is None else build_config(**inputs, host=host, node=node)


class ConfigError(ValueError):
    """A user-facing configuration problem; the message names node, value and valid choices, and
    stays under MESSAGE_MAX characters whatever the input."""

    def __init__(self, message: str = ""):
        message = str(message)
        if len(message) > MESSAGE_MAX:
            message = message[:MESSAGE_MAX - 40] + f"... (message cut from {len(message)} characters)"
        super().__init__(message)


class InputError(ConfigError):
    """A value no widget of the node can produce: a wrong type, a size out of its range, a text too
    long or with control characters, a number that is not finite. The HTTP route answers it 400."""
