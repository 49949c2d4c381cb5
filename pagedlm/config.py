"""Engine configuration: one frozen dataclass per concern, built once from EngineArgs.

Each config checks its own fields in __post_init__ (a ValueError naming the setting), and
EngineConfig checks how they fit together, so a config that exists is a valid one whoever built
it. EngineArgs only turns the user's settings into these (defaults that depend on the model,
names looked up in registries above this module).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

import torch

from pagedlm import envs
from pagedlm.config_checks import check_bool, check_positive_int, is_int
from pagedlm.device_config import DeviceConfig
from pagedlm.model_config import ModelConfig
from pagedlm.request_limits import RequestLimits
from pagedlm.speculative_config import SpeculativeConfig

# The attention kernels keep a block's rows on each thread's stack: 262144 overflowed it (a
# segfault at the first decode step). vLLM's CUDA kernels take at most 256 too.
MAX_BLOCK_SIZE = 256
# vLLM's largest max_lora_rank: a rank of 10^7 asked the allocator for 69 GB of slots.
MAX_LORA_RANK = 512


# The prefix-cache block hash algorithms (core/block_hash.py implements them).
HASH_ALGOS = ("sha256", "builtin")

# kv_cache_dtype's values and the KV-cache element types they name: "auto" is the model's dtype.
# (The native kernels read each of these types: kernels/kv_types.py.)
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Either an explicit byte budget, an exact block count, or (neither) a share of free RAM.
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # or "builtin" (see core/block_hash.py)
    swap_space_bytes: int = 0  # host memory for swapped-out blocks
    # Element type of the KV cache; None: the model's dtype. A narrower one halves the bytes
    # per block (more blocks in the same budget) at the cost of rounding K/V once.
    cache_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        check_positive_int("block_size", self.block_size, maximum=MAX_BLOCK_SIZE)
        check_positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        check_positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override,
                            allow_none=True)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}.")
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {list(HASH_ALGOS)}, got "
                             f"{self.prefix_caching_hash_algo!r}.")
        if not is_int(self.swap_space_bytes) or self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be an integer >= 0, got "
                             f"{self.swap_space_bytes!r}.")
        if self.cache_dtype not in KV_CACHE_DTYPES.values():
            raise ValueError(f"cache_dtype must be one of {list(KV_CACHE_DTYPES.values())} "
                             f"(None: the model's dtype), got {self.cache_dtype!r}.")

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.cache_dtype or model_dtype

    @property
    def reserves_memory(self) -> bool:
        """Whether the user sized the cache (bytes or blocks): a reservation, committed at
        startup as vLLM commits its cache. The default size, a share of the RAM free at
        startup, is only faulted in as blocks are first written (see worker/cache_engine.py)."""
        return self.kv_cache_memory_bytes is not None or self.num_gpu_blocks_override is not None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # or "priority" (EngineArgs' scheduling_policy)
    max_loras: int = 0  # distinct adapters per step (0: LoRA disabled)
    preemption_mode: str = "recompute"  # or "swap"
    # Multi-step decoding: a decode-only step runs the model up to this many times, each
    # iteration's sampled tokens feeding the next on the device (1: one token per step).
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        check_positive_int("max_num_seqs", self.max_num_seqs)
        check_positive_int("num_scheduler_steps", self.num_scheduler_steps)
        check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_positive_int("max_model_len", self.max_model_len)
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got "
                             f"{self.policy!r}.")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got "
                             f"{self.preemption_mode!r}.")
        if not is_int(self.max_loras) or self.max_loras < 0:
            raise ValueError(f"max_loras must be an integer >= 0, got {self.max_loras!r}.")
        batched, max_len = self.max_num_batched_tokens, self.max_model_len
        # Without chunked prefill a whole prompt must fit in one step's token budget.
        if batched < max_len and not self.enable_chunked_prefill:
            raise ValueError(f"max_num_batched_tokens ({batched}) is smaller than max_model_len "
                             f"({max_len}): a long prompt could never be scheduled. Raise "
                             f"max_num_batched_tokens, lower max_model_len, or enable "
                             f"chunked prefill.")
        if batched < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({batched}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}).")


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # adapters in one step (device slots)
    max_lora_rank: int = 16
    max_cpu_loras: int = 1  # loaded per worker (>= max_loras), plus those of unfinished requests

    def __post_init__(self) -> None:
        check_positive_int("max_loras", self.max_loras)
        check_positive_int("max_lora_rank", self.max_lora_rank, maximum=MAX_LORA_RANK)
        check_positive_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras}).")


EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "uni" (in-process), "mp" (worker processes on this node), "ray". None is resolved here,
    # once: uni for one worker, ray when RAY_ADDRESS names a cluster, else mp.
    distributed_executor_backend: str | None = None
    # Cores each worker may use (torch and kernel threads): the node's cores split between the
    # workers on it, so N workers never oversubscribe it. None: torch's default in-process;
    # for worker processes it is resolved here to their share of the cores.
    threads_per_worker: int | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            check_positive_int(name, getattr(self, name))
        world = self.world_size
        backend = self.distributed_executor_backend
        if backend is None:
            backend = "uni" if world == 1 else ("ray" if envs.RAY_ADDRESS else "mp")
            object.__setattr__(self, "distributed_executor_backend", backend)
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{list(EXECUTOR_BACKENDS)} or None, got {backend!r}.")
        if backend == "uni" and world > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one worker, but "
                             f"tensor_parallel_size x pipeline_parallel_size is {world}: use "
                             f"'mp' or 'ray'.")
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install "
                             "'pagedlm[ray]'.")
        check_positive_int("threads_per_worker", self.threads_per_worker, allow_none=True)
        if self.threads_per_worker is None and backend != "uni":  # workers share the cores
            object.__setattr__(self, "threads_per_worker",
                               max(1, (os.cpu_count() or 1) // world))

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=lambda: DeviceConfig("cpu"))
    lora_config: LoRAConfig | None = None  # None: LoRA disabled
    trace_file: str | None = None  # the step tracer's Chrome JSON (metrics/tracer.py); None: off
    structured_outputs_backend: str = "xgrammar"  # compiles requests' grammars
    # Seconds a new grammar may take to compile (in a child process, killed past it).
    structured_outputs_compile_timeout: float = 10.0
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self) -> None:
        if self.trace_file is not None:
            if not isinstance(self.trace_file, (str, os.PathLike)) or not str(self.trace_file):
                raise ValueError(f"trace_file must be a file path, got {self.trace_file!r}.")
            parent = os.path.dirname(os.path.abspath(self.trace_file))
            if not os.path.isdir(parent):
                raise ValueError(f"trace_file {str(self.trace_file)!r}: its directory "
                                 f"{parent!r} does not exist.")
            object.__setattr__(self, "trace_file", os.fspath(self.trace_file))
        t = self.structured_outputs_compile_timeout
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t < float("inf"):
            raise ValueError(f"structured_outputs_compile_timeout must be a number of seconds "
                             f"> 0, got {t!r}.")
        object.__setattr__(self, "structured_outputs_compile_timeout", float(t))
        # How the configs fit together.
        model, quantization = self.model_config, self.model_config.quantization
        if model.device_type != self.device_config.device_type:
            raise ValueError(f"model_config.device_type ({model.device_type!r}) differs from "
                             f"device_config's ({self.device_config.device_type!r}).")
        if quantization is not None and self.lora_config is not None:
            raise ValueError(f"quantization={quantization!r} cannot be combined with "
                             f"enable_lora: LoRA adapters need the float base weights.")
        pc = self.parallel_config
        model.verify_with_parallel_config(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        spec = self.speculative_config
        if spec is not None and model.runner == "pooling":
            raise ValueError("speculative_config cannot be combined with runner='pooling': "
                             "nothing is decoded.")
        if spec is not None and spec.method == "draft_model" and pc.world_size > 1:
            raise ValueError(f"speculative_config with a draft model cannot be combined with "
                             f"tensor_parallel_size={pc.tensor_parallel_size} x "
                             f"pipeline_parallel_size={pc.pipeline_parallel_size}: the draft "
                             f"runs in one worker.")
        sc = self.scheduler_config
        if (spec is not None and model.deterministic
                and spec.num_speculative_tokens + 1 > sc.max_num_batched_tokens):
            # Outside the mode k is capped to the budget; within it that made a seeded
            # request's tokens depend on max_num_batched_tokens.
            raise ValueError(f"speculative_config.num_speculative_tokens "
                             f"({spec.num_speculative_tokens}) + 1 must be <= "
                             f"max_num_batched_tokens ({sc.max_num_batched_tokens}) under "
                             f"deterministic=True: a step verifies a sequence's k drafts "
                             f"together.")
        if sc.num_scheduler_steps > 1:
            # Each iteration's tokens stay on the one worker that samples them.
            other = ("speculative_config" if spec is not None
                     else "runner='pooling'" if model.runner == "pooling"
                     else f"tensor_parallel_size={pc.tensor_parallel_size} x "
                          f"pipeline_parallel_size={pc.pipeline_parallel_size}"
                     if pc.world_size > 1 else None)
            if other is not None:
                raise ValueError(f"num_scheduler_steps={sc.num_scheduler_steps} cannot be "
                                 f"combined with {other}: multi-step decoding runs on one "
                                 f"worker, without drafts.")
        if sc.max_model_len != model.max_model_len:
            raise ValueError(f"scheduler_config.max_model_len ({sc.max_model_len}) differs from "
                             f"model_config.max_model_len ({model.max_model_len}).")
        max_loras = self.lora_config.max_loras if self.lora_config is not None else 0
        if sc.max_loras != max_loras:
            raise ValueError(f"scheduler_config.max_loras ({sc.max_loras}) differs from the "
                             f"LoRA config's max_loras ({max_loras}; 0 without LoRA).")

    @property
    def device(self) -> str:
        """The device type ("cpu" or "cuda"): device_config.device is the torch.device."""
        return self.device_config.device_type
