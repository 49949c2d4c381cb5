"""Structured outputs and token constraints over the OpenAI API (a real server on a socket, the
`openai` client, the default model): response_format json_schema / json_object, vLLM's
structured_outputs field and the older guided_* fields, logit_bias, allowed_token_ids and
bad_words on both endpoints; bad specs are 400s naming the field and the server keeps serving."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from pagedlm import EngineArgs
from pagedlm.engine.async_llm_engine import AsyncLLMEngine
from tests.server_utils import assert_all_blocks_free, serve_in_thread, wait_until_idle
from tests.structured_cases import (CHOICE_PROMPT, CHOICES, GRAMMAR, GRAMMAR_PROMPT, GRAMMAR_RE,
                                    REGEX, REGEX_PROMPT, SCHEMAS)

MODEL = "smollm2-structured"
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(max_model_len=1024, num_gpu_blocks_override=640), log_stats=False,
        model_name=MODEL)
    try:
        with serve_in_thread(engine, served_model_names=[MODEL]) as running:
            yield running
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


def concurrently(fn, items):
    """Send the requests at once, so that the engine batches them."""
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def response_format(i: int, schema: dict) -> dict:
    return {"type": "json_schema",
            "json_schema": {"name": f"case{i}", "schema": schema, "strict": True}}


def stream_texts(stream) -> dict[int, str]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert set(finish.values()) == {"stop"}, finish
    return texts


def test_ten_schemas_n3_streamed_and_not(server, client):
    def ask(case, stream):
        i, (prompt, schema) = case
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], n=3,
            temperature=1.0, seed=i, max_tokens=MAX_TOKENS,
            response_format=response_format(i, schema), stream=stream)

    # All twenty at once (one batch of 60 sequences: half the time of two batches of 30).
    cases = list(enumerate(SCHEMAS))
    both = concurrently(lambda c: stream_texts(ask(c[1], True)) if c[0] else ask(c[1], False),
                        [(0, c) for c in cases] + [(1, c) for c in cases])
    full, streamed = both[:len(cases)], both[len(cases):]
    for (_, schema), r, texts in zip(SCHEMAS, full, streamed):
        assert len(r.choices) == 3
        for c in r.choices:
            assert c.finish_reason == "stop", c.message.content
            jsonschema.validate(json.loads(c.message.content), schema)
        # The stream reassembles to three valid replies. Not compared with the other call's:
        # sharing a batch and the prefix cache by arrival order, the two run on other compute
        # paths, whose last-bit differences can move a seeded draw (tests/compare_utils.py).
        assert sorted(texts) == [0, 1, 2]
        for text in texts.values():
            jsonschema.validate(json.loads(text), schema)
    wait_until_idle(server.engine)
    assert_all_blocks_free(server.engine)


def test_every_way_to_ask_for_structure(client):
    """Completions and chat; vLLM's structured_outputs and the older guided_* fields."""
    prompt, schema = SCHEMAS[0]
    chat = [{"role": "user", "content": prompt}]
    cases = [
        ("completions", REGEX_PROMPT, {"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
        ("completions", CHOICE_PROMPT, {"guided_choice": CHOICES}, lambda t: t in CHOICES),
        ("completions", GRAMMAR_PROMPT, {"guided_grammar": GRAMMAR},
         lambda t: GRAMMAR_RE.fullmatch(t)),
        ("completions", REGEX_PROMPT, {"structured_outputs": {"regex": REGEX}},
         lambda t: re.fullmatch(REGEX, t)),
        ("completions", CHOICE_PROMPT, {"response_format": {"type": "json_object"}},
         lambda t: isinstance(json.loads(t), dict)),
        ("chat", chat, {"guided_json": schema},
         lambda t: jsonschema.validate(json.loads(t), schema) is None),
        ("chat", chat, {"guided_json": json.dumps(schema)},
         lambda t: jsonschema.validate(json.loads(t), schema) is None),
        ("chat", chat, {"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
         lambda t: jsonschema.validate(json.loads(t), schema) is None and "\n" not in t),
        ("chat", chat, {"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
        ("chat", [{"role": "user", "content": "Describe a dog as JSON."}],
         {"response_format": {"type": "json_object"}},
         lambda t: isinstance(json.loads(t), dict)),
    ]

    def ask(case):
        endpoint, prompt, extra, _ = case
        if endpoint == "completions":
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60,
                                          temperature=0, extra_body=extra)
            return r.choices[0].text, r.choices[0].finish_reason
        r = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body=extra)
        return r.choices[0].message.content, r.choices[0].finish_reason

    for case, (text, finish) in zip(cases, concurrently(ask, cases)):
        assert finish == "stop" and case[3](text), (case[2], text)


def test_logit_bias_allowed_token_ids_and_bad_words(server, client):
    tok = server.engine.get_tokenizer()
    prompt = "The capital of France is"

    def complete(**extra):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                      logprobs=0, extra_body={"ignore_eos": True, **extra})
        return r.choices[0]

    base = complete()
    first = tok.encode(base.logprobs.tokens[0], add_special_tokens=False)
    forced_id = tok.encode(" banana", add_special_tokens=False)[0]
    # OpenAI's client sends logit_bias with string keys.
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                       logit_bias={str(forced_id): 100},
                                       extra_body={"ignore_eos": True})
    assert forced.choices[0].text == tok.decode([forced_id] * 5)
    banned = complete(logit_bias={str(first[0]): -100})
    assert banned.logprobs.tokens[0] != base.logprobs.tokens[0]
    allowed = tok.encode(" one two three", add_special_tokens=False)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0,
                                  seed=1, extra_body={"ignore_eos": True,
                                                      "allowed_token_ids": allowed})
    assert set(tok.encode(r.choices[0].text, add_special_tokens=False)) <= set(allowed)
    word = base.text.split()[0]
    r = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, extra_body={"bad_words": [word]},
        messages=[{"role": "user", "content": f"Complete: {prompt}"}])
    assert word not in r.choices[0].message.content.split()


BAD = [
    ("chat", {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("completions", {"guided_regex": "([0-9]"}, "guided_regex"),
    ("completions", {"guided_grammar": "root ::= nothing_here"}, "guided_grammar"),
    ("completions", {"guided_json": "{not json"}, "guided_json"),
    ("completions", {"guided_choice": []}, "guided_choice"),
    ("completions", {"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ("completions", {"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
    ("completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("completions", {"logit_bias": {"abc": 5}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 500}}, "logit_bias.5"),  # the entry out of range
    ("completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("completions", {"allowed_token_ids": [99999999]}, "allowed_token_ids"),
    ("chat", {"bad_words": [""]}, "bad_words"),
    # beam search with a constraint: the field the request set, not structured_outputs
    ("completions", {"use_beam_search": True, "n": 2, "temperature": 0,
                     "guided_choice": ["a", "b"]}, "guided_choice"),
    ("chat", {"use_beam_search": True, "n": 2, "temperature": 0,
              "response_format": {"type": "json_object"}}, "response_format"),
]


@pytest.mark.parametrize("endpoint, extra, param", BAD, ids=[p for _, _, p in BAD])
def test_bad_specs_are_400_naming_the_field(server, client, endpoint, extra, param):
    with pytest.raises(openai.BadRequestError) as exc_info:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, max_tokens=4, extra_body=extra,
                                           messages=[{"role": "user", "content": "hi"}])
        else:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body=extra)
    body = exc_info.value.body
    assert body["code"] == 400 and body["type"] == "BadRequestError"
    assert body["param"] == param, body
    # The server keeps serving, and nothing was left behind.
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    wait_until_idle(server.engine)
    assert_all_blocks_free(server.engine)
