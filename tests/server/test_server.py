"""The OpenAI-compatible server, over a real socket with the `openai` client, on the default model.

One server (real uvicorn, in a thread of this process) serves the module, so the tests can also
look at the engine behind it: after 64 concurrent streams with a quarter dropped midway, every
KV block must be free again.
"""
from __future__ import annotations

import asyncio
import gzip
import importlib.util
import json
import re
import sys
from pathlib import Path

import httpx
import openai
import pytest

from pagedlm import EngineArgs
from pagedlm.engine.async_llm_engine import AsyncLLMEngine
from tests.server_utils import assert_all_blocks_free, serve_in_thread, wait_until_idle

MODEL = "smollm2-test"
API_KEY = "sk-pagedlm-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 512
PROMPT = "The three most common colors of cars are"


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=320),
        log_stats=False, model_name=MODEL)
    try:
        with serve_in_thread(engine, served_model_names=[MODEL, "alias"],
                             api_key=API_KEY) as running:
            yield running
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.engine.get_tokenizer()


def chat_prompt_len(tokenizer, messages) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, "alias"]
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200
    assert httpx.get(server.url + "/version", headers=AUTH).json()["version"]
    # The page answers HEAD as GET (uptime probes send it; it was a 405).
    r = httpx.head(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    # So do the other GET routes (they were 405), behind the key where the GET is.
    for path in ("/version", "/metrics", "/v1/models"):
        r = httpx.head(server.url + path, headers=AUTH)
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)
        assert r.headers["content-type"] == httpx.get(server.url + path,
                                                      headers=AUTH).headers["content-type"]
    assert httpx.head(server.url + "/v1/models").status_code == 401


def test_completion_usage_matches_tokenizer(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.text
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 9
    assert r.usage.total_tokens == r.usage.prompt_tokens + 9
    # The served alias answers too, with the same greedy text.
    again = client.completions.create(model="alias", prompt=PROMPT, max_tokens=9, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == choice.text and again.model == "alias"


def _stream_completion(client, **kwargs):
    texts, finish, usage, chunks = {}, {}, None, 0
    for chunk in client.completions.create(stream=True, **kwargs):
        chunks += 1
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, usage, chunks


def test_completion_stream_equals_non_stream_with_seed_and_n(client, tokenizer):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.9, seed=1234, n=3)
    full = client.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts, finish, usage, chunks = _stream_completion(
        client, stream_options={"include_usage": True}, **kwargs)
    assert chunks > 3  # really streamed, not one blob
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    assert len(set(texts.values())) > 1  # n samples, not one sample three times
    assert usage.prompt_tokens == full.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert usage.completion_tokens == full.usage.completion_tokens
    # Exact counts: with ignore_eos every sample runs to max_tokens.
    exact = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, n=2, seed=3,
                                      extra_body={"ignore_eos": True})
    assert exact.usage.completion_tokens == 14
    # A choice that stops before its siblings says so once (it did on every later step).
    stops = dict(model=MODEL, max_tokens=30, n=4, temperature=1.0, seed=5, stop=["e"],
                 stream=True, extra_body={"ignore_eos": True})
    for chunks in (client.completions.create(prompt=PROMPT, **stops),
                   client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}],
                                                  **stops)):
        finishes = [c.index for chunk in chunks for c in chunk.choices if c.finish_reason]
        assert sorted(finishes) == [0, 1, 2, 3], finishes


def test_chat_stream_equals_non_stream(client, tokenizer):
    messages = [{"role": "system", "content": "You answer in one sentence."},
                {"role": "user", "content": "What is the capital of France?"}]
    kwargs = dict(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0.8,
                  seed=7)
    # Seeded draws are compared on one compute path: a prefix-cache hit on the first call's
    # blocks would change the logits' last bits, which can move a draw. Own salts: no hits.
    full = client.chat.completions.create(**kwargs,
                                          extra_body={"cache_salt": "chat-stream-test-full"})
    assert full.object == "chat.completion"
    (choice,) = full.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert full.usage.prompt_tokens == chat_prompt_len(tokenizer, messages)
    text, roles, finish, usage = "", [], None, None
    for chunk in client.chat.completions.create(
            stream=True, stream_options={"include_usage": True},
            extra_body={"cache_salt": "chat-stream-test-stream"}, **kwargs):
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert roles == ["assistant"]
    assert text == choice.message.content
    assert finish == choice.finish_reason
    assert usage.model_dump() == full.usage.model_dump()


def test_chat_max_tokens_and_n(client, tokenizer):
    messages = [{"role": "user", "content": "Tell me a joke."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=2,
                                       temperature=1.0, seed=11,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == chat_prompt_len(tokenizer, messages)


def test_completion_logprobs(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))


def test_streamed_text_offsets_are_the_tokens_own(client):
    """A streamed completion's text_offset counted the characters sent, which lag the tokens
    while a stop string could still cut the text (it is held back): offsets ran behind the
    non-streamed answer's."""
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                  stop=["never written, held back"], extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].logprobs
    streamed, tokens = [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.text_offset
                tokens += c.logprobs.tokens
    assert tokens == full.tokens
    assert streamed == full.text_offset == [sum(map(len, full.tokens[:i])) for i in range(8)]


def test_completion_echo_with_logprobs(client, tokenizer):
    n_prompt = len(tokenizer.encode(PROMPT))
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                  echo=True, logprobs=1, extra_body={"ignore_eos": True})
    (choice,) = r.choices
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert choice.text == PROMPT + plain.choices[0].text
    # Streaming echo: the prompt comes first.
    texts, _, _, _ = _stream_completion(client, model=MODEL, prompt=PROMPT, max_tokens=4,
                                        temperature=0, echo=True,
                                        extra_body={"ignore_eos": True})
    assert texts[0] == choice.text


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(x.token for x in content) == r.choices[0].message.content
    for x in content:
        assert len(x.top_logprobs) == 2
        assert x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob
        assert x.token == x.top_logprobs[0].token  # greedy
        assert x.bytes == list(x.token.encode())


def _check_prompt_logprobs(plp, prompt_ids: list[int], k: int) -> None:
    """vLLM's format: per prompt position None (the first) or token id -> logprob, rank,
    decoded_token, holding the prompt's token and the top k."""
    assert len(plp) == len(prompt_ids) and plp[0] is None
    for tid, pos in zip(prompt_ids[1:], plp[1:]):
        assert str(tid) in pos and len(pos) in (max(k, 1), k + 1), pos
        ranked = sorted(pos.values(), key=lambda x: x["rank"])
        assert [x["rank"] for x in ranked][:k] == list(range(1, k + 1))
        values = [x["logprob"] for x in ranked if x["rank"] <= k]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert all(isinstance(x["decoded_token"], str) for x in ranked)


def test_prompt_logprobs_are_returned(client, tokenizer):
    """They were computed when asked for, and dropped from the answer. An echo's larger
    `logprobs` does not widen them; a one-token prompt has its one (empty) position."""
    prompt_ids = tokenizer.encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                  echo=True, logprobs=4, extra_body={"prompt_logprobs": 2})
    (choice,) = r.choices
    plp = choice.model_extra["prompt_logprobs"]
    _check_prompt_logprobs(plp, prompt_ids, 2)
    # The prompt's own token: as the echoed legacy logprobs of the same answer give it.
    echoed = choice.logprobs.token_logprobs[1:len(prompt_ids)]
    assert [pos[str(t)]["logprob"] for t, pos in zip(prompt_ids[1:], plp[1:])] == echoed
    assert [pos[str(t)]["decoded_token"] for t, pos in zip(prompt_ids[1:], plp[1:])] == \
        choice.logprobs.tokens[1:len(prompt_ids)]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None
    one = client.completions.create(model=MODEL, prompt=[[prompt_ids[0]], prompt_ids],
                                    max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert one.choices[0].model_extra["prompt_logprobs"] == [None]
    _check_prompt_logprobs(one.choices[1].model_extra["prompt_logprobs"], prompt_ids, 0)

    messages = [{"role": "user", "content": "Count to five."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body={"prompt_logprobs": 1})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat_ids = tokenizer.encode(text, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(chat_ids)
    _check_prompt_logprobs(r.model_extra["prompt_logprobs"], chat_ids, 1)


@pytest.mark.parametrize("create", ["completions", "chat"])
def test_prompt_logprobs_with_stream_are_400(client, create):
    """As vLLM: they come with the whole answer, which a stream never sends."""
    kwargs = dict(model=MODEL, max_tokens=2, stream=True)
    call = client.completions.create if create == "completions" else \
        client.chat.completions.create
    kwargs.update({"prompt": PROMPT} if create == "completions" else
                  {"messages": [{"role": "user", "content": PROMPT}]})
    with pytest.raises(openai.BadRequestError) as exc_info:
        call(**kwargs, extra_body={"prompt_logprobs": 1})
    _error(exc_info, 400, "prompt_logprobs")
    # 0 asks for nothing a stream would lose.
    assert list(call(**kwargs, extra_body={"prompt_logprobs": 0}))


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    words = re.findall(r"[A-Za-z]{3,}", base)
    assert len(words) >= 3, base
    stop = words[2]
    cut = base.index(stop)
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "@@@"])
    r = client.completions.create(**kwargs)
    assert r.choices[0].text == base[:cut]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    texts, finish, _, _ = _stream_completion(client, **kwargs)
    assert texts[0] == base[:cut] and finish[0] == "stop"
    inclusive = client.completions.create(**kwargs,
                                          extra_body={"include_stop_str_in_output": True})
    assert inclusive.choices[0].text == base[:cut + len(stop)]


def test_batch_of_prompts(client, tokenizer):
    prompts = [PROMPT, "Paris is a city in"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, n=2,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 20
    single = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=5,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[2].text == r.choices[3].text == single.choices[0].text
    # Token-id prompts work as well.
    ids = tokenizer.encode(prompts[1])
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == single.choices[0].text


# ---- errors ----

def _error(exc_info, status: int, param: str | None = None) -> dict:
    e = exc_info.value
    assert e.status_code == status
    body = e.body
    assert set(body) >= {"message", "type", "param", "code"}, body
    assert body["code"] == status and body["message"]
    if param is not None:
        assert body["param"] == param, body
    return body


@pytest.mark.parametrize("extra, param", [
    ({"max_tokens": "abc"}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"n": "two"}, "n"),
    ({"top_p": 1.5}, "top_p"),
    ({"stop": 5}, "stop"),
    ({"logprobs": 100}, "logprobs"),
    ({"seed": "x"}, "seed"),
])
def test_bad_fields_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as exc_info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=extra)
    body = _error(exc_info, 400, param)
    assert body["type"] == "BadRequestError"


def test_bad_chat_requests_are_400(client):
    with pytest.raises(openai.BadRequestError) as exc_info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user"}],
                                       max_tokens="many")
    _error(exc_info, 400, "max_tokens")
    with pytest.raises(openai.BadRequestError) as exc_info:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    _error(exc_info, 400, "messages")


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as exc_info:
        client.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=4)
    body = _error(exc_info, 404, "model")
    assert body["type"] == "NotFoundError" and "gpt-9" in body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user",
                                                                 "content": "hi"}])


def test_prompt_over_the_context_is_400(client):
    long_prompt = "hello " * (MAX_MODEL_LEN + 50)
    with pytest.raises(openai.BadRequestError) as exc_info:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4)
    body = _error(exc_info, 400)
    assert "max_model_len" in body["message"] and str(MAX_MODEL_LEN) in body["message"]
    with pytest.raises(openai.BadRequestError) as exc_info:
        client.chat.completions.create(model=MODEL, max_tokens=4,
                                       messages=[{"role": "user", "content": long_prompt}])
    assert "max_model_len" in _error(exc_info, 400)["message"]


def test_prompt_plus_max_tokens_over_the_context_is_400(client):
    prompt_ids = [1000] * (MAX_MODEL_LEN - 10)
    with pytest.raises(openai.BadRequestError) as exc_info:
        client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=20)
    body = _error(exc_info, 400, "max_tokens")
    assert str(MAX_MODEL_LEN) in body["message"] and str(MAX_MODEL_LEN + 10) in body["message"]
    ok = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=10)
    assert ok.usage.prompt_tokens + ok.usage.completion_tokens <= MAX_MODEL_LEN


@pytest.mark.parametrize("content", [b'{"model": "x", "prompt": ', b"not json", b"", b"[1, 2]"])
def test_invalid_json_is_400(server, content):
    r = httpx.post(server.base_url + "/completions", content=content,
                   headers={"Authorization": f"Bearer {API_KEY}",
                            "Content-Type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["message"]


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(server.base_url + "/completions", headers=headers,
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 401
        err = r.json()["error"]
        assert err["code"] == 401 and err["type"] == "AuthenticationError" and err["message"]
    assert httpx.get(server.base_url + "/models").status_code == 401
    with pytest.raises(openai.AuthenticationError) as exc_info:
        openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0).models.list()
    _error(exc_info, 401)
    # Health stays open for probes; metrics name the adapters, so they need the key.
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/metrics", headers=AUTH).status_code == 200


def test_bodies_not_sent_as_json_are_415(server):
    """A page in a browser may send text/plain, form and multipart bodies anywhere without a
    CORS preflight: read as JSON, they let any page use a server without an API key on its
    visitor's machine. JSON media types, or none, are read as before (FastAPI's rule)."""
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        for ctype in ("text/plain", "application/x-www-form-urlencoded",
                      "multipart/form-data; boundary=x", "text/html; charset=utf-8"):
            r = httpx.post(server.url + path, content=body, headers={
                **AUTH, "Content-Type": ctype, "Origin": "http://elsewhere.test"})
            assert r.status_code == 415, (path, ctype, r.text)
            err = r.json()["error"]
            assert err["type"] == "UnsupportedMediaTypeError" and ctype in err["message"], err
    # A second header must not slip a type past the first, in either order.
    for first, second in (("application/json", "text/plain"), ("text/plain", "application/json"),
                          ("application/+json", "application/json")):
        r = httpx.post(server.base_url + "/completions", content=body,
                       headers=[*AUTH.items(), ("Content-Type", first), ("Content-Type", second)])
        assert r.status_code == 415, (first, second, r.text)
    # JSON is UTF-8: a body declared in another charset would be misread, so it is refused.
    for ctype in ("application/json; charset=latin-1", 'application/json; Charset="ISO-8859-1"',
                  "application/json; charset=utf-16"):
        r = httpx.post(server.base_url + "/completions", content=body,
                       headers={**AUTH, "Content-Type": ctype})
        assert r.status_code == 415, (ctype, r.text)
        assert "UTF-8" in r.json()["error"]["message"], r.text
    # A compressed body is refused as such, not parsed as it came ("not valid JSON").
    for encoding in ("gzip", "br", "deflate, gzip"):
        r = httpx.post(server.base_url + "/completions", content=gzip.compress(body.encode()),
                       headers={**AUTH, "Content-Type": "application/json",
                                "Content-Encoding": encoding})
        assert r.status_code == 415 and "Content-Encoding" in r.json()["error"]["message"], \
            (encoding, r.text)
    r = httpx.post(server.base_url + "/completions", content=body,
                   headers={**AUTH, "Content-Encoding": "identity"})
    assert r.status_code == 200, r.text
    for ctype in (None, "application/json", "application/json; charset=utf-8",
                  'application/json; charset="UTF-8"', "Application/JSON",
                  "application/merge-patch+json"):
        headers = AUTH if ctype is None else {**AUTH, "Content-Type": ctype}
        r = httpx.post(server.base_url + "/completions", content=body, headers=headers)
        assert r.status_code == 200, (ctype, r.text)
    assert httpx.head(server.url + "/health").status_code == 200  # load balancers' checks


def test_a_body_that_is_not_json_is_a_400_that_says_so(server):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        for body in (b'{"prompt": ', b"\xff\xfe", b"[1, 2"):
            r = httpx.post(server.url + path, content=body,
                           headers={**AUTH, "Content-Type": "application/json"})
            assert r.status_code == 400, (path, body, r.text)
            message = r.json()["error"]["message"]
            assert message.startswith("The request body is not valid JSON: "), message
            assert "Invalid JSON" not in message, message


def test_cors_preflight(server):
    r = httpx.options(server.base_url + "/chat/completions",
                      headers={"Origin": "http://example.test",
                               "Access-Control-Request-Method": "POST",
                               "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] in ("*", "http://example.test")


def test_cors_with_no_allowed_origin_allows_none(server):
    """--allowed-origins '[]' allows no origin (an empty list was read as the default, '*')."""
    with serve_in_thread(server.engine, allowed_origins=[]) as closed:
        r = httpx.options(closed.url + "/v1/chat/completions",
                          headers={"Origin": "http://evil.example",
                                   "Access-Control-Request-Method": "POST"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_server_keeps_serving_after_errors(client):
    for bad in ({"max_tokens": "abc"}, {"max_tokens": -3}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt=PROMPT, extra_body=bad)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


# ---- load: 64 streams, a quarter dropped midway ----

def test_64_streams_dropping_a_quarter_frees_every_block(server):
    engine = server.engine
    aborted_before = engine.metrics.num_finished.get("abort", 0)
    max_tokens = 32

    async def one(i: int, client: openai.AsyncOpenAI):
        drop = i % 4 == 0
        stream = await client.completions.create(
            model=MODEL, prompt=f"Story number {i}: once upon a time", max_tokens=max_tokens,
            temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        chunks, finish, usage = 0, None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                chunks += 1
                finish = c.finish_reason or finish
            if drop and chunks >= 3:
                await stream.close()  # hang up mid-stream
                return "dropped", chunks, None
        return finish, chunks, usage

    async def run():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY,
                                      max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(one(i, client) for i in range(64)))

    results = asyncio.run(run())
    dropped = [r for r in results if r[0] == "dropped"]
    finished = [r for r in results if r[0] != "dropped"]
    assert len(dropped) == 16 and len(finished) == 48
    for finish, chunks, usage in finished:
        assert finish == "length"
        assert usage.completion_tokens == max_tokens
    wait_until_idle(engine)
    # The engine aborted exactly the 16 dropped requests, and every KV block is free again.
    assert engine.metrics.num_finished.get("abort", 0) - aborted_before == 16
    assert_all_blocks_free(engine)
    metrics = httpx.get(server.url + "/metrics", headers=AUTH).text
    assert re.search(r'pagedlm:request_finished_total\{finished_reason="abort",'
                     r'model_name="smollm2-test"\} (\d+)', metrics)


def test_metrics_endpoint(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=False,
                              extra_body={"ignore_eos": True})
    wait_until_idle(server.engine)
    text = httpx.get(server.url + "/metrics", headers=AUTH).text

    def value(name: str) -> float:
        m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
        assert m, name
        return float(m.group(1))

    assert value("pagedlm:num_requests_running") == 0
    assert value("pagedlm:num_requests_waiting") == 0
    assert value("pagedlm:num_requests_swapped") == 0
    assert value("pagedlm:kv_cache_usage_perc") == 0
    assert value("pagedlm:prefix_cache_hit_rate") > 0  # PROMPT was sent many times
    assert value("pagedlm:prompt_tokens_total") > 0
    assert value("pagedlm:generation_tokens_total") >= 4
    assert value("pagedlm:time_to_first_token_seconds_count") > 0
    assert value("pagedlm:inter_token_latency_seconds_count") > 0
    assert value("pagedlm:e2e_request_latency_seconds_count") > 0
    assert 'finished_reason="length"' in text


def test_non_streaming_request_is_aborted_when_the_client_hangs_up(server):
    engine = server.engine
    aborted_before = engine.metrics.num_finished.get("abort", 0)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", json=body, timeout=httpx.Timeout(5, read=1.0),
                   headers={"Authorization": f"Bearer {API_KEY}"})
    wait_until_idle(engine)
    assert engine.metrics.num_finished.get("abort", 0) - aborted_before == 1
    assert_all_blocks_free(engine)


def test_serving_benchmark_against_the_server(server, tmp_path, monkeypatch):
    """benchmarks/serving.py end to end (a small run): every request succeeds and is timed."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"
    monkeypatch.syspath_prepend(str(path.parent))  # as for a script: its folder holds `lib`
    spec = importlib.util.spec_from_file_location("serving_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    plot, out = tmp_path / "latency.png", tmp_path / "result.json"
    summary = bench.main(["--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "6",
                          "--request-rate", "20", "--input-len", "16", "--output-len", "5",
                          "--save-plot", str(plot), "--output-json", str(out)])
    assert summary["successful_requests"] == 6 and summary["failed_requests"] == 0
    assert summary["total_output_tokens"] == 30 and summary["total_input_tokens"] >= 6 * 16
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = summary[key]
        assert 0 < stats["median"] <= stats["p99"], (key, stats)
    assert summary["ttft_ms"]["p99"] <= summary["e2el_ms"]["p99"]
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert len(json.loads(out.read_text())["requests"]) == 6


def test_best_of_and_beam_search(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=6, n=2, best_of=4, temperature=1.0,
                  seed=21, extra_body={"ignore_eos": True})
    r = client.completions.create(**kwargs)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 12  # the two returned, not the four sampled
    texts, finish, usage, _ = _stream_completion(client, stream_options={"include_usage": True},
                                                 **kwargs)
    assert texts == {c.index: c.text for c in r.choices} and usage.completion_tokens == 12
    beams = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=2, best_of=3,
                                      temperature=0, logprobs=0,
                                      extra_body={"use_beam_search": True, "ignore_eos": True})
    assert len(beams.choices) == 2 and beams.choices[0].text != beams.choices[1].text
    assert all(len(c.logprobs.token_logprobs) == 6 for c in beams.choices)  # they were empty
    score = [sum(c.logprobs.token_logprobs) for c in beams.choices]
    assert score[0] >= score[1]  # best beam first (equal lengths: length_penalty plays no part)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=4, n=1,
        temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"use_beam_search": True, "best_of": 2, "ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content), content
    assert all(t.logprob <= 0 and t.logprob >= t.top_logprobs[-1].logprob for t in content)
    with pytest.raises(openai.BadRequestError) as exc_info:
        client.completions.create(model=MODEL, prompt=PROMPT, n=3, best_of=2)
    _error(exc_info, 400, "best_of")
    # `priority` reaches the engine, which refuses it under first-come-first-served.
    with pytest.raises(openai.BadRequestError) as exc_info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                  extra_body={"priority": 1})
    assert "scheduling_policy" in _error(exc_info, 400, "priority")["message"]
