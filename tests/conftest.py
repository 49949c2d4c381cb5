"""Shared fixtures: the default model through pagedlm and transformers, and tiny random models."""
from __future__ import annotations

import ctypes
import gc
import os
import shutil
import sys

import pytest
import torch

# Without a GPU, the GPU path's Triton kernels run on CPU tensors in Triton's interpreter. It
# must be chosen before anything imports triton (triton.language's own helpers are built for
# one mode at import), so here, first; on a GPU machine the kernels are compiled for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedlm.kernels.loader import kernels_disabled  # noqa: E402


def pytest_configure(config):
    # Under pytest-xdist the cores are shared by the workers: more torch threads than cores
    # spin against each other (a decode step ran 100x slower at load 25 here).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(scope="module", autouse=True)
def _free_module_engines():
    """After each test module, free the engines its fixtures shut down. FastAPI 0.165 keeps
    every route endpoint it has classified in module-level lru_caches (fastapi.dependencies.
    models). When build_app's endpoints closed over their AsyncLLMEngine, every app a module
    built kept its engine (model weights included) alive for the rest of the session, and an
    xdist worker grew past 14 GiB and was OOM-killed. The routes are module-level now
    (routes.py) and read the engine from app.state, but anything else a cached entry reaches is
    still kept, so the caches are still cleared. A served process builds one app, so only the
    tests need it. malloc_trim hands the freed heap back (the worker's malloc settings keep up
    to 1 GiB per arena otherwise)."""
    yield
    try:
        import fastapi.dependencies.models as fastapi_models
    except ImportError:
        fastapi_models = None
    for value in vars(fastapi_models).values() if fastapi_models else ():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The embedded SmolLM2 GGUF, converted to an HF-format dir with float32 weights (cached
    under ~/.cache/pagedlm)."""
    from pagedlm.model_executor.model_loader.model_path import float_model_dir
    return float_model_dir(None)


@pytest.fixture(scope="session")
def hf_default_model(default_model_dir):
    """transformers on the converted GGUF: the numerical reference. (test_model_loading checks
    that the conversion is bit-identical to transformers' own, much slower, GGUF loading.)"""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


# The native kernels are built with gcc at first use; without it, or with
# PAGEDLM_DISABLE_KERNELS=1, every op takes its PyTorch path, which the tests of that path cover
# (and deterministic=True, which needs the kernels, is refused).
KERNELS_OFF = "the native kernels are off (no C compiler, or PAGEDLM_DISABLE_KERNELS=1)"


def kernels_off() -> bool:
    return shutil.which("gcc") is None or kernels_disabled()


needs_kernels = pytest.mark.skipif(kernels_off(), reason=KERNELS_OFF)


def require_kernels() -> None:
    """For a module of kernel tests: skipped where the kernels are off on purpose, failed where
    they should have built (a build error must not pass as a skip)."""
    from pagedlm.kernels import loader
    if kernels_off():
        pytest.skip(KERNELS_OFF)
    if not loader.available():
        pytest.fail("the native quantized kernels did not build (see the warning above)")


def make_tiny_model(root, arch: str, default_model_dir: str, **overrides) -> str:
    """A random-weight model of `arch` saved as safetensors with the SmolLM2 tokenizer."""
    from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, MistralConfig, MistralForCausalLM)
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM)}
    config_cls, model_cls = classes[arch]
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    kwargs = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6,
                  # Larger weights give peaked logits, so greedy choices are not near-ties.
                  initializer_range=0.3, tie_word_embeddings=False,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).eval()
    path = os.path.join(str(root), arch)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
