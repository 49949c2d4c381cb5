"""pagedlm: a small LLM inference engine with a paged KV cache and continuous batching."""
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.entrypoints.llm import LLM
from pagedlm.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from pagedlm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput",
           "CompletionOutput", "RequestOutputKind", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use: it needs the `server` extra (prometheus_client).
    if name == "AsyncLLMEngine":
        from pagedlm.engine.async_llm_engine import AsyncLLMEngine
        return AsyncLLMEngine
    raise AttributeError(f"module 'pagedlm' has no attribute {name!r}")
