"""The Executor: the engine's handle on its workers, whatever runs them.

`Executor.get_class(config)` picks the implementation from `distributed_executor_backend`:
UniProcExecutor (one worker in this process), MultiprocExecutor (worker processes on this node)
or RayDistributedExecutor (worker actors on a Ray cluster). The engine talks to workers only
through `collective_rpc(method, args)` (every worker runs `Worker.method(*args)`; their results
come back as a list in rank order) and `execute_model`, which returns the output rank's result.
The KV-cache size is agreed here: each rank reports what it can hold and all take the minimum.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any

from pagedlm.config import EngineConfig
from pagedlm.model_io import ExecuteModelRequest, ModelRunnerOutput


_EXECUTORS = {"uni": "pagedlm.executor.uniproc_executor:UniProcExecutor",
              "mp": "pagedlm.executor.multiproc_executor:MultiprocExecutor",
              "ray": "pagedlm.executor.ray_distributed_executor:RayDistributedExecutor"}


class WorkerFailedError(RuntimeError):
    """A worker died or raised: the executor is unusable and has been shut down."""


class Executor(ABC):

    @staticmethod
    def get_class(config: EngineConfig) -> type["Executor"]:
        backend = config.parallel_config.distributed_executor_backend
        if backend not in _EXECUTORS:
            raise ValueError(f"distributed_executor_backend {backend!r} is not one of "
                             f"{sorted(_EXECUTORS)}.")
        # By name: the base class does not import its implementations (Ray is optional).
        module, name = _EXECUTORS[backend].split(":")
        return getattr(importlib.import_module(module), name)

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int]) -> None:
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.is_shutdown = False
        try:
            self._init_executor()
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
            sizes = self.collective_rpc("determine_num_blocks")
            self.num_gpu_blocks = min(gpu for gpu, _ in sizes)
            self.num_cpu_blocks = min(cpu for _, cpu in sizes)
            self.collective_rpc("initialize_cache", args=(self.num_gpu_blocks,
                                                          self.num_cpu_blocks))
        except BaseException:
            self.shutdown()
            raise

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers (not yet initialised)."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None
                       ) -> list[Any]:
        """Run Worker.method(*args, **kwargs) on every worker; their results in rank order."""

    def execute_model(self, req: ExecuteModelRequest) -> ModelRunnerOutput | None:
        """One step on every worker; the output rank's result (None for cache-only steps)."""
        return next((r for r in self.collective_rpc("execute_model", args=(req,))
                     if r is not None), None)

    def check_health(self) -> None:
        """Raise WorkerFailedError if a worker has died since the last call (the engine asks
        between steps while it has nothing to run: a step finds a dead worker by itself)."""

    def shutdown(self) -> None:
        """Stop the workers; safe to call more than once."""
        self.is_shutdown = True
