"""SamplingParams validation, and input validation through LLM.generate.

Every bad field must raise a ValueError that names the field; every bad prompt must be rejected
before anything is queued, leaving the engine with no requests and every KV block free.
"""
import re

import pytest

from pagedlm import SamplingParams
from pagedlm.sampling_params import RequestOutputKind

# (kwargs, the field the error message must name)
INVALID = [
    ({"n": 0}, "n"),
    ({"n": -3}, "n"),
    ({"n": 1.5}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": -1e-3}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"frequency_penalty": 2.01}, "frequency_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 5.0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": {"a": 1}}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 2.0}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"seed": "x"}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
]


@pytest.mark.parametrize("kwargs,field", INVALID, ids=[repr(k) for k, _ in INVALID])
def test_invalid_field_raises_value_error_naming_it(kwargs, field):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    # The field name must appear as a word of its own ("n" must not just match "must").
    assert re.search(rf"(?<![A-Za-z_]){field}(?![A-Za-z_])", str(exc.value)), str(exc.value)


def test_bool_is_not_an_integer():
    # bool is a subclass of int; True must not be taken for n=1 or max_tokens=1.
    for name in ("n", "max_tokens", "top_k", "logprobs", "seed"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: True})


def test_min_tokens_greater_than_max_tokens_names_both():
    with pytest.raises(ValueError) as exc:
        SamplingParams(min_tokens=10, max_tokens=3)
    assert "min_tokens" in str(exc.value) and "max_tokens" in str(exc.value)
    assert "10" in str(exc.value) and "3" in str(exc.value)


def test_valid_edge_values_accepted_and_normalised():
    p = SamplingParams(top_k=-1)
    assert p.top_k == 0
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=1).top_k == 1

    p = SamplingParams(stop="x")
    assert p.stop == ["x"] and p.stop_strings == ("x",)
    p = SamplingParams(stop=("a", "bc"), stop_token_ids=(0, 7))
    assert p.stop == ["a", "bc"] and p.stop_token_ids == [0, 7]
    assert p.stop_strings == ("a", "bc") and p.all_stop_token_ids == frozenset({0, 7})
    p = SamplingParams()
    assert p.stop == [] and p.stop_token_ids == [] and p.stop_strings == ()

    # Boundaries of each range are inclusive where documented.
    SamplingParams(temperature=0, top_p=1.0, min_p=0.0)
    SamplingParams(min_p=1.0, top_p=1e-6)
    SamplingParams(presence_penalty=2, frequency_penalty=-2)
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0)
    SamplingParams(repetition_penalty=1e-3)
    SamplingParams(max_tokens=None, min_tokens=1000)
    SamplingParams(max_tokens=1, min_tokens=1)
    SamplingParams(seed=0, logprobs=0, prompt_logprobs=0, stop_token_ids=[0])
    SamplingParams(n=8, temperature=2.5)


def test_greedy_and_penalty_properties():
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.5).greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties
    assert SamplingParams(frequency_penalty=0.5).has_penalties


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], stop_token_ids=[3])
    q = p.clone()
    q.stop.append("b")
    q.stop_token_ids.append(4)
    q.output_kind = RequestOutputKind.DELTA
    assert p.stop == ["a"] and p.stop_token_ids == [3]
    assert p.output_kind is RequestOutputKind.CUMULATIVE


# ---------------------------------------------------------------------------------------------
# Engine-level validation through LLM.generate
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    from pagedlm import LLM
    return LLM(kv_cache_memory_bytes=512 * 2**20)


@pytest.fixture(scope="module")
def short_llm():
    from pagedlm import LLM
    return LLM(kv_cache_memory_bytes=64 * 2**20, max_model_len=64)


def assert_engine_clean(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.get_num_unfinished_requests() == 0
    assert engine.requests == {}
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(c == 0 for c in bm.ref_counts)


GREEDY = SamplingParams(temperature=0, max_tokens=4)

BAD_PROMPTS = [
    ("", "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, 2, 49152]}, "vocabulary"),
    ({"prompt_token_ids": [-1, 5]}, "vocabulary"),
    ({"prompt_token_ids": [1, "2"]}, "prompt_token_ids"),
    ({"prompt_token_ids": "1 2 3"}, "prompt_token_ids"),
    ({}, "prompt_token_ids"),
    ({"text": "hello"}, "prompt_token_ids"),
    ({"prompt": 12}, "prompt"),
    (12, "prompt must be a string or a dict"),
]


@pytest.mark.parametrize("bad,msg", BAD_PROMPTS, ids=[repr(b) for b, _ in BAD_PROMPTS])
def test_bad_prompt_rejected_and_nothing_left_queued(llm, bad, msg):
    # The bad prompt comes after a valid one: generate() is all or nothing.
    with pytest.raises(ValueError, match=re.escape(msg)):
        llm.generate(["A valid prompt", bad], GREEDY, use_tqdm=False)
    assert_engine_clean(llm)
    with pytest.raises(ValueError, match=re.escape(msg)):
        llm.generate(bad if isinstance(bad, (str, dict)) else [bad], GREEDY, use_tqdm=False)
    assert_engine_clean(llm)


def test_prompt_longer_than_max_model_len(short_llm):
    with pytest.raises(ValueError) as exc:
        short_llm.generate([{"prompt_token_ids": [42] * 10}, {"prompt_token_ids": [42] * 100}],
                           GREEDY, use_tqdm=False)
    msg = str(exc.value)
    assert "too long" in msg and "100" in msg and "64" in msg and "max_model_len" in msg
    assert_engine_clean(short_llm)

    # The longest allowed prompt is accepted, and the output is capped at max_model_len.
    prompt = list(range(1000, 1060))
    out = short_llm.generate({"prompt_token_ids": prompt},
                             SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                             use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt
    assert len(prompt) + len(out.outputs[0].token_ids) == 64
    assert out.outputs[0].finish_reason == "length"
    assert_engine_clean(short_llm)


def test_non_sampling_params_entry(llm):
    with pytest.raises(ValueError, match="SamplingParams") as exc:
        llm.generate(["a b", "c d"], [GREEDY, {"temperature": 0}], use_tqdm=False)
    assert "dict" in str(exc.value)
    assert_engine_clean(llm)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.llm_engine.add_request("x", "hello", {"temperature": 0})
    assert_engine_clean(llm)


def test_mismatched_number_of_sampling_params(llm):
    with pytest.raises(ValueError, match="sampling_params") as exc:
        llm.generate(["one", "two", "three"], [GREEDY, GREEDY], use_tqdm=False)
    assert "2" in str(exc.value) and "3" in str(exc.value)
    assert_engine_clean(llm)


def test_duplicate_request_id_rejected(llm):
    engine = llm.llm_engine
    engine.add_request("dup", "Hello", GREEDY)
    try:
        with pytest.raises(ValueError, match="dup"):
            engine.add_request("dup", "Hello again", GREEDY)
    finally:
        engine.abort_request("dup")
    assert_engine_clean(llm)


def test_unknown_llm_kwarg_raises_type_error_naming_it():
    from pagedlm import LLM
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(max_num_sequences=4)


def test_valid_generate_works_after_failures(llm):
    # Make sure something failed first in this test too, then run a real request.
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], GREEDY, use_tqdm=False)
    assert_engine_clean(llm)
    outs = llm.generate(["The capital of France is", "1, 2, 3,"],
                        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    assert [o.prompt for o in outs] == ["The capital of France is", "1, 2, 3,"]
    for o in outs:
        assert o.finished
        assert len(o.outputs[0].token_ids) == 5
        assert o.outputs[0].finish_reason == "length"
        assert o.outputs[0].text
    assert_engine_clean(llm)
