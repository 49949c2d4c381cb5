"""The model's configuration: which weights, their dtype and length limits, and what the model's
HF config says (ModelConfig, built once by EngineArgs; see config.py for the others)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from pagedlm.config_checks import check_bool, check_positive_int, is_int
from pagedlm.distributed.utils import get_pp_indices
from pagedlm.model_executor.models.registry import resolve_architecture
from pagedlm.pooling_params import PoolerConfig
from pagedlm.resolved_config import resolve_hf_config

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


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
        if not is_int(self.seed) or not -2**63 <= self.seed < 2**63:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}.")
        if not is_int(self.max_logprobs) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 (the vocabulary), "
                             f"got {self.max_logprobs!r}.")
        if self.quantization is not None and not isinstance(self.quantization, str):
            raise ValueError(f"quantization must be a method name or None, got "
                             f"{self.quantization!r}.")
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"runner must be 'generate' or 'pooling', got {self.runner!r}.")
        check_bool("deterministic", self.deterministic)
        check_bool("enforce_eager", self.enforce_eager)
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
        check_positive_int("tensor_parallel_size", tp)
        check_positive_int("pipeline_parallel_size", pp)
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
