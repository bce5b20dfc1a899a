"""World's dispatch: one forward on every rank, the models the ranks hold, the layouts they run in.

``Dispatch`` is the half of ``World`` that a prompt drives (the other half, ``world.py``, starts
the workers, watches them and stops them): rank 0 binds the call, decides the layout, makes sure
every rank holds the model (``weights/model_copies.py``), sends the call to the workers, runs its
own part (``parallel/execution.py``) and turns any rank's failure into one ``WorkerFailure``
that names it. It reads the world's state (``self.workers``, ``self.copies``, ``self.watchdog``,
...) and calls back into its lifecycle (``expect``, ``shutdown``, ``_explain_failure``).
"""
from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass

import torch

from . import memory, protocol, settings
from .watchdog import SectionStopped
from .workers import WorkerFailure
from ..config import MESH_DIMS, describe_sizes
from ..distributed import comm, messages
from ..distributed.mesh import MeshLayout, ProcessMesh
from ..layout.auto import calibrate
from ..parallel import arguments, compile_regions, model_patches
from ..parallel.cfg import batch_of
from ..parallel.execution import check_arguments, run_sharded
from ..plans import PATCH_MODEL_PLAN, Plan
from ..weights import pickling
from ..weights.model_copies import LoadStopped
from ..weights.shards import named_tensors

log = logging.getLogger("parallel")


@dataclass
class _Call:
    """One forward as rank 0 prepared it: the bound call, its layout, what the workers receive."""

    plan: Plan
    method_name: str
    bound: inspect.BoundArguments
    trial: inspect.BoundArguments | None  # layout auto: the call rank 0 measures the run's shape with
    layout: MeshLayout
    spec: object
    tensors: list
    meta: list
    patch_models: list  # the models of the call's model patches (parallel/model_patches.py)
    t0: float
    t_prepared: float


class Dispatch:
    """Mixed into ``World``: what runs on the ranks once they are up."""

    # ---------------------------------------------------------------- models
    @property
    def param_bytes_rank0(self) -> int:
        return self.copies.param_bytes_rank0

    def release(self, module: torch.nn.Module) -> bool:
        """ComfyUI unloaded ``module``: free it on every rank."""
        with self._lock:
            return self.copies.release(module)

    def holdings(self, module: torch.nn.Module) -> dict[int, dict]:
        """rank -> {tensor name: (shape, dtype, sha256)} of what each rank holds of ``module``
        (rank 0: what it runs), to check what arrived where without moving the weights."""
        run_module = self.copies.run_module(module)
        if run_module is None:
            raise KeyError(f"the ranks hold no {type(module).__name__}")
        out = {0: {name: pickling.tensor_digest(t) for name, t in named_tensors(run_module)}}
        key = self.copies.key_of(module)
        deadline = time.monotonic() + self.startup_timeout
        for w in self.workers:
            w.send(messages.Digest(key))
            out[w.rank] = self.expect(w, messages.Digests, deadline).digests
        return out

    def release_free_heap(self) -> None:
        """Every CPU rank gives its freed heap back now (workers do so by themselves once idle for
        settings.IDLE_TRIM_S): for memory figures that must not wait for that."""
        memory.release_free_heap()
        deadline = time.monotonic() + self.startup_timeout
        for w in self.workers:
            w.send(messages.Trim())
        for w in self.workers:
            self.expect(w, messages.Trimmed, deadline)

    # ---------------------------------------------------------------- forward
    def forward(self, module: torch.nn.Module, plan: Plan, method, args: tuple, kwargs: dict, source=None,
                distributed_attention: bool = True, compile=None, layout: MeshLayout | None = None,
                weights: tuple[float, ...] | None = None, ulysses_chunks: int | None = None,
                ulysses_overlap: bool | None = None):
        """Run ``method(*args, **kwargs)`` of ``module`` on every rank, context-parallel.

        ``method`` is rank 0's bound callable (it may be a wrapper chain ending in a
        method of ``module``); workers call the method of the same name on their copy.
        ``source`` (``weights/sources.WeightSource``) says where the weights come from in
        ComfyUI and when they changed; without it the module's tensors are sent as they are,
        once. ``compile`` (compile_regions.CompileSettings): every rank runs the plan's blocks compiled.
        ``layout``: the ranks' layout for this model (same world size; default: the config's).
        ``weights``: relative speed per rank for the token split (default: the config's, or what
        layout auto measured; () for an even split). ``ulysses_chunks``: head groups of a pure
        Ulysses exchange that overlap the attention (default: PARALLEL_ULYSSES_CHUNKS, else 1).
        ``ulysses_overlap``: pure Ulysses' return overlaps each rank's own attention (default:
        ``settings.ulysses_overlap_setting``).
        """
        if self.state != "ready":
            raise WorkerFailure(f"the parallel world is {self.state}: {self.failure or ''}")
        chunks = ulysses_chunks if ulysses_chunks is not None else settings.ulysses_chunks_setting()
        overlap = (ulysses_overlap if ulysses_overlap is not None
                   else settings.ulysses_overlap_setting(tuple(self.config.devices)))
        call = self._prepare_call(module, plan, method, args, kwargs, layout)
        # Nothing has reached a worker yet: errors above leave the world usable.
        try:
            if call.trial is not None:  # inside: the ranks time the candidates, a failure there ends the world
                call.layout = self.auto.layout_for(module, call.plan, _method_of(module, call.method_name),
                                                   call.trial.args, call.trial.kwargs)
            if call.plan.configured_layout:
                self._note_idle_cfg(call.layout, call.bound)
                self.last_heads = call.plan.heads(module)
            self.current_layout = call.layout
            if weights is None:
                weights = self.config.weights or (self.auto.weights_for(module) if self.config.auto_layout else ())
            sends = self.copies.sends
            with self.watchdog.guard("process groups", settings.STARTUP_TIMEOUT_S):
                mesh = self.mesh_for(call.layout)
            with self.watchdog.guard("weight send", settings.STARTUP_TIMEOUT_S):
                key, run_module = self.copies.ensure(module, call.plan, source, call.layout)
                # A patch's model is held whole on every rank (not cut under TP), sent once.
                patch_keys = [self.copies.ensure(m, PATCH_MODEL_PLAN, None, call.layout)[0] for m in call.patch_models]
            if self.copies.sends != sends and self.device.type == "cpu":
                # A send to CPU ranks moves the weights into shared memory (or cuts them) and frees
                # what they were loaded into: in the arenas of ComfyUI's prompt thread glibc keeps
                # those pages (measured: half a model's worth under Ulysses 2) unless trimmed.
                memory.release_free_heap(collect=False)
            run = messages.RunSettings(distributed_attention, compile, list(call.layout.sizes), weights, (chunks, overlap))
            out = self._run_everywhere(call, module, method, key, run_module, mesh, run, patch_keys)
            if self.first_forward is None:
                self.first_forward = {"seconds": round(time.perf_counter() - call.t0, 3),
                                      "after_ready_s": round(time.monotonic() - self.ready_at, 3)}
            if self.copies.sends != sends:  # this forward carried a model to the ranks
                self.copies.last_send["forward_s"] = round(time.perf_counter() - call.t0, 3)
            return out
        except LoadStopped:
            raise  # Cancel during the load: every rank dropped the model, the world stays up
        except BaseException as exc:
            mesh = None  # noqa: F841  (this frame must not keep the subgroups open through the shutdown)
            failure = self._fail(exc)
            if failure:
                raise WorkerFailure(failure) from exc
            raise

    def _prepare_call(self, module, plan: Plan, method, args, kwargs, layout) -> "_Call":
        """Bind the call on rank 0 and encode what the workers receive (nothing is sent yet)."""
        t0 = time.perf_counter()
        plan = plan.for_module(module)
        method_name = _method_name(method)
        signature = inspect.signature(_method_of(module, method_name))
        bound = signature.bind(*args, **kwargs)
        check_arguments(plan, bound)
        if layout is not None and layout.world_size != self.world_size:
            raise ValueError(f"layout {layout.sizes} has {layout.world_size} ranks; this world has {self.world_size}")
        trial = None
        if layout is None and self.config.auto_layout and plan.configured_layout:
            # The model runs alone on rank 0 up to its blocks to be measured: on its own copy of the options.
            trial = signature.bind(*bound.args, **bound.kwargs)
            arguments.set_options(trial, dict(arguments.get_options(bound) or {}))
        worker_bound = signature.bind(*bound.args, **bound.kwargs)
        patch_models = []
        if plan.takes_transformer_options:
            # Model patches as data that every rank (rank 0 too) rebuilds them from; refused by name if unknown.
            options, patch_models = model_patches.encode(arguments.get_options(bound), plan,
                                                         next(iter(bound.arguments.values()), None))
            arguments.set_options(bound, options)
            arguments.set_options(worker_bound, protocol.worker_transformer_options(options))
        tensors: list = []
        spec = protocol.flatten((worker_bound.args, worker_bound.kwargs), tensors)
        return _Call(plan, method_name, bound, trial, layout or self.layout, spec, tensors,
                     protocol.tensor_meta(tensors), patch_models, t0, time.perf_counter())

    def _run_everywhere(self, call: "_Call", module, method, key, run_module, mesh, run: messages.RunSettings,
                        patch_keys):
        """The guarded section: the workers get the call and the inputs, rank 0 runs its part."""
        started = time.perf_counter()
        try:
            with self._threads(), self.watchdog.guard("forward", settings.COLLECTIVE_TIMEOUT_S):
                prompt = memory.current_prompt()  # a new prompt resets every rank's memory peaks
                memory.PEAKS.begin(prompt, self.device)
                for w in self.workers:
                    w.send(messages.Forward(key, call.method_name, call.spec, call.meta, run, prompt, patch_keys))
                t_sent = time.perf_counter()
                protocol.broadcast_tensors(call.tensors, call.meta, self.device)
                t_broadcast = time.perf_counter()
                # What rank 0 spends on dispatch besides the input broadcast (a collective).
                self.last_dispatch = {"prepare_ms": (call.t_prepared - call.t0) * 1e3,
                                      "weights_check_ms": (started - call.t_prepared) * 1e3,
                                      "send_ms": (t_sent - started) * 1e3,
                                      "broadcast_ms": (t_broadcast - t_sent) * 1e3}
                # With TP rank 0 runs its shard; ours is the innermost wrapper, so calling the
                # shard's method directly is what the wrapper chain would have done.
                own = _method_of(run_module, call.method_name)
                with compile_regions.watched(run.compile, (key, repr(call.layout.sizes)), call.meta):
                    out = run_sharded(run_module, call.plan, mesh, method if run_module is module else own, own,
                                      call.bound.args, call.bound.kwargs,
                                      distributed_attention=run.distributed_attention, compile=run.compile,
                                      weights=run.weights, ulysses=run.ulysses, patch_models=call.patch_models)
                comm.synchronize(self.device)  # a step's time, not the time to queue its kernels
        except BaseException:
            # The traceback keeps this frame: it must not keep the subgroups open through the shutdown
            # (a worker blocked in a collective with us would not fail, release its weights and exit).
            mesh = None  # noqa: F841
            raise
        self.last_forward_ms = (time.perf_counter() - started) * 1e3
        memory.PEAKS.sample(self.device)  # USS peak (CPU ranks)
        memory.PEAKS.sample_weights(memory.device_weight_bytes(self.device, self.copies.own_param_bytes_rank0))
        self.forwards += 1
        self.last_prompt = prompt
        return out

    def _fail(self, exc: BaseException) -> str | None:
        """A forward failed after reaching the workers: which rank and why (None: rank 0's own error),
        and the world goes down so that the next run starts fresh workers."""
        if self.watchdog.hung:  # it killed the workers: their deaths say nothing
            failure = f"{self.watchdog.fired}; every rank was stopped and the next run starts fresh workers"
        else:
            failure = self._explain_failure(exc)
            if failure is None and isinstance(exc, SectionStopped):
                failure = f"{exc}; every rank was stopped and the next run starts fresh workers"
        self.failure = failure or f"rank 0: {type(exc).__name__}: {exc}"
        self.state = "failed"
        self.shutdown("a rank failed" if failure else f"rank 0 raised {type(exc).__name__}")
        return failure

    def calibrate(self, run: dict, layouts: list) -> list[dict]:
        """Every rank times attention and a matmul at a run's size at once (layout/auto.py: calibrate)."""
        with self.watchdog.guard("layout timings", settings.STARTUP_TIMEOUT_S):
            for w in self.workers:
                w.send(messages.Calibrate(run, layouts))
            with self._threads():
                mine = calibrate(run, layouts, self.device)
            deadline = time.monotonic() + settings.STARTUP_TIMEOUT_S
            return [mine] + [self.expect(w, messages.Timings, deadline).timings for w in self.workers]

    def _note_idle_cfg(self, layout: MeshLayout, bound) -> None:
        """A cfg dimension with nothing to split (CFG 1, or cond and uncond run apart) is said in the status."""
        cfg = layout.size("cfg")
        batch = batch_of(next(iter(bound.arguments.values()), None))  # the rule the cfg split itself uses
        if cfg > 1 and batch % cfg:
            note = (f"cfg_size {cfg} has nothing to split: the model runs with a batch of {batch} (CFG 1, or "
                    f"ComfyUI running cond and uncond apart), so the {cfg} cfg groups compute the same thing; "
                    "set cfg_size 1 (or layout auto) and give the ranks to ulysses or ring")
            if note not in self.notes:
                log.warning("parallel: %s", note)
                self.notes.append(note)

    def mesh_for(self, layout: MeshLayout) -> ProcessMesh:
        """This world's process groups for ``layout``, formed on every rank the first time."""
        mesh = self.meshes.get(layout.sizes)
        if mesh is None:
            for w in self.workers:
                w.send(messages.Mesh(list(layout.sizes)))
            mesh = self.meshes[layout.sizes] = ProcessMesh(layout, 0, self._process_groups)  # every rank, in order
            log.info("parallel world: process groups for layout %s formed", describe_sizes(dict(zip(MESH_DIMS, layout.sizes))))
        return mesh

    def _threads(self):
        world = self

        class _Threads:
            def __enter__(self):
                self.saved = torch.get_num_threads()
                if world.threads is not None and world.threads != self.saved:
                    torch.set_num_threads(world.threads)

            def __exit__(self, *exc):
                if torch.get_num_threads() != self.saved:
                    torch.set_num_threads(self.saved)
        return _Threads()



def _method_of(module: torch.nn.Module, name: str):
    """The class's method bound to ``module`` (not an instance-level override such as the
    dispatch an object patch installs on a text encoder's ``forward``)."""
    return getattr(type(module), name).__get__(module)

def _method_name(method) -> str:
    """The name of the model method at the end of a wrapper chain (``_forward`` for ComfyUI models)."""
    target = getattr(method, "original", method)  # comfy.patcher_extension.WrapperExecutor
    func = getattr(target, "__func__", target)
    return func.__name__
