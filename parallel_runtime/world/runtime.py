"""The process-wide runtime on rank 0: at most one live World, started lazily.

Workers start on the first sharded run, stay up across prompts, are replaced
when the config changes or a rank failed, and exit with ComfyUI. A rank that dies in the middle
of a prompt fails that prompt, between two forwards as during one.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time

from .memory import current_prompt, recent_process_memory
from .workers import WorkerFailure
from .world import World
from ..config import ParallelConfig

log = logging.getLogger("parallel")


class Runtime:
    def __init__(self):
        self._lock = threading.RLock()
        self._world = None  # the live World, if any
        self.last_failure: dict | None = None
        self.comfyui_path: str | None = None  # None: found from the imported comfy package
        self.first_step_check: dict | None = None  # the last first-step check's findings (comfyui_glue)
        self.block_cache = None  # () -> Block Cache's steps per prompt (comfyui_glue.cached_steps.counts)
        self.on_load = None  # () -> a listener of a weight load's progress (comfyui_glue.load_bar: ComfyUI's bar)
        self.load_cancelled = None  # () -> Cancel was pressed: a load under way stops (comfyui_glue.interrupts)

    def world_for(self, config: ParallelConfig):
        with self._lock:
            world = self._world
            if world is not None:
                if world.config == config and world.healthy:
                    return world
                lost = world.lost_during(current_prompt())
                if lost is not None:
                    world.failure, world.state = lost, "failed"
                if world.state == "failed" and world.failure:
                    self.last_failure = {"time": time.time(), "message": world.failure}
                reason = "config changed" if world.config != config else f"world {world.state}"
                world.shutdown(reason)
                self._world = None
                if lost is not None:  # this prompt fails; the next one starts fresh workers
                    raise WorkerFailure(lost)
            log.info("starting parallel world: %s", config.describe())
            self._world = World(config, comfyui_path=self.comfyui_path, on_load=self.on_load,
                                 load_cancelled=self.load_cancelled).start()
            return self._world

    @property
    def world(self):
        return self._world

    def release(self, module) -> bool:
        """ComfyUI unloaded ``module``: free it on every rank of the live world."""
        world = self._world
        return world is not None and world.state == "ready" and world.release(module)

    def shutdown(self, reason: str = "shutdown") -> None:
        with self._lock:
            if self._world is not None:
                self._world.shutdown(reason)
                self._world = None

    def status(self) -> dict:
        world = self._world
        if world is not None and world.failure and (self.last_failure is None
                                                    or self.last_failure["message"] != world.failure):
            self.last_failure = {"time": time.time(), "message": world.failure}
        if world is not None and world.state != "stopped":
            out = world.status()
        else:
            out = {"world_size": 1, "mesh": {"cfg": 1, "ring": 1, "ulysses": 1, "tp": 1}, "backend": None,
                   "state": "idle", "failure": None, "forwards": 0,
                   "ranks": [{"rank": 0, "device": None, "pid": os.getpid(), "alive": True, "param_bytes": 0,
                              **recent_process_memory(os.getpid()), "last_forward_ms": None, "forwards": 0}]}
        out["last_failure"] = self.last_failure
        out["first_step_check"] = self.first_step_check
        out["block_cache"] = self.block_cache() if self.block_cache is not None else []
        return out


RUNTIME = Runtime()
atexit.register(RUNTIME.shutdown, "ComfyUI exiting")
