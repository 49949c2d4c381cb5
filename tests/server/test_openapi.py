"""The server's OpenAPI document (/openapi.json, /docs): request bodies, responses and error
statuses from the pydantic models; and a short schemathesis fuzz against it (the long one is
scripts/fuzz_openapi.py).

One server on a tiny random model, with an API key and runtime LoRA updating, so every route
and every status the document promises can occur.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import pytest

from pagedlm import EngineArgs
from pagedlm.engine.async_llm_engine import AsyncLLMEngine
from tests.conftest import make_tiny_model
from tests.server_utils import assert_all_blocks_free, serve_in_thread, wait_until_idle

API_KEY = "sk-openapi-test"
ROOT = Path(__file__).resolve().parents[2]
BODIES = {  # POST route -> the request models its body may be
    "/v1/completions": ["CompletionRequest"],
    "/v1/chat/completions": ["ChatCompletionRequest"],
    "/v1/embeddings": ["EmbeddingRequest"],
    "/tokenize": ["TokenizeCompletionRequest", "TokenizeChatRequest"],
    "/detokenize": ["DetokenizeRequest"],
    "/v1/load_lora_adapter": ["LoadLoRAAdapterRequest"],
    "/v1/unload_lora_adapter": ["UnloadLoRAAdapterRequest"],
}
GETS = ["/health", "/version", "/metrics", "/v1/models", "/engine/events"]
WITH_MODEL = {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize",
              "/detokenize", "/v1/unload_lora_adapter"}
ERROR_REF = "#/components/schemas/ErrorResponse"


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    model = make_tiny_model(tmp_path_factory.mktemp("openapi"), "llama", default_model_dir)
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=model, max_model_len=256, max_num_seqs=4), log_stats=False)
    try:
        with serve_in_thread(engine, served_model_names=["tiny"], api_key=API_KEY,
                             enable_runtime_lora_updating=True) as running:
            yield running
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def doc(server) -> dict:
    r = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200
    return r.json()


def resolve(doc: dict, ref: str) -> dict:
    assert ref.startswith("#/"), ref
    node = doc
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def refs(node) -> list[str]:
    if isinstance(node, dict):
        return ([node["$ref"]] if "$ref" in node else []) + [r for v in node.values()
                                                              for r in refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in refs(v)]
    return []


def test_every_route_is_documented_and_every_ref_resolves(doc):
    ops = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    assert ops == ({("POST", p) for p in BODIES} | {("GET", p) for p in GETS}
                   | {("HEAD", "/health")})
    for ref in refs(doc):
        resolve(doc, ref)  # KeyError if the document points at a missing schema


def test_every_post_has_its_request_body(doc):
    for path, names in BODIES.items():
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        schema = body["content"]["application/json"]["schema"]
        got = [r.rsplit("/", 1)[1] for r in refs(schema)]
        assert got == names, path
        for name in names:
            assert doc["components"]["schemas"][name]["properties"], name
    schemas = doc["components"]["schemas"]
    # The pydantic models' fields and constraints, nested models included.
    assert {"prompt", "max_tokens", "n", "stream"} <= set(schemas["CompletionRequest"]
                                                          ["properties"])
    assert "prompt" in schemas["CompletionRequest"]["required"]
    chat = schemas["ChatCompletionRequest"]
    assert chat["properties"]["messages"]["minItems"] == 1
    assert refs(chat["properties"]["messages"]) == ["#/components/schemas/ChatMessage"]
    emb = schemas["EmbeddingRequest"]["properties"]
    assert set(emb["encoding_format"]["enum"]) == {"float", "base64"}
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["type"] == "integer"


def test_responses_and_error_statuses(doc):
    schemas = doc["components"]["schemas"]
    info = resolve(doc, refs(schemas["ErrorResponse"]["properties"]["error"])[0])
    assert set(info["required"]) == {"message", "type", "code"}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            statuses = set(op["responses"])
            # /health: 503 once the engine failed (vLLM's status), as the route declares.
            want = {"200", "503"} if path == "/health" else {"200", "500"}
            if method == "post":
                # 408: a body that stopped arriving (--request-read-timeout); 413: one over
                # --max-request-body-bytes; 415: one not sent as JSON
                want.update({"400", "408", "413", "415"})
            if path != "/health":
                want.add("401")  # with an API key, every route but the probe
            if path == "/engine/events":
                want.add("503")  # the most view streams served at once are open
            if path in WITH_MODEL:
                want.add("404")
            assert statuses == want, (method, path)
            assert "422" not in statuses  # bad bodies are OpenAI's 400, not FastAPI's 422
            for status in want - {"200"}:
                content = op["responses"][status]["content"]
                assert list(content) == ["application/json"], (path, status)
                assert content["application/json"]["schema"] == {"$ref": ERROR_REF}
    ok = {p: doc["paths"][p]["post"]["responses"]["200"]["content"] for p in BODIES}
    for path, model in [("/v1/completions", "CompletionResponse"),
                        ("/v1/chat/completions", "ChatCompletionResponse"),
                        ("/v1/embeddings", "EmbeddingResponse"),
                        ("/tokenize", "TokenizeResponse"),
                        ("/detokenize", "DetokenizeResponse")]:
        assert ok[path]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "text/event-stream" in ok[path]  # stream=true
    models = doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]
    assert models["application/json"]["schema"] == {"$ref": "#/components/schemas/ModelList"}


def test_docs_page_and_errors_keep_openai_shape(server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.get(server.url + "/docs", headers=auth)
    assert r.status_code == 200 and "swagger" in r.text.lower()
    # Not an object; not UTF-8 at all (the fuzzer's negative mode found that one a 500).
    for content in (b"[1]", b"\xa6M\xfay"):
        for path in BODIES:
            r = httpx.post(server.url + path, content=content, headers=auth)
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]


def _load_fuzz_script():
    spec = importlib.util.spec_from_file_location("fuzz_openapi",
                                                  ROOT / "scripts" / "fuzz_openapi.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _numeric_leaves(schema: dict, defs: dict, path: str) -> list[tuple[str, dict]]:
    """(path, schema) of every integer or number a body can hold, nested ones included."""
    while "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[1]]
    found = [(path, schema)] if schema.get("type") in ("integer", "number") else []
    for alt in schema.get("anyOf", []):
        found += _numeric_leaves(alt, defs, path)
    if isinstance(schema.get("items"), dict):
        found += _numeric_leaves(schema["items"], defs, path + "[]")
    if isinstance(schema.get("additionalProperties"), dict):
        found += _numeric_leaves(schema["additionalProperties"], defs, path + "{}")
    for name, sub in schema.get("properties", {}).items():
        found += _numeric_leaves(sub, defs, f"{path}.{name}")
    return found


def test_every_number_of_a_request_body_shows_its_range(doc):
    """Issue 29: a seed of 2**70 reached torch and killed the engine. Every integer a body can
    carry has both bounds in the document, and every float at least its lower one (NaN and
    infinities are refused too, which JSON Schema cannot say)."""
    schemas = doc["components"]["schemas"]
    leaves = [leaf for names in BODIES.values() for name in names
              for leaf in _numeric_leaves(schemas[name], schemas, name)]
    assert len(leaves) > 40
    for path, leaf in leaves:
        assert "minimum" in leaf or "exclusiveMinimum" in leaf, path
        if leaf["type"] == "integer":
            assert "maximum" in leaf, path
    completion = schemas["CompletionRequest"]["properties"]
    seed = next(s for s in completion["seed"]["anyOf"] if s["type"] == "integer")
    assert (seed["minimum"], seed["maximum"]) == (-2**63, 2**63 - 1)  # vLLM's, torch's int64
    tokens = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert tokens["minimum"] == 0 and tokens["maximum"] == 2**31 - 1


def test_schemathesis_fuzz(server):
    """Every operation, generated from the document: no 5xx, no undocumented status or content
    type, every response body valid against its schema, no request slower than the deadline;
    the engine is idle and every KV block free afterwards. Positive data reaches the ends of
    every documented range; negative data breaks one constraint at a time (a number past its
    bound, a wrong type, a missing field), on the routes with a body. (scripts/fuzz_openapi.py
    runs 100+ examples per operation.)"""
    fuzz = _load_fuzz_script()
    auth = {"Authorization": f"Bearer {API_KEY}"}
    reports = fuzz.fuzz_server(server.url, max_examples=10, max_tokens=2, modes=["positive"],
                               headers=auth, verbose=False, deadline_s=30)
    assert {r.label.split(" [")[0] for r in reports} == (
        {f"POST {p}" for p in BODIES} | {f"GET {p}" for p in GETS} | {"HEAD /health"})
    negative = fuzz.fuzz_server(server.url, max_examples=40, max_tokens=2, modes=["negative"],
                                only=set(BODIES), headers=auth, verbose=False, deadline_s=30)
    assert {r.label for r in negative} == {f"POST {p} [negative]" for p in BODIES}
    failures = [f"{r.label}: {f}" for r in reports + negative for f in r.failures]
    assert not failures, "\n".join(failures[:10])
    statuses = {s for r in reports for s in r.statuses}
    assert 200 in statuses and 400 in statuses
    # Every negative request was refused as the client's fault.
    assert all(400 <= s < 500 for r in negative for s in r.statuses), \
        [(r.label, r.statuses) for r in negative]
    assert all(r.sent >= 20 for r in negative), [(r.label, r.sent) for r in negative]
    assert server.engine.is_running
    wait_until_idle(server.engine)
    assert_all_blocks_free(server.engine)
