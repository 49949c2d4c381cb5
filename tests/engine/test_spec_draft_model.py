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
from tests.conftest import needs_kernels
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


def ask(seq_id: int, tokens: list[int], k: int, table=None) -> ProposalRequest:
    """A request with a block table of its own (10 blocks from 10 * seq_id) unless given."""
    return ProposalRequest(seq_id, tokens, k,
                           list(table if table is not None else range(10 * seq_id,
                                                                       10 * seq_id + 10)))


def count_rows(proposer: DraftModelProposer, monkeypatch) -> list[int]:
    """The draft's forward passes record their row counts here."""
    rows, forward = [], proposer.model.forward
    monkeypatch.setattr(proposer.model, "forward",
                        lambda ids, *a, **kw: rows.append(len(ids)) or forward(ids, *a, **kw))
    return rows


def test_proposals_follow_committed_tokens_across_rollbacks(draft_dir, target_config, hf_draft):
    proposer = make_proposer(draft_dir, target_config, num_blocks=64)
    a = list(range(1000, 1019))  # 19 tokens: the catch-up is a prefill chunk
    b = [5, 77, 3000, 41, 9]
    props = proposer.propose([ask(0, a, 4), ask(1, b, 3)])
    assert [p.token_ids for p in props] == [greedy(hf_draft, a, 4), greedy(hf_draft, b, 3)]
    assert all(p.probs is None for p in props)  # greedy drafts: one-hot q
    da, db = props[0].token_ids, props[1].token_ids
    # a: two drafts accepted, then a correction (d3's K/V rolled back); b: every draft
    # rejected; c: a new one-token prompt joins the batch (a prefill chunk of one token).
    a2 = a + da[:2] + [(da[2] + 1) % 49152]
    b2 = b + [(db[0] + 1) % 49152]
    c = [17]
    props = proposer.propose([ask(0, a2, 4), ask(1, b2, 2), ask(2, c, 3)])
    assert [p.token_ids for p in props] == [greedy(hf_draft, a2, 4), greedy(hf_draft, b2, 2),
                                            greedy(hf_draft, c, 3)]
    # a: all four drafts and a bonus accepted (more than the cache holds: a decode-free
    # catch-up of two tokens); b: one committed token (a decode row); c asks for none.
    a3 = a2 + props[0].token_ids + [11]
    b3 = b2 + [props[1].token_ids[0]]
    props = proposer.propose([ask(0, a3, 1), ask(1, b3, 4),
                              ask(2, c + [props[2].token_ids[0]], 0)])
    assert [p.token_ids for p in props] == [greedy(hf_draft, a3, 1), greedy(hf_draft, b3, 4),
                                            []]
    proposer.drop([0, 1, 2, 99])  # an unknown id is ignored
    assert not proposer.seqs


def test_shared_and_reused_blocks(draft_dir, target_config, hf_draft, monkeypatch):
    """The draft's K/V lives under the target's block ids: a block shared through prefix
    caching, or reused after its sequence finished, is not computed again when it holds the
    same tokens after the same prefix; a copy-on-write copy, or a block that held the same
    tokens after another prefix, is."""
    proposer = make_proposer(draft_dir, target_config, num_blocks=32)
    rows = count_rows(proposer, monkeypatch)
    p = list(range(1000, 1010))  # blocks 0 and 1 full, block 2 half
    assert proposer.propose([ask(0, p, 3, [0, 1, 2, 3])])[0].token_ids == greedy(hf_draft, p, 3)
    assert rows == [10, 1, 1]
    # A prefix-cache hit on blocks 0 and 1: only its own 3 tokens are computed.
    q = p[:8] + [7, 8, 9]
    rows.clear()
    assert proposer.propose([ask(1, q, 3, [0, 1, 4, 5])])[0].token_ids == greedy(hf_draft, q, 3)
    assert rows == [3, 1, 1]
    # A fork of sequence 0: block 6 is the target's copy of block 2 (nothing of the draft's
    # in it). Sequence 0 kept its accepted draft: one decode row.
    d1 = greedy(hf_draft, p, 1)[0]
    p0, p2 = p + [d1, 5], p + [6]
    rows.clear()
    props = proposer.propose([ask(0, p0, 2, [0, 1, 2, 3]), ask(2, p2, 2, [0, 1, 6, 7])])
    assert [x.token_ids for x in props] == [greedy(hf_draft, p0, 2), greedy(hf_draft, p2, 2)]
    assert rows == [1 + 3, 2]
    # All finished; a new sequence gets blocks 0-2 back: block 2 still holds p[8:10] + [d1].
    proposer.drop([0, 1, 2])
    z = p + [d1, 8]
    rows.clear()
    assert proposer.propose([ask(3, z, 2, [0, 1, 2, 11])])[0].token_ids == greedy(hf_draft, z, 2)
    assert rows == [1, 1]
    # Block 1 holds p[4:8] after p[:4]; after other tokens it is computed again.
    proposer.drop([3])
    r = [5] * 4 + p[4:8] + [3]
    rows.clear()
    assert proposer.propose([ask(4, r, 2, [8, 1, 9, 10])])[0].token_ids == greedy(hf_draft, r, 2)
    assert rows == [9, 1]


def test_catchup_budget_and_context_limits(draft_dir, target_config, hf_draft, monkeypatch):
    proposer = make_proposer(draft_dir, target_config, num_blocks=16)
    mid = list(range(300, 312))
    # Positions past the draft's context, or past the slots the target reserved, are not fed.
    assert proposer.propose([ask(0, mid, 4, [0, 1, 2])])[0].token_ids == greedy(hf_draft, mid, 1)
    short_context = DraftModelProposer(dataclasses.replace(proposer.config, max_model_len=14),
                                       CacheConfig(block_size=4), 16, model=proposer.model)
    assert short_context.propose([ask(0, mid, 4)])[0].token_ids == greedy(hf_draft, mid, 3)
    assert short_context.propose([ask(0, mid + [1, 2, 3], 4)])[0].token_ids == []
    # The catch-up is budgeted per sequence: a long prompt is computed over several steps
    # and drafts once it is caught up; the others draft meanwhile.
    chunked = DraftModelProposer(proposer.config, CacheConfig(block_size=4), 32,
                                 model=proposer.model, max_catchup_tokens=8)
    short, long = [5, 6, 7], mid + mid
    asks = [ask(0, short, 2), ask(1, long, 2, range(10, 17))]
    got = [[p.token_ids for p in chunked.propose(asks)] for _ in range(3)]
    assert got[:2] == [[greedy(hf_draft, short, 2), []]] * 2
    assert got[2] == [greedy(hf_draft, short, 2), greedy(hf_draft, long, 2)]
    # By its own catch-ups, not by what the cache holds: the same prompt in the same blocks
    # (all computed already) drafts at its third step too, as it would alone.
    rows = count_rows(chunked, monkeypatch)
    got = [chunked.propose([ask(2, long, 2, range(10, 17))])[0].token_ids for _ in range(3)]
    assert got == [[], [], greedy(hf_draft, long, 2)] and rows == [1, 1]


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


@needs_kernels  # deterministic=True
def test_greedy_outputs_equal_plain_decoding_end_to_end(draft_dir):
    """A random draft is mostly rejected, but every output is the target's: under
    --deterministic, token for token the plain engine's. Every KV block is free afterwards
    (the draft's K/V is kept under the target's block ids) and the draft holds no state."""
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
                assert not proposer.seqs
                assert engine.scheduler.stats.spec_num_drafts > 0  # it did speculate
        finally:
            llm.shutdown()
    assert outputs[False] == outputs[True]


@needs_kernels  # deterministic=True
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
                assert not proposer.seqs
            bm = llm.llm_engine.block_manager
            assert bm.num_free_blocks == bm.num_blocks
        finally:
            llm.shutdown()
    assert outputs[False] == outputs[True]


@needs_kernels  # deterministic=True
def test_seeded_output_does_not_depend_on_load(draft_dir):
    """Under --deterministic a seeded temperature-1 request speculating with a draft model
    emits the same tokens in a batch that shares its prompt's blocks (prefix caching), forks
    n = 3 requests and fills the cache (block ids the draft shares) nearly full, and alone
    (after the batch: its whole prompt a prefix-cache hit); greedy outputs are plain
    decoding's; every block is free afterwards."""
    from pagedlm import LLM, SamplingParams
    prefix = "The history of the old harbour town begins with a small fishing village by the river"
    prompts = [prefix + end for end in (" and", " but", " so", " where", ",")]
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    forks = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=16, ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # The seeded request comes last: the draft used to give blocks in request order.
    params = [forks, plain, plain, forks, seeded]
    num_blocks = 40
    outputs = {}
    for spec in (None, {"model": draft_dir, "num_speculative_tokens": 3}):
        llm = LLM(model=draft_dir, speculative_config=spec, deterministic=True, block_size=4,
                  num_gpu_blocks_override=num_blocks)
        try:
            engine = llm.llm_engine
            bm = engine.block_manager
            peak, schedule = [], engine.scheduler.schedule

            def counted(*args, schedule=schedule, **kwargs):
                out = schedule(*args, **kwargs)
                peak.append(bm.num_blocks - bm.num_free_blocks)  # lookahead slots included
                return out
            engine.scheduler.schedule = counted
            outs = llm.generate(prompts, params, use_tqdm=False)
            outputs[spec is None] = [outs[i].outputs[0].token_ids for i in (1, 2)]
            seqs = [(len(o.prompt_token_ids), len(c.token_ids)) for o in outs for c in o.outputs]
            if spec is not None:
                # Sequences holding their own blocks would need more than the cache has.
                assert sum(-(-(p + n) // 4) for p, n in seqs) > num_blocks
                assert max(peak) >= num_blocks * 0.8
                alone = llm.generate(prompts[-1], seeded, use_tqdm=False)[0].outputs[0]
                assert alone.token_ids == outs[-1].outputs[0].token_ids
                assert engine.scheduler.stats.spec_num_accepted > 0
                llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
                assert not engine.executor.worker.proposer.seqs
            assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
        finally:
            llm.shutdown()
    assert outputs[False] == outputs[True]


@needs_kernels  # deterministic=True
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_requests_through_preemptions(draft_dir, mode):
    """Under --deterministic two seeded requests emit the same tokens and logprobs alone and as
    the youngest of a batch that preempts them (recompute; swap, which the draft's K/V
    does not follow: computed again), with prefix caching on: one at a
    low temperature, whose drafts are mostly accepted (k stays up), and one with penalties
    (which the greedy draft does not see: its drafts are rejected, its k backs off and
    retries). Three things had moved them: a re-prefill sampled the next token plainly, one
    draw of the generator where the step it replaced drew 1 + k; so did the step that swapped
    a group in; and the back-off counted decode steps, so a re-prefill's token delayed the
    retry."""
    from pagedlm import LLM, SamplingParams
    plain = SamplingParams(temperature=0.2, seed=5, max_tokens=40, ignore_eos=True, logprobs=1)
    penalised = SamplingParams(temperature=0.7, seed=5, max_tokens=40, ignore_eos=True,
                               logprobs=1, presence_penalty=1.0, frequency_penalty=0.5,
                               repetition_penalty=1.2)
    fillers = [SamplingParams(temperature=0.8, seed=i, n=1 + i % 3, max_tokens=30 + 5 * i,
                              ignore_eos=True) for i in range(6)]
    llm = LLM(model=draft_dir, speculative_config={"model": draft_dir,
                                                   "num_speculative_tokens": 3},
              deterministic=True, block_size=4, num_gpu_blocks_override=48,
              enable_prefix_caching=True, preemption_mode=mode, swap_space=0.05)
    try:
        engine = llm.llm_engine
        preempted, preempt = [], engine.scheduler._preempt

        def recorded(group, sched_out, preempt=preempt):
            preempted.append(group.request_id)
            return preempt(group, sched_out)
        engine.scheduler._preempt = recorded

        def result(out):
            c = out.outputs[0]
            return list(c.token_ids), [{t: lp.logprob for t, lp in pos.items()}
                                       for pos in c.logprobs]
        prompts = ["1, 2, 3, 4, 5, 6, 7,", "Once upon a time there was"]
        probes = [penalised, plain]
        alone = [result(llm.generate(p, sp, use_tqdm=False)[0]) for p, sp in zip(prompts, probes)]
        assert not preempted
        outs = llm.generate(PROMPTS[:6] + prompts, fillers + probes, use_tqdm=False)
        for out in outs[-2:]:
            assert preempted.count(out.request_id) >= 2
        stats = engine.scheduler.stats
        assert 0 < stats.spec_num_accepted < stats.spec_num_drafts
        assert (stats.num_swapped_out > 0) == (mode == "swap")
        assert [result(o) for o in outs[-2:]] == alone
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.shutdown()
