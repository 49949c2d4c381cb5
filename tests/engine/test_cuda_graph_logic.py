"""CUDA graphs' logic on the CPU (worker/cuda_graph.py): the capture sizes, padding a step to
one, which steps and which engines may replay a graph. Capture and replay themselves need a
GPU: tests/gpu/test_cuda_graphs.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.attention.metadata import AttentionMetadata, PrefillChunk
from pagedlm.utils import cdiv
from pagedlm.worker.cuda_graph import (CUDAGraphRunner, StaticDecodeBatch,
                                       attention_backend_names, capture_sizes,
                                       graphs_off_reason, padded_size)
from tests.conftest import make_tiny_model


def test_capture_sizes_are_vllms_list_capped_at_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes == [1, 2, 4] + list(range(8, 257, 8)) and len(sizes) == 35
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_padded_size_is_the_smallest_capture_size_that_holds_the_step():
    sizes = capture_sizes(20)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 20)] == [
        1, 2, 4, 4, 8, 8, 16, 16, 20, 20]
    assert padded_size(21, sizes) is None and padded_size(0, sizes) is None


def _decode_meta(slots, tables, seq_lens) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=torch.tensor(slots), num_decode_tokens=len(slots),
                             decode_block_tables=torch.tensor(tables, dtype=torch.int32),
                             decode_mask=None, prefills=[],
                             decode_seq_lens=torch.tensor(seq_lens, dtype=torch.int32))


def test_static_batch_pads_the_rows_past_the_step():
    batch = StaticDecodeBatch(max_rows=8, block_table_width=4, device=torch.device("cpu"))
    # Fresh buffers are all padding: slot -1 (not written), length 0 (zeros), token and
    # position 0.
    assert batch.slot_mapping.tolist() == [-1] * 8 and batch.seq_lens.tolist() == [0] * 8
    meta = _decode_meta([17, 33, 50, 70, 90], [[1, 2], [2, 3], [3, 4], [4, 5], [5, 6]],
                        [18, 34, 19, 23, 27])
    batch.load(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([17, 33, 18, 22, 26]), meta)
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert batch.positions.tolist() == [17, 33, 18, 22, 26, 0, 0, 0]
    assert batch.slot_mapping.tolist() == [17, 33, 50, 70, 90, -1, -1, -1]
    assert batch.seq_lens.tolist() == [18, 34, 19, 23, 27, 0, 0, 0]
    assert batch.block_tables[:5, :2].tolist() == [[1, 2], [2, 3], [3, 4], [4, 5], [5, 6]]
    # A smaller step re-pads the rows the last one used.
    meta = _decode_meta([100, 120], [[7, 8, 9], [9, 10, 11]], [37, 40])
    batch.load(torch.tensor([11, 12]), torch.tensor([36, 39]), meta)
    assert batch.input_ids.tolist() == [11, 12] + [0] * 6
    assert batch.positions.tolist() == [36, 39] + [0] * 6
    assert batch.slot_mapping.tolist() == [100, 120] + [-1] * 6
    assert batch.seq_lens.tolist() == [37, 40] + [0] * 6
    assert batch.block_tables[:2, :3].tolist() == [[7, 8, 9], [9, 10, 11]]
    # The metadata a graph of size 4 is captured with: views of the buffers, decode only.
    graph_meta = batch.metadata(4)
    assert graph_meta.num_decode_tokens == 4 and graph_meta.prefills == []
    assert graph_meta.decode_block_tables.shape == (4, 4)
    assert graph_meta.slot_mapping.data_ptr() == batch.slot_mapping.data_ptr()
    assert graph_meta.decode_seq_lens.tolist() == [37, 40, 0, 0]


def test_only_pure_decode_steps_that_fit_the_buffers_replay():
    batch = StaticDecodeBatch(max_rows=4, block_table_width=3, device=torch.device("cpu"))
    meta = _decode_meta([1, 2], [[0, 1], [1, 2]], [2, 3])
    assert batch.fits(2, meta)
    # Speculative verification rows are decode rows: a sequence's 1 + k rows fit like others.
    assert batch.fits(4, _decode_meta([1, 2, 3, 4], [[0]] * 4, [2, 3, 4, 5]))
    assert not batch.fits(5, _decode_meta([1] * 5, [[0]] * 5, [1] * 5))  # past the largest
    assert not batch.fits(2, _decode_meta([1, 2], [[0, 1, 2, 3]] * 2, [2, 3]))  # too wide
    mixed = _decode_meta([1, 2, 3], [[0], [1]], [2, 3])
    mixed.num_decode_tokens = 2
    mixed.prefills = [PrefillChunk(2, 3, 0, None)]
    assert not batch.fits(3, mixed)
    no_lens = _decode_meta([1, 2], [[0], [1]], [2, 3])
    no_lens.decode_seq_lens = None
    assert not batch.fits(2, no_lens)


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory, default_model_dir):
    path = make_tiny_model(tmp_path_factory.mktemp("graphs"), "llama", default_model_dir)
    with LLM(path, max_num_seqs=4, max_model_len=128) as llm:
        yield llm


def test_an_engine_decides_once_whether_its_worker_captures(tiny_llm):
    worker = tiny_llm.llm_engine.executor.worker
    out = tiny_llm.generate(["Hello there", "A"], SamplingParams(max_tokens=4, temperature=0))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    # On the CPU nothing is captured, and every step runs the model eagerly.
    assert worker.runner.cuda_graphs is None
    config, model = worker.config, worker.model
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert "device cpu" in graphs_off_reason(config, model, cpu, has_lora=False)
    # On a GPU, the CPU's attention backends are not graph-safe (no padding rows, host syncs).
    reason = graphs_off_reason(config, model, cuda, has_lora=False)
    assert "attention backend" in reason and "triton" in reason
    assert "LoRA" in graphs_off_reason(config, model, cuda, has_lora=True)
    eager = dataclasses.replace(config, model_config=dataclasses.replace(
        config.model_config, enforce_eager=True))
    assert graphs_off_reason(eager, model, cuda, has_lora=False) == "enforce_eager=True"
    tp = dataclasses.replace(config, parallel_config=dataclasses.replace(
        config.parallel_config, tensor_parallel_size=2, distributed_executor_backend="mp"))
    assert "more than one rank" in graphs_off_reason(tp, model, cuda, has_lora=False)


def test_a_padded_static_step_computes_the_eager_rows(monkeypatch, tmp_path_factory,
                                                       default_model_dir):
    """What a graph records, run eagerly on the CPU through the Triton backend (interpreted):
    a 3-row decode step padded to 4 in the static buffers (after a 5-row step left its rows
    there) gives the eager step's hidden states and KV-cache writes; the padding row writes
    nothing."""
    monkeypatch.setenv("PAGEDLM_ATTENTION_BACKEND", "triton")
    path = make_tiny_model(tmp_path_factory.mktemp("static"), "llama", default_model_dir,
                           num_hidden_layers=2)
    with LLM(path, max_num_seqs=8, max_model_len=64, num_gpu_blocks_override=12) as llm:
        worker = llm.llm_engine.executor.worker
        model, kv = worker.model, worker.cache_engine.kv_caches
        assert attention_backend_names(model) == {"triton"}
        gen = torch.Generator().manual_seed(0)
        for k, v in kv:
            k.copy_(torch.randn(k.shape, generator=gen))
            v.copy_(torch.randn(v.shape, generator=gen))
        bs = kv[0][0].shape[1]

        def step(tables, seq_lens, ids):
            pos = [n - 1 for n in seq_lens]
            slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)]
            return torch.tensor(ids), torch.tensor(pos), _decode_meta(slots, tables, seq_lens)

        before = [(k.clone(), v.clone()) for k, v in kv]
        ids, pos, meta = step([[0, 1], [2, 3], [4, 5]], [20, 9, 32], [5, 77, 300])
        with torch.inference_mode():
            eager = model(ids, pos, kv, meta).clone()
            eager_kv = [(k.clone(), v.clone()) for k, v in kv]
            for (k, v), (k0, v0) in zip(kv, before):
                k.copy_(k0)
                v.copy_(v0)
            runner = CUDAGraphRunner(model, kv, capture_sizes(8), cdiv(64, bs), torch.device("cpu"))
            runner.batch.load(*step([[6], [7], [8], [9], [10]], [3, 4, 5, 6, 7], [1, 2, 3, 4, 5]))
            runner.batch.load(ids, pos, meta)
            static = runner.forward_static(padded_size(3, runner.sizes))
        assert static.shape[0] == 4 and torch.isfinite(static).all()
        torch.testing.assert_close(static[:3], eager, rtol=1e-5, atol=1e-5)
        # The padded step's projections run at another row count than the eager step's: the
        # written K/V agree to rounding (and a write from the padding row would differ by far).
        for (k, v), (ke, ve) in zip(kv, eager_kv):
            torch.testing.assert_close(k, ke, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, ve, rtol=1e-5, atol=1e-5)
        assert model.fused_decode.stack is None  # the layers ran, not the native stack
