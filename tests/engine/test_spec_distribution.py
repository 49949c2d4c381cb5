"""Speculative decoding keeps the target distribution, end to end (issue 34), and is observable.

A tiny random Llama whose next-token probabilities transformers computes exactly. Every request
has the same prompt and allowed_token_ids = three tokens, so the distribution is concentrated
(a chi-square over few cells is meaningful). The first token comes from prefill and is never
speculated; the second is at a drafted position. The prompt makes n-gram lookup (bigrams) draft,
after each possible first token, a token the target likely accepts, one it likely rejects, and
one it never samples (outside the allowed set). Many seeded temperature-1 requests, with and
without speculation: the (first, second) token frequencies of each run against the exact
probabilities, and the two runs against each other (chi-square at p = 0.001). The same run then
checks the counters against the emitted tokens, and the step trace, the engine view and /metrics.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter

import httpx
import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.engine.async_llm_engine import AsyncLLMEngine
from pagedlm.metrics.engine_view import take_engine_view
from pagedlm.metrics.trace_render import render_html
from pagedlm.metrics.tracer import load_records, records_path
from tests.server_utils import serve_in_thread
from tests.stats_utils import assert_fits, assert_same_distribution

ALLOWED = [1012, 1013, 1014]
Z = 999  # precedes each key: bigram lookup finds (Z, first token) and drafts what followed
OUTSIDE = 1500  # a draft the target never samples (not allowed)
NUM_REQUESTS = 600
SPEC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
        "prompt_lookup_max": 2, "max_batch_for_spec": 4096}


def _tiny_model(root, default_model_dir) -> str:
    """One random layer with the default model's tokenizer files (copied: building the
    tokenizer takes seconds), and the first 2048 tokens of its vocabulary: the sampler's work
    per row is linear in the vocabulary (67% of the step time at 49152 tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    with open(os.path.join(default_model_dir, "config.json")) as f:
        base = json.load(f)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rms_norm_eps=1e-6,
                         initializer_range=0.15, tie_word_embeddings=False,
                         bos_token_id=base.get("bos_token_id"),
                         eos_token_id=base.get("eos_token_id"))
    path = str(root)
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(default_model_dir, name), path)
    return path


def _prompt(drafts: dict[int, int]) -> list[int]:
    body = list(range(800, 810))
    for i, key in enumerate(ALLOWED):
        body += [Z, key, drafts[key], 1100 + i]
    return body + [Z]


@pytest.fixture(scope="module")
def case(tmp_path_factory, default_model_dir):
    """The model, the prompt and the exact joint distribution of the first two tokens."""
    from transformers import AutoModelForCausalLM
    path = _tiny_model(tmp_path_factory.mktemp("spec_tiny"), default_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    allowed = torch.tensor(ALLOWED)

    def dist(tokens):
        with torch.no_grad():
            return hf(torch.tensor([tokens])).logits[0, -1, allowed].double().softmax(-1)

    # The drafts after A and B depend on the probabilities, which depend on the prompt that
    # holds them: iterate to a fixed point (the first step usually is one).
    a, b, c = ALLOWED
    drafts = {a: a, b: a, c: OUTSIDE}
    for _ in range(4):
        prompt = _prompt(drafts)
        second = {t: dist(prompt + [t]) for t in ALLOWED}
        new = {a: ALLOWED[int(second[a].argmax())], b: ALLOWED[int(second[b].argmin())],
               c: OUTSIDE}
        if new == drafts:
            break
        drafts = new
    assert new == drafts
    first = dist(prompt)
    joint = {(t1, t2): float(first[i] * second[t1][j])
             for i, t1 in enumerate(ALLOWED) for j, t2 in enumerate(ALLOWED)}
    p_draft = {t: float(second[t][ALLOWED.index(drafts[t])]) if drafts[t] in ALLOWED else 0.0
               for t in ALLOWED}
    # The premise: one draft likely accepted, one likely rejected, one always rejected; and
    # every first token common enough to be drafted after.
    assert p_draft[a] > 0.5 and 0 < p_draft[b] < 0.25 and p_draft[c] == 0, p_draft
    assert min(first) > 0.05, first
    return dict(path=path, hf=hf, prompt=prompt, drafts=drafts, joint=joint, p_draft=p_draft)


def _params():
    return [SamplingParams(temperature=1.0, seed=i, max_tokens=4,
                           allowed_token_ids=ALLOWED) for i in range(NUM_REQUESTS)]


def _pairs(outs) -> Counter:
    return Counter(tuple(o.outputs[0].token_ids[:2]) for o in outs)


@pytest.fixture(scope="module")
def plain_counts(case):
    with LLM(case["path"], max_num_seqs=256) as llm:
        outs = llm.generate([{"prompt_token_ids": case["prompt"]}] * NUM_REQUESTS, _params(),
                            use_tqdm=False)
    return _pairs(outs)


@pytest.fixture(scope="module")
def spec_run(case, tmp_path_factory):
    trace_file = str(tmp_path_factory.mktemp("spec_trace") / "run.json")
    llm = LLM(case["path"], max_num_seqs=256, speculative_config=SPEC, trace_file=trace_file)
    engine = llm.llm_engine
    outs = llm.generate([{"prompt_token_ids": case["prompt"]}] * NUM_REQUESTS, _params(),
                        use_tqdm=False)
    spec = engine.stats.spec_decode
    view = take_engine_view(engine.scheduler, engine.stats)
    lp_outs = llm.generate([{"prompt_token_ids": case["prompt"]}] * 16,
                           [SamplingParams(temperature=1.0, seed=i, max_tokens=4, logprobs=2,
                                           allowed_token_ids=ALLOWED) for i in range(16)],
                           use_tqdm=False)
    lp_spec = engine.stats.spec_decode - spec
    # The same engine behind a server: /metrics after one more request.
    server_engine = AsyncLLMEngine(engine, log_stats=False, model_name="tiny")
    try:
        with serve_in_thread(server_engine, served_model_names=["tiny"]) as running:
            r = httpx.post(running.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": case["prompt"], "max_tokens": 4, "seed": 1,
                "temperature": 1.0, "allowed_token_ids": ALLOWED})
            assert r.status_code == 200, r.text
            metrics = httpx.get(running.url + "/metrics").text
            spec_after = engine.stats.spec_decode
    finally:
        server_engine.shutdown()
    meta, steps = load_records(records_path(trace_file))
    return dict(outs=outs, counts=_pairs(outs), spec=spec, view=view, metrics=metrics,
                spec_after=spec_after, meta=meta, steps=steps, lp_outs=lp_outs, lp_spec=lp_spec)


def test_speculation_keeps_the_exact_distribution(case, plain_counts, spec_run):
    assert_fits(plain_counts, case["joint"])
    assert_fits(spec_run["counts"], case["joint"])
    assert_same_distribution(spec_run["counts"], plain_counts)


def test_counters_match_the_emitted_tokens(case, spec_run):
    # Every request verified its two drafts once (after its first token), and a draft was
    # accepted exactly when the second token is it (the draft after it is never allowed).
    spec, drafts, counts = spec_run["spec"], case["drafts"], spec_run["counts"]
    accepted = sum(n for (t1, t2), n in counts.items() if drafts[t1] == t2)
    assert (spec.num_drafts, spec.num_draft_tokens) == (NUM_REQUESTS, 2 * NUM_REQUESTS)
    assert spec.num_accepted_tokens == accepted
    # The likely-accepted draft mostly was, the likely-rejected one mostly was not.
    for t1 in ALLOWED[:2]:
        n = sum(v for (a, _), v in counts.items() if a == t1)
        rate = counts[(t1, drafts[t1])] / n
        assert abs(rate - case["p_draft"][t1]) < 0.1, (t1, rate, case["p_draft"])


def test_logprobs_of_accepted_drafts_are_the_models(case, spec_run):
    # Raw logprobs (before allowed_token_ids), as transformers computes them teacher-forced.
    assert spec_run["lp_spec"].num_accepted_tokens > 0  # some tokens were accepted drafts
    prompt = case["prompt"]
    for out in spec_run["lp_outs"]:
        c = out.outputs[0]
        with torch.no_grad():
            raw = case["hf"](torch.tensor([prompt + c.token_ids])).logits[0].log_softmax(-1)
        assert len(c.logprobs) == len(c.token_ids) == 4
        for j, (tok, lps) in enumerate(zip(c.token_ids, c.logprobs)):
            row = raw[len(prompt) - 1 + j]
            assert lps[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
            assert lps[tok].rank == int((row > row[tok]).sum()) + 1
            assert set(row.topk(2).indices.tolist()) <= set(lps)


def test_trace_engine_view_and_metrics_report_speculation(spec_run):
    spec, after, steps = spec_run["spec"], spec_run["spec_after"], spec_run["steps"]
    # Trace: per-step counts add up to the engine's; lookahead slots are recorded per sequence.
    assert sum(s["spec_draft_tokens"] for s in steps) == after.num_draft_tokens
    assert sum(s["spec_accepted_tokens"] for s in steps) == after.num_accepted_tokens
    assert sum(s["spec_drafts"] for s in steps) == after.num_drafts
    assert max(x["lookahead"] for s in steps for x in s["scheduled"]) == 2
    page = render_html(spec_run["meta"], steps, b"", b"")
    assert f"<th>draft tokens verified</th><td>{after.num_draft_tokens}</td>" in page
    assert f"<th>mean acceptance length</th><td>{after.mean_acceptance_length:.2f}" in page
    view = spec_run["view"]
    assert view.speculative and view.spec_num_draft_tokens == spec.num_draft_tokens
    assert view.spec_acceptance_rate == pytest.approx(spec.acceptance_rate)
    assert view.spec_mean_acceptance_length == pytest.approx(spec.mean_acceptance_length)
    assert 0 < spec.acceptance_rate < 0.5 and 1 < spec.mean_acceptance_length < 2

    def value(name: str) -> float:
        m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", spec_run["metrics"],
                      re.M)
        assert m, name
        return float(m.group(1))

    assert value("pagedlm:spec_decode_num_draft_tokens_total") == after.num_draft_tokens
    assert value("pagedlm:spec_decode_num_accepted_tokens_total") == after.num_accepted_tokens
    assert value("pagedlm:spec_decode_num_drafts_total") == after.num_drafts
    assert value("pagedlm:spec_decode_draft_acceptance_rate") == pytest.approx(
        after.acceptance_rate)
    assert value("pagedlm:spec_decode_mean_acceptance_length") == pytest.approx(
        after.mean_acceptance_length)
