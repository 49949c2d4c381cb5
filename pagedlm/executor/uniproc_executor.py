"""UniProcExecutor: one worker in the engine's own process (today's path: no copies, no IPC)."""
from __future__ import annotations

from typing import Any

from pagedlm.executor.abstract import Executor
from pagedlm.model_io import ExecuteModelRequest, ModelRunnerOutput
from pagedlm.worker.worker import Worker


class UniProcExecutor(Executor):

    def _init_executor(self) -> None:
        self.worker = Worker(self.config, self.eos_token_ids)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None
                       ) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def execute_model(self, req: ExecuteModelRequest) -> ModelRunnerOutput | None:
        return self.worker.execute_model(req)
