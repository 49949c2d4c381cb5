"""EngineArgs: the user-facing engine settings (vLLM's names), turned into config dataclasses."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass

from pagedlm.core.block_hash import HASH_ALGOS
from pagedlm.config import (EXECUTOR_BACKENDS, KV_CACHE_DTYPES, CacheConfig, EngineConfig,
                            LoRAConfig, ModelConfig, ParallelConfig, RequestLimits,
                            SchedulerConfig)
from pagedlm.model_executor.layers.quantization import (get_quantization_config,
                                                        verify_quantization)
from pagedlm.model_executor.model_loader.model_path import resolve_model
from pagedlm.pooling_params import PoolerConfig
from pagedlm.structured_output.registry import SUPPORTED_BACKENDS


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
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), float32, bfloat16, float16
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    max_logprobs: int = 20  # most logprobs a request may ask for per token (-1: the vocabulary)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # or "builtin": faster, for single-tenant use
    preemption_mode: str = "recompute"  # or "swap"
    swap_space: float = 4  # GiB of host memory for swapped-out blocks (swap mode only)
    scheduling_policy: str = "fcfs"  # or "priority"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "uni", "mp" or "ray"; None: uni for one worker, ray if RAY_ADDRESS is set, else mp.
    distributed_executor_backend: str | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    quantization: str | None = None  # None: float weights; "int8", "int4" or "gguf"
    runner: str = "generate"  # or "pooling": embeddings (LLM.embed, /v1/embeddings)
    pooling_type: str | None = None  # pooling runner: LAST (default) or MEAN
    # pooling runner: a PoolerConfig or its fields as a dict (JSON on the command line)
    pooler_config: PoolerConfig | dict | None = None

    def _pooler_config(self) -> PoolerConfig | None:
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"runner must be 'generate' or 'pooling', got {self.runner!r}.")
        if self.runner == "generate":
            if self.pooling_type is not None or self.pooler_config is not None:
                raise ValueError("pooling_type and pooler_config need runner='pooling'.")
            return None
        pc = self.pooler_config
        if isinstance(pc, dict):
            try:
                pc = PoolerConfig(**pc)
            except TypeError as e:
                raise ValueError(f"pooler_config: {e}") from None
        elif pc is None:
            pc = PoolerConfig()
        elif not isinstance(pc, PoolerConfig):
            raise ValueError(f"pooler_config must be a PoolerConfig or a dict, got "
                             f"{type(pc).__name__}.")
        if self.pooling_type is not None:
            pc = PoolerConfig(self.pooling_type, pc.normalize)
        return pc
    trace_file: str | None = None  # record each step: Chrome trace JSON, .steps.jsonl beside it
    structured_outputs_backend: str = "xgrammar"  # grammar library for structured outputs
    # A grammar compiles in a child process, killed past this: its request is then a 400.
    structured_outputs_compile_timeout: float = 10.0  # seconds a request's new grammar may compile
    max_bad_words: int = 1000  # most bad_words entries a request may give
    max_logit_bias: int = 1024  # most logit_bias entries a request may give
    max_stop_strings: int = 256  # most stop strings a request may give
    max_stop_token_ids: int = 128  # most stop_token_ids a request may give

    def _lora_config(self) -> LoRAConfig | None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a bool, got {self.enable_lora!r}.")
        if not self.enable_lora:
            return None
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            v = getattr(self, name)
            if v is None and name == "max_cpu_loras":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}.")
        cpu = self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
        if cpu < self.max_loras:
            raise ValueError(f"max_cpu_loras ({cpu}) must be >= max_loras ({self.max_loras}).")
        return LoRAConfig(self.max_loras, self.max_lora_rank, cpu)

    def _parallel_config(self) -> ParallelConfig:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}.")
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        backend = self.distributed_executor_backend
        if backend is None:
            backend = "uni" if world == 1 else ("ray" if os.environ.get("RAY_ADDRESS") else "mp")
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
        threads = None
        if backend != "uni":  # workers on one node share its cores
            threads = max(1, (os.cpu_count() or 1) // world)
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size, backend,
                              threads)

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
        if (not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool)
                or self.max_logprobs < -1):
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 (the vocabulary), "
                             f"got {self.max_logprobs!r}.")
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
        if self.trace_file is not None:
            if not isinstance(self.trace_file, (str, os.PathLike)) or not str(self.trace_file):
                raise ValueError(f"trace_file must be a file path, got {self.trace_file!r}.")
            parent = os.path.dirname(os.path.abspath(self.trace_file))
            if not os.path.isdir(parent):
                raise ValueError(f"trace_file {str(self.trace_file)!r}: its directory "
                                 f"{parent!r} does not exist.")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}.")
        parallel_config = self._parallel_config()
        lora_config = self._lora_config()
        quantization = verify_quantization(self.quantization)
        if quantization is not None and lora_config is not None:
            raise ValueError(f"quantization={quantization!r} cannot be combined with "
                             f"enable_lora: LoRA adapters need the float base weights.")
        pooler_config = self._pooler_config()
        prefix_caching = self.enable_prefix_caching
        if pooler_config is not None and pooler_config.pooling_type == "MEAN":
            # A prefix-cache hit skips computing the cached tokens, whose hidden states MEAN
            # pooling averages; LAST only needs the last token, which is always computed.
            prefix_caching = False
        model_dir = resolve_model(self.model)
        model_config = ModelConfig.from_dir(self.model, model_dir, self.dtype,
                                            self.max_model_len, self.seed)
        # Checked here, before any worker starts: e.g. gguf on a non-GGUF model, or a GGUF
        # tensor type it cannot run.
        get_quantization_config(quantization, model_dir)
        model_config.quantization = quantization
        model_config.max_logprobs = self.max_logprobs
        if pooler_config is not None:
            model_config.runner, model_config.pooler_config = "pooling", pooler_config
        model_config.verify_with_parallel_config(parallel_config.tensor_parallel_size,
                                                 parallel_config.pipeline_parallel_size)
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
                                     enable_prefix_caching=prefix_caching,
                                     prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                                     swap_space_bytes=swap_bytes,
                                     cache_dtype=KV_CACHE_DTYPES[self.kv_cache_dtype]),
            parallel_config=parallel_config,
            scheduler_config=SchedulerConfig(max_num_batched_tokens=batched,
                                             max_num_seqs=self.max_num_seqs,
                                             max_model_len=max_len,
                                             enable_chunked_prefill=chunked,
                                             policy=self.scheduling_policy,
                                             preemption_mode=self.preemption_mode,
                                             max_loras=lora_config.max_loras if lora_config
                                             else 0),
            lora_config=lora_config,
            trace_file=os.fspath(self.trace_file) if self.trace_file is not None else None,
            structured_outputs_backend=self._structured_outputs_backend(),
            structured_outputs_compile_timeout=self._compile_timeout(),
            request_limits=self._request_limits())

    def _structured_outputs_backend(self) -> str:
        if self.structured_outputs_backend not in SUPPORTED_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of "
                             f"{list(SUPPORTED_BACKENDS)}, got "
                             f"{self.structured_outputs_backend!r}.")
        return self.structured_outputs_backend

    def _compile_timeout(self) -> float:
        t = self.structured_outputs_compile_timeout
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t < float("inf"):
            raise ValueError(f"structured_outputs_compile_timeout must be a number of seconds "
                             f"> 0, got {t!r}.")
        return float(t)

    def _request_limits(self) -> RequestLimits:
        names = [f.name for f in dataclasses.fields(RequestLimits)]
        for name in names:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}.")
        return RequestLimits(**{name: getattr(self, name) for name in names})
