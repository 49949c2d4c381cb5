"""The Worker: owns the model, the KV cache and the ModelRunner on one device."""
from __future__ import annotations

import logging
import time

from pagedlm.attention import kernels
from pagedlm.config import CacheConfig, ModelConfig
from pagedlm.core.sched_output import ExecuteModelRequest
from pagedlm.model_executor.model_loader.loader import get_model
from pagedlm.utils import available_memory_bytes, cdiv
from pagedlm.worker.cache_engine import CacheEngine, kv_bytes_per_block
from pagedlm.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = logging.getLogger(__name__)


class Worker:

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 eos_token_ids: frozenset[int]) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        t = time.perf_counter()
        self.model = get_model(model_config)
        logger.info("model weights loaded in %.2fs", time.perf_counter() - t)
        # Build (first run only) and load the native attention kernel now rather than in the
        # middle of the first request; without a compiler this warns and falls back.
        kernels.available()
        self.runner = ModelRunner(model_config, self.model, cache_config.block_size, eos_token_ids)
        self.cache_engine: CacheEngine | None = None

    def determine_num_blocks(self, max_tokens_needed: int) -> int:
        cc = self.cache_config
        per_block = kv_bytes_per_block(self.model_config, cc.block_size)
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory_bytes is not None:
            return cc.kv_cache_memory_bytes // per_block
        # A share of the memory free now, but no more than the longest possible batch needs.
        budget = int(available_memory_bytes() * cc.gpu_memory_utilization)
        return min(budget // per_block, cdiv(max_tokens_needed, cc.block_size))

    def determine_num_cpu_blocks(self) -> int:
        per_block = kv_bytes_per_block(self.model_config, self.cache_config.block_size)
        return self.cache_config.swap_space_bytes // per_block

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        self.cache_config.num_gpu_blocks = num_blocks
        self.cache_config.num_cpu_blocks = num_cpu_blocks
        self.cache_engine = CacheEngine(self.model_config, self.cache_config)

    def execute_model(self, req: ExecuteModelRequest) -> ModelRunnerOutput | None:
        # Swap-outs first: the blocks they vacate may be written this very step.
        self.cache_engine.swap_out(req.blocks_to_swap_out)
        self.cache_engine.swap_in(req.blocks_to_swap_in)
        self.cache_engine.copy_blocks(req.blocks_to_copy)
        if not req.has_work:
            self.runner.update_states(req)  # drop finished requests all the same
            return None
        return self.runner.execute_model(req, self.cache_engine.kv_caches)
