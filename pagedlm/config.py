"""Engine configuration: one dataclass per concern, built from EngineArgs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig

from pagedlm.distributed.utils import get_pp_indices
from pagedlm.model_executor.models.registry import resolve_architecture
from pagedlm.pooling_params import PoolerConfig

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}



@dataclass
class ModelConfig:
    model: str  # what the user asked for (None -> default)
    model_dir: str  # resolved HF-format directory
    dtype: torch.dtype
    max_model_len: int
    architecture: str  # the HF name the registry maps to a model class
    # transformers' config class for the model type: its attribute_map gives every model the
    # same names (GPT-2's n_head reads as num_attention_heads) and it fills the class defaults
    # a config.json may leave out.
    hf_config: PretrainedConfig
    seed: int = 0
    # None (float weights), or a name from layers/quantization's QUANTIZATION_METHODS.
    quantization: str | None = None
    runner: str = "generate"  # or "pooling": prompts in, embeddings out (no sampling)
    pooler_config: PoolerConfig | None = None  # set when runner is "pooling"
    # Most logprobs (and prompt_logprobs) a request may ask for per position; -1: the whole
    # vocabulary (vLLM's setting and default).
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        if isinstance(self.hf_config, dict):  # tests and tools may pass plain keys
            self.hf_config = PretrainedConfig(**self.hf_config)

    def get_hf(self, key: str, default: Any = None) -> Any:
        """A config value, or `default` when the config lacks it or sets it to None."""
        value = getattr(self.hf_config, key, None)
        return default if value is None else value

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.hf_config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.get_hf("num_key_value_heads") or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.get_hf("head_dim") or self.hf_config.hidden_size // self.num_heads

    @property
    def rope_theta(self) -> float:
        # transformers 5 nests rope settings in rope_parameters; older configs keep them flat.
        params = self.get_hf("rope_parameters") or {}
        return params.get("rope_theta") or self.get_hf("rope_theta") or 10000.0

    @property
    def rope_scaling(self) -> dict | None:
        params = self.get_hf("rope_parameters") or self.get_hf("rope_scaling")
        if not params or (params.get("rope_type") or params.get("type")) in (None, "default"):
            return None
        return params

    def get_sliding_window(self, layer: int) -> int | None:
        """Keys a query of this (global) layer sees, itself included; None for full attention.

        As transformers reads it: a config with `layer_types` windows only its
        "sliding_attention" layers (Qwen2 derives them from use_sliding_window and
        max_window_layers, Gemma from its pattern); one without (Mistral) windows every layer.
        """
        window = self.get_hf("sliding_window")
        if window is None or self.get_hf("use_sliding_window", True) is False:
            return None
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"sliding_window in {self.model_dir}/config.json must be a "
                             f"positive integer or null, got {window!r}.")
        layer_types = self.get_hf("layer_types")
        if layer_types is None:
            return window
        if len(layer_types) != self.num_layers:
            raise ValueError(f"layer_types in {self.model_dir}/config.json has "
                             f"{len(layer_types)} entries for {self.num_layers} layers.")
        return window if layer_types[layer] == "sliding_attention" else None

    @property
    def hidden_size(self) -> int:
        return self.hf_config.hidden_size

    @property
    def matryoshka_dimensions(self) -> list[int] | None:
        return self.get_hf("matryoshka_dimensions")

    @property
    def is_matryoshka(self) -> bool:
        """Trained so that a prefix of the embedding is an embedding (sentence-transformers'
        config flags it): only then may a request ask for fewer dimensions."""
        return bool(self.get_hf("is_matryoshka") or self.matryoshka_dimensions)

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    # -- per-rank sizes under tensor / pipeline parallelism ------------------------------------

    def get_num_kv_heads(self, tensor_parallel_size: int = 1) -> int:
        """KV heads one TP rank holds (and caches): its share, or 1 when the KV heads are
        fewer than the ranks and so replicated."""
        return max(1, self.num_kv_heads // tensor_parallel_size)

    def get_num_layers(self, pipeline_parallel_size: int = 1, pipeline_rank: int = 0) -> int:
        """Layers (and so KV caches) of one pipeline stage."""
        start, end = get_pp_indices(self.num_layers, pipeline_rank, pipeline_parallel_size)
        return end - start

    def verify_with_parallel_config(self, tensor_parallel_size: int,
                                    pipeline_parallel_size: int) -> None:
        """Raise ValueError, naming the setting, for sizes this model cannot be split by.

        The vocabulary needs no check: it is padded to a multiple of the TP size."""
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        for field, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}.")
        if self.num_heads % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's "
                             f"num_attention_heads ({self.num_heads}).")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's "
                             f"num_key_value_heads ({self.num_kv_heads}) or be a multiple of it.")
        if pp > self.num_layers:
            raise ValueError(f"pipeline_parallel_size ({pp}) must be at most the model's "
                             f"num_hidden_layers ({self.num_layers}).")

    @classmethod
    def from_dir(cls, model: str | None, model_dir: str, dtype: str, max_model_len: int | None,
                 seed: int) -> "ModelConfig":
        from huggingface_hub.errors import StrictDataclassError
        from transformers import AutoConfig
        try:
            hf = AutoConfig.from_pretrained(model_dir)
        # transformers 5 validates field types itself, raising a non-ValueError.
        except (ValueError, KeyError, OSError, StrictDataclassError) as e:
            raise ValueError(f"model: cannot read {model_dir}/config.json: {e}") from None
        arch = resolve_architecture(getattr(hf, "architectures", None))
        if dtype not in _DTYPES and dtype != "auto":
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}.")
        # float32 by default: CPU matmuls gain nothing from fp16 and lose accuracy.
        torch_dtype = torch.float32 if dtype == "auto" else _DTYPES[dtype]
        derived = getattr(hf, "max_position_embeddings", None) or 2048
        if max_model_len is None:
            max_model_len = derived
        elif not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}.")
        elif max_model_len > derived:
            raise ValueError(f"max_model_len ({max_model_len}) is larger than the model's "
                             f"context length ({derived}).")
        config = cls(model=model, model_dir=model_dir, dtype=torch_dtype,
                     max_model_len=max_model_len, architecture=arch, hf_config=hf, seed=seed)
        for i in range(config.num_layers):  # a bad window fails here, not inside a layer
            config.get_sliding_window(i)
        return config


@dataclass
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

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.cache_dtype or model_dtype

    @property
    def reserves_memory(self) -> bool:
        """Whether the user sized the cache (bytes or blocks): a reservation, committed at
        startup as vLLM commits its cache. The default size, a share of the RAM free at
        startup, is only faulted in as blocks are first written (see worker/cache_engine.py)."""
        return self.kv_cache_memory_bytes is not None or self.num_gpu_blocks_override is not None


# kv_cache_dtype values: "auto" is the model's dtype.
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # or "priority"
    max_loras: int = 0  # distinct adapters per step (0: LoRA disabled)
    preemption_mode: str = "recompute"  # or "swap"


@dataclass
class LoRAConfig:
    max_loras: int = 1  # adapters in one step (device slots)
    max_lora_rank: int = 16
    max_cpu_loras: int = 1  # adapters kept loaded per worker (>= max_loras)


@dataclass
class RequestLimits:
    """Caps on a request's lists. Each is walked when the request is added, and every step
    after by the sampler (bad words, biases) or the stop check (stop strings), so one request
    with a huge list would slow every other request down. Defaults: vLLM's limits where it has
    them (1024 logit_bias entries, 128 stop_token_ids), else generous for any real use."""
    max_bad_words: int = 1000
    max_logit_bias: int = 1024
    max_stop_strings: int = 256
    max_stop_token_ids: int = 128


EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "uni" (in-process), "mp" (worker processes on this node), "ray"; resolved from None by
    # EngineArgs: uni for one worker, ray when RAY_ADDRESS names a cluster, else mp.
    distributed_executor_backend: str = "uni"
    # Cores each worker may use (torch and kernel threads): the node's cores split between the
    # workers on it, so N workers never oversubscribe it. None: torch's default.
    threads_per_worker: int | None = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "cpu"
    lora_config: LoRAConfig | None = None  # None: LoRA disabled
    trace_file: str | None = None  # the step tracer's Chrome JSON (engine/tracer.py); None: off
    structured_outputs_backend: str = "xgrammar"  # compiles requests' grammars
    # Seconds a new grammar may take to compile (in a child process, killed past it).
    structured_outputs_compile_timeout: float = 10.0
    request_limits: RequestLimits = field(default_factory=RequestLimits)
