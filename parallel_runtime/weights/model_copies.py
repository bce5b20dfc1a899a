"""Which models the ranks of a world hold, and getting the weights there.

A model reaches the workers once per *version*: ComfyUI's patch set and which patched tensors
it patches per forward (``sources.WeightSource.version``), cut for the layout's tensor-parallel size (layouts that
differ only in their context-parallel dimensions share it). A LoRA strength change gives a new
version and a re-send; the same prompt again sends nothing. When ComfyUI unloads the model,
``release`` frees it on every rank.

How the weights travel (``choose_transport``):

- ``shared``: CPU ranks on one host map rank 0's pages (``pickling.pack_module``), no copy.
- ``process_group``: accelerators with NCCL, and ranks on other hosts: a skeleton plus a
  bucketed byte stream from rank 0's device memory (``stream``).
- ``handles``: accelerators on one host without NCCL (several ranks sharing a GPU through
  gloo): the same stream, each bucket handed over by CUDA IPC. Only where rank 0's allocator
  can export IPC handles: ComfyUI's ``cuda_malloc.py`` switches most NVIDIA setups to PyTorch's
  ``cudaMallocAsync`` backend (workers inherit it), which cannot ("cudaMallocAsync does not yet
  support shareIpcHandle"). So the allocator backend is read and a one-bucket trial export is
  made first; where either says no, the stream goes through the process group (gloo stages it
  through host memory) and the status route says why (``transport_reason``).

With tensor parallelism rank 0 cuts every rank's slices from each weight in turn and keeps
only its own; workers receive only theirs.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import sys
import time
import weakref
from dataclasses import dataclass

import torch

from . import file_reads, quantized, sources, packed, pickling, stream
from .shards import build_shard, cut_plan, finish_shard, named_tensors
from ..distributed import comm, messages
from ..plans import Plan, plan_wire

log = logging.getLogger("parallel")

TRANSPORT_ENV = "PARALLEL_WEIGHT_TRANSPORT"  # expert / test override: shared, process_group, handles
TRANSPORTS = ("shared", "process_group", "handles")


def allocator_backend() -> str:
    """PyTorch's CUDA allocator backend in this process ("native" or "cudaMallocAsync"); the
    workers inherit the setting (PYTORCH_CUDA_ALLOC_CONF) from rank 0."""
    try:
        return str(torch.cuda.get_allocator_backend())
    except Exception:  # no CUDA in this build: read the setting as PyTorch would
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
        return "cudaMallocAsync" if "backend:cudamallocasync" in conf.replace(" ", "").lower() else "native"


def trial_export(device) -> str | None:
    """Export one small bucket's CUDA IPC handle as the handle channel would: None if it works,
    else what went wrong."""
    try:
        bucket = torch.empty(stream.TRIAL_BUCKET_BYTES, dtype=torch.uint8, device=device)
        bucket.untyped_storage()._share_cuda_()
        return None
    except Exception as exc:  # RuntimeError from the allocator, or no CUDA at all
        return f"{type(exc).__name__}: {exc}".strip()


def handles_refusal(device) -> str | None:
    """Why CUDA IPC handles cannot carry the weights from rank 0's ``device``, or None."""
    if not sys.platform.startswith("linux"):
        return "CUDA IPC handles between processes need Linux"
    backend = allocator_backend()
    if backend != "native":
        return (f"PyTorch's {backend} allocator cannot export CUDA IPC handles (ComfyUI selects it unless started "
                "with --disable-cuda-malloc)")
    failed = trial_export(device)
    if failed is not None:
        return f"a trial export of a CUDA IPC handle failed ({failed})"
    return None


def choose_transport(config, device=None) -> tuple[str, str]:
    """(transport, why) for a world of ``config`` whose rank 0 computes on ``device``."""
    device = device if device is not None else torch.device(config.devices[0])
    forced = os.environ.get(TRANSPORT_ENV, "").strip().lower()
    if forced:
        if forced not in TRANSPORTS:
            raise ValueError(f"{TRANSPORT_ENV}={forced!r}: choose one of {', '.join(TRANSPORTS)}")
        if forced == "shared" and (config.multi_host or config.device_type != "cpu"):
            raise ValueError(f"{TRANSPORT_ENV}=shared needs CPU ranks on one host")
        if forced == "handles" and config.multi_host:
            raise ValueError(f"{TRANSPORT_ENV}=handles needs every rank on one host")
        if forced == "handles" and config.device_type != "cpu":
            refusal = handles_refusal(device)
            if refusal is not None:
                raise ValueError(f"{TRANSPORT_ENV}=handles cannot work here: {refusal}")
        return forced, f"{TRANSPORT_ENV}={forced}"
    if config.multi_host:
        return "process_group", "ranks on several hosts"
    if config.device_type == "cpu":
        return "shared", "CPU ranks on one host map rank 0's pages"
    if config.backend == "nccl":
        return "process_group", "NCCL between the ranks' devices"
    refusal = handles_refusal(device)
    if refusal is not None:
        log.warning("parallel: weights travel through the process group (staged through host memory): %s", refusal)
        return "process_group", refusal
    return "handles", "ranks sharing a host without NCCL: CUDA IPC handles"


@dataclass
class _Copy:
    key: str
    version: tuple
    run_module: torch.nn.Module | None  # rank 0's own shard (tensor parallel), else None: the module itself
    param_bytes: int
    send: dict | None = None  # how its weights came: the send's figures (``last_send``), with the model's name


class LoadStopped(RuntimeError):
    """Cancel was pressed while a model's weights were loading: the workers stopped reading and no
    rank holds the model (the world stays up; the next run loads it again)."""


class ModelCopies:
    def __init__(self, world):
        self._world = weakref.ref(world)
        self._copies: "weakref.WeakKeyDictionary[torch.nn.Module, _Copy]" = weakref.WeakKeyDictionary()
        self._keys = itertools.count(1)
        self._dead_keys: list[str] = []  # models garbage-collected on rank 0, to drop at the next safe point
        self.transport, self.transport_reason = choose_transport(world.config, world.device)
        self.sends = 0
        self.last_reads: dict | None = None  # the last stream's file reads (file_reads.ReadPlan, summed up)
        self.last_send: dict = {}  # the last model sent: seconds, transport, bytes (and the forward it came with)

    @property
    def world(self):
        return self._world()

    # ------------------------------------------------------------ queries
    def holds(self, module: torch.nn.Module) -> bool:
        return module in self._copies

    @property
    def param_bytes_rank0(self) -> int:
        return sum(c.param_bytes for c in list(self._copies.values()))

    @property
    def own_param_bytes_rank0(self) -> int:
        """Rank 0's copies that are not ComfyUI's module itself (tensor-parallel shards)."""
        return sum(c.param_bytes for c in list(self._copies.values()) if c.run_module is not None)

    def held(self) -> list[dict]:
        """Every model the ranks hold now and how its weights came (the status route's ``models``)."""
        return [dict(c.send) for c in list(self._copies.values()) if c.send is not None]

    def key_of(self, module: torch.nn.Module) -> str:
        return self._copies[module].key

    def run_module(self, module: torch.nn.Module) -> torch.nn.Module | None:
        copy = self._copies.get(module)
        return None if copy is None else (copy.run_module or module)

    # ------------------------------------------------------------ send
    def ensure(self, module: torch.nn.Module, plan: Plan, source: "sources.WeightSource | None",
               layout=None):
        """The key the workers know ``module`` by and the module rank 0 runs (``module`` itself,
        or its tensor-parallel shard), sending the weights first unless the ranks hold this version
        (in ``layout``, default the world's: its tensor-parallel slices are cut for that layout)."""
        world = self.world
        layout = layout or world.layout
        self.drop_dead()
        tp = layout.size("tp") if plan.tensor_parallel is not None else 1
        # What each rank holds depends on the layout through its tensor-parallel slice only (tp is
        # the innermost dimension: rank r holds slice r % tp in every layout): layouts that differ
        # in their context-parallel dimensions alone share the weights sent once.
        # A user plan whose file changed since the send (plans/vocabulary/user.py) sends the model again, with
        # the new plan: every rank runs the plan rank 0 runs.
        version = (tp, source.version() if source is not None else ("as given",), plan.source)
        found = self._copies.get(module)
        if found is not None and found.version == version:
            sources.finish_offload(module)  # held already: the full weights still leave the device
            return found.key, found.run_module or module
        plan.check_matches(module)
        if source is not None:
            source.refuse_unsupported(plan.title)
        key = found.key if found is not None else f"m{next(self._keys)}"
        if found is not None:
            self._copies.pop(module, None)  # rank 0's old shard goes before the new one is cut
            found.run_module = None
        started = time.perf_counter()
        shared_before = pickling.SHARED_BYTES.total
        coords = [layout.coords(r)["tp"] for r in range(world.world_size)]
        with world.loading():
            if self.transport == "shared":
                run_module = self._send_shared(module, plan, source, key, tp, coords)
            else:
                run_module = self._send_stream(module, plan, source, key, tp, coords)
            sources.finish_offload(module)  # what the stream did not move (packed tensors, the shared path)
            self._await_loaded(key)
        comm.HOST.clear()  # the send's staging buffers (pinned with gloo on CUDA): a model's worth otherwise
        nbytes = pickling.param_bytes(run_module)
        elapsed = time.perf_counter() - started
        self.sends += 1
        self.last_send = {"seconds": round(elapsed, 3), "transport": self.transport, "rank0_bytes": nbytes, "tp": tp,
                          "file_reads": self.last_reads if self.transport != "shared" else None,
                          # shared: what this send copied into shared memory (the rest travelled as handles)
                          "shared_bytes": pickling.SHARED_BYTES.total - shared_before if self.transport == "shared"
                          else None}
        self._copies[module] = _Copy(key, version, run_module if run_module is not module else None, nbytes,
                                     {"key": key, "model": type(module).__name__, **self.last_send})
        weakref.finalize(module, _release_key, weakref.ref(self), key)
        log.info("sent %s (%.1f MB on rank 0%s) to %d workers by %s in %.2fs", type(module).__name__, nbytes / 1e6,
                 f", tensor parallel {tp}" if tp > 1 else "", len(world.workers), self.transport, elapsed)
        return key, run_module

    def _await_loaded(self, key: str) -> None:
        """Every worker's answer to the send of ``key``. Cancel pressed meanwhile (the world's
        ``load_cancelled``) stops the workers' file reads (``world.stop_loads``): a worker that
        stopped holds nothing of the model, and then no rank does (``LoadStopped``)."""
        world = self.world
        deadline = time.monotonic() + world.startup_timeout
        stopped = []

        def waiting():
            if not stopped and world.load_cancelled():
                world.stop_loads()
                stopped.append(True)
        answers = [world.expect(w, (messages.Loaded, messages.LoadHalted), deadline, patient=True, waiting=waiting)
                   for w in world.workers]
        halted = sum(isinstance(a, messages.LoadHalted) for a in answers)
        if halted:
            self._drop_everywhere(key)
            comm.HOST.clear()
            raise LoadStopped(f"Cancel stopped the load of {key}'s weights ({halted} of {len(answers)} workers were "
                              "still reading them); no rank holds the model")

    def _weight_of(self, module, source, device):
        if source is None:
            return lambda name, t: t if t.device == device else t.to(device)
        owners = sources.owners(module)
        return lambda name, t: source.weight(name, t, device, owners.get(name))

    @staticmethod
    def _packed_patches(source, name, t) -> list:
        """The LoRA patches a packed (GGUF) tensor's layer applies when it dequantizes."""
        return source.packed_patches(name) if source is not None else list(getattr(t, "patches", None) or ())

    @staticmethod
    def _dequantize(module, source):
        """name, packed tensor -> the layer's own dequantization of it (patches applied), in the
        dtype the model computes in: what TP cuts where a packed tensor cannot be cut as stored."""
        owners = sources.owners(module)
        dtype = (source.compute_dtype() if source is not None else None) or torch.float32
        return lambda name, w: packed.dequantized(owners[name], w, dtype)

    def _send_shared(self, module, plan, source, key, tp, coords):
        """CPU ranks on one host: each worker maps the pages of its module (zero copy)."""
        world = self.world
        weight_of = self._weight_of(module, source, torch.device("cpu"))
        if tp > 1:
            dequantize = self._dequantize(module, source)
            # Views where a slice is one: every rank maps the pages of the weight rank 0 holds.
            shards = {c: build_shard(module, plan.tensor_parallel, c, tp, weight_of=weight_of, dequantize=dequantize,
                                     views=True) for c in range(tp)}
            run_module, target_of = shards[coords[0]], (lambda rank: shards[coords[rank]])
        else:
            run_module, target_of = module, (lambda rank: module)
        stream.LOAD.begin(sum(pickling.param_bytes(target_of(w.rank)) for w in world.workers))
        for w in world.workers:
            target = target_of(w.rank)
            # One pickle per receiver: each pickle takes a reference on the shared files that
            # its receiver releases, so one pickle read by several workers would let them vanish.
            w.send(messages.Load(key, plan_wire(plan),
                                pickling.pack_module(target, module_state=sources.worker_module_state)))
            w.storages[key] = pickling.shared_storages(target)  # given back if this worker dies
            stream.LOAD.add(pickling.param_bytes(target))
        return run_module

    def _send_stream(self, module, plan, source, key, tp, coords):
        """Accelerators and other hosts: a skeleton, then the bytes from rank 0's device."""
        world = self.world
        names = {id(t): n for n, t in named_tensors(module)}
        cuts = cut_plan(module, plan.tensor_parallel, tp) if tp > 1 else {}
        forms = self._stream_forms(module, source, cuts, tp)
        data, tensors, packed_slots, parts = pickling.pack_skeleton(
            module, module_state=sources.worker_module_state, forms=forms)
        weight = self._stream_weight(module, source, names, tensors, packed_slots, parts, forms, tp)
        reads = self._file_reads(module, source, names, tensors, packed_slots, parts, forms)
        entries = [dataclasses.replace(e, from_file=True) if i in reads.keys else e
                   for i, e in enumerate(_stream_entries(tensors, packed_slots, parts, forms, cuts))]
        wire = [e.wire() for e in entries]
        for w in world.workers:
            w.send(messages.LoadStream(key, plan_wire(plan), data, wire, (coords[w.rank], tp), self.transport,
                                      stream.BUCKET_BYTES, reads.wire()))
        self.last_reads = {"file": reads.path and os.path.basename(reads.path), "tensors": len(reads.keys),
                           "bytes_per_worker": [sum(entries[i].local_nbytes(tp) for i in reads.keys)
                                                for _ in world.workers],
                           "streamed_tensors": sum(reads.why_streamed.values()),
                           "why_streamed": dict(reads.why_streamed)}
        kept = stream.send(entries, weight, self._channel(), world.device, tp, coords,
                           keep_coord=coords[0] if tp > 1 else None, bucket_bytes=stream.BUCKET_BYTES)
        if tp == 1:
            return module
        shard = finish_shard(pickling.unpack_skeleton(data, kept), plan.tensor_parallel, coords[0], tp)
        return shard.to(world.device)

    def _file_reads(self, module, source, names, tensors, packed_slots, parts, forms) -> file_reads.ReadPlan:
        """The slots every worker reads from the checkpoint itself (``file_reads``), checked here."""
        plain = [i for i, t in enumerate(tensors)
                 if i not in parts and i not in packed_slots and id(t) not in forms and file_reads.readable(t)]
        if not file_reads.enabled():
            path, why = None, f"{file_reads.SWITCH_ENV}=0"
        elif self.world.config.multi_host:
            path, why = None, "ranks on several hosts (the file may not be on theirs)"
        elif source is None:
            path, why = None, "a model without a ComfyUI loader"
        else:
            path, why = source.checkpoint()
        owners = sources.owners(module) if path is not None else {}
        slots = []
        for i in plain:
            t, name = tensors[i], names.get(id(tensors[i]))
            patched = path is not None and name is not None and source.patched(name, owners.get(name))
            base = t if path is None or patched or name is None else source.weight(name, t, t.device, owners.get(name))
            slots.append((i, name, base, patched))
        return file_reads.plan_reads(path, why, slots)

    def _stream_forms(self, module, source, cuts, tp) -> dict:
        """Packed (GGUF) tensors: stored as they are, or dequantized where TP cannot cut them;
        ComfyUI's quantized layouts that TP cuts: each rank's part, a slot per data / scale tensor.
        A cut layer's LoRA tensors are added to ``cuts``: the stream cuts them alike."""
        dtype = (source.compute_dtype() if source is not None else None) or torch.float32
        forms = {}
        for name, t in named_tensors(module):
            if id(t) in cuts and quantized.layout_name(t) is not None:
                forms[id(t)] = quantized.PartForm(t, cuts[id(t)], tp)
                continue
            form = packed.stream_form(t, cuts.get(id(t)), tp, self._packed_patches(source, name, t), dtype)
            if form is not None:
                forms[id(t)] = form
                cuts.update(form.patch_cuts or {})
        return forms

    def _stream_weight(self, module, source, names, tensors, packed_slots, parts, forms, tp):
        """``weight(i)``: the tensor the stream sends for skeleton slot ``i``, as the forward uses it
        (patched, dequantized where its form says so), read from rank 0's device."""
        device = self.world.device
        weight_of = self._weight_of(module, source, device)
        dequantize = self._dequantize(module, source)
        offload = sources.offload_target(module) if tp > 1 else None
        owner_of = sources.owners(module) if offload is not None else {}

        def source_weight(i):
            t = tensors[i]
            if i in parts:  # the whole quantized tensor, as the forward uses it: its entry cuts it
                return weight_of(names.get(id(t)), t)
            if i in packed_slots:
                return t if t.device == device else t.to(device)
            name = names.get(id(t))
            if id(t) in forms:
                form = forms[id(t)]
                on_device = t.to(device)
                return dequantize(name, packed.with_patches(on_device, list(form.patches)))
            return weight_of(name, t)

        def weight(i):
            w = source_weight(i)
            t = tensors[i]
            name = names.get(id(t))
            if offload is not None and i not in parts and i not in packed_slots and id(t) not in forms and name in owner_of:
                # Cut from the device where ComfyUI left it; the module's own tensor leaves the device
                # now, while this bucket still reads the device data (a detached alias of it).
                w = w.detach() if w is t else w
                sources.offload_tensor(owner_of[name], name.rsplit(".", 1)[-1], offload)
            return w

        return weight

    def _channel(self):
        if self.transport == "process_group":
            return stream.ProcessGroupChannel()
        world = self.world

        def send(payloads, bucket):
            for w in world.workers:
                w.send(messages.Bucket(bucket if payloads is None else payloads[w.rank]))

        def confirm():
            deadline = time.monotonic() + world.startup_timeout
            for w in world.workers:
                world.expect(w, messages.BucketDone, deadline)
        return stream.HandleChannel(send=send, confirm=confirm)

    # ------------------------------------------------------------ release
    def release(self, module: torch.nn.Module) -> bool:
        """Free ``module`` on every rank (ComfyUI unloaded it). True if the ranks held it."""
        self.drop_dead()
        copy = self._copies.pop(module, None)
        if copy is None:
            return False
        copy.run_module = None
        self._drop_everywhere(copy.key)
        return True

    def drop_dead(self) -> None:
        """Tell the workers to drop the models rank 0 no longer has."""
        while self._dead_keys:
            self._drop_everywhere(self._dead_keys.pop())

    def _drop_everywhere(self, key: str) -> None:
        world = self.world
        if world is None or world.state != "ready":
            return
        for w in world.workers:
            try:
                w.send(messages.Drop(key))
                w.storages.pop(key, None)
            except (OSError, EOFError):
                pass


def _release_key(copies_ref, key: str) -> None:
    # A finalizer runs wherever the garbage collector does, even in the middle of a weight
    # stream: only note the key here; ``drop_dead`` tells the workers at a safe point.
    copies = copies_ref()
    if copies is not None:
        copies._dead_keys.append(key)


def _stream_entries(tensors, packed_slots, parts, forms, cuts) -> list:
    """One stream entry per skeleton slot: its shape and dtype on the wire and the cut each rank
    keeps (None: whole)."""
    entries = []
    for i, t in enumerate(tensors):
        origin = packed_slots.get(i)
        if i in parts:  # one plain tensor of each rank's part of a quantized tensor
            form = forms[id(t)]
            shape, part_dtype = form.specs[parts[i]]
            entries.append(stream.Entry(shape, part_dtype, quantized.PartOf(form.cut, parts[i], shape)))
        elif origin is not None:  # a packed tensor's stored data
            cut = cuts.get(id(origin))
            entries.append(stream.Entry(tuple(t.shape), t.dtype, packed.stored_cut(cut, origin) if cut else None))
        elif id(t) in forms:  # dequantized
            entries.append(stream.Entry(packed.logical_shape(t), forms[id(t)].dtype, cuts.get(id(t))))
        else:
            entries.append(stream.Entry(tuple(t.shape), t.dtype, cuts.get(id(t))))
    return entries
