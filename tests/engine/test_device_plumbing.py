"""device="cpu"|"cuda": DeviceConfig, the settings that depend on the device, the step's inputs
in one buffer, and the KV sizing on a GPU. Runs on the CPU (what needs a GPU is faked)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from pagedlm.attention.metadata import PAD_SLOT_ID
from pagedlm.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedlm.device_config import DeviceConfig
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.entrypoints.cli import make_parser
from pagedlm.entrypoints.cli_args import engine_args_from_namespace
from pagedlm.worker.model_runner import CachedSequenceState, ModelRunner, _FlatBatch
from pagedlm.worker.step_inputs import build_step_tensors, to_device_in_one_copy
from pagedlm.worker.worker import Worker

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA errors")


def test_device_config_resolves_and_validates():
    cpu = DeviceConfig("cpu")
    assert cpu.device == torch.device("cpu") and cpu.device_type == "cpu" and not cpu.is_cuda
    assert DeviceConfig("cpu:0").device == torch.device("cpu")
    assert DeviceConfig(torch.device("cpu")).device_type == "cpu"
    auto = DeviceConfig("auto")
    assert auto.device_type == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("tpu", "gpu", "", 3):
        with pytest.raises(ValueError, match="device must be one of"):
            DeviceConfig(bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cpu.device = torch.device("cpu")
    assert cpu.worker_device(1, 2) == torch.device("cpu")


@no_cuda
def test_cuda_without_cuda_is_refused_before_the_model_is_read():
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=f"device '{device}': CUDA is not available"):
            DeviceConfig(device)
        with pytest.raises(ValueError, match="CUDA is not available"):
            EngineArgs(model="/nonexistent", device=device).create_engine_config()


def test_dtype_and_compute_dtype_follow_the_device(default_model_dir):
    cpu = ModelConfig.from_dir(None, default_model_dir, "auto", 64, 0)
    cuda = ModelConfig.from_dir(None, default_model_dir, "auto", 64, 0, device_type="cuda")
    assert (cpu.dtype, cpu.compute_dtype) == (torch.float32, torch.float32)
    assert (cuda.dtype, cuda.compute_dtype) == (torch.bfloat16, torch.bfloat16)

    def config(**kw):
        return dataclasses.replace(cpu, **kw)
    assert config(dtype=torch.bfloat16).compute_dtype == torch.float32  # widened on the CPU
    assert config(dtype=torch.float16, device_type="cuda").compute_dtype == torch.float16
    assert config(device_type="cuda", enforce_eager=True).enforce_eager
    # What cannot run on a GPU names its setting.
    with pytest.raises(ValueError, match="deterministic=True is CPU-only"):
        config(device_type="cuda", deterministic=True)
    with pytest.raises(ValueError, match="quantization='int8' needs the native CPU"):
        config(device_type="cuda", quantization="int8")
    with pytest.raises(ValueError, match="device_type must be"):
        config(device_type="tpu")
    with pytest.raises(ValueError, match="enforce_eager must be a bool"):
        config(enforce_eager=1)


def test_flags_and_engine_args():
    assert EngineArgs().device == "cpu" and EngineArgs().enforce_eager is False
    ns = make_parser().parse_args(["serve", "--device", "cuda:1", "--enforce-eager"])
    args = engine_args_from_namespace(ns)
    assert (args.device, args.enforce_eager) == ("cuda:1", True)


def _seq(blocks, n):
    return CachedSequenceState("r", list(range(n)), blocks, n)


def test_step_inputs_are_views_of_one_buffer():
    a, b, c = _seq([7], 3), _seq([4, 5], 20), _seq([9], 2)
    # Two decode rows (a at position 2, b at 19), then c's fresh prefill of 2 tokens and b's
    # chunk of 3 after 16 cached tokens.
    batch = _FlatBatch(input_ids=[11, 12, 13, 14, 15, 16, 17],
                       positions=[2, 19, 0, 1, 16, 17, 18],
                       slots=[114, 83, 144, 145, 80, 81, PAD_SLOT_ID],
                       decodes=[(a, 2), (b, 19)],
                       prefills=[(c, 0, 2, 4), (b, 16, 4, 7)], last_row={})
    step = build_step_tensors(batch, [1, 6, 6], torch.device("cpu"))
    meta = step.attn_metadata
    wide = [step.input_ids, step.positions, meta.slot_mapping, step.sample_rows]
    narrow = [meta.decode_seq_lens, meta.decode_block_tables, meta.prefill_query_start_loc,
              meta.prefill_context_lens, meta.prefill_block_tables]
    for group, dtype in ((wide, torch.int64), (narrow, torch.int32)):
        assert {t.untyped_storage().data_ptr() for t in group} == {
            group[0].untyped_storage().data_ptr()}
        assert all(t.dtype == dtype and t.is_contiguous() for t in group)
    assert step.input_ids.tolist() == batch.input_ids
    assert step.positions.tolist() == batch.positions
    assert meta.slot_mapping.tolist() == batch.slots
    assert step.sample_rows.tolist() == [1, 6, 6]
    assert meta.num_decode_tokens == 2 and meta.decode_seq_lens.tolist() == [3, 20]
    assert meta.decode_block_tables.tolist() == [[7, 0], [4, 5]]
    assert meta.prefill_query_start_loc.tolist() == [2, 4, 7]
    assert meta.prefill_context_lens.tolist() == [0, 16]
    assert meta.prefill_block_tables.tolist() == [[0, 0], [4, 5]]
    assert meta.max_prefill_query_len == 3
    first, second = meta.prefills
    assert (first.start, first.end, first.context_len, first.block_table) == (2, 4, 0, None)
    assert (second.start, second.end, second.context_len) == (4, 7, 16)
    assert second.block_table.tolist() == [4, 5]
    # What a GPU step moves: one buffer, both regions viewed in their own type.
    longs, ints = to_device_in_one_copy(torch.tensor([1, -1, 2**40]), torch.tensor(
        [3, 4, 5], dtype=torch.int32), torch.device("cpu"))
    assert longs.tolist() == [1, -1, 2**40] and ints.tolist() == [3, 4, 5]
    assert (longs.dtype, ints.dtype) == (torch.int64, torch.int32)
    assert longs.untyped_storage().data_ptr() == ints.untyped_storage().data_ptr()
    # A pure decode step has no prefill arrays; an empty sample list is an empty view.
    only = build_step_tensors(_FlatBatch([5], [2], [114], [(a, 2)], [], {}), [],
                              torch.device("cpu"))
    assert only.attn_metadata.prefill_query_start_loc is None
    assert only.sample_rows.numel() == 0 and only.attn_metadata.max_prefill_query_len == 0


def test_generators_live_on_the_models_device(default_model_dir):
    config = ModelConfig.from_dir(None, default_model_dir, "auto", 64, 3)
    model = torch.nn.Linear(2, 2)
    runner = ModelRunner(config, model, 16, frozenset())
    assert runner.device == torch.device("cpu")
    assert runner.sampler.generator.device == runner.device
    # The sampler upcasts narrow logits and draws where they are.
    logits = torch.randn(3, 50).to(torch.bfloat16)
    out = runner.sampler(logits, _meta(3))
    assert len(out.sampled_token_ids) == 3 and all(0 <= t < 50 for t in out.sampled_token_ids)
    assert out.sampled_token_ids[1] == logits[1].float().argmax().item()


def _meta(n):
    from pagedlm.model_executor.layers.sampler import SamplingMetadata
    from pagedlm.sampling_params import SamplingParams
    params = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_k=5)][:n]
    gens = [torch.Generator(torch.device("cpu")).manual_seed(1), None, None][:n]
    return SamplingMetadata(params=params, generators=gens, output_token_ids=[[]] * n,
                            prompt_token_ids=[[1]] * n, stop_ids=[frozenset()] * n,
                            all_greedy=False, max_num_logprobs=1)


def test_kv_sizing_on_a_gpu_takes_free_memory_less_a_headroom(monkeypatch, default_model_dir):
    free = 10 * 2**30
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    mc = ModelConfig.from_dir(None, default_model_dir, "auto", 2048, 0, device_type="cuda")
    sc = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=2048)
    per_block = 2**20

    def blocks(**cache):
        fake = SimpleNamespace(cache_config=CacheConfig(**cache), model_config=mc,
                               config=SimpleNamespace(scheduler_config=sc),
                               device=torch.device("cuda"))
        return Worker._num_cuda_blocks(fake, per_block)
    headroom = 2048 * (4 * mc.vocab_size + 8 * mc.get_hf("intermediate_size") * 2)
    assert blocks() == (int(free * 0.9) - headroom) // per_block
    assert blocks(gpu_memory_utilization=0.5) == (int(free * 0.5) - headroom) // per_block
    assert blocks(num_gpu_blocks_override=100) == 100
    with pytest.raises(ValueError, match="num_gpu_blocks_override: 20000 KV blocks"):
        blocks(num_gpu_blocks_override=20000)
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.01"):
        blocks(gpu_memory_utilization=0.01)
