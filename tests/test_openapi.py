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
ROOT = Path(__file__).resolve().parent.parent
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
    assert ops == {("POST", p) for p in BODIES} | {("GET", p) for p in GETS}
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
            want = {"200", "500"}
            if method == "post":
                want.update({"400", "413"})  # 413: a body over --max-request-body-bytes
            if path != "/health":
                want.add("401")  # with an API key, every route but the probe
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


def test_schemathesis_fuzz(server):
    """Every operation, generated from the document: no 5xx, no undocumented status or content
    type, every response body valid against its schema; the engine is idle and every KV block
    free afterwards. (scripts/fuzz_openapi.py runs 100+ examples per operation.)"""
    fuzz = _load_fuzz_script()
    reports = fuzz.fuzz_server(server.url, max_examples=8, max_tokens=2, modes=["positive"],
                               headers={"Authorization": f"Bearer {API_KEY}"}, verbose=False)
    assert {r.label.split(" [")[0] for r in reports} == (
        {f"POST {p}" for p in BODIES} | {f"GET {p}" for p in GETS})
    failures = [f"{r.label}: {f}" for r in reports for f in r.failures]
    assert not failures, "\n".join(failures[:10])
    statuses = {s for r in reports for s in r.statuses}
    assert 200 in statuses and 400 in statuses
    wait_until_idle(server.engine)
    assert_all_blocks_free(server.engine)
