"""Per-request lists and grammars that would make the engine thread do heavy work (issue 29).

Over a real server (the `openai` client and httpx on a socket, the default model): a grammar
past each size bound is a 400 naming the bound and the field; a deep guided_json string is
refused at once while /health keeps answering; a grammar that compiles past
structured_outputs_compile_timeout is a 400 naming that limit while /health and a plain request
keep going; each list past its cap is a 400 naming the cap. Offline (LLM): the same ValueErrors,
and bad_words bans what it did before (a greedy reference run shows the banned word would have
come; with the ban it never does, and the output is the reference's up to that token), also
checked against the definition on random lists. Every KV block is free at the end.
"""
from __future__ import annotations

import json
import random
import re
import string
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pagedlm import LLM, EngineArgs, SamplingParams
from pagedlm.engine.async_llm_engine import AsyncLLMEngine
from pagedlm.engine.request_prep import MAX_BAD_WORD_CHARS, tokenize_bad_words
from pagedlm.model_executor.layers.token_constraints import TokenConstraints
from pagedlm.sampling_params import StructuredOutputsParams
from pagedlm.structured_output import limits
from tests.server_utils import assert_all_blocks_free, serve_in_thread, wait_until_idle

MODEL = "smollm2-lists"
COMPILE_TIMEOUT = 2.0
# Within every bound (as many choices as allowed, each as long as allowed), and 34 s of CPU
# time to compile on the test machine: what only the compile time limit catches.
SLOW_CHOICES = ["".join(random.Random(i).choices(string.ascii_letters, k=limits.MAX_CHOICE_CHARS))
                for i in range(limits.MAX_CHOICES)]
COUNT_PROMPT = "Count from one to ten: one, two,"


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(max_model_len=512, num_gpu_blocks_override=128,
                   structured_outputs_compile_timeout=COMPILE_TIMEOUT),
        log_stats=False, model_name=MODEL)
    try:
        with serve_in_thread(engine, served_model_names=[MODEL]) as running:
            yield running
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def llm():
    engine = LLM(kv_cache_memory_bytes=32 * 2**20,
                 structured_outputs_compile_timeout=COMPILE_TIMEOUT)
    yield engine
    engine.llm_engine.shutdown()


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    while depth > 2:  # each level: the property's schema and its properties object
        schema = {"type": "object", "properties": {"a": schema}}
        depth -= 2
    return schema


def expect_400(client, endpoint: str, extra: dict, param: str, limit: str) -> str:
    with pytest.raises(openai.BadRequestError) as exc_info:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, max_tokens=4, extra_body=extra,
                                           messages=[{"role": "user", "content": "hi"}])
        else:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body=extra)
    body = exc_info.value.body
    assert body["code"] == 400 and body["type"] == "BadRequestError", body
    assert body["param"] == param, body
    assert limit in body["message"], body
    return body["message"]


class HealthProbe:
    """GET /health every 50 ms on its own thread while in the `with` block."""

    def __init__(self, url: str) -> None:
        self.url, self._stop = url, threading.Event()
        self.answers: list[tuple[int, float]] = []  # (status, seconds)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                t = time.monotonic()
                status = http.get(self.url + "/health").status_code
                self.answers.append((status, time.monotonic() - t))
                time.sleep(0.05)

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def assert_answered_within(self, seconds: float) -> None:
        assert self.answers, "no /health probe ran"
        assert all(status == 200 and t < seconds for status, t in self.answers), self.answers


BOUNDS = [
    ("completions", {"guided_json": json.dumps({"type": "string", "description": "x" * (
        limits.MAX_JSON_SCHEMA_BYTES)})}, "guided_json", "(JSON schema size)"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": nested(limits.MAX_JSON_SCHEMA_DEPTH + 2)}}},
     "response_format.json_schema.schema", "(JSON schema nesting depth)"),
    ("completions", {"guided_json": json.dumps(nested(limits.MAX_JSON_SCHEMA_DEPTH + 2))},
     "guided_json", "(JSON schema nesting depth)"),
    ("completions", {"guided_regex": "a" * (limits.MAX_REGEX_CHARS + 1)}, "guided_regex",
     "(regex length)"),
    ("completions", {"structured_outputs": {"grammar": 'root ::= "a"' + " " * (
        limits.MAX_GRAMMAR_CHARS)}}, "structured_outputs.grammar", "(grammar length)"),
    ("completions", {"guided_choice": [str(i) for i in range(limits.MAX_CHOICES + 1)]},
     "guided_choice", "(number of choices)"),
    ("chat", {"guided_choice": ["yes", "n" * (limits.MAX_CHOICE_CHARS + 1)]}, "guided_choice",
     "(choice length)"),
]


@pytest.mark.parametrize("endpoint, extra, param, limit", BOUNDS,
                         ids=[b[3].strip("()") for b in BOUNDS])
def test_grammar_past_each_bound_is_a_400_naming_it(client, endpoint, extra, param, limit):
    expect_400(client, endpoint, extra, param, limit)


def test_just_under_the_bounds_is_accepted(client):
    r = client.completions.create(
        model=MODEL, prompt="Pick a letter:", max_tokens=3, temperature=0,
        extra_body={"guided_choice": ["a" * limits.MAX_CHOICE_CHARS, "b"] + [
            f"c{i}" for i in range(limits.MAX_CHOICES - 2)]})
    assert r.choices[0].text


def test_deep_guided_json_string_is_refused_while_health_answers(server, client):
    """Nested past the parser's recursion limit, as a string (pydantic does not look inside),
    within the size bound: refused before anything parses it, /health never waits."""
    deep = "[" * 40_000 + "]" * 40_000
    with HealthProbe(server.url) as probe:
        for _ in range(3):
            expect_400(client, "completions", {"guided_json": deep}, "guided_json",
                       "(JSON schema nesting depth)")
        time.sleep(0.2)  # a probe after the refusals too
    probe.assert_answered_within(1.0)


def test_grammar_past_the_compile_timeout_is_a_400_while_others_run(server, client):
    """The choices compile in the sandbox until their CPU time runs out; meanwhile /health
    answers within a second and a plain request completes; then the sandbox serves the next
    grammar."""
    def plain():
        return client.completions.create(model=MODEL, prompt=COUNT_PROMPT, max_tokens=8,
                                         temperature=0).choices[0].text

    with HealthProbe(server.url) as probe, ThreadPoolExecutor(1) as pool:
        slow = pool.submit(expect_400, client, "chat", {"guided_choice": SLOW_CHOICES},
                           "guided_choice", "structured_outputs_compile_timeout")
        assert plain()
        message = slow.result()
    probe.assert_answered_within(1.0)
    # Refused again at once (the failure is kept), and the next grammar compiles.
    assert expect_400(client, "chat", {"guided_choice": SLOW_CHOICES}, "guided_choice",
                      "structured_outputs_compile_timeout") == message
    r = client.completions.create(model=MODEL, prompt="Yes or no?", max_tokens=3,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    wait_until_idle(server.engine)
    assert_all_blocks_free(server.engine)


LIST_CAPS = [
    ({"bad_words": [f"w{i}" for i in range(30_000)]}, "bad_words", "max_bad_words"),
    ({"bad_words": [f"w{i}" for i in range(1001)]}, "bad_words", "max_bad_words"),
    ({"bad_words": ["ok", "x" * (MAX_BAD_WORD_CHARS + 1)]}, "bad_words",
     f"limit of {MAX_BAD_WORD_CHARS}"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "max_logit_bias"),
    ({"stop": [f"s{i}" for i in range(257)]}, "stop", "max_stop_strings"),
    ({"stop_token_ids": list(range(129))}, "stop_token_ids", "max_stop_token_ids"),
    ({"allowed_token_ids": [1] * 50_000}, "allowed_token_ids", "vocabulary"),
]


@pytest.mark.parametrize("extra, param, limit", LIST_CAPS,
                         ids=["bad_words-30000", "bad_words-1001", "bad_word-length",
                              "logit_bias", "stop", "stop_token_ids", "allowed_token_ids"])
def test_list_past_its_cap_is_a_400_naming_it(server, client, extra, param, limit):
    for endpoint in ("completions", "chat"):
        expect_400(client, endpoint, extra, param, limit)


@pytest.mark.parametrize("extra, param", [
    ({"allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 3}, "min_tokens"),
    ({"allowed_token_ids": [5], "bad_words": ["<file_sep>"]}, "allowed_token_ids"),
])
def test_settings_that_leave_nothing_to_sample_are_a_400(server, client, extra, param):
    """They were a 200 whose tokens lay outside allowed_token_ids (every allowed token
    masked, the sampler drew from nothing)."""
    for endpoint in ("completions", "chat"):
        expect_400(client, endpoint, extra, param, "nothing could be generated")
    wait_until_idle(server.engine)
    assert_all_blocks_free(server.engine)


def test_a_whitespace_bad_word_is_a_400_that_says_why(server, client):
    for endpoint in ("completions", "chat"):
        for words in (["\n"], ["ok", "  "], [""]):
            expect_400(client, endpoint, {"bad_words": words}, "bad_words", "whitespace only")


def test_bad_words_at_the_cap_ban_over_the_server(server, client):
    """1000 words, tokenized on the caller's side: the one the greedy run would write first is
    never written."""
    ref = client.completions.create(model=MODEL, prompt=COUNT_PROMPT, max_tokens=6,
                                    temperature=0).choices[0].text
    word = ref.split()[0].strip(",")
    words = [f"zq{i}" for i in range(999)] + [word]
    r = client.completions.create(model=MODEL, prompt=COUNT_PROMPT, max_tokens=6,
                                  temperature=0, extra_body={"bad_words": words})
    assert word not in re.findall(r"\w+", r.choices[0].text), (ref, r.choices[0].text)
    wait_until_idle(server.engine)
    assert_all_blocks_free(server.engine)


# ---- offline ----

def first_index(tokens: list[int], word: list[int]) -> int:
    return next(i for i in range(len(tokens)) if tokens[i:i + len(word)] == word)


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens)))


def test_bad_words_ban_single_and_multi_token_words(llm):
    tok = llm.get_tokenizer()
    greedy = dict(temperature=0, max_tokens=14, ignore_eos=True)
    single, multi = "three", "seven, eight"
    ref, no_single, no_multi = (o.outputs[0].token_ids for o in llm.generate(
        [COUNT_PROMPT] * 3, [SamplingParams(**greedy),
                             SamplingParams(**greedy, bad_words=[single]),
                             SamplingParams(**greedy, bad_words=[multi])], use_tqdm=False))
    for word, banned in ((single, no_single), (multi, no_multi)):
        variants = tokenize_bad_words(tok, [word])
        hit = [v for v in variants if contains(ref, v)]
        assert hit, (word, tok.decode(ref))  # the reference run writes it
        assert not any(contains(banned, v) for v in variants), tok.decode(banned)
        # Only its last token is banned, only there: the same output up to that token.
        k = first_index(ref, hit[0]) + len(hit[0]) - 1
        assert banned[:k] == ref[:k] and banned[k] != ref[k]
    assert len(tokenize_bad_words(tok, [multi])[0]) > 1
    assert_offline_blocks_free(llm)


def test_bad_words_match_the_definition_on_random_lists():
    """TokenConstraints bans exactly what the former per-step loop banned: for each word, its
    last token wherever the output ends with the rest of it."""
    rng = random.Random(0)
    vocab = 40
    for _ in range(200):
        words = [[rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
                 for _ in range(rng.randint(1, 30))]
        out = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        if words and rng.random() < 0.5 and len(words[0]) > 1:
            out += words[0][:-1]  # make a prefix match likely
        params = SamplingParams(bad_words=["x"])
        params.bad_words_token_ids = words
        c = TokenConstraints.build(params, vocab)
        got = set(c.banned_ids.tolist()) if c.banned_ids is not None else set()
        after = c.banned_after(out)
        got |= set(after.tolist()) if after is not None else set()
        expected = {w[-1] for w in words if not w[:-1] or out[len(out) - len(w) + 1:] == w[:-1]}
        assert got == expected, (words, out)


def test_tokenized_bad_words_are_the_former_ones(llm):
    tok = llm.get_tokenizer()
    words = ["three", " three", "three", "seven, eight", "  twelve", "x"]
    former = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tok.encode(text, add_special_tokens=False)
            if ids and ids not in former:
                former.append(ids)
    assert tokenize_bad_words(tok, words) == former


def assert_offline_blocks_free(llm):
    engine = llm.llm_engine
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert not engine.has_unfinished_requests() and not engine._structured_ids


OFFLINE_ERRORS = [
    (dict(bad_words=[f"w{i}" for i in range(30_000)]), "bad_words", "max_bad_words"),
    (dict(bad_words=["x" * (MAX_BAD_WORD_CHARS + 1)]), "bad_words", "characters long"),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias", "max_logit_bias"),
    (dict(stop=[f"s{i}" for i in range(257)]), "stop", "max_stop_strings"),
    (dict(stop_token_ids=list(range(129))), "stop_token_ids", "max_stop_token_ids"),
    (dict(allowed_token_ids=[1] * 50_000), "allowed_token_ids", "vocabulary"),
]


@pytest.mark.parametrize("kwargs, field, limit", OFFLINE_ERRORS,
                         ids=[e[1] + "-" + e[2].split()[0] for e in OFFLINE_ERRORS])
def test_offline_list_caps_are_value_errors(llm, kwargs, field, limit):
    with pytest.raises(ValueError, match=rf"^{field}\b.*{re.escape(limit)}"):
        llm.generate(["x"], SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    assert_offline_blocks_free(llm)


OFFLINE_GRAMMARS = [
    (dict(json="[" * 5000 + "]" * 5000), "(JSON schema nesting depth)"),
    (dict(json=nested(limits.MAX_JSON_SCHEMA_DEPTH + 2)), "(JSON schema nesting depth)"),
    (dict(json={"description": "x" * limits.MAX_JSON_SCHEMA_BYTES}), "(JSON schema size)"),
    (dict(regex="a" * (limits.MAX_REGEX_CHARS + 1)), "(regex length)"),
    (dict(grammar="root ::= " + '"a" ' * limits.MAX_GRAMMAR_CHARS), "(grammar length)"),
    (dict(choice=["c"] * (limits.MAX_CHOICES + 1)), "(number of choices)"),
    (dict(choice=["c" * (limits.MAX_CHOICE_CHARS + 1)]), "(choice length)"),
    (dict(choice=SLOW_CHOICES), "structured_outputs_compile_timeout"),
]


@pytest.mark.parametrize("kwargs, limit", OFFLINE_GRAMMARS,
                         ids=[g[1].strip("()") for g in OFFLINE_GRAMMARS])
def test_offline_grammar_limits_are_value_errors(llm, kwargs, limit):
    kind = next(iter(kwargs))
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{kind}\b.*{re.escape(limit)}"):
        llm.generate(["x"], SamplingParams(
            max_tokens=2, structured_outputs=StructuredOutputsParams(**kwargs)), use_tqdm=False)
    assert_offline_blocks_free(llm)
