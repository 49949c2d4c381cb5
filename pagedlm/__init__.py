"""pagedlm: a small LLM inference engine with a paged KV cache and continuous batching."""
from __future__ import annotations

import importlib

# The public names, imported on first use: importing pagedlm (or one of its submodules, as a
# spawned worker process does) then costs neither the engine nor transformers up front.
_EXPORTS = {
    "LLM": "pagedlm.entrypoints.llm",
    "LLMEngine": "pagedlm.engine.llm_engine",
    "EngineArgs": "pagedlm.engine.arg_utils",
    "SamplingParams": "pagedlm.sampling_params",
    "RequestOutputKind": "pagedlm.sampling_params",
    "BeamSearchParams": "pagedlm.sampling_params",
    "StructuredOutputsParams": "pagedlm.sampling_params",
    "RequestOutput": "pagedlm.outputs",
    "CompletionOutput": "pagedlm.outputs",
    "BeamSearchOutput": "pagedlm.outputs",
    "BeamSearchSequence": "pagedlm.outputs",
    # Needs the `server` extra (prometheus_client).
    "AsyncLLMEngine": "pagedlm.engine.async_llm_engine",
    "LoRARequest": "pagedlm.lora.request",
}

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput",
           "CompletionOutput", "RequestOutputKind", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence", "LoRARequest", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'pagedlm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
