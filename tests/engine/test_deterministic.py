"""deterministic=True (issue 31), what it guarantees so far, bitwise: attention gives a row the
same result whether its prefix was prefilled with it, read from the prefix cache, or computed
in other chunks, with a float32 and a bfloat16 KV cache; so a prompt whose prefix is read from
the prefix cache gives the same token ids and logprobs as a cold prefill, greedy and seeded.
The default keeps its fast paths."""
from __future__ import annotations

import argparse

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.attention.backends import NativeKernelBackend, get_attn_backend
from pagedlm.attention.backends.native import kernel_plan, prefill_plan
from pagedlm.attention.metadata import AttentionMetadata, PrefillChunk
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.entrypoints.cli_args import add_engine_args, engine_args_from_namespace
from tests.conftest import needs_kernels

CACHE_DTYPES = [torch.float32, torch.bfloat16]

# Prompts of 50-112 tokens: a warm re-run reads their whole blocks from the cache.
PROBES = [f"Note {i}: " + " ".join(f"item {j * (i + 3)} goes on shelf {j % (i + 2)}."
                                   for j in range(5 + 2 * i)) for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=3, ignore_eos=True, logprobs=5)
PARAMS = [GREEDY, SEEDED, GREEDY, SEEDED]  # one per probe: every prompt is cold once


def _outputs(llm: LLM, prompts=PROBES, params=PARAMS) -> list:
    """(token ids, {token: logprob} per position) of every prompt."""
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params, use_tqdm=False)]


def _step(backend, q, k, v, k_cache, v_cache, spans, block_table):
    """One step of one sequence over blocks block_table: chunks (context_len, n) of the flat
    rows q/k/v, placed after an unrelated fresh 5-token prompt in the batch."""
    g = torch.Generator().manual_seed(1)
    other = [torch.randn(5, *t.shape[1:], generator=g) for t in (q, k, v)]
    rows = [(c, n) for c, n in spans]
    qs = torch.cat([other[0]] + [q[c:c + n] for c, n in rows])
    ks = torch.cat([other[1]] + [k[c:c + n] for c, n in rows])
    vs = torch.cat([other[2]] + [v[c:c + n] for c, n in rows])
    bs = k_cache.shape[1]
    other_slots = torch.arange(5) + (k_cache.shape[0] - 1) * bs  # the last block
    slots = torch.cat([other_slots] + [block_table[torch.arange(c, c + n) // bs] * bs
                                       + torch.arange(c, c + n) % bs for c, n in rows])
    prefills, r = [PrefillChunk(0, 5, 0, None)], 5
    for c, n in rows:
        prefills.append(PrefillChunk(r, r + n, c, block_table if c else None))
        r += n
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=0, decode_block_tables=None,
                             decode_mask=None, prefills=prefills)
    return backend.forward(qs, ks, vs, k_cache, v_cache, meta, 0.125)[5:]


@needs_kernels
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_attention_rows_do_not_depend_on_how_the_context_was_computed(cache_dtype):
    """A 50-token prompt (3 kv heads of 3 query heads, blocks of 16, shuffled) fresh in one
    chunk, as a prefix-cache hit (32 cached, 18 computed), and in chunks of 8, 3, 21 and 18:
    the attention output of every row is the same bits, on 1 thread or 2."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(50, h, 64, generator=g) for h in (9, 3, 3))
    table = torch.tensor([6, 2, 9, 4], dtype=torch.int32)
    backend = NativeKernelBackend(deterministic=True)

    def run(plan_of_steps):
        k_cache = torch.zeros(11, 16, 3, 64, dtype=cache_dtype)
        v_cache = torch.zeros_like(k_cache)
        return torch.cat([_step(backend, q, k, v, k_cache, v_cache, spans, table)
                          for spans in plan_of_steps])

    fresh = run([[(0, 50)]])
    cached = run([[(0, 32)], [(32, 18)]])
    assert torch.equal(cached[32:], fresh[32:])
    assert torch.equal(run([[(0, 8)], [(8, 3)], [(11, 21)], [(32, 18)]]), fresh)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run([[(0, 50)]]), fresh)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16"])
def test_prefix_hit_is_bitwise_cold_prefill(kv_cache_dtype):
    llm = LLM(deterministic=True, enable_prefix_caching=True, kv_cache_dtype=kv_cache_dtype,
              kv_cache_memory_bytes=32 * 2**20)
    stats = llm.llm_engine.stats
    cold = _outputs(llm)
    computed = stats.num_prompt_tokens
    warm = _outputs(llm)
    # The warm pass read every prompt's whole blocks from the cache.
    lens = [len(llm.get_tokenizer()(p).input_ids) for p in PROBES]
    assert stats.num_prompt_tokens - computed <= sum(n - (n - 1) // 16 * 16 for n in lens)
    assert warm == cold


# A step that computes a few rows (a small chunk, a prefix hit alone with a short remainder)
# gives the bits of a cold prefill only where every float32 linear layer runs one kernel with
# one sum order per output at every row count: the panel kernel (AVX2 or AVX-512 builds), or,
# under deterministic=True without it, the GEMV kernel at every row count. Before the AVX2 panel
# kernel this failed on AVX2 machines (GEMV up to gemv.GEMV_MAX_ROWS rows, oneDNN past them).
@needs_kernels
def test_small_chunks_and_a_lone_prefix_hit_are_bitwise_cold_prefill():
    kw = dict(deterministic=True, kv_cache_memory_bytes=32 * 2**20)
    llm = LLM(enable_prefix_caching=True, **kw)
    cold = _outputs(llm, PROBES[:1], PARAMS[:1])
    chunked = LLM(enable_prefix_caching=False, max_num_batched_tokens=8, max_num_seqs=8, **kw)
    chunked_out = _outputs(chunked, PROBES[:1], PARAMS[:1])
    # Alone, the 50-token probe's hit leaves 2 tokens to compute.
    assert _outputs(llm, PROBES[:1], PARAMS[:1]) == cold
    assert chunked_out == cold


@needs_kernels
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_default_keeps_the_fast_paths(cache_dtype):
    """Off by default, and off means the paths of before (a fresh prefill attends over its own
    K/V through the prefill kernel or SDPA): the switch cannot slow the default down."""
    assert EngineArgs().deterministic is False
    assert get_attn_backend(torch.float32).deterministic is False
    assert get_attn_backend(torch.float32, deterministic=True).deterministic is True
    with pytest.raises(ValueError, match="deterministic=True needs the native"):
        get_attn_backend(torch.bfloat16, deterministic=True)
    k_cache = torch.zeros(4, 16, 3, 64, dtype=cache_dtype)
    q, k, v = torch.randn(20, 9, 64), torch.randn(20, 3, 64), torch.randn(20, 3, 64)
    meta = AttentionMetadata(slot_mapping=torch.arange(20), num_decode_tokens=0,
                             decode_block_tables=None, decode_mask=None,
                             prefills=[PrefillChunk(0, 20, 0, None)])
    assert kernel_plan(meta, k_cache).token_seq.numel() == 0
    plan = prefill_plan(meta, q, k, v, k_cache)
    assert plan.chunks.shape[0] + len(plan.sdpa) == 1  # the prefill kernel's, or SDPA's
    every = kernel_plan(meta, k_cache, every_row=True)
    assert every.ctx_lens.tolist() == list(range(1, 21))
    assert every.block_tables.tolist() == [[0, 1]]


def test_cli_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).deterministic is False
    args = engine_args_from_namespace(parser.parse_args(["--deterministic"]))
    assert args.deterministic is True
    assert args.create_engine_config().model_config.deterministic is True
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        EngineArgs(deterministic="yes").create_engine_config()
