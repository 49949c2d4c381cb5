"""Speculative decoding with n-gram prompt lookup, end to end on the default model: greedy
outputs are plain decoding's (bitwise under deterministic=True, up to a near-tie otherwise),
with their logprobs; stops, max_tokens and min_tokens inside accepted drafts; penalties,
logit_bias and bad_words at drafted positions; structured outputs skip speculation; n > 1,
preemption (swap and recompute) and prefix caching keep working; every block is free after.
Configuration errors name the field. (The distribution at temperature > 0 is checked in
test_spec_distribution.py, the scheduler's slots in tests/core/test_spec_scheduler.py.)"""
from __future__ import annotations

import argparse

import pytest

from pagedlm import LLM, EngineArgs, SamplingParams
from pagedlm.sampling_params import BeamSearchParams, StructuredOutputsParams
from pagedlm.speculative_config import SpeculativeConfig
from tests.compare_utils import assert_greedy_logprobs_match
from tests.conftest import needs_kernels

pytestmark = needs_kernels  # deterministic=True needs the native kernels

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
# Copy-heavy prompts (answers that quote them: drafts get accepted) and others (rejected).
LIST = ("Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape.\n"
        "Repeated list: apple, banana,")
CODE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "# The same two functions again:\ndef add(a, b):\n")
COUNT = "1 2 3 4 5 6 7 8 9 10 1 2 3 4 5"
PROMPTS = [LIST, CODE, COUNT,
           "Name: John Smith\nAge: 42\nCity: Boston\n\nExtract the fields as JSON: "
           "{\"name\": \"John Smith\", \"age\":",
           "Copy: the quick brown fox jumps over the lazy dog. Copy: the quick brown fox",
           "The capital of France is", "Once upon a time", "Question: what is 2+2? Answer:"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=2)


def _kv(num_blocks: int) -> dict:
    return dict(num_gpu_blocks_override=num_blocks)


@pytest.fixture(scope="module")
def plain():
    with LLM(deterministic=True, **_kv(256)) as llm:
        yield llm


@pytest.fixture(scope="module")
def spec():
    # A small cache with swap preemption: test_preemption_swap_and_recompute fills it.
    with LLM(deterministic=True, speculative_config=NGRAM, preemption_mode="swap",
             swap_space=0.1, **_kv(24)) as llm:
        yield llm


@pytest.fixture(scope="module")
def spec_nd():
    # The default (non-deterministic) mode, its batch rule raised so that a batch of 8 speculates.
    with LLM(speculative_config={**NGRAM, "max_batch_for_spec": 64}, **_kv(24)) as llm:
        yield llm


@pytest.fixture(scope="module")
def chat_eos(plain):
    """A chat whose answer repeats an earlier answer of the conversation, which ends with EOS:
    n-gram lookup drafts the EOS too."""
    tok = plain.get_tokenizer()
    turn = [{"role": "user", "content": "Say exactly: hello world, how are you"},
            {"role": "assistant", "content": "hello world, how are you"}]
    return tok.apply_chat_template(turn + turn[:1], tokenize=False, add_generation_prompt=True)


def spec_counts(llm) -> tuple[int, int, int]:
    s = llm.llm_engine.scheduler.stats
    return s.spec_num_drafts, s.spec_num_accepted, s.spec_num_verifies


def assert_clean(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.requests == {}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def run_steps(llm, prompt, params: SamplingParams):
    """The request alone, step by step: its final output, and for each step the tokens it
    appended and the drafts it verified and accepted."""
    engine = llm.llm_engine
    engine.add_request("steps", prompt, params)
    steps, seen, final = [], 0, None
    while engine.has_unfinished_requests():
        before = spec_counts(llm)
        for out in engine.step():
            final = out
        n = len(final.outputs[0].token_ids) if final is not None else 0
        after = spec_counts(llm)
        steps.append((n - seen, after[0] - before[0], after[1] - before[1]))
        seen = n
    assert_clean(llm)
    return final.outputs[0], steps


def test_greedy_outputs_are_plain_decodings(plain, spec, spec_nd):
    ref = [o.outputs[0] for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    for llm, exact in ((spec, True), (spec_nd, False)):
        before = spec_counts(llm)
        got = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        drafts, accepted, verifies = (a - b for a, b in zip(spec_counts(llm), before))
        # Drafts were accepted and others rejected, in several sequence-steps.
        assert 0 < accepted < drafts and verifies > len(PROMPTS)
        if exact:  # deterministic: bitwise plain decoding, logprobs included
            assert [g.token_ids for g in got] == [r.token_ids for r in ref]
            assert [g.logprobs for g in got] == [r.logprobs for r in ref]
        else:  # another compute path (k+1 rows a pass): equal up to a near-tie
            assert assert_greedy_logprobs_match(ref, got) >= len(PROMPTS) - 2
        assert_clean(llm)


def test_stops_inside_accepted_drafts(plain, spec, chat_eos):
    ref = plain.generate(COUNT, SamplingParams(temperature=0, max_tokens=24),
                         use_tqdm=False)[0].outputs[0]
    # A stop string, a stop token id and max_tokens where the answer is all drafted.
    text_stop = ref.text[12:17]
    assert ref.text.find(text_stop) == 12
    token_stop = next(t for i, t in enumerate(ref.token_ids) if i >= 12
                      and t not in ref.token_ids[:i])
    cases = [SamplingParams(temperature=0, max_tokens=24, stop=[text_stop]),
             SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[token_stop]),
             SamplingParams(temperature=0, max_tokens=11)]
    wants = [o.outputs[0] for o in plain.generate([COUNT] * 3, cases, use_tqdm=False)]
    for params, want in zip(cases, wants):
        got, steps = run_steps(spec, COUNT, params)
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason)
        appended, drafts, accepted = steps[-1]
        assert accepted >= 1  # the last step emitted accepted drafts
        if params.max_tokens == 11:
            # k never reaches past max_tokens: every emitted token is kept.
            assert appended == accepted + 1 and len(got.token_ids) == 11
        else:  # the stop dropped the emitted tokens after it
            assert appended < accepted + 1
    # EOS drafted (the earlier answer ended with it) and accepted: the output stops there.
    params = SamplingParams(temperature=0, max_tokens=24)
    want = plain.generate(chat_eos, params, use_tqdm=False)[0].outputs[0]
    got, steps = run_steps(spec, chat_eos, params)
    assert got.finish_reason == "stop" and got.token_ids == want.token_ids
    assert got.token_ids[-1] in plain.llm_engine.eos_token_ids
    assert steps[-1][2] >= 1 and steps[-1][0] <= steps[-1][2] + 1


def test_min_tokens_and_constraints_at_drafted_positions(plain, spec, chat_eos):
    tok = plain.get_tokenizer()
    banana = tok.encode(" banana", add_special_tokens=False)[0]
    cases = [(chat_eos, SamplingParams(temperature=0, max_tokens=20, min_tokens=12)),
             (COUNT, SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3,
                                    frequency_penalty=0.3, presence_penalty=0.2)),
             (LIST, SamplingParams(temperature=0, max_tokens=24, logit_bias={banana: -100})),
             (LIST, SamplingParams(temperature=0, max_tokens=24, bad_words=["banana"])),
             (CODE, SamplingParams(temperature=0, max_tokens=24, bad_words=["return a"]))]
    before = spec_counts(spec)
    prompts = [p for p, _ in cases]
    params = [s for _, s in cases]
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    assert len(got[0].outputs[0].token_ids) >= 12  # min_tokens held EOS back
    assert " banana" not in got[2].outputs[0].text and "banana" not in got[3].outputs[0].text
    drafts, accepted, _ = (a - b for a, b in zip(spec_counts(spec), before))
    assert drafts > accepted > 0
    assert_clean(spec)


def test_structured_outputs_do_not_speculate(plain, spec):
    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=(
        StructuredOutputsParams(choice=["apple, banana, cherry", "fig, grape"])))
    want = plain.generate(LIST, params, use_tqdm=False)[0].outputs[0].text
    before = spec_counts(spec)
    assert spec.generate(LIST, params, use_tqdm=False)[0].outputs[0].text == want
    assert spec_counts(spec) == before
    # Beside a speculating sequence (its drafts shift the sample rows the grammar's bitmask
    # applies to), the grammar still holds and the other is still plain decoding.
    mixed = spec.generate([COUNT, LIST], [GREEDY, params], use_tqdm=False)
    assert spec_counts(spec)[0] > before[0]
    assert mixed[1].outputs[0].text == want
    assert mixed[0].outputs[0].token_ids == plain.generate(
        COUNT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert_clean(spec)


def test_seeded_sampling_n_and_batch_independence(spec):
    # n > 1 with a seed: under deterministic=True a request's k depends on its own history
    # only, so its samples are the same alone or among others.
    params = SamplingParams(temperature=0.8, max_tokens=12, n=2, seed=7)
    alone = spec.generate(COUNT, params, use_tqdm=False)[0]
    mixed = spec.generate([LIST, COUNT, CODE], [GREEDY, params, params], use_tqdm=False)[1]
    assert len(alone.outputs) == 2
    assert [o.token_ids for o in alone.outputs] == [o.token_ids for o in mixed.outputs]
    assert all(len(o.token_ids) == 12 for o in alone.outputs)
    assert_clean(spec)


def test_preemption_swap_and_recompute(plain, spec, spec_nd):
    # 12 sequences of 3 blocks or more in a cache of 24 blocks.
    prompts = PROMPTS + [LIST + " cherry", CODE + "    return", COUNT + " 6", CODE + "def"]
    params = GREEDY
    ref = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    for llm, stat in ((spec, "num_swapped_out"), (spec_nd, "num_preemptions")):
        before = getattr(llm.llm_engine.scheduler.stats, stat)
        got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert getattr(llm.llm_engine.scheduler.stats, stat) > before
        if llm is spec:
            assert [g.token_ids for g in got] == [r.token_ids for r in ref]
        else:
            assert assert_greedy_logprobs_match(ref, got) >= len(prompts) - 2
        assert_clean(llm)


def test_prefix_caching_with_speculation(plain, spec):
    # The second prompt extends the first one's whole output: its blocks (hashed once their
    # tokens were accepted) are found in the cache, and the answer is still plain decoding's.
    params = SamplingParams(temperature=0, max_tokens=32)
    first = spec.generate(CODE, params, use_tqdm=False)[0]
    follow = CODE + first.outputs[0].text
    got = spec.generate(follow, params, use_tqdm=False)[0]
    want = plain.generate(follow, params, use_tqdm=False)[0]
    assert got.num_cached_tokens >= 64
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert_clean(spec)


def test_beam_search_is_refused(spec):
    # Named first: the server's 400 names its first word as the param (it was null).
    with pytest.raises(ValueError, match="^use_beam_search: .*speculative_config"):
        spec.beam_search(["Hi"], BeamSearchParams(beam_width=2, max_tokens=4))


@pytest.mark.parametrize("value, field", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": -2}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "lookup": 3}, "lookup"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 1.5}, "prompt_lookup_max"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ("{not json", "speculative_config"),
])
def test_config_errors_name_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_user(value)


def test_engine_combinations_and_command_line(default_model_dir):
    from pagedlm.entrypoints.cli_args import add_engine_args, engine_args_from_namespace
    with pytest.raises(ValueError, match="runner='pooling'"):
        EngineArgs(runner="pooling", speculative_config=NGRAM).create_engine_config()
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        EngineArgs(pipeline_parallel_size=2, speculative_config={
            "model": default_model_dir, "num_speculative_tokens": 2}).create_engine_config()
    # Under the deterministic mode k is the request's own, never capped to the step's budget;
    # nor may a group's drafts miss the budget (its sequences then decoded plainly): refused.
    with pytest.raises(ValueError, match=r"num_speculative_tokens \(4\) \+ 1 must be <= "
                                         r"max_num_batched_tokens \(4\)"):
        EngineArgs(deterministic=True, speculative_config=NGRAM,
                   max_num_batched_tokens=4, max_num_seqs=4).create_engine_config()
    EngineArgs(speculative_config=NGRAM, max_num_batched_tokens=4,
               max_num_seqs=4).create_engine_config()  # outside the mode k is capped
    with LLM(deterministic=True, speculative_config=NGRAM, max_num_batched_tokens=10,
             max_num_seqs=4, **_kv(8)) as llm:
        with pytest.raises(ValueError, match=r"^n \(3\) x \(num_speculative_tokens 4 \+ 1\)"):
            llm.generate("Hi", SamplingParams(n=3, max_tokens=2), use_tqdm=False)
        with pytest.raises(ValueError, match=r"^best_of \(3\) x"):
            llm.generate("Hi", SamplingParams(n=1, best_of=3, max_tokens=2), use_tqdm=False)
        out = llm.generate("Hi", SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=2),
                           use_tqdm=False)[0]
        assert [len(c.token_ids) for c in out.outputs] == [2, 2]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--speculative-config",
                            '{"method": "ngram", "num_speculative_tokens": 3, '
                            '"prompt_lookup_max": 5}'])
    config = engine_args_from_namespace(ns).create_engine_config().speculative_config
    assert config == SpeculativeConfig("ngram", 3, 2, 5)
