"""Sampling: the Sampler on hand-built logits, and the real engine on the default model.

Sampler-level tests check the exact support / distribution of each truncation stage and the
direction of each penalty; engine-level tests check seeding, greedy equivalences, n > 1, min_tokens
and logprobs (against transformers on the same weights).
"""
from collections import Counter

import pytest
import torch

from pagedlm import SamplingParams
from pagedlm.model_executor.layers.sampler import (
    Sampler,
    _apply_penalties,
)
from tests.compare_utils import assert_outputs_bitwise_equal
from tests.conftest import needs_kernels
from tests.sampling_utils import make_meta

# ---------------------------------------------------------------------------------------------
# Sampler on hand-built logits
# ---------------------------------------------------------------------------------------------


def sample_many(logits_row, params, draws=4000, seed=0):
    """Draw `draws` samples from one logits row (as a batch of identical rows)."""
    sampler = Sampler(torch.Generator().manual_seed(seed))
    logits = logits_row.unsqueeze(0).repeat(draws, 1)
    out = sampler(logits, make_meta([params] * draws))
    return Counter(out.sampled_token_ids)


def logits_from_probs(probs, vocab=None):
    p = torch.tensor(probs, dtype=torch.float32)
    if vocab is not None:  # pad with (practically) impossible tokens
        p = torch.cat([p, torch.full((vocab - len(probs),), 1e-30)])
    return p.log()


def assert_frequencies(counts, expected, draws, tol=0.03):
    assert set(counts) == {t for t, p in expected.items() if p > 0}, (counts, expected)
    for t, p in expected.items():
        assert abs(counts[t] / draws - p) < tol, (t, counts[t] / draws, p)


def chi_square_p_value(counts, expected, draws):
    """Pearson's goodness-of-fit p-value of `counts` against the distribution `expected`
    (token -> probability, every token of the support listed)."""
    assert set(counts) <= set(expected), (counts, expected)
    stat = sum((counts[t] - draws * p) ** 2 / (draws * p) for t, p in expected.items())
    dof = torch.tensor((len(expected) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(dof, torch.tensor(stat / 2, dtype=torch.float64)).item()


def assert_distribution(counts, expected, draws, wrong):
    """The draws fit `expected`, and the same draws reject each distribution in `wrong`, so the
    check could not pass with that mistake in the sampler. The draws are seeded: the p-values are
    fixed numbers, the thresholds only say how far from the edge they are."""
    assert_frequencies(counts, expected, draws)
    assert chi_square_p_value(counts, expected, draws) > 1e-3, (counts, expected)
    for name, alternative in wrong.items():
        assert chi_square_p_value(counts, alternative, draws) < 1e-9, name


@pytest.fixture(scope="module")
def perm_logits():
    """50 logits spread over [0, 3] in a random order, so the top ids are not just 0..k-1."""
    g = torch.Generator().manual_seed(7)
    perm = torch.randperm(50, generator=g)
    return torch.linspace(0.0, 3.0, 50)[perm]


def test_top_k_restricts_support_and_renormalises(perm_logits):
    # The top-5 probabilities all lie within 0.025 of 0.2: enough draws that a uniform pick among
    # the top k (no renormalised softmax) is rejected by the chi-square test.
    k, draws = 5, 40000
    counts = sample_many(perm_logits, SamplingParams(temperature=1.0, top_k=k), draws)
    top = perm_logits.topk(k).indices.tolist()
    probs = perm_logits[top].double().softmax(-1).tolist()
    assert_distribution(counts, dict(zip(top, probs)), draws,
                        wrong={"uniform over the top k": dict.fromkeys(top, 1 / k)})
    # Without top_k the support is much wider.
    wide = sample_many(perm_logits, SamplingParams(temperature=1.0), draws)
    assert len(set(wide) - set(top)) > 20


def test_top_k_with_temperature(perm_logits):
    # temperature 0.5 sharpens the renormalised top-k distribution: logits / T then softmax.
    # The whole effect of T=0.5 against T=1 here is at most 0.021 per token: enough draws that
    # the T=1 distribution (temperature ignored) is rejected by the chi-square test.
    k, draws = 3, 40000
    counts = sample_many(perm_logits, SamplingParams(temperature=0.5, top_k=k), draws, seed=1)
    top = perm_logits.topk(k).indices.tolist()
    probs = (perm_logits[top].double() / 0.5).softmax(-1).tolist()
    ignored = perm_logits[top].double().softmax(-1).tolist()
    assert_distribution(counts, dict(zip(top, probs)), draws,
                        wrong={"temperature ignored": dict(zip(top, ignored)),
                               "uniform over the top k": dict.fromkeys(top, 1 / k)})


def test_top_p_keeps_smallest_nucleus():
    probs = [0.05, 0.5, 0.1, 0.2, 0.15]  # by id; sorted: 1 (.5), 3 (.2), 4 (.15), 2 (.1), 0 (.05)
    logits = logits_from_probs(probs, vocab=32)
    draws = 6000
    # 0.5 + 0.2 = 0.7 < 0.75, so the nucleus needs id 4 as well (0.85).
    counts = sample_many(logits, SamplingParams(temperature=1.0, top_p=0.75), draws)
    assert_frequencies(counts, {1: 0.5 / 0.85, 3: 0.2 / 0.85, 4: 0.15 / 0.85}, draws)
    counts = sample_many(logits, SamplingParams(temperature=1.0, top_p=0.6), draws, seed=2)
    assert_frequencies(counts, {1: 0.5 / 0.7, 3: 0.2 / 0.7}, draws)
    # A tiny top_p keeps only the most likely token.
    counts = sample_many(logits, SamplingParams(temperature=1.0, top_p=0.01), 500)
    assert set(counts) == {1}


def test_min_p_drops_tokens_below_threshold():
    probs = [0.05, 0.5, 0.1, 0.2, 0.15]
    logits = logits_from_probs(probs, vocab=32)
    draws = 6000
    # threshold 0.25 * 0.5 = 0.125: ids 1, 3, 4 survive.
    counts = sample_many(logits, SamplingParams(temperature=1.0, min_p=0.25), draws)
    assert_frequencies(counts, {1: 0.5 / 0.85, 3: 0.2 / 0.85, 4: 0.15 / 0.85}, draws)
    # threshold 0.35 * 0.5 = 0.175: ids 1, 3.
    counts = sample_many(logits, SamplingParams(temperature=1.0, min_p=0.35), draws, seed=3)
    assert_frequencies(counts, {1: 0.5 / 0.7, 3: 0.2 / 0.7}, draws)


def test_top_k_one_and_temperature_zero_are_greedy():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(64, 1000, generator=g) * 3
    argmax = logits.argmax(-1).tolist()
    sampler = Sampler(torch.Generator().manual_seed(0))
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_k=1),
                   SamplingParams(temperature=0, top_k=5, top_p=0.3, min_p=0.2)):
        out = sampler(logits, make_meta([params] * 64))
        assert out.sampled_token_ids == argmax, params
    # Mixed batch: greedy rows stay greedy next to random rows.
    mixed = [SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=1.0)
             for i in range(64)]
    out = sampler(logits, make_meta(mixed))
    greedy_rows = [t for i, t in enumerate(out.sampled_token_ids) if i % 2]
    assert greedy_rows == argmax[1::2]
    random_rows = [t for i, t in enumerate(out.sampled_token_ids) if not i % 2]
    assert random_rows != argmax[0::2]


def test_seeded_rows_do_not_depend_on_the_batch(perm_logits):
    p = SamplingParams(temperature=1.0, seed=5)
    logits = perm_logits.unsqueeze(0)

    def run(batch_before, batch_after, sampler_seed, steps=20):
        gen = torch.Generator().manual_seed(5)
        sampler = Sampler(torch.Generator().manual_seed(sampler_seed))
        toks = []
        for _ in range(steps):
            rows = batch_before + 1 + batch_after
            params = [SamplingParams(temperature=1.0)] * rows
            gens = [None] * rows
            params[batch_before], gens[batch_before] = p, gen
            out = sampler(logits.repeat(rows, 1), make_meta(params, generators=gens))
            toks.append(out.sampled_token_ids[batch_before])
        return toks

    alone = run(0, 0, 0)
    assert run(3, 2, 1) == alone
    assert run(1, 5, 2) == alone
    assert len(set(alone)) > 3  # it really samples


def test_repetition_penalty_direction():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -0.5, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    meta = make_meta([params], outputs=[[0, 1]], prompts=[[3]])
    out = _apply_penalties(logits, meta)
    # Positive logits of seen tokens (output 0, prompt 3) are divided, negative ones multiplied.
    assert torch.allclose(out, torch.tensor([[1.0, -2.0, 0.5, 0.5, -0.5, 0.0]]))
    assert logits[0, 0] == 2.0  # input untouched

    # Through the Sampler: the penalised token loses the argmax.
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    sampler = Sampler(torch.Generator().manual_seed(0))
    assert sampler(logits, make_meta([SamplingParams(temperature=0)],
                                     outputs=[[0]])).sampled_token_ids == [0]
    assert sampler(logits, make_meta([params], outputs=[[0]])).sampled_token_ids == [1]
    # repetition_penalty < 1 favours seen tokens.
    logits = torch.tensor([[1.0, 1.9, 0.0]])
    rp = SamplingParams(temperature=0, repetition_penalty=0.5)
    assert sampler(logits, make_meta([rp], outputs=[[0]])).sampled_token_ids == [0]
    # Negative logits: multiplying makes the seen token even less likely.
    logits = torch.tensor([[-1.0, -1.2, -5.0]])
    assert sampler(logits, make_meta([params], outputs=[[0]])).sampled_token_ids == [1]
    # The prompt counts for the repetition penalty.
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    assert sampler(logits, make_meta([params], outputs=[[]], prompts=[[0]])
                   ).sampled_token_ids == [1]


def test_presence_and_frequency_penalties():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    # Token 0 seen 3 times, token 1 once, token 3 only in the prompt.
    hist = [[0, 0, 1, 0]]
    out = _apply_penalties(logits, make_meta([SamplingParams(frequency_penalty=0.5)],
                                             outputs=hist, prompts=[[3]]))
    assert torch.allclose(out, torch.tensor([[-0.5, 0.5, 1.0, 1.0]]))
    out = _apply_penalties(logits, make_meta([SamplingParams(presence_penalty=0.5)],
                                             outputs=hist, prompts=[[3]]))
    assert torch.allclose(out, torch.tensor([[0.5, 0.5, 1.0, 1.0]]))
    out = _apply_penalties(logits, make_meta(
        [SamplingParams(presence_penalty=-1.0, frequency_penalty=0.25)],
        outputs=hist, prompts=[[3]]))
    assert torch.allclose(out, torch.tensor([[1.25, 1.75, 1.0, 1.0]]))

    # Per row: a row without penalties in the same batch is unchanged.
    logits2 = logits.repeat(2, 1)
    out = _apply_penalties(logits2, make_meta(
        [SamplingParams(frequency_penalty=1.0), SamplingParams()],
        outputs=[[0, 0], [0, 0]]))
    assert torch.allclose(out[0], torch.tensor([-1.0, 1.0, 1.0, 1.0]))
    assert torch.allclose(out[1], logits[0])

    # Through the Sampler, greedy: a frequency penalty moves the choice off the repeated token.
    sampler = Sampler(torch.Generator().manual_seed(0))
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    p = SamplingParams(temperature=0, frequency_penalty=0.6)
    assert sampler(logits, make_meta([p], outputs=[[0]])).sampled_token_ids == [0]
    assert sampler(logits, make_meta([p], outputs=[[0, 0]])).sampled_token_ids == [1]
    p = SamplingParams(temperature=0, presence_penalty=1.5)
    assert sampler(logits, make_meta([p], outputs=[[0]])).sampled_token_ids == [1]


def test_min_tokens_masks_stop_ids_in_sampler():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]])  # 2 (say EOS) is the argmax, then 3
    sampler = Sampler(torch.Generator().manual_seed(0))
    stops = [frozenset({2, 3})]
    p = SamplingParams(temperature=0, min_tokens=3)
    for n_out, expected in ((0, 4), (2, 4), (3, 2)):
        out = sampler(logits, make_meta([p], outputs=[[1] * n_out], stop_ids=stops))
        assert out.sampled_token_ids == [expected], n_out
    # Sampled rows never draw a masked id either.
    p = SamplingParams(temperature=1.0, min_tokens=2)
    out = sampler(logits.repeat(500, 1), make_meta([p] * 500, outputs=[[]] * 500,
                                                    stop_ids=stops * 500))
    assert not {2, 3} & set(out.sampled_token_ids)


def test_sampler_logprobs_are_raw_and_ranked():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 100, generator=g)
    params = [SamplingParams(temperature=1.0, logprobs=4, repetition_penalty=1.5)] * 6
    out = Sampler(torch.Generator().manual_seed(0))(logits, make_meta(params, outputs=[[5]] * 6))
    ref = logits.log_softmax(-1)
    for i, tok in enumerate(out.sampled_token_ids):
        # The raw model distribution, not the penalised one.
        assert out.sampled_logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-5)
        assert out.ranks[i] == int((ref[i] > ref[i, tok]).sum()) + 1
        assert out.top_token_ids[i] == ref[i].topk(4).indices.tolist()
        assert out.top_logprobs[i] == pytest.approx(ref[i].topk(4).values.tolist(), abs=1e-5)


# ---------------------------------------------------------------------------------------------
# Through the engine on the default model
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    from pagedlm import LLM
    return LLM(kv_cache_memory_bytes=512 * 2**20)


def assert_all_blocks_free(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


PROMPT = "The most surprising thing about the ocean is"


def gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_seeded_sampling_reproducible_next_to_other_draws(llm):
    """A seeded request draws from its own generator: run again next to the same requests,
    whose unseeded draws have moved on, it gives the same tokens. Compared in batches of one
    shape (ignore_eos), whose logits are the same bit for bit: alone, in a batch of another
    size, they may differ in the last bits, which can move a draw (tests/compare_utils.py)."""
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    other = SamplingParams(temperature=1.0, seed=4321, max_tokens=24, ignore_eos=True)
    prompts = ["Write a haiku about rain.", PROMPT, PROMPT, "1 2 3 4"]
    params = [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True), p, other,
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    first, again = ([o.outputs[0].token_ids for o in gen(llm, prompts, params)]
                    for _ in range(2))
    assert again[0] != first[0]  # the unseeded neighbour drew other tokens
    assert again[1] == first[1] and len(first[1]) == 24
    # A different seed gives a different continuation of the same prompt.
    assert first[2] != first[1]
    assert_all_blocks_free(llm)


def test_greedy_equivalences(llm):
    prompts = [PROMPT, "def fibonacci(n):"]
    variants = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.1, max_tokens=12,
                       ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True),
    ]
    # One batch: every variant of every prompt runs side by side.
    outs = gen(llm, [p for p in prompts for _ in variants], [v for _ in prompts for v in variants])
    for i in range(len(prompts)):
        greedy, truncated, top1 = (o.outputs[0] for o in outs[3 * i:3 * i + 3])
        assert len(greedy.token_ids) == 12
        assert truncated.token_ids == greedy.token_ids
        assert top1.token_ids == greedy.token_ids
        assert truncated.text == greedy.text
        # Greedy: every sampled token is the argmax of the model's distribution.
        for tok, lp in zip(greedy.token_ids, greedy.logprobs):
            assert lp[tok].rank == 1
            assert lp[tok].logprob == max(v.logprob for v in lp.values())
        assert greedy.cumulative_logprob == pytest.approx(
            sum(lp[tok].logprob for tok, lp in zip(greedy.token_ids, greedy.logprobs)), abs=1e-4)
    assert outs[0].outputs[0].token_ids != outs[3].outputs[0].token_ids


def test_n_greater_than_one(llm):
    p = SamplingParams(n=4, temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    out = gen(llm, [PROMPT], p)
    assert len(out) == 1
    comps = out[0].outputs
    assert [c.index for c in comps] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in comps)
    assert len({tuple(c.token_ids) for c in comps}) > 1
    assert all(c.text for c in comps)
    assert_all_blocks_free(llm)
    # Seeded n > 1 is reproducible next to other requests (in two batches of one shape: see
    # test_seeded_sampling_reproducible_next_to_other_draws); greedy n > 1 gives n equal copies.
    batch = (["Hello there", PROMPT, PROMPT, "Once"],
             [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), p,
              SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)])
    first, again = gen(llm, *batch), gen(llm, *batch)
    assert [c.token_ids for c in again[1].outputs] == [c.token_ids for c in first[1].outputs]
    assert len({tuple(c.token_ids) for c in first[1].outputs}) > 1
    greedy = again[2].outputs
    assert [c.index for c in greedy] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in greedy}) == 1 and len(greedy[0].token_ids) == 6
    assert_all_blocks_free(llm)


@needs_kernels
def test_deterministic_draws_do_not_depend_on_the_batch():
    """Under deterministic=True (issue 31) the two tests above need no batches of one shape: a
    seeded request (n=1 and n=4) and a greedy one give the same tokens and logprobs, bit for
    bit, alone and in batches of other sizes and compositions, with unseeded neighbours."""
    from pagedlm import LLM
    llm = LLM(kv_cache_memory_bytes=256 * 2**20, deterministic=True)
    probes = [(PROMPT, SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True,
                                      logprobs=3)),
              (PROMPT, SamplingParams(n=4, temperature=1.0, seed=99, max_tokens=12,
                                      ignore_eos=True, logprobs=3)),
              ("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                   logprobs=3))]
    others = [("Write a haiku about rain.", SamplingParams(temperature=0.8, max_tokens=10,
                                                         ignore_eos=True)),
              ("1 2 3 4", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
              ("Hello there", SamplingParams(n=3, temperature=1.0, max_tokens=6,
                                             ignore_eos=True)),
              ("Once", SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True))]
    try:
        alone = [gen(llm, [p], sp)[0].outputs for p, sp in probes]
        for batch in (others[:1] + probes + others[1:], probes[::-1] + others[2:]):
            outs = {id(sp): o.outputs for (_, sp), o in
                    zip(batch, gen(llm, [p for p, _ in batch], [sp for _, sp in batch]))}
            for (_, sp), ref in zip(probes, alone):
                assert_outputs_bitwise_equal(ref, outs[id(sp)])
        assert len({tuple(c.token_ids) for c in alone[1]}) > 1
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_min_tokens_prevents_eos(llm):
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    conv = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    plain = llm.chat(conv, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    short = plain.outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] == eos
    k = len(short.token_ids) + 4
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=k + 2, min_tokens=k,
                                        stop_token_ids=[eos]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= k
    assert eos not in out.token_ids[:k]
    # Before the EOS would have been sampled, the output is the same greedy path.
    n = len(short.token_ids) - 1
    assert out.token_ids[:n] == short.token_ids[:n]
    assert_all_blocks_free(llm)


def check_position_logprobs(lp, sampled, k):
    assert sampled in lp
    assert k <= len(lp) <= k + 1
    assert all(v.logprob <= 0 for v in lp.values())
    assert all(v.decoded_token is not None for v in lp.values())
    ranked = sorted(lp.items(), key=lambda kv: kv[1].rank)
    top = [(t, v) for t, v in ranked if v.rank <= k]
    assert [v.rank for _, v in top] == list(range(1, k + 1))
    vals = [v.logprob for _, v in top]
    assert vals == sorted(vals, reverse=True)
    # The sampled token's rank is 1 + the number of tokens strictly more likely.
    s = lp[sampled]
    if s.rank <= k:
        assert lp[top[s.rank - 1][0]].logprob == pytest.approx(s.logprob, abs=1e-6)
    else:
        assert len(lp) == k + 1 and s.logprob <= vals[-1]


def test_logprobs_structure_sampled(llm):
    p = SamplingParams(temperature=1.5, seed=3, max_tokens=10, ignore_eos=True, logprobs=5)
    c = gen(llm, [PROMPT], p)[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 10
    for tok, lp in zip(c.token_ids, c.logprobs):
        check_position_logprobs(lp, tok, 5)
    assert c.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)), abs=1e-4)
    # At temperature 1.5 some sampled token is outside the top 5 (or at least not rank 1).
    assert any(lp[t].rank > 1 for t, lp in zip(c.token_ids, c.logprobs))


def test_prompt_logprobs_structure(llm):
    out = gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    plp = out.prompt_logprobs
    ids = out.prompt_token_ids
    assert plp is not None and len(plp) == len(ids)
    assert plp[0] is None
    for tid, lp in zip(ids[1:], plp[1:]):
        check_position_logprobs(lp, tid, 3)
    # logprobs=None: no per-token logprobs.
    assert out.outputs[0].logprobs is None


@pytest.fixture(scope="module")
def hf_model(llm):
    transformers = pytest.importorskip("transformers")
    d = llm.llm_engine.config.model_config.model_dir
    return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def test_logprobs_match_transformers(llm, hf_model):
    prompts = [PROMPT, "Écris une phrase en français:"]
    outs = gen(llm, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                            logprobs=5, prompt_logprobs=5))
    for out in outs:
        c = out.outputs[0]
        ids = list(out.prompt_token_ids) + list(c.token_ids)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        n_prompt = len(out.prompt_token_ids)
        # Greedy continuation equals HF's argmax at every position.
        assert c.token_ids == ref[n_prompt - 1:-1].argmax(-1).tolist()
        positions = [(n_prompt - 1 + j, lp) for j, lp in enumerate(c.logprobs)]
        positions += [(i - 1, lp) for i, lp in enumerate(out.prompt_logprobs) if i > 0]
        for row, lp in positions:
            hf_top = ref[row].topk(5)
            ours = sorted(((v.logprob, t) for t, v in lp.items() if v.rank <= 5), reverse=True)
            assert len(ours) == 5
            for (val, _), hv in zip(ours, hf_top.values.tolist()):
                assert abs(val - hv) < 1e-3
            for t, v in lp.items():
                hv = ref[row, t].item()
                assert abs(v.logprob - hv) < 1e-3
                # Same rank as in HF, up to near-ties.
                assert int((ref[row] > hv + 1e-3).sum()) + 1 <= v.rank
                assert v.rank <= int((ref[row] > hv - 1e-3).sum()) + 1
