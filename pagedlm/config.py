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
from typing import Any

import torch
from transformers import PretrainedConfig

from pagedlm import envs
from pagedlm.device_config import DeviceConfig
from pagedlm.distributed.utils import get_pp_indices
from pagedlm.model_executor.models.registry import resolve_architecture
from pagedlm.pooling_params import PoolerConfig
from pagedlm.request_limits import RequestLimits
from pagedlm.resolved_config import resolve_hf_config
from pagedlm.speculative_config import SpeculativeConfig

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


# The attention kernels keep a block's rows on each thread's stack: 262144 overflowed it (a
# segfault at the first decode step). vLLM's CUDA kernels take at most 256 too.
MAX_BLOCK_SIZE = 256
# vLLM's largest max_lora_rank: a rank of 10^7 asked the allocator for 69 GB of slots.
MAX_LORA_RANK = 512


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive_int(name: str, value: object, allow_none: bool = False,
                        maximum: int | None = None) -> None:
    if value is None and allow_none:
        return
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}.")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}.")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # what the user asked for (None -> default)
    model_dir: str  # resolved HF-format directory
    # The element type the weights are stored in (and the KV cache's "auto" type). Activations,
    # norms and attention compute in compute_dtype whatever it is: a 2-byte dtype halves the
    # weight bytes each token streams, as the weight-only quantized formats do.
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
    # Bitwise-reproducible outputs (attention over the K/V as stored, one kernel for every
    # row); what it guarantees so far is in the --deterministic help (entrypoints/cli_args.py).
    deterministic: bool = False
    # A directory whose tokenizer (and chat template) replaces the model's own (vLLM's
    # --tokenizer); None: the model's, from model_dir (for a GGUF file, from its metadata).
    tokenizer: str | None = None
    # Where the model runs (DeviceConfig.device_type, set once by EngineArgs): it decides
    # compute_dtype and which dtype "auto" means.
    device_type: str = "cpu"
    # Never capture CUDA graphs (vLLM's name): every step runs eagerly.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.hf_config, dict):  # tests and tools may pass plain keys
            object.__setattr__(self, "hf_config", PretrainedConfig(**self.hf_config))
        if self.tokenizer is not None and (not isinstance(self.tokenizer, (str, os.PathLike))
                                           or not os.path.isdir(self.tokenizer)):
            raise ValueError(f"tokenizer must be a directory holding a tokenizer, got "
                             f"{self.tokenizer!r}.")
        if self.dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(set(map(str, _DTYPES.values())))}, "
                             f"got {self.dtype!r}.")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got "
                             f"{self.max_model_len!r}.")
        if self.max_model_len > self.derived_max_model_len:
            raise ValueError(f"max_model_len ({self.max_model_len}) is larger than the model's "
                             f"context length ({self.derived_max_model_len}).")
        if not _is_int(self.seed) or not -2**63 <= self.seed < 2**63:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}.")
        if not _is_int(self.max_logprobs) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 (the vocabulary), "
                             f"got {self.max_logprobs!r}.")
        if self.quantization is not None and not isinstance(self.quantization, str):
            raise ValueError(f"quantization must be a method name or None, got "
                             f"{self.quantization!r}.")
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"runner must be 'generate' or 'pooling', got {self.runner!r}.")
        _check_bool("deterministic", self.deterministic)
        _check_bool("enforce_eager", self.enforce_eager)
        if self.device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be 'cpu' or 'cuda', got {self.device_type!r}.")
        if self.device_type == "cuda" and self.deterministic:
            raise ValueError("deterministic=True is CPU-only (its guarantees rest on the native "
                             "CPU kernels): use device='cpu' or drop --deterministic.")
        if self.device_type == "cuda" and self.quantization is not None:
            raise ValueError(f"quantization={self.quantization!r} needs the native CPU matmul "
                             f"kernels: use device='cpu', or float weights (a dtype) on cuda.")
        if (self.runner == "pooling") != (self.pooler_config is not None):
            raise ValueError(f"pooler_config is set exactly when runner is 'pooling' (runner "
                             f"{self.runner!r}, pooler_config {self.pooler_config!r}).")
        for i in range(self.num_layers):  # a bad window fails here, not inside a layer
            self.get_sliding_window(i)

    @property
    def tokenizer_dir(self) -> str:
        """Where the tokenizer and its chat template are loaded from."""
        return os.fspath(self.tokenizer) if self.tokenizer is not None else self.model_dir

    @property
    def compute_dtype(self) -> torch.dtype:
        """What activations, norms, attention queries and matmul sums run in. On the CPU
        float32 for every `dtype` (2-byte weights widen as the kernels read them; the native
        kernels, the fused decode stack and the deterministic mode all take float32
        activations). On CUDA `dtype` itself: the GPU's matmuls and the Triton kernels take
        bfloat16/float16 inputs (accumulating in float32), at half the bytes per step."""
        return self.dtype if self.device_type == "cuda" else torch.float32

    @property
    def derived_max_model_len(self) -> int:
        """The model's own context length (max_position_embeddings; 2048 if it has none)."""
        return self.get_hf("max_position_embeddings") or 2048

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
        _check_positive_int("tensor_parallel_size", tp)
        _check_positive_int("pipeline_parallel_size", pp)
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
                 seed: int, **settings: Any) -> "ModelConfig":
        """The config of the HF-format model in `model_dir`; `settings` are the remaining
        fields (quantization, runner, pooler_config, max_logprobs, deterministic,
        tokenizer, device_type, enforce_eager)."""
        # Resolved once and recorded: AutoConfig's imports cost 1.5-2 s of a start-up
        # (resolved_config.py).
        hf = resolve_hf_config(model_dir)
        arch = resolve_architecture(getattr(hf, "architectures", None))
        if dtype not in _DTYPES and dtype != "auto":
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}.")
        # float32 by default on the CPU: the weights as the checkpoint has them; a 2-byte dtype
        # rounds them (and the KV cache) to halve the bytes. bfloat16 by default on CUDA, as
        # GPU engines serve (half the bytes each step streams, float32's range).
        auto = torch.bfloat16 if settings.get("device_type") == "cuda" else torch.float32
        torch_dtype = auto if dtype == "auto" else _DTYPES[dtype]
        if max_model_len is None:
            max_model_len = getattr(hf, "max_position_embeddings", None) or 2048
        return cls(model=model, model_dir=model_dir, dtype=torch_dtype,
                   max_model_len=max_model_len, architecture=arch, hf_config=hf, seed=seed,
                   **settings)


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
        _check_positive_int("block_size", self.block_size, maximum=MAX_BLOCK_SIZE)
        _check_positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        _check_positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override,
                            allow_none=True)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}.")
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {list(HASH_ALGOS)}, got "
                             f"{self.prefix_caching_hash_algo!r}.")
        if not _is_int(self.swap_space_bytes) or self.swap_space_bytes < 0:
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
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        _check_positive_int("num_scheduler_steps", self.num_scheduler_steps)
        _check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_positive_int("max_model_len", self.max_model_len)
        _check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got "
                             f"{self.policy!r}.")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got "
                             f"{self.preemption_mode!r}.")
        if not _is_int(self.max_loras) or self.max_loras < 0:
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
        _check_positive_int("max_loras", self.max_loras)
        _check_positive_int("max_lora_rank", self.max_lora_rank, maximum=MAX_LORA_RANK)
        _check_positive_int("max_cpu_loras", self.max_cpu_loras)
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
            _check_positive_int(name, getattr(self, name))
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
        _check_positive_int("threads_per_worker", self.threads_per_worker, allow_none=True)
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
