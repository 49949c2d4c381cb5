"""Multi-step decoding (num_scheduler_steps; core/multi_step.py, worker/multi_step.py), end to
end on the default model under deterministic=True, where one step of K iterations and K single
steps are designed to compute the same values: the same tokens, texts, stops and seeded samples
as single steps, with fewer engine steps; stops inside a step's iterations; requests that need
the host between tokens (logprobs, penalties) decoding one token per step beside the others; a
prompt joining a step; preemption; every block free after. The GPU path (CUDA graphs replayed
per iteration) is tests/gpu/test_cuda_graphs.py's."""
from __future__ import annotations

import argparse

import pytest
import torch

from pagedlm import LLM, EngineArgs, SamplingParams
from pagedlm.worker.multi_step import plan_iterations
from tests.conftest import needs_kernels

pytestmark = needs_kernels  # deterministic=True needs the native kernels

STEPS = 4
PROMPTS = ["The capital of France is", "Once upon a time", "1 2 3 4 5 6 7 8",
           "def add(a, b):", "Question: what is 2+2? Answer:"]
# Output lengths that are not multiples of STEPS: the last steps' lookahead is cut short.
GREEDY = [SamplingParams(temperature=0, max_tokens=n) for n in (21, 6, 13, 30, 2)]


@pytest.fixture(scope="module")
def single():
    with LLM(deterministic=True, num_gpu_blocks_override=256) as llm:
        yield llm


@pytest.fixture(scope="module")
def multi():
    # A small cache with swap preemption: test_preemption fills it.
    with LLM(deterministic=True, num_scheduler_steps=STEPS, num_gpu_blocks_override=24,
             preemption_mode="swap", swap_space=0.1) as llm:
        yield llm


def assert_clean(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.requests == {}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _outs(results):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
             o.outputs[0].stop_reason) for o in results]


def test_greedy_outputs_are_single_steps_in_fewer_steps(single, multi):
    want = single.generate(PROMPTS, GREEDY, use_tqdm=False)
    before = multi.llm_engine.stats.num_steps
    got = multi.generate(PROMPTS, GREEDY, use_tqdm=False)
    steps = multi.llm_engine.stats.num_steps - before
    assert _outs(got) == _outs(want)
    assert max(len(o.outputs[0].token_ids) for o in got) == 30
    # The prefill step, then ceil(29 / 4) steps for the longest output's other tokens.
    assert steps == 1 + -(-29 // STEPS), steps
    assert_clean(multi)


def test_stops_inside_a_steps_iterations(single, multi):
    ref = single.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24),
                          use_tqdm=False)[0].outputs[0]
    text_stop = ref.text[9:12]
    token_stop = next(t for i, t in enumerate(ref.token_ids) if i >= 6
                      and t not in ref.token_ids[:i])
    chat = single.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Say hi."}], tokenize=False, add_generation_prompt=True)
    cases = [(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, stop=[text_stop])),
             (PROMPTS[2], SamplingParams(temperature=0, max_tokens=24,
                                         stop_token_ids=[token_stop])),
             (PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, stop=[text_stop],
                                         include_stop_str_in_output=True)),
             (chat, SamplingParams(temperature=0, max_tokens=64))]  # ends with EOS
    prompts, params = [c[0] for c in cases], [c[1] for c in cases]
    want = _outs(single.generate(prompts, params, use_tqdm=False))
    got = _outs(multi.generate(prompts, params, use_tqdm=False))
    assert got == want
    assert [w[2] for w in want] == ["stop"] * 4 and len(want[3][0]) < 64
    assert want[0][3] == text_stop and want[1][3] == token_stop
    assert_clean(multi)


def test_seeded_sampling_and_n(single, multi):
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=14, n=2, seed=7),
              SamplingParams(temperature=1.0, top_k=20, max_tokens=9, seed=11)]
    want = single.generate(PROMPTS[:2], params, use_tqdm=False)
    got = multi.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in want]
    assert len(got[0].outputs) == 2
    assert_clean(multi)


def test_requests_that_need_the_host_decode_singly_beside_the_others(single, multi):
    params = [SamplingParams(temperature=0, max_tokens=10, logprobs=2),
              SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=10, min_tokens=8),
              SamplingParams(temperature=0, max_tokens=10)]
    want = single.generate(PROMPTS[:4], params, use_tqdm=False)
    before = multi.llm_engine.stats.num_steps
    got = multi.generate(PROMPTS[:4], params, use_tqdm=False)
    assert _outs(got) == _outs(want)
    assert got[0].outputs[0].logprobs == want[0].outputs[0].logprobs
    # The logprobs request makes every step of the batch a single step.
    assert multi.llm_engine.stats.num_steps - before == 10
    # Alone, a plain request beside a penalised one still takes multi-step steps (the
    # penalised one's rows stop after the first iteration).
    before = multi.llm_engine.stats.num_steps
    got = multi.generate(PROMPTS[:2], [params[3], params[1]], use_tqdm=False)
    assert _outs(got) == _outs(single.generate(PROMPTS[:2], [params[3], params[1]],
                                               use_tqdm=False))
    assert multi.llm_engine.stats.num_steps - before == 10  # the penalised one: 1 a step
    assert_clean(multi)


def test_a_prompt_joining_runs_its_step_once(single, multi):
    engine = multi.llm_engine
    engine.add_request("a", PROMPTS[3], GREEDY[3])
    outs = {}
    for i in range(40):
        if i == 3:  # mid-decode of "a": the step that admits "b" runs once
            engine.add_request("b", PROMPTS[0], GREEDY[0])
        for o in engine.step():
            outs[o.request_id] = o
        if not engine.has_unfinished_requests():
            break
    want = single.generate([PROMPTS[3], PROMPTS[0]], [GREEDY[3], GREEDY[0]], use_tqdm=False)
    assert _outs([outs["a"], outs["b"]]) == _outs(want)
    assert_clean(multi)


def test_preemption(single, multi):
    # 10 sequences of 3-4 blocks in a cache of 24 blocks.
    prompts = PROMPTS + [p + " and" for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=44, ignore_eos=True)
    stats = multi.llm_engine.scheduler.stats
    before = stats.num_preemptions
    got = multi.generate(prompts, params, use_tqdm=False)
    assert stats.num_preemptions > before
    assert _outs(got) == _outs(single.generate(prompts, params, use_tqdm=False))
    assert_clean(multi)


def test_plan_iterations():
    # Row 0: 2 lookahead slots, row 1: none (done after the first iteration), block size 4.
    tables = torch.tensor([[7, 3, 0], [5, 9, 2]], dtype=torch.int32)
    plan = plan_iterations(torch.tensor([3, 6]), torch.tensor([4, 7], dtype=torch.int32),
                           tables, torch.tensor([2, 0]), 3, 4)
    assert plan.positions.tolist() == [[3, 6], [4, 6], [5, 6]]
    assert plan.seq_lens.tolist() == [[4, 7], [5, 7], [6, 7]]
    # Positions 3, 4, 5 of row 0: block 7 row 3, block 3 rows 0 and 1; row 1 stays at its slot.
    assert plan.slots.tolist() == [[31, 38], [12, 38], [13, 38]]


@pytest.mark.parametrize("kwargs, field", [
    ({"num_scheduler_steps": 0}, "num_scheduler_steps"),
    ({"num_scheduler_steps": 1.5}, "num_scheduler_steps"),
    ({"num_scheduler_steps": 2, "speculative_config": {"method": "ngram",
                                                       "num_speculative_tokens": 2}},
     "speculative_config"),
    ({"num_scheduler_steps": 2, "pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
    ({"num_scheduler_steps": 2, "runner": "pooling"}, "runner='pooling'"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(**kwargs).create_engine_config()


def test_command_line():
    from pagedlm.entrypoints.cli_args import add_engine_args, engine_args_from_namespace
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from_namespace(parser.parse_args(["--num-scheduler-steps", "8"]))
    assert args.num_scheduler_steps == 8
    assert args.create_engine_config().scheduler_config.num_scheduler_steps == 8
