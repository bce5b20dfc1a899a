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

import torch

from . import memory, protocol, settings
from .watchdog import SectionStopped
from .workers import WorkerFailure
from ..config import MESH_DIMS, describe_sizes
from ..distributed import comm
from ..distributed.mesh import MeshLayout, ProcessMesh
from ..layout.auto import calibrate
from ..parallel import arguments, compile_regions
from ..parallel.context_parallel import check_supported_arguments
from ..parallel.execution import run_sharded
from ..plans import ModelPlan
from ..weights import pickling
from ..weights.shards import named_tensors

log = logging.getLogger("parallel")


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
            w.conn.send(("digest", key))
            out[w.rank] = self.expect(w, "digest", deadline)[1]
        return out

    # ---------------------------------------------------------------- forward
    def forward(self, module: torch.nn.Module, plan: ModelPlan, method, args: tuple, kwargs: dict, source=None,
                distributed_attention: bool = True, compile=None, layout: MeshLayout | None = None,
                weights: tuple[float, ...] | None = None, ulysses_chunks: int | None = None):
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
        """
        if self.state != "ready":
            raise WorkerFailure(f"the parallel world is {self.state}: {self.failure or ''}")
        t0 = time.perf_counter()
        chunks = ulysses_chunks if ulysses_chunks is not None else settings.ulysses_chunks_setting()
        plan = plan.for_module(module)
        method_name = _method_name(method)
        bound = inspect.signature(_method_of(module, method_name)).bind(*args, **kwargs)
        check_supported_arguments(plan, bound)
        choose = layout is None and self.config.auto_layout and plan.kind == "transformer"
        if layout is not None and layout.world_size != self.world_size:
            raise ValueError(f"layout {layout.sizes} has {layout.world_size} ranks; this world has {self.world_size}")
        layout = layout or self.layout
        if choose:  # the model runs alone on rank 0 up to its blocks: on its own copy of the options
            trial = inspect.signature(_method_of(module, method_name)).bind(*bound.args, **bound.kwargs)
            arguments.set_options(trial, dict(arguments.get_options(bound) or {}))
        worker_bound = inspect.signature(_method_of(module, method_name)).bind(*bound.args, **bound.kwargs)
        if plan.kind == "transformer":  # text encoders take no transformer_options
            options = arguments.get_options(bound)
            arguments.set_options(worker_bound, protocol.worker_transformer_options(options))
        tensors: list = []
        spec = protocol.flatten((worker_bound.args, worker_bound.kwargs), tensors)
        meta = protocol.tensor_meta(tensors)
        t_prepared = time.perf_counter()
        # Nothing has reached a worker yet: errors above leave the world usable.
        try:
            if choose:  # inside: the ranks time the candidates, a failure there ends the world like any other
                layout = self.auto.layout_for(module, plan, _method_of(module, method_name), trial.args, trial.kwargs)
            if plan.kind == "transformer":
                self._note_idle_cfg(layout, bound)
            self.current_layout = layout
            if weights is None:
                weights = self.config.weights or (self.auto.weights_for(module) if self.config.auto_layout else ())
            sends = self.copies.sends
            with self.watchdog.guard("process groups", settings.STARTUP_TIMEOUT_S):
                mesh = self.mesh_for(layout)
            with self.watchdog.guard("weight send", settings.STARTUP_TIMEOUT_S):
                key, run_module = self.copies.ensure(module, plan, source, layout)
            started = time.perf_counter()
            with self._threads(), self.watchdog.guard("forward", settings.COLLECTIVE_TIMEOUT_S):
                prompt = memory.current_prompt()  # a new prompt resets every rank's memory peaks
                memory.PEAKS.begin(prompt, self.device)
                for w in self.workers:
                    w.conn.send(("forward", key, method_name, spec, meta, distributed_attention, compile,
                                 list(layout.sizes), weights, chunks, prompt))
                t_sent = time.perf_counter()
                protocol.broadcast_tensors(tensors, meta, self.device)
                t_broadcast = time.perf_counter()
                # What rank 0 spends on dispatch besides the input broadcast (a collective).
                self.last_dispatch = {"prepare_ms": (t_prepared - t0) * 1e3,
                                      "weights_check_ms": (started - t_prepared) * 1e3,
                                      "send_ms": (t_sent - started) * 1e3, "broadcast_ms": (t_broadcast - t_sent) * 1e3}
                # With TP rank 0 runs its shard; ours is the innermost wrapper, so calling the
                # shard's method directly is what the wrapper chain would have done.
                call = method if run_module is module else _method_of(run_module, method_name)
                with compile_regions.watched(compile, (key, repr(layout.sizes)), meta):
                    out = run_sharded(run_module, plan, mesh, call, _method_of(run_module, method_name),
                                      bound.args, bound.kwargs, distributed_attention=distributed_attention,
                                      compile=compile, weights=weights, ulysses_chunks=chunks)
                comm.synchronize(self.device)  # a step's time, not the time to queue its kernels
            self.last_forward_ms = (time.perf_counter() - started) * 1e3
            memory.PEAKS.sample(self.device)  # USS peak (CPU ranks)
            self.forwards += 1
            if self.first_forward is None:
                self.first_forward = {"seconds": round(time.perf_counter() - t0, 3),
                                      "after_ready_s": round(time.monotonic() - self.ready_at, 3)}
            if self.copies.sends != sends:  # this forward carried a model to the ranks
                self.copies.last_send["forward_s"] = round(time.perf_counter() - t0, 3)
            return out
        except BaseException as exc:
            mesh = None  # noqa: F841  (this frame must not keep the subgroups open through the shutdown)
            if self.watchdog.hung:  # it killed the workers: their deaths say nothing
                failure = f"{self.watchdog.fired}; every rank was stopped and the next run starts fresh workers"
            else:
                failure = self._explain_failure(exc)
                if failure is None and isinstance(exc, SectionStopped):
                    failure = f"{exc}; every rank was stopped and the next run starts fresh workers"
            self.failure = failure or f"rank 0: {type(exc).__name__}: {exc}"
            self.state = "failed"
            self.shutdown("a rank failed" if failure else f"rank 0 raised {type(exc).__name__}")
            if failure:
                raise WorkerFailure(failure) from exc
            raise

    def calibrate(self, run: dict, layouts: list) -> list[dict]:
        """Every rank times attention and a matmul at a run's size at once (layout/auto.py: calibrate)."""
        with self.watchdog.guard("layout timings", settings.STARTUP_TIMEOUT_S):
            for w in self.workers:
                w.conn.send(("calibrate", run, layouts))
            with self._threads():
                mine = calibrate(run, layouts, self.device)
            deadline = time.monotonic() + settings.STARTUP_TIMEOUT_S
            return [mine] + [self.expect(w, "calibrate", deadline)[1] for w in self.workers]

    def _note_idle_cfg(self, layout: MeshLayout, bound) -> None:
        """A cfg dimension with nothing to split (CFG 1, or cond and uncond run apart) is said in the status."""
        cfg = layout.size("cfg")
        first = next(iter(bound.arguments.values()), None)
        batch = first.shape[0] if isinstance(first, torch.Tensor) and first.ndim else 1
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
                w.conn.send(("mesh", list(layout.sizes)))
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
