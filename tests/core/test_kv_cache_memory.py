"""KV-cache memory: an explicit size is committed at start-up, the default size is faulted in as
blocks are used, and an explicit size past the free memory is refused by name."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tests.conftest import make_tiny_model

REPO = str(Path(__file__).resolve().parents[2])

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="page residency is read with Linux's mincore")


def resident_fraction(t: torch.Tensor) -> float:
    """Share of the tensor's pages that are in memory (mincore)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * -(-length // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, length, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vec) / len(vec)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    return make_tiny_model(tmp_path_factory.mktemp("kvmem"), "llama", default_model_dir)


def caches(llm):
    return [t for pair in llm.llm_engine.executor.worker.cache_engine.kv_caches for t in pair]


@pytest.mark.parametrize("size", [{"kv_cache_memory_bytes": 64 * 2**20},
                                  {"num_gpu_blocks_override": 8192}])
def test_explicit_size_is_committed_at_startup(tiny, size):
    llm = LLM(model=tiny, max_model_len=256, **size)
    kv = caches(llm)
    assert sum(t.numel() * t.element_size() for t in kv) >= 48 * 2**20
    assert min(resident_fraction(t) for t in kv) == 1.0
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4,
                                                                    temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_default_size_is_faulted_in_as_blocks_are_used(tiny):
    # A fresh interpreter: in this one, glibc may serve the cache from heap memory that earlier
    # tests' engines freed and that is still resident.
    script = f"""
import sys
sys.path.insert(0, {REPO!r})
from pagedlm import LLM, SamplingParams
from tests.core.test_kv_cache_memory import caches, resident_fraction
# The default size is max_num_seqs full-length sequences here (less than 90% of free RAM).
llm = LLM(model={tiny!r}, max_model_len=256, max_num_seqs=2048)
kv = caches(llm)
assert kv[0].numel() * 4 >= 64 * 2**20, kv[0].shape
llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))
print("resident", max(resident_fraction(t) for t in kv))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # Far more blocks than one short request touches: nearly all pages still unbacked.
    assert float(out.stdout.split("resident")[-1]) < 0.1


@pytest.mark.parametrize("field,value", [("kv_cache_memory_bytes", 1 << 50),
                                         ("num_gpu_blocks_override", 1 << 40)])
def test_explicit_size_past_free_memory_is_refused_by_name(tiny, field, value):
    with pytest.raises(ValueError, match=f"{field}: .* more than the .* bytes of memory"):
        LLM(model=tiny, max_model_len=256, **{field: value})
