"""A worker rank (1..N-1), started by rank 0 with ``python -m parallel_runtime.world.worker`` or
forked from the fork server that imported this module (spawn.py, forkserver.py).

It reads its bootstrap from stdin, puts the ComfyUI root first on ``sys.path`` (the pack root
last) and sets ``comfy.cli_args.args`` before anything imports ``comfy`` (nothing of the runtime
imports ComfyUI when it is imported), connects its control channel, joins the process group and
then serves rank 0's commands in order. Any error is reported with its traceback and ends the
process, so that no other rank stays blocked in a collective. It also exits when rank 0 goes away.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import importlib.abc
import importlib.machinery
import json
import os
import pickle
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client

import psutil
import torch
import torch.distributed as dist

from . import memory, protocol, settings
from .memory import keep_freed_heap, release_free_heap
from ..distributed import comm, messages
from ..distributed.mesh import MeshLayout, ProcessMesh
from ..layout import probe
from ..layout.auto import calibrate
from ..parallel import compile_regions, scoped_hooks
from ..parallel.execution import run_sharded, timed_modules
from ..plans import plan_from_wire
from ..weights import file_reads, pickling, stream
from ..weights.pickling import tensor_digest
from ..weights.shards import finish_shard, named_tensors

# The runtime as this process imports it ("parallel_runtime"); rank 0's name for it may differ.
RUNTIME_PACKAGE = __package__.rpartition(".")[0]


def _watch_parent(parent_pid: int) -> None:
    """Exit when rank 0 (our parent) is gone, even if it was killed with SIGKILL."""
    def loop():
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(0.5)
    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


def _prepare_comfy(boot: dict) -> None:
    pack_root = boot["pack_root"]
    while pack_root in sys.path:  # on PYTHONPATH to start this module; behind everything from now on
        sys.path.remove(pack_root)
    sys.path.insert(0, boot["comfyui_path"])
    sys.path.append(pack_root)  # after ComfyUI: the pack's folder names must not shadow ComfyUI's
    import comfy.options  # noqa: F401  (arg parsing stays off: we are not ComfyUI's main)
    import comfy.cli_args

    for key, value in boot.get("comfy_args", {}).items():
        setattr(comfy.cli_args.args, key, value)
    alias_rank0_package(boot.get("rank0_package"))


class _Rank0Names(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``<rank 0's name>[.sub]`` as this process's ``parallel_runtime[.sub]`` (the very
    module object, imported here if it was not yet), and the packages above rank 0's name as
    empty ones: every module of the runtime, whichever a pickle names, with no list to keep."""

    def __init__(self, rank0: str, own: str = RUNTIME_PACKAGE):
        self.rank0, self.own = rank0, own
        self.parents = {rank0.rsplit(".", i)[0] for i in range(1, rank0.count(".") + 1)}
        self._found: dict[str, object] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.rank0 or fullname.startswith(self.rank0 + "."):
            module = importlib.import_module(self.own + fullname[len(self.rank0):])
            self._found[fullname] = (module, module.__spec__)
            return importlib.machinery.ModuleSpec(fullname, self, is_package=hasattr(module, "__path__"))
        if fullname in self.parents:
            return importlib.machinery.ModuleSpec(fullname, None, is_package=True)  # an empty namespace
        return None

    def create_module(self, spec):
        return self._found[spec.name][0]

    def exec_module(self, module):
        # The import system gave the module the alias's spec: it keeps its own.
        for found, own_spec in self._found.values():
            if found is module:
                module.__spec__ = own_spec


def alias_rank0_package(name: str | None) -> None:
    """Rank 0 imported the pack under the name ComfyUI gave it; let pickles that name it
    (its weights slots, for instance) find this process's modules."""
    if not name or name == RUNTIME_PACKAGE:
        return
    sys.meta_path.insert(0, _Rank0Names(name))


def main() -> int:
    """A spawned worker: its bootstrap comes on stdin."""
    return run(json.loads(sys.stdin.readline()))


def run(boot: dict) -> int:
    """Serve as the worker ``boot`` describes (spawned, or forked by the fork server) until told to stop."""
    # The test fake of NCCL's abort (comm.FAKE_ABORT_ENV) is rank 0's: only rank 0 aborts.
    os.environ.pop("PARALLEL_TEST_NCCL_ABORT", None)
    rank = boot["rank"]
    _watch_parent(boot["parent_pid"])
    _prepare_comfy(boot)

    address = boot["control_address"]
    if isinstance(address, list):  # rank 0 on another host: TCP on its rendezvous address
        conn = Client(tuple(address), family="AF_INET", authkey=bytes.fromhex(boot["authkey"]))
    else:
        conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(boot["authkey"]))
    server = None
    failure = None
    try:
        conn.send(messages.wire(messages.Hello(rank, os.getpid())))
        server = _Server(boot, conn)
        server.serve()
    except (EOFError, ConnectionError):
        return 0  # rank 0 went away
    except BaseException:
        failure = traceback.format_exc()
    if failure is not None:
        # Outside the except block: the traceback's frames (which hold the model) are gone,
        # so releasing the shared weights really unmaps them.
        try:
            conn.send(messages.wire(messages.Error(rank, failure)))
            if server is not None:
                server.release()
        except Exception:
            pass
        sys.stderr.write(failure)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(3)  # no clean-up that could block in a collective
    return 0


class _Server:
    def __init__(self, boot: dict, conn):
        self.boot = boot
        self.conn = conn
        self.rank = boot["rank"]
        self.device = torch.device(boot["devices"][self.rank])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if boot.get("threads"):
            torch.set_num_threads(int(boot["threads"]))
        self.heap_kept = self.device.type == "cpu" and keep_freed_heap()
        pickling.use_shared_memory_strategy()
        first = messages.unwire(conn.recv())
        assert isinstance(first, messages.StatusTable), first
        self.remote = bool(boot.get("remote"))
        # On another host the table cannot be shared: the row goes to rank 0 in Stats messages.
        self.status_table = pickle.loads(first.table) if first.table is not None else \
            torch.zeros(boot["world_size"], len(protocol.STATUS_FIELDS), dtype=torch.float64)
        timeout = datetime.timedelta(seconds=boot["timeout_s"])
        store = dist.TCPStore(boot["store_host"], boot["store_port"], boot["world_size"], False, timeout=timeout)
        dist.init_process_group(boot["backend"], store=store, rank=self.rank, world_size=boot["world_size"],
                                timeout=timeout)
        self.process_groups: dict = {}  # rank set -> group, shared by the meshes (as on rank 0)
        self.mesh = ProcessMesh(MeshLayout.from_sizes(boot["mesh"]), self.rank, self.process_groups)
        self.meshes = {self.mesh.layout.sizes: self.mesh}  # every layout rank 0 formed groups for
        self.models: dict[str, tuple] = {}
        self.read_slots: dict[str, dict] = {}  # model key -> slot -> (file, key, tp, tensor) read from the file
        self.heap_to_trim = False
        self._publish_progress()
        self.send(messages.Ready(self.rank))

    def _publish_progress(self) -> None:
        """Rank 0's watchdog judges a long forward by whether the ranks progress: this rank's count
        of completed collectives goes to its row of the shared status table, every 50 ms."""
        field = protocol.STATUS_FIELDS.index("progress")
        stop = threading.Event()

        def publish() -> None:  # holds the table only while it writes to it
            table = self.status_table
            if table is not None:
                table[self.rank, field] = float(comm.PROGRESS.count)
                table[self.rank, protocol.LOAD_FIELDS] = torch.tensor(
                    [float(stream.LOAD.done), float(stream.LOAD.total), float(file_reads.READ_BYTES.total),
                     float(stream.LOAD.loads)], dtype=torch.float64)

        def loop():
            while not stop.is_set():
                publish()
                stop.wait(0.05)
        thread = threading.Thread(target=loop, name="parallel-progress", daemon=True)
        thread.start()

        def stop_publishing() -> None:
            stop.set()
            thread.join(5)
        self.stop_progress = stop_publishing

    def send(self, record) -> None:
        """A message to rank 0 (distributed/messages.py)."""
        self.conn.send(messages.wire(record))

    def serve(self) -> None:
        handlers = {messages.Load: self.on_load, messages.LoadStream: self.on_load_stream,
                    messages.Drop: self.on_drop, messages.Digest: self.on_digest, messages.Probe: self.on_probe,
                    messages.Calibrate: self.on_calibrate, messages.Mesh: self.on_mesh,
                    messages.Forward: self.on_forward, messages.Trim: self.on_trim, messages.Ping: self.on_ping}
        while True:
            msg = self._next_command()
            if isinstance(msg, messages.Shutdown):
                self.release()
                return
            handlers[type(msg)](msg)

    def _next_command(self):
        """Rank 0's next message. A CPU rank with a forward's freed heap that waits for it
        ``settings.IDLE_TRIM_S`` (its prompt is over) gives that heap back first."""
        if self.heap_to_trim and not self.conn.poll(settings.IDLE_TRIM_S):
            release_free_heap(collect=False)
            self.heap_to_trim = False
        return messages.unwire(self.conn.recv())

    def release(self) -> None:
        """Unmap the shared weights and the status table, and tell rank 0 so. The progress thread
        stops first: a reference it held would keep the table mapped past the release."""
        self.stop_progress()
        self.models.clear()
        self.read_slots.clear()
        self.status_table = None
        gc.collect()
        comm.clear_pools()  # the staging pool's pinned buffers and the exchange's
        self.send(messages.Released(self.rank))

    def on_load(self, msg: messages.Load) -> None:
        """CPU ranks on one host: map rank 0's shared pages (no copy). ``msg.plan``: ``plans.plan_wire``'s
        form (a family name, or a user plan's text)."""
        self._drop(msg.key)  # release the old weights first
        module = pickling.unpack_module(msg.data, self.device)
        stream.LOAD.begin(pickling.param_bytes(module))
        stream.LOAD.finish()  # mapped at once
        self.models[msg.key] = (module, plan_from_wire(msg.plan).for_module(module))
        self._loaded(msg.key)

    def on_load_stream(self, msg: messages.LoadStream) -> None:
        """A skeleton whose slots are allocated here, on this rank's device, at this rank's
        shape, then filled from rank 0's byte stream (weights/stream.py) and, for the slots
        ``reads`` names (``(path, {slot: key})``), from the checkpoint file (weights/file_reads.py)."""
        key, tp, reads = msg.key, msg.tp, msg.reads
        held = self.read_slots.pop(key, {})  # what the old version read from the file, kept where unchanged
        self._drop(key)  # free the old copy before the new one takes device memory
        stops = self._load_stops()  # before rank 0 can stop this load: it streams first
        tp_rank, tp_size = tp
        entries = [stream.Entry.from_wire(item) for item in msg.wire]
        slots = stream.allocate(entries, tp_size, self.device)
        link = stream.ProcessGroupChannel() if msg.channel == "process_group" else \
            stream.HandleChannel(receive=self._bucket, received=lambda: self.send(messages.BucketDone()))
        stream.receive(entries, slots, link, self.device, tp_size, msg.bucket_bytes)
        if reads is not None:
            path, keys = reads
            kept = file_reads.reusable(held, path, keys, tp, slots)
            for index, tensor in kept.items():
                slots[index] = tensor
                stream.LOAD.add(tensor.numel() * tensor.element_size())
            if not file_reads.read_into(path, {i: k for i, k in keys.items() if int(i) not in kept}, entries, slots,
                                        tp, progress=stream.LOAD.add, stop=lambda: self._load_stops() != stops):
                del slots, held, kept  # nothing of the model stays
                stream.LOAD.abandon()
                comm.HOST.clear()
                self._publish(param_bytes=pickling.param_bytes_all(m for m, _ in self.models.values()))
                self.send(messages.LoadHalted(key))
                return
            comm.synchronize(self.device)
            self.read_slots[key] = {int(i): (path, k, tuple(tp), slots[int(i)]) for i, k in keys.items()}
        del held
        # Filled first: a tensor rebuilt around its slots may copy them (ComfyUI's QuantizedTensor).
        module = pickling.unpack_skeleton(msg.data, slots)
        plan = plan_from_wire(msg.plan).for_module(module)
        if tp_size > 1:
            finish_shard(module, plan.tensor_parallel, tp_rank, tp_size)
        module.to(self.device)  # anything the skeleton carried by value
        module.requires_grad_(False)
        self.models[key] = (module, plan)
        comm.HOST.clear()  # the send's staging buffers (pinned with gloo on CUDA)
        self._loaded(key)

    def _bucket(self):
        """The next bucket of a stream sent by handles."""
        msg = messages.unwire(self.conn.recv())
        if not isinstance(msg, messages.Bucket):
            raise RuntimeError(f"weight stream: expected a bucket from rank 0, got {type(msg).__name__}")
        return msg.payload

    def _load_stops(self) -> float:
        """Loads rank 0 stopped (Cancel), from its row of the shared table (none seen on another host)."""
        return float(self.status_table[0, protocol.LOAD_STOPS_FIELD])

    def _loaded(self, key: str) -> None:
        self._publish(param_bytes=pickling.param_bytes_all(m for m, _ in self.models.values()))
        self.send(messages.Loaded(key))

    def _drop(self, key: str) -> None:
        self.read_slots.pop(key, None)
        if self.models.pop(key, None) is None:
            return
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # give the memory back to the device, not just to torch's cache

    def on_drop(self, msg: messages.Drop) -> None:
        self._drop(msg.key)
        self._publish(param_bytes=pickling.param_bytes_all(m for m, _ in self.models.values()))

    def on_digest(self, msg: messages.Digest) -> None:
        """Name -> (shape, dtype, sha256 of the bytes) of every tensor this rank holds for ``key``
        (tests: did a worker receive exactly the slices it should have?)."""
        module, _ = self.models[msg.key]
        self.send(messages.Digests({name: tensor_digest(t) for name, t in named_tensors(module)}))

    def on_probe(self, msg: messages.Probe) -> None:
        self.send(messages.ProbeResult(probe.run(self.device, self.rank, self.boot["world_size"])))

    def on_calibrate(self, msg: messages.Calibrate) -> None:
        timings = calibrate(msg.run, msg.layouts, self.device)
        factor = slow_factor(self.rank)
        if factor != 1.0:  # the test knob's slower rank measures slower too
            timings = {"sites": {k: v * factor for k, v in timings["sites"].items()},
                       "matmul_flops_per_s": timings["matmul_flops_per_s"] / factor}
        self.send(messages.Timings(timings))

    def on_mesh(self, msg: messages.Mesh) -> None:
        """Form the process groups of another layout (rank 0 does the same, in the same order)."""
        layout = MeshLayout(tuple(msg.sizes))
        self.meshes[layout.sizes] = ProcessMesh(layout, self.rank, self.process_groups)

    def on_forward(self, msg: messages.Forward) -> None:
        key, meta, run = msg.key, msg.meta, msg.settings
        compile = run.compile
        memory.PEAKS.begin(msg.prompt, self.device)  # a new prompt: this rank's memory peaks start again
        started = time.perf_counter()
        self._maybe_inject_fault("start")
        module, plan = self.models[key]
        tensors = protocol.broadcast_tensors(None, meta, self.device)
        self._maybe_inject_fault("inputs")
        args, kwargs = protocol.unflatten(msg.spec, tensors)
        method = getattr(module, msg.method)
        if compile is not None and compile_regions.watch().listener is None:
            compile_regions.watch().listener = self._publish_compile
        mesh = self.meshes[tuple(run.layout)] if run.layout is not None else self.mesh
        with torch.inference_mode(), compile_regions.watched(compile, (key, repr(mesh.layout.sizes)), meta):
            with _slowed(module, plan, self.rank):
                run_sharded(module, plan, mesh, method, method, args, kwargs,
                            distributed_attention=run.distributed_attention, compile=compile, weights=run.weights,
                            ulysses=tuple(run.ulysses), patch_models=[self.models[k][0] for k in msg.patch_keys])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's time, not the time to queue its kernels
        row = self.status_table[self.rank]
        row[0] = (time.perf_counter() - started) * 1e3
        self._send_stats(forward_done=True)
        # The step's freed temporaries go back to the OS once this rank idles (settings.IDLE_TRIM_S),
        # or each CPU rank would keep a step of dead heap between prompts.
        self.heap_to_trim = self.device.type == "cpu"

    def _maybe_inject_fault(self, stage: str) -> None:
        """Failure drills: PARALLEL_FAULT_INJECT="raise:<rank>:<n>" makes that rank raise on its
        n-th forward, "hang:<rank>:<n>" makes it stop there without dying (the watchdog's case),
        "kill:<rank>:<n>" makes it die by SIGKILL in the middle of it (its inputs received, its
        part not computed), so that error reporting can be tested end to end."""
        spec = os.environ.get("PARALLEL_FAULT_INJECT", "")
        kind, _, rest = spec.partition(":")
        rank, _, nth = rest.partition(":")
        if kind not in ("raise", "hang", "kill") or not rank.isdigit() or int(rank) != self.rank:
            return
        if stage == "start":
            self.forwards_seen = getattr(self, "forwards_seen", 0) + 1
        if self.forwards_seen != int(nth or 1):
            return
        if kind == "kill" and stage == "inputs":
            os.kill(os.getpid(), 9)
        if kind == "hang" and stage == "start":  # alive, but never joins the forward's collectives
            time.sleep(10**6)
        if kind == "raise" and stage == "start":
            raise RuntimeError(f"injected fault on rank {self.rank} (PARALLEL_FAULT_INJECT={spec})")

    def _publish_compile(self, watch) -> None:
        """Live in the shared status table (rank 0's watchdog waits while a rank compiles)."""
        self.status_table[self.rank][protocol.COMPILE_FIELDS] = torch.tensor(watch.row(), dtype=torch.float64)
        if self.remote:  # no shared table across hosts: rank 0's watchdog reads it from a "stats" message
            self._send_stats()

    def on_trim(self, msg: messages.Trim) -> None:
        """Rank 0 asks for the freed heap back now (memory figures)."""
        if self.device.type == "cpu":
            release_free_heap(collect=False)
        self.heap_to_trim = False
        self.send(messages.Trimmed(self.rank))

    def on_ping(self, msg: messages.Ping) -> None:
        self.send(messages.Pong(self.rank))

    def _publish(self, param_bytes: int) -> None:
        self.status_table[self.rank][1] = float(param_bytes)
        self._send_stats()

    def _send_stats(self, forward_done: bool = False) -> None:
        """This rank's row: current and peak memory (a USS sample on CPU ranks, at the end of each
        forward and load: memory.PeakMemory) and the staging pool's pinned / kept bytes. A finished
        forward is counted last, so whoever sees the new count sees that forward's figures."""
        allocated, reserved = protocol.device_memory(self.device)
        row = self.status_table[self.rank]
        row[4], row[5] = (-1.0, -1.0) if allocated is None else (float(allocated), float(reserved))
        memory.PEAKS.sample(self.device)
        row[protocol.MEMORY_FIELDS] = torch.tensor(memory.PEAKS.row(self.device), dtype=torch.float64)
        if forward_done:
            row[2] += 1
        if self.remote:
            self.send(messages.Stats(self.status_table[self.rank].tolist() + [psutil.Process().memory_info().rss]))


SLOW_RANK_ENV = "PARALLEL_TEST_SLOW_RANK"


def slow_factor(rank: int) -> float:
    which, _, factor = os.environ.get(SLOW_RANK_ENV, "").partition(":")
    return float(factor or 2) if which.isdigit() and int(which) == rank else 1.0


def _slowed(module, plan, rank: int):
    """Test-only: PARALLEL_TEST_SLOW_RANK="<rank>:<factor>" makes that rank as many times slower
    (after each of the plan's blocks, or a VAE's convolutions, it waits factor - 1 times the CPU
    time that module took, and its layout-auto timings are that much slower), to check weighted
    splits against a slow GPU on a machine of equal ranks. Workers only (rank 1 and up)."""
    factor = slow_factor(rank)
    slowed = timed_modules(module, plan) if factor != 1.0 else []
    if not slowed:
        return contextlib.nullcontext()

    extra = factor - 1
    started: dict[int, float] = {}

    # This thread's CPU time, not the wall time: waiting for the other ranks inside a block
    # (the attention's exchange) must not count as work to slow down.
    def before(mod, args):
        started[id(mod)] = time.thread_time()

    def after(mod, args, out):
        time.sleep(max(0.0, extra * (time.thread_time() - started.pop(id(mod), time.thread_time()))))

    @contextlib.contextmanager
    def hooked():
        handles = []
        try:
            for mod in slowed:
                handles += [scoped_hooks.pre_hook(mod, before), scoped_hooks.post_hook(mod, after)]
            yield
        finally:
            for h in handles:
                h.remove()
    return hooked()


if __name__ == "__main__":
    sys.exit(main())
