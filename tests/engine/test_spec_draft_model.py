"""The draft-model proposer (issue 34): a tiny random Llama sharing the default model's
tokenizer drafts greedily, kept in step with committed tokens across rollbacks."""
from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch

from pagedlm.config import CacheConfig, ModelConfig
from pagedlm.spec_decode.draft_config import check_draft_model, draft_model_config
from pagedlm.spec_decode.draft_model import DraftModelProposer
from pagedlm.spec_decode.proposer import ProposalRequest
from tests.models.test_model_loading import _tiny_hf_state, write_tiny_gguf


def tiny_draft(root, target: ModelConfig, **overrides) -> str:
    """A random 2-layer Llama with the target's vocabulary and tokenizer files (copied: loading
    the tokenizer, as conftest's make_tiny_model does, takes seconds)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    kwargs = dict(vocab_size=target.vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6,
                  # Larger weights give peaked logits, so greedy choices are not near-ties.
                  initializer_range=0.3, tie_word_embeddings=False,
                  bos_token_id=target.get_hf("bos_token_id"),
                  eos_token_id=target.get_hf("eos_token_id"))
    kwargs.update(overrides)
    torch.manual_seed(0)
    path = str(root)
    LlamaForCausalLM(LlamaConfig(**kwargs)).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(target.model_dir, name), path)
    return path


@pytest.fixture(scope="module")
def target_config(default_model_dir) -> ModelConfig:
    return ModelConfig.from_dir(None, default_model_dir, "auto", None, 0)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, target_config) -> str:
    return tiny_draft(tmp_path_factory.mktemp("draft"), target_config)


@pytest.fixture(scope="module")
def hf_draft(draft_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()


def greedy(hf_model, tokens: list[int], n: int) -> list[int]:
    """transformers' greedy continuation: the reference the proposer must reproduce."""
    out = list(tokens)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf_model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(tokens):]


def make_proposer(draft_dir, target_config, num_blocks: int) -> DraftModelProposer:
    return DraftModelProposer(draft_model_config(draft_dir, target_config),
                              CacheConfig(block_size=4), num_blocks)


def test_proposals_follow_committed_tokens_across_rollbacks(draft_dir, target_config, hf_draft):
    proposer = make_proposer(draft_dir, target_config, num_blocks=64)
    a = list(range(1000, 1019))  # 19 tokens: the catch-up is a prefill chunk
    b = [5, 77, 3000, 41, 9]
    props = proposer.propose([ProposalRequest(0, a, 4), ProposalRequest(1, b, 3)])
    assert [p.token_ids for p in props] == [greedy(hf_draft, a, 4), greedy(hf_draft, b, 3)]
    assert all(p.probs is None for p in props)  # greedy drafts: one-hot q
    da, db = props[0].token_ids, props[1].token_ids
    # a: two drafts accepted, then a correction (d3's K/V rolled back); b: every draft
    # rejected; c: a new one-token prompt joins the batch (a prefill chunk of one token).
    a2 = a + da[:2] + [(da[2] + 1) % 49152]
    b2 = b + [(db[0] + 1) % 49152]
    c = [17]
    props = proposer.propose([ProposalRequest(0, a2, 4), ProposalRequest(1, b2, 2),
                              ProposalRequest(2, c, 3)])
    assert [p.token_ids for p in props] == [greedy(hf_draft, a2, 4), greedy(hf_draft, b2, 2),
                                            greedy(hf_draft, c, 3)]
    # a: all four drafts and a bonus accepted (more than the cache holds: a decode-free
    # catch-up of two tokens); b: one committed token (a decode row); c asks for none.
    a3 = a2 + props[0].token_ids + [11]
    b3 = b2 + [props[1].token_ids[0]]
    props = proposer.propose([ProposalRequest(0, a3, 1), ProposalRequest(1, b3, 4),
                              ProposalRequest(2, c + [props[2].token_ids[0]], 0)])
    assert [p.token_ids for p in props] == [greedy(hf_draft, a3, 1), greedy(hf_draft, b3, 4),
                                            []]
    assert proposer.num_free_blocks < proposer.num_blocks
    proposer.drop([0, 1, 2, 99])  # an unknown id is ignored
    assert proposer.num_free_blocks == proposer.num_blocks and not proposer.seqs


def test_full_pool_proposes_nothing_for_that_sequence(draft_dir, target_config, hf_draft):
    proposer = make_proposer(draft_dir, target_config, num_blocks=4)  # 16 token slots
    short, long = [5, 6, 7], list(range(200, 230))
    props = proposer.propose([ProposalRequest(0, short, 3), ProposalRequest(1, long, 3)])
    assert props[0].token_ids == greedy(hf_draft, short, 3) and props[1].token_ids == []
    assert 1 not in proposer.seqs  # holds no blocks the others could use
    # A sequence not drafting this step gives its blocks to one that needs them.
    mid = list(range(300, 312))
    assert proposer.propose([ProposalRequest(2, mid, 3)])[0].token_ids == greedy(hf_draft,
                                                                                  mid, 3)
    assert list(proposer.seqs) == [2]
    # Nor when its own lookahead outgrows the pool: its blocks are given back.
    assert proposer.propose([ProposalRequest(2, mid + [1], 16)])[0].token_ids == []
    assert not proposer.seqs
    # Positions past the draft's context are not fed: k shrinks to fit it.
    short_context = DraftModelProposer(dataclasses.replace(proposer.config, max_model_len=14),
                                       CacheConfig(block_size=4), 4, model=proposer.model)
    assert short_context.propose([ProposalRequest(0, mid, 4)])[0].token_ids == greedy(
        hf_draft, mid, 3)
    assert short_context.propose([ProposalRequest(0, mid + [1, 2, 3], 4)])[0].token_ids == []
    # The catch-up is budgeted per sequence: a long prompt is computed over several steps
    # and drafts once it is caught up; the others draft meanwhile.
    chunked = DraftModelProposer(proposer.config, CacheConfig(block_size=4), 16,
                                 model=proposer.model, max_catchup_tokens=8)
    asks = [ProposalRequest(0, short, 2), ProposalRequest(1, mid + mid, 2)]
    got = [[p.token_ids for p in chunked.propose(asks)] for _ in range(3)]
    assert got[:2] == [[greedy(hf_draft, short, 2), []]] * 2
    assert got[2] == [greedy(hf_draft, short, 2), greedy(hf_draft, mid + mid, 2)]
    assert proposer.num_free_blocks == 4


def test_draft_model_refusals_name_the_field(tmp_path, monkeypatch, draft_dir, target_config):
    check_draft_model(draft_dir, target_config)
    other = tiny_draft(tmp_path / "other", target_config, vocab_size=1000)
    with pytest.raises(ValueError, match=r"speculative_config\.model: .*vocabulary has 1000"):
        check_draft_model(other, target_config)
    eos = tiny_draft(tmp_path / "eos", target_config, eos_token_id=7)
    with pytest.raises(ValueError, match=r"speculative_config\.model: .*EOS token ids \[7\]"):
        check_draft_model(eos, target_config)
    # A .gguf draft is read from its metadata (tests/models/test_model_loading's tiny file).
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "cache"))
    gguf_draft = write_tiny_gguf(tmp_path / "draft.gguf", _tiny_hf_state(False, False))
    with pytest.raises(ValueError, match=r"speculative_config\.model: .*vocabulary has 260"):
        check_draft_model(str(gguf_draft), target_config)
    with pytest.raises(ValueError, match=r"speculative_config\.model: .*does not exist"):
        check_draft_model(str(tmp_path / "missing"), target_config)
    with pytest.raises(ValueError, match=r"speculative_config\.model: .*config\.json"):
        check_draft_model(str(tmp_path), target_config)


PROMPTS = ["The capital of France is", "def fib(n):", "1, 2, 3, 4,", "Once upon a time",
           "Water boils at", "The quick brown fox", "import numpy as np\n", "Dear Sir,"]


def test_greedy_outputs_equal_plain_decoding_end_to_end(draft_dir):
    """A random draft is mostly rejected, but every output is the target's: under
    --deterministic, token for token the plain engine's. Every KV block is free afterwards,
    the draft's too."""
    from pagedlm import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    settings = dict(deterministic=True, kv_cache_memory_bytes=32 << 20)
    outputs = {}
    for spec in (None, {"model": draft_dir, "num_speculative_tokens": 3}):
        llm = LLM(speculative_config=spec, **settings)
        try:
            outputs[spec is None] = [o.outputs[0].token_ids
                                     for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            engine = llm.llm_engine
            bm = engine.block_manager
            assert not engine.has_unfinished_requests()
            assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
            if spec is not None:
                proposer = engine.executor.worker.proposer
                assert isinstance(proposer, DraftModelProposer)
                # The workers drop finished sequences' state (the draft's blocks too) when
                # the next step tells them: a one-token request (a prefill, never drafted).
                llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
                assert proposer.num_free_blocks == proposer.num_blocks and not proposer.seqs
                assert engine.scheduler.stats.spec_num_drafts > 0  # it did speculate
        finally:
            llm.shutdown()
    assert outputs[False] == outputs[True]


def test_accepted_drafts_with_preemption_and_n_2(draft_dir):
    """The draft as its own target: drafts are accepted (bonus tokens, two-token catch-ups),
    through recompute preemptions (a 24-block cache) and an n=2 request, and the greedy outputs
    are still plain decoding's."""
    from pagedlm import LLM, SamplingParams
    greedy_params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=16, ignore_eos=True)
    outputs = {}
    for spec in (None, {"model": draft_dir, "num_speculative_tokens": 3}):
        llm = LLM(model=draft_dir, speculative_config=spec, deterministic=True, block_size=4,
                  num_gpu_blocks_override=24)
        try:
            outs = llm.generate(PROMPTS + PROMPTS[:1], [greedy_params] * 8 + [sampled],
                                use_tqdm=False)
            outputs[spec is None] = [o.outputs[0].token_ids for o in outs[:8]]
            assert [len(c.token_ids) for c in outs[8].outputs] == [16, 16]
            stats = llm.llm_engine.scheduler.stats
            assert stats.num_preemptions > 0
            if spec is not None:
                assert stats.spec_num_accepted > stats.spec_num_verifies > 0
                proposer = llm.llm_engine.executor.worker.proposer
                llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
                assert proposer.num_free_blocks == proposer.num_blocks and not proposer.seqs
            bm = llm.llm_engine.block_manager
            assert bm.num_free_blocks == bm.num_blocks
        finally:
            llm.shutdown()
    assert outputs[False] == outputs[True]
