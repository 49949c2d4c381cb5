"""The Executor: the engine's handle on its workers (one in-process worker here)."""
from __future__ import annotations

from pagedlm.config import EngineConfig
from pagedlm.core.sched_output import ExecuteModelRequest
from pagedlm.worker.model_runner import ModelRunnerOutput
from pagedlm.worker.worker import Worker


class UniProcExecutor:

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int]) -> None:
        self.config = config
        self.worker = Worker(config.model_config, config.cache_config, eos_token_ids)
        sc = config.scheduler_config
        num_blocks = self.worker.determine_num_blocks(sc.max_num_seqs * sc.max_model_len)
        self.worker.initialize_cache(num_blocks, self.worker.determine_num_cpu_blocks())

    @property
    def num_gpu_blocks(self) -> int:
        return self.config.cache_config.num_gpu_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.config.cache_config.num_cpu_blocks

    def execute_model(self, req: ExecuteModelRequest) -> ModelRunnerOutput | None:
        return self.worker.execute_model(req)
