"""EngineArgs: the user-facing engine settings (vLLM's names), turned into config dataclasses.

The configs check their own fields (config.py); EngineArgs checks only what it turns into
them (names, units, switches) and the names that registries above config.py hold (quantization
methods, structured-output backends), then assembles the configs once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedlm import prefault
from pagedlm.device_config import DeviceConfig
from pagedlm.config import (KV_CACHE_DTYPES, CacheConfig, EngineConfig, LoRAConfig,
                            ModelConfig, ParallelConfig, SchedulerConfig)
from pagedlm.model_executor.layers.quantization import (get_quantization_config,
                                                        resolve_quantization,
                                                        verify_quantization)
from pagedlm.model_executor.model_loader.memory_check import (check_fits_memory,
                                                               check_layer_count, weight_memory)
from pagedlm.model_executor.model_loader.model_path import (ensure_float_weights, gguf_source,
                                                             resolve_model)
from pagedlm.pooling_params import PoolerConfig
from pagedlm.request_limits import RequestLimits
from pagedlm.resolved_config import resolve_hf_config
from pagedlm.speculative_config import SpeculativeConfig
from pagedlm.spec_decode.draft_config import check_draft_model
from pagedlm.structured_output.registry import SUPPORTED_BACKENDS
from pagedlm.utils import available_memory_bytes


# Tokens per step with chunked prefill: enough for GEMM efficiency on a prefill chunk, small
# enough that decodes sharing the step are not held up long.
DEFAULT_CHUNKED_BUDGET = 2048
# On a GPU a prefill chunk costs little next to the step's fixed costs (launches, the host's
# work), so fewer, larger chunks: vLLM's default for its server on GPUs.
DEFAULT_CHUNKED_BUDGET_GPU = 8192


@dataclass
class EngineArgs:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    device: str = "cpu"  # "cpu", "cuda", "cuda:N" or "auto" (cuda when torch sees a GPU)
    enforce_eager: bool = False  # never capture CUDA graphs: every step runs eagerly
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
    num_scheduler_steps: int = 1  # decode iterations per engine step (multi-step decoding)
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
    trace_file: str | None = None  # record each step: Chrome trace JSON, .steps.jsonl beside it
    structured_outputs_backend: str = "xgrammar"  # grammar library for structured outputs
    # A grammar compiles in a child process, killed past this: its request is then a 400.
    structured_outputs_compile_timeout: float = 10.0  # seconds a request's new grammar may compile
    max_bad_words: int = 1000  # most bad_words entries a request may give
    max_logit_bias: int = 1024  # most logit_bias entries a request may give
    max_stop_strings: int = 256  # most stop strings a request may give
    max_stop_token_ids: int = 128  # most stop_token_ids a request may give
    deterministic: bool = False  # bitwise-reproducible outputs (see cli_args' help)
    # A directory whose tokenizer and chat template replace the model's (for a GGUF file, the
    # ones in its metadata); default: the model's own.
    tokenizer: str | None = None
    # Speculative decoding, in vLLM's shape: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b} or {"model": DIR_OR_GGUF,
    # "num_speculative_tokens": k}; a dict or its JSON text. None: off.
    speculative_config: dict | str | SpeculativeConfig | None = None

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

    def _lora_config(self) -> LoRAConfig | None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a bool, got {self.enable_lora!r}.")
        if not self.enable_lora:
            return None
        cpu = self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
        return LoRAConfig(self.max_loras, self.max_lora_rank, cpu)

    def _cache_config(self, pooler_config: PoolerConfig | None) -> CacheConfig:
        if (not isinstance(self.swap_space, (int, float)) or isinstance(self.swap_space, bool)
                or self.swap_space < 0):
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}.")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}.")
        prefix_caching = self.enable_prefix_caching
        if (pooler_config is not None and pooler_config.pooling_type == "MEAN"
                and prefix_caching is True):  # (a non-bool is CacheConfig's error)
            # A prefix-cache hit skips computing the cached tokens, whose hidden states MEAN
            # pooling averages; LAST only needs the last token, which is always computed.
            prefix_caching = False
        # The host pool only exists for swap preemption.
        swap_bytes = int(self.swap_space * 2**30) if self.preemption_mode == "swap" else 0
        return CacheConfig(block_size=self.block_size,
                           kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                           num_gpu_blocks_override=self.num_gpu_blocks_override,
                           gpu_memory_utilization=self.gpu_memory_utilization,
                           enable_prefix_caching=prefix_caching,
                           prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                           swap_space_bytes=swap_bytes,
                           cache_dtype=KV_CACHE_DTYPES[self.kv_cache_dtype])

    def create_engine_config(self) -> EngineConfig:
        # The configs that need no model first: a bad setting fails before the model is read.
        device_config = DeviceConfig(self.device)
        parallel_config = ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size,
                                         self.distributed_executor_backend)
        lora_config = self._lora_config()
        quantization = verify_quantization(self.quantization)
        pooler_config = self._pooler_config()
        cache_config = self._cache_config(pooler_config)
        request_limits = RequestLimits(**{f.name: getattr(self, f.name)
                                          for f in dataclasses.fields(RequestLimits)})
        speculative_config = SpeculativeConfig.from_user(self.speculative_config)
        model_dir = resolve_model(self.model)
        # quantization=None keeps a large GGUF file in its blocks (resolve_quantization).
        quantization = resolve_quantization(quantization, model_dir)
        # Checked here, before any worker starts: e.g. gguf on a non-GGUF model, or a GGUF
        # tensor type it cannot run.
        get_quantization_config(quantization, model_dir)
        if gguf_source(model_dir) is None:  # (a GGUF file's layers were counted at conversion)
            # Before the config is built: it visits every layer (their sliding windows).
            check_layer_count(model_dir, getattr(resolve_hf_config(model_dir),
                                                 "num_hidden_layers", None))
        model_config = ModelConfig.from_dir(self.model, model_dir, self.dtype,
                                            self.max_model_len, self.seed,
                                            quantization=quantization, runner=self.runner,
                                            pooler_config=pooler_config,
                                            max_logprobs=self.max_logprobs,
                                            deterministic=self.deterministic,
                                            tokenizer=self.tokenizer,
                                            device_type=device_config.device_type,
                                            enforce_eager=self.enforce_eager)
        # Before any weight is converted or loaded: a model larger than memory fails here. (The
        # weights pass through host memory on their way to a GPU too; a GPU's KV cache does
        # not, the worker checks it against the GPU's memory.)
        host_kv = cache_config.kv_cache_memory_bytes if not device_config.is_cuda else None
        # Memory `pagedlm serve` faulted in for this load's panels is no longer MemAvailable,
        # but it is the load's.
        check_fits_memory(weight_memory(model_dir, quantization, model_config.dtype),
                          available_memory_bytes() + prefault.reserved_bytes(), host_kv or 0)
        if quantization != "gguf":
            ensure_float_weights(model_dir)  # a GGUF file's float32 copy, written once
        if speculative_config is not None and speculative_config.method == "draft_model":
            # Its path and vocabulary, before any worker loads it.
            check_draft_model(speculative_config.model, model_config)
        chunked = self.enable_chunked_prefill
        batched = self.max_num_batched_tokens
        if batched is None:
            # Without chunked prefill a whole prompt must fit in one step's token budget.
            budget = (DEFAULT_CHUNKED_BUDGET_GPU if device_config.is_cuda
                      else DEFAULT_CHUNKED_BUDGET)
            batched = budget if chunked else max(model_config.max_model_len, budget)
        scheduler_config = SchedulerConfig(max_num_batched_tokens=batched,
                                           max_num_seqs=self.max_num_seqs,
                                           max_model_len=model_config.max_model_len,
                                           enable_chunked_prefill=chunked,
                                           policy=self.scheduling_policy,
                                           preemption_mode=self.preemption_mode,
                                           num_scheduler_steps=self.num_scheduler_steps,
                                           max_loras=lora_config.max_loras if lora_config
                                           else 0)
        return EngineConfig(model_config=model_config, cache_config=cache_config,
                            scheduler_config=scheduler_config, parallel_config=parallel_config,
                            device_config=device_config, lora_config=lora_config,
                            trace_file=self.trace_file,
                            structured_outputs_backend=self._structured_outputs_backend(),
                            structured_outputs_compile_timeout=(
                                self.structured_outputs_compile_timeout),
                            request_limits=request_limits,
                            speculative_config=speculative_config)

    def _structured_outputs_backend(self) -> str:
        if self.structured_outputs_backend not in SUPPORTED_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of "
                             f"{list(SUPPORTED_BACKENDS)}, got "
                             f"{self.structured_outputs_backend!r}.")
        return self.structured_outputs_backend
