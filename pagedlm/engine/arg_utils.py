"""EngineArgs: the user-facing engine settings (vLLM's names), turned into config dataclasses."""
from __future__ import annotations

from dataclasses import dataclass

from pagedlm.core.block_hash import HASH_ALGOS
from pagedlm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedlm.model_executor.model_loader.model_path import resolve_model


# Tokens per step with chunked prefill: enough for GEMM efficiency on a prefill chunk, small
# enough that decodes sharing the step are not held up long.
DEFAULT_CHUNKED_BUDGET = 2048


@dataclass
class EngineArgs:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # or "builtin": faster, for single-tenant use
    preemption_mode: str = "recompute"  # or "swap"
    swap_space: float = 4  # GiB of host memory for swapped-out blocks (swap mode only)
    scheduling_policy: str = "fcfs"  # or "priority"

    def create_engine_config(self) -> EngineConfig:
        def positive_int(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}.")

        positive_int("block_size")
        positive_int("max_num_seqs")
        positive_int("max_num_batched_tokens", allow_none=True)
        positive_int("kv_cache_memory_bytes", allow_none=True)
        positive_int("num_gpu_blocks_override", allow_none=True)
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")
        for name in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}.")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {list(HASH_ALGOS)}, got "
                             f"{self.prefix_caching_hash_algo!r}.")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got "
                             f"{self.preemption_mode!r}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got "
                             f"{self.scheduling_policy!r}.")
        if (not isinstance(self.swap_space, (int, float)) or isinstance(self.swap_space, bool)
                or self.swap_space < 0):
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}.")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}.")
        model_dir = resolve_model(self.model)
        model_config = ModelConfig.from_dir(self.model, model_dir, self.dtype,
                                            self.max_model_len, self.seed)
        max_len = model_config.max_model_len
        chunked = self.enable_chunked_prefill
        # Without chunked prefill a whole prompt must fit in one step's token budget.
        batched = self.max_num_batched_tokens or (DEFAULT_CHUNKED_BUDGET if chunked
                                                  else max(max_len, 2048))
        if batched < max_len and not chunked:
            raise ValueError(f"max_num_batched_tokens ({batched}) is smaller than max_model_len "
                             f"({max_len}): a long prompt could never be scheduled. Raise "
                             f"max_num_batched_tokens, lower max_model_len, or enable "
                             f"chunked prefill.")
        if batched < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({batched}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}).")
        # The host pool only exists for swap preemption.
        swap_bytes = int(self.swap_space * 2**30) if self.preemption_mode == "swap" else 0
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=self.block_size,
                                     kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                                     num_gpu_blocks_override=self.num_gpu_blocks_override,
                                     gpu_memory_utilization=self.gpu_memory_utilization,
                                     enable_prefix_caching=self.enable_prefix_caching,
                                     prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                                     swap_space_bytes=swap_bytes),
            scheduler_config=SchedulerConfig(max_num_batched_tokens=batched,
                                             max_num_seqs=self.max_num_seqs,
                                             max_model_len=max_len,
                                             enable_chunked_prefill=chunked,
                                             policy=self.scheduling_policy,
                                             preemption_mode=self.preemption_mode))
