"""Priority scheduling: a high-priority request submitted behind a queue runs first, preempting
lower-priority work when the engine is full; FCFS ignores priority and rejects it."""
from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams

LOW = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
HIGH = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def finish_order(engine) -> list[str]:
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    return order


@pytest.fixture(scope="module")
def llm():
    return LLM(scheduling_policy="priority", max_num_seqs=2, num_gpu_blocks_override=64)


def test_high_priority_request_behind_a_queue_finishes_first(llm):
    engine = llm.llm_engine
    for i in range(6):
        engine.add_request(f"low{i}", f"Request number {i} says", LOW, priority=5)
    engine.step()
    engine.step()  # two low-priority requests are running, four wait
    engine.add_request("high", "Urgent:", HIGH, priority=0)
    before = engine.stats.num_preemptions
    order = finish_order(engine)
    assert order[0] == "high"
    assert engine.stats.num_preemptions > before  # a running low-priority request made room
    assert sorted(order[1:]) == [f"low{i}" for i in range(6)]
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_generate_takes_priorities_and_fcfs_would_finish_it_last(llm):
    prompts = [f"Item {i}:" for i in range(6)] + ["Urgent:"]
    params = [LOW] * 6 + [HIGH]
    engine = llm.llm_engine
    llm._add_requests(prompts, params, [5] * 6 + [0])
    assert finish_order(engine)[0] == "6"  # request ids follow the prompts' order
    fcfs = LLM(max_num_seqs=2, num_gpu_blocks_override=64)
    fcfs._add_requests(prompts, params, [0] * 7)
    assert finish_order(fcfs.llm_engine)[-1] == "6"
    outs = llm.generate(prompts, params, priority=[5] * 6 + [0], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12] * 6 + [4]


def test_priority_needs_the_priority_policy():
    fcfs = LLM(num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="priority"):
        fcfs.generate(["a"], SamplingParams(max_tokens=1), priority=[1], use_tqdm=False)
    assert not fcfs.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(scheduling_policy="lottery")
