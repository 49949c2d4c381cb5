"""Every number a request can carry, at the extremes of its type: a 200 or a 400 naming the
field, never a 5xx; and afterwards the server still serves, /health is 200 and every KV block
is free (issue 29: a seed of 2**70 answered 500 and killed the engine for good).

The fields are read from the request models' JSON schemas, so a numeric field added later is
driven too, nested ones included. JSON has no NaN or Infinity, but Python's json and pydantic's
parser read the raw tokens (and 1e309 as infinity): they are sent as raw text.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import pytest

from pagedlm import EngineArgs
from pagedlm.engine.async_llm_engine import AsyncLLMEngine
from pagedlm.entrypoints.openai.protocol_chat import ChatCompletionRequest
from pagedlm.entrypoints.openai.protocol_completion import CompletionRequest
from pagedlm.entrypoints.openai.protocol_embedding import EmbeddingRequest
from pagedlm.entrypoints.openai.protocol_tokenization import (DetokenizeRequest,
                                                              TokenizeChatRequest,
                                                              TokenizeCompletionRequest)
from tests.conftest import make_tiny_model
from tests.server_utils import assert_all_blocks_free, serve_in_thread, wait_until_idle

MAX_MODEL_LEN = 128
MAX_LOGPROBS = 5  # below the default, so the engine setting is what a request meets
MESSAGES = [{"role": "user", "content": "Hi"}]
# route -> (its request model, a valid body with every required field; max_tokens 1 keeps the
# 200s quick)
ROUTES: dict[str, tuple[type, dict]] = {
    "/v1/completions": (CompletionRequest, {"prompt": "Hello", "max_tokens": 1}),
    "/v1/chat/completions": (ChatCompletionRequest, {"messages": MESSAGES, "max_tokens": 1}),
    "/v1/embeddings": (EmbeddingRequest, {"input": "Hello"}),
    "/tokenize": (TokenizeCompletionRequest, {"prompt": "Hello"}),
    "/detokenize": (DetokenizeRequest, {"tokens": [1, 2]}),
}
# /tokenize with `messages` is the chat form: its own route entry would shadow the other.
CHAT_TOKENIZE = (TokenizeChatRequest, {"messages": MESSAGES})
# Fields that only matter together with another: set with it.
COMPANIONS = {"top_logprobs": {"logprobs": True},
              "length_penalty": {"use_beam_search": True, "temperature": 0, "n": 2}}
# Raw JSON number tokens: type edges (each side of int32 and int64), non-numbers, overflow.
EXTREMES = ["0", "-1", "1", "0.5", "2147483647", "2147483648", "9223372036854775807",
            "9223372036854775808", "-9223372036854775808", "-9223372036854775809",
            "18446744073709551616", "1180591620717411303424", "NaN", "Infinity", "-Infinity",
            "1e309", "-1e309", "1e308"]
_HOLE = "__value__"  # replaced by the raw token in the serialized body


@dataclass
class Slot:
    """Where a number goes: the top-level field, and its value with the number inside."""
    path: str  # for messages, e.g. logit_bias{} or prompt[][]
    field: str
    wrap: Callable[[Any], Any]


def _resolve(schema: dict, defs: dict) -> dict:
    while "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def minimal(schema: dict, defs: dict) -> Any:
    """A small valid instance of a schema: what surrounds a nested number."""
    schema = _resolve(schema, defs)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    if "anyOf" in schema:
        return minimal(next(s for s in schema["anyOf"] if s.get("type") != "null"), defs)
    kind = schema.get("type")
    if kind == "object":
        return {k: minimal(schema["properties"][k], defs) for k in schema.get("required", [])}
    if kind == "array":
        return [minimal(schema["items"], defs)] if schema.get("minItems") else []
    return {"string": "x", "integer": 1, "number": 1.0, "boolean": False}.get(kind)


def numeric_slots(schema: dict, defs: dict, path: str) -> list[Callable[[Any], Any]]:
    """Every place in `schema` a number can go, as functions number -> value of `schema`."""
    schema = _resolve(schema, defs)
    kind = schema.get("type")
    found: list[tuple[str, Callable]] = []
    if kind in ("integer", "number"):
        found.append((path, lambda v: v))
    for alt in schema.get("anyOf", []):
        found += numeric_slots(alt, defs, path)
    if kind == "array" and "items" in schema:
        found += [(p, lambda v, w=w: [w(v)]) for p, w in
                  numeric_slots(schema["items"], defs, path + "[]")]
    if kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):  # a map, e.g. logit_bias: token id -> bias
            found += [(p, lambda v, w=w: {"5": w(v)}) for p, w in
                      numeric_slots(extra, defs, path + "{}")]
        base = minimal(schema, defs)
        for name, sub in schema.get("properties", {}).items():
            found += [(p, lambda v, w=w, name=name: {**base, name: w(v)}) for p, w in
                      numeric_slots(sub, defs, f"{path}.{name}")]
    # Union alternatives of the same shape (int | None) give the same path once.
    return list({p: (p, w) for p, w in found}.values())


def model_slots(model: type) -> list[Slot]:
    schema = model.model_json_schema(mode="validation")
    defs = schema.get("$defs", {})
    return [Slot(p, name, w) for name, prop in schema["properties"].items()
            for p, w in numeric_slots(prop, defs, name)]


def raw_body(base: dict, field: str, value: Any, token: str) -> bytes:
    body = {**base, **COMPANIONS.get(field, {}), field: value}
    text = json.dumps(body)
    assert text.count(json.dumps(_HOLE)) == 1
    return text.replace(json.dumps(_HOLE), token).encode()


def _tiny_engine(root, default_model_dir, **kwargs) -> AsyncLLMEngine:
    model = make_tiny_model(root, "llama", default_model_dir)
    return AsyncLLMEngine.from_engine_args(
        EngineArgs(model=model, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                   num_gpu_blocks_override=64, **kwargs), log_stats=False)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, default_model_dir):
    """A generating server, and a pooling one for /v1/embeddings."""
    root = tmp_path_factory.mktemp("limits")
    engine = _tiny_engine(root / "gen", default_model_dir, max_logprobs=MAX_LOGPROBS)
    pooling = _tiny_engine(root / "pool", default_model_dir, runner="pooling")
    try:
        with serve_in_thread(engine) as gen, serve_in_thread(pooling) as emb:
            yield gen, emb
    finally:
        engine.shutdown()
        pooling.shutdown()


def test_every_request_model_has_its_numbers_found():
    """The walk over the schemas finds the numbers (else the sweep below proves nothing)."""
    paths = {s.path for s in model_slots(CompletionRequest)}
    assert {"n", "seed", "temperature", "top_k", "max_tokens", "logprobs", "priority",
            "logit_bias{}", "stop_token_ids[]", "prompt[]", "prompt[][]"} <= paths
    chat = {s.path for s in model_slots(ChatCompletionRequest)}
    assert {"top_logprobs", "max_completion_tokens", "length_penalty"} <= chat
    assert {s.path for s in model_slots(EmbeddingRequest)} >= {"dimensions", "priority",
                                                                "input[]", "input[][]"}
    assert {s.path for s in model_slots(DetokenizeRequest)} == {"tokens[]"}


def _check_response(r: httpx.Response, label: str, field: str) -> None:
    assert r.status_code in (200, 400), f"{label}: {r.status_code} {r.text[:300]}"
    if r.status_code == 400:
        err = r.json()["error"]
        assert err["code"] == 400 and err["type"] == "BadRequestError", label
        # The field itself, or a place inside it (prompt.0, logit_bias.5, input[0]).
        param = err["param"] or ""
        assert param.split(".")[0].split("[")[0] == field, f"{label}: {err}"


def test_every_numeric_field_at_its_extremes_is_200_or_400(servers):
    gen, emb = servers
    routes = [(path, model, base) for path, (model, base) in ROUTES.items()]
    routes.append(("/tokenize", *CHAT_TOKENIZE))
    cases = [(route, (emb if route == "/v1/embeddings" else gen).url + route, slot, token,
              raw_body(base, slot.field, slot.wrap(_HOLE), token))
             for route, model, base in routes for slot in model_slots(model)
             for token in EXTREMES]
    # A few at a time: requests with odd values share engine steps with others.
    with httpx.Client(timeout=60, headers={"Content-Type": "application/json"}) as client, \
            ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda c: client.post(c[1], content=c[4]), cases))
    statuses: dict[str, set[int]] = {}
    for (route, _, slot, token, _), r in zip(cases, responses):
        _check_response(r, f"{route} {slot.path}={token}", slot.field)
        statuses.setdefault(f"{route} {slot.path}", set()).add(r.status_code)
    # Both outcomes occur: the sweep reached the engine, and the bounds refused something.
    for key in ("/v1/completions seed", "/v1/chat/completions n", "/v1/embeddings priority",
                "/v1/completions logprobs", "/v1/chat/completions top_logprobs"):
        assert statuses[key] == {200, 400}, (key, statuses[key])
    assert all(400 in s for s in statuses.values()), statuses
    for server in (gen, emb):
        assert httpx.get(server.url + "/health").status_code == 200
        wait_until_idle(server.engine)
        assert_all_blocks_free(server.engine)


@pytest.mark.parametrize("route,body,param", [
    # The request: it killed the engine inside manual_seed.
    ("/v1/completions", {"prompt": "Hi", "seed": 1180591620717411303424}, "seed"),
    ("/v1/completions", {"prompt": "Hi", "n": 2**40}, "n"),
    ("/v1/completions", {"prompt": "Hi", "top_k": 2**63}, "top_k"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": MAX_LOGPROBS + 1},
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": MAX_LOGPROBS + 1},
     "logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True,
                              "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "n": 5}, "n"),  # over max_num_seqs (4)
    ("/v1/completions", {"prompt": "Hi", "best_of": 5}, "best_of"),
    ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "temperature": 0,
                         "n": 2, "length_penalty": 1e300}, "length_penalty"),
    ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "temperature": 0,
                         "n": 2, "allowed_token_ids": [5]}, "allowed_token_ids"),
    # 2 * beams past max_logprobs: the field that set the beams' number
    ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "temperature": 0, "n": 3},
     "n"),
    ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "temperature": 0, "n": 2,
                         "best_of": 3}, "best_of"),
    ("/v1/chat/completions", {"messages": MESSAGES, "use_beam_search": True, "temperature": 0,
                              "n": 2, "logit_bias": {"5": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": [49152]}, "prompt"),  # outside the vocabulary
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [49152]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "allowed_token_ids": [49152]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"49152": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"-1": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"1" * 30: 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"1e5": 1}}, "logit_bias"),
    ("/detokenize", {"tokens": [49152]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_out_of_range_values_name_their_field(servers, route, body, param):
    gen, _ = servers
    r = httpx.post(gen.url + route, json={"max_tokens": 1, **body} if "prompt" in body
                   or "messages" in body else body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].split(".")[0] == param, err
    assert param in err["message"], err


def test_server_still_serves_after_the_sweep(servers):
    gen, _ = servers
    r = httpx.post(gen.url + "/v1/completions", timeout=60,
                   json={"prompt": "Hello", "max_tokens": 3, "seed": 2**63 - 1,
                         "logprobs": MAX_LOGPROBS, "ignore_eos": True})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "length"
    # The top MAX_LOGPROBS, and the sampled token when it is not among them.
    assert MAX_LOGPROBS <= len(choice["logprobs"]["top_logprobs"][0]) <= MAX_LOGPROBS + 1
    assert httpx.get(gen.url + "/health").status_code == 200
    assert gen.engine.is_running
    wait_until_idle(gen.engine)
    assert_all_blocks_free(gen.engine)


def test_max_logprobs_is_a_cli_flag():
    import argparse

    from pagedlm.entrypoints.cli_args import add_engine_args, engine_args_from_namespace
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from_namespace(parser.parse_args([])).max_logprobs == 20
    args = engine_args_from_namespace(parser.parse_args(["--max-logprobs", "7"]))
    assert args.max_logprobs == 7
    assert "--max-logprobs" in parser.format_help()
