"""LoRA over the OpenAI server (a real socket, the `openai` client) and the CLI's --lora, on a
tiny random Llama, against the offline LLM's outputs with the same adapters."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import threading
import time

import httpx
import openai
import pytest

from pagedlm import LLM, EngineArgs, LoRARequest, SamplingParams
from pagedlm.engine.async_llm_engine import AsyncLLMEngine
from pagedlm.entrypoints.openai.serving_models import MAX_LORA_NAME, parse_lora_module
from tests.conftest import make_tiny_model
from tests.server_utils import assert_all_blocks_free, serve_in_thread, wait_until_idle
from tests.server.test_cli import REPO, _env, cli
from tests.engine.test_lora import ALL_PROJ, make_adapter

BASE = "tiny-base"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
MAX_TOKENS = 16
ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, num_gpu_blocks_override=128,
              max_model_len=256)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("lora_server")
    base = make_tiny_model(root, "llama", default_model_dir)
    paths = {"a1": make_adapter(base, str(root / "a1"), ALL_PROJ, seed=1),
             "a2": make_adapter(base, str(root / "a2"), ["q_proj", "v_proj", "down_proj"],
                                r=4, seed=2),
             "a3": make_adapter(base, str(root / "a3"), ["o_proj", "up_proj"], seed=3),
             "r16": make_adapter(base, str(root / "r16"), ["q_proj"], r=16),
             "head": make_adapter(base, str(root / "head"), ["lm_head"])}
    wide = make_tiny_model(root / "wide", "llama", default_model_dir, hidden_size=96)
    paths["wide"] = make_adapter(wide, str(root / "wide_a"), ["q_proj"])
    return base, paths


@pytest.fixture(scope="module")
def offline(setup):
    """Greedy completions of PROMPTS per adapter (None: the base model), offline."""
    base, paths = setup
    llm = LLM(base, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {}
    for i, name in enumerate([None, "a1", "a2", "a3"]):
        lora = LoRARequest(name, i, paths[name]) if name else None
        out[name] = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False,
                                                               lora_request=lora)]
    llm.shutdown()
    return out


@pytest.fixture(scope="module")
def server(setup):
    base, paths = setup
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(base, **ENGINE), log_stats=False,
                                             model_name=BASE)
    modules = [parse_lora_module(f"a1={paths['a1']}"),
               parse_lora_module(f'{{"name": "a2", "path": "{paths["a2"]}", '
                                 f'"base_model_name": "{BASE}"}}')]
    try:
        with serve_in_thread(engine, served_model_names=[BASE], lora_modules=modules,
                             enable_runtime_lora_updating=True) as running:
            yield running
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def complete(client, model: str) -> list[str]:
    r = client.completions.create(model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                  temperature=0, extra_body={"ignore_eos": True})
    return [c.text for c in sorted(r.choices, key=lambda c: c.index)]


def _error(exc_info, status: int, param: str | None = None) -> dict:
    e = exc_info.value
    assert e.status_code == status
    body = e.body
    assert body["code"] == status and body["message"]
    if param is not None:
        assert body["param"] == param, body
    return body


# A completion and a chat completion, each of one prompt.
BOTH_ROUTES = pytest.mark.parametrize("route,body", [
    ("/completions", {"prompt": PROMPTS[0]}),
    ("/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[0]}]}),
])


def assert_unloaded_error(server, err: dict) -> None:
    """The 404 naming the model of a request whose adapter was unloaded; then nothing left."""
    assert err["code"] == 404 and err["param"] == "model", err
    assert "unloaded while this request ran" in err["message"]
    wait_until_idle(server.engine)
    assert_all_blocks_free(server.engine)


def test_models_lists_adapters_with_parent(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {BASE, "a1", "a2"}
    assert cards["a1"].parent == cards["a2"].parent == BASE
    assert getattr(cards[BASE], "parent", None) is None


def test_adapters_match_offline(client, offline):
    assert complete(client, BASE) == offline[None]
    assert complete(client, "a1") == offline["a1"]
    assert complete(client, "a2") == offline["a2"]
    assert offline["a1"] != offline[None] != offline["a2"]


def test_concurrent_requests_of_several_adapters(server, offline):
    import asyncio

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0)

        async def one(model, prompt):
            r = await aclient.completions.create(model=model, prompt=prompt, temperature=0,
                                                 max_tokens=MAX_TOKENS,
                                                 extra_body={"ignore_eos": True})
            return r.choices[0].text
        jobs = [(m, i) for m in (BASE, "a1", "a2") for i in range(len(PROMPTS))]
        texts = await asyncio.gather(*(one(m, PROMPTS[i]) for m, i in jobs))
        return dict(zip(jobs, texts))

    got = asyncio.run(run())
    for (model, i), text in got.items():
        assert text == offline[None if model == BASE else model][i]


def test_running_adapters_in_metrics(server, client):
    stream = client.completions.create(model="a1", prompt=PROMPTS[0], max_tokens=200,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # a1 is running now
    text = httpx.get(server.url + "/metrics").text
    stream.close()
    assert 'pagedlm:lora_requests_info{max_lora="2",running_lora_adapters="a1"}' in text
    assert f'pagedlm:num_running_lora_adapters{{model_name="{BASE}"}} 1.0' in text
    wait_until_idle(server.engine)


def test_load_and_unload_at_runtime(server, client, setup, offline):
    _, paths = setup
    r = httpx.post(server.url + "/v1/load_lora_adapter",
                   json={"lora_name": "a3", "lora_path": paths["a3"]})
    assert r.status_code == 200, r.text
    assert "a3" in {m.id for m in client.models.list().data}
    assert complete(client, "a3") == offline["a3"]
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a3"})
    assert r.status_code == 200, r.text
    assert "a3" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError) as exc_info:
        complete(client, "a3")
    _error(exc_info, 404, "model")
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a3"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
    assert server.engine.engine.lora_stats().cached_ids.count(3) == 0


def test_unloading_an_adapter_in_use_answers_its_requests(server, client, setup):
    """Unloading aborts the adapter's running requests; a waiting non-streaming one got a 500
    (its stream ended without a final output). It is a 404 naming the model now."""
    _, paths = setup
    r = httpx.post(server.url + "/v1/load_lora_adapter",
                   json={"lora_name": "gone", "lora_path": paths["a3"]})
    assert r.status_code == 200, r.text
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, server.base_url + "/completions", timeout=120, json={
            "model": "gone", "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True})
        deadline = time.monotonic() + 60
        while server.engine.metrics.snapshot.num_running == 0:
            assert time.monotonic() < deadline and not pending.done(), "it never ran"
            time.sleep(0.01)
        r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "gone"})
        assert r.status_code == 200, r.text
        answer = pending.result()
    assert answer.status_code == 404, answer.text
    assert_unloaded_error(server, answer.json()["error"])


@BOTH_ROUTES
def test_unloading_an_adapter_in_use_ends_its_streams_with_an_error(server, setup, route, body):
    """A stream whose adapter was unloaded ended with [DONE] alone, as if its answer were
    complete; its last event before [DONE] is now the 404 naming the model."""
    _, paths = setup
    name = "gone-" + route.strip("/").replace("/", "-")
    r = httpx.post(server.url + "/v1/load_lora_adapter",
                   json={"lora_name": name, "lora_path": paths["a3"]})
    assert r.status_code == 200, r.text
    events = []
    body = {**body, "model": name, "max_tokens": 200, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.base_url + route, json=body, timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if len(events) == 3:  # it runs: unload its adapter
                r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": name})
                assert r.status_code == 200, r.text
    assert events[-1] == "[DONE]"
    # No usage chunk: the answer is not whole.
    assert all(json.loads(e).get("usage") is None for e in events[:-2])
    assert_unloaded_error(server, json.loads(events[-2])["error"])


@BOTH_ROUTES
def test_unloading_an_adapter_ends_its_beam_searches(server, setup, route, body):
    """A beam search adds each step's requests afresh, and the engine loaded the unloaded
    adapter again from its path: the search ran on with it and answered 200. It ends at the
    next step now, as a 404 naming the model."""
    _, paths = setup
    name = "beam-" + route.strip("/").replace("/", "-")
    r = httpx.post(server.url + "/v1/load_lora_adapter",
                   json={"lora_name": name, "lora_path": paths["a3"]})
    assert r.status_code == 200, r.text
    body = {**body, "model": name, "max_tokens": 120, "ignore_eos": True,
            "use_beam_search": True, "n": 2, "temperature": 0}
    generated = server.engine.metrics.snapshot.generation_tokens
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, server.base_url + route, json=body, timeout=120)
        deadline = time.monotonic() + 60
        # A few steps in (each adds its one-token requests afresh, briefly running).
        while server.engine.metrics.snapshot.generation_tokens < generated + 8:
            assert time.monotonic() < deadline and not pending.done(), "it never ran"
            time.sleep(0.005)
        r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": name})
        assert r.status_code == 200, r.text
        answer = pending.result()
    assert answer.status_code == 404, answer.text[:300]
    assert_unloaded_error(server, answer.json()["error"])


@pytest.mark.parametrize("unload_at", ["check", "prepare"])
def test_an_adapter_unloaded_before_its_request_reaches_the_engine(server, setup, monkeypatch,
                                                                   unload_at):
    """Unloaded after the request's model was checked ("check": before the adapter was
    looked up) the request ran on the base model under the adapter's name; unloaded while
    the request was prepared ("prepare": bad_words tokenized), the engine loaded the adapter
    again from its path, answered with it, and kept it for good (no name left to unload it
    by). Both are the 404 naming the model now, and the engine holds no such adapter."""
    from pagedlm.entrypoints.openai.serving_engine import OpenAIServing
    from pagedlm.engine.request_prep import RequestPreparer
    _, paths = setup
    name = f"brief-{unload_at}"
    r = httpx.post(server.url + "/v1/load_lora_adapter",
                   json={"lora_name": name, "lora_path": paths["a3"]})
    assert r.status_code == 200, r.text
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        assert release.wait(60)

    if unload_at == "check":
        submit = OpenAIServing.submit

        async def hold_then_submit(self, *args, **kwargs):
            if name in (*args, kwargs.get("model")):
                await asyncio.to_thread(hold)
            return await submit(self, *args, **kwargs)
        monkeypatch.setattr(OpenAIServing, "submit", hold_then_submit)
    else:
        prepare = RequestPreparer.prepare

        async def prepare_then_hold(self, params):
            if getattr(params, "bad_words", None) == ["hold"]:
                await asyncio.to_thread(hold)
            return await prepare(self, params)
        monkeypatch.setattr(RequestPreparer, "prepare", prepare_then_hold)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, server.base_url + "/completions", timeout=120, json={
            "model": name, "prompt": PROMPTS[0], "max_tokens": 4, "bad_words": ["hold"]})
        assert held.wait(60)
        r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": name})
        assert r.status_code == 200, r.text
        release.set()
        answer = pending.result()
    assert answer.status_code == 404, answer.text
    err = answer.json()["error"]
    assert err["param"] == "model" and name in err["message"], err
    assert name not in {lora.lora_name for lora in server.engine.engine.list_loras()}
    wait_until_idle(server.engine)
    assert_all_blocks_free(server.engine)


def test_an_overlong_adapter_name_is_refused(server, client, setup):
    before = sorted(m.id for m in client.models.list().data)
    r = httpx.post(server.url + "/v1/load_lora_adapter",
                   json={"lora_name": "x" * (MAX_LORA_NAME + 1), "lora_path": setup[1]["a3"]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "lora_name" and str(MAX_LORA_NAME) in err["message"], err
    assert sorted(m.id for m in client.models.list().data) == before
    r = httpx.post(server.url + "/v1/load_lora_adapter",
                   json={"lora_name": "y" * MAX_LORA_NAME, "lora_path": setup[1]["a3"]})
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "y" * MAX_LORA_NAME})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body,param,words", [
    ({"lora_name": "x"}, "lora_path", "lora_path"),
    ({"lora_path": "/tmp"}, "lora_name", "lora_name"),
    ({"lora_name": "x", "lora_path": "/nonexistent/adapter"}, "lora_path", "not a directory"),
    ({"lora_name": "x", "lora_path": "r16"}, "lora_path", "max_lora_rank"),
    ({"lora_name": "x", "lora_path": "head"}, "lora_path", "lm_head"),
    ({"lora_name": "x", "lora_path": "wide"}, "lora_path", "shape"),
    ({"lora_name": "a1", "lora_path": "a3"}, "lora_name", "already in use"),
    # /metrics lists adapter names joined by commas; a newline breaks logs
    ({"lora_name": "a,b", "lora_path": "a3"}, "lora_name", "comma or a control character"),
    ({"lora_name": "a\nb", "lora_path": "a3"}, "lora_name", "comma or a control character"),
    ({"lora_name": "x", "lora_path": "a3", "base_model_name": "other"}, "base_model_name",
     "base_model_name"),
])
def test_bad_load_requests_are_400(server, client, setup, body, param, words):
    _, paths = setup
    body = {k: paths.get(v, v) if k == "lora_path" else v for k, v in body.items()}
    before = sorted(m.id for m in client.models.list().data)
    cached = server.engine.engine.lora_stats().cached_ids
    r = httpx.post(server.url + "/v1/load_lora_adapter", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert sorted(m.id for m in client.models.list().data) == before
    assert server.engine.engine.lora_stats().cached_ids == cached


def test_runtime_updating_needs_the_flag(server, setup):
    with serve_in_thread(server.engine, served_model_names=[BASE],
                         enable_runtime_lora_updating=False) as other:
        r = httpx.post(other.url + "/v1/load_lora_adapter",
                       json={"lora_name": "x", "lora_path": setup[1]["a3"]})
        assert r.status_code == 404


def test_cli_generate_with_lora(setup, offline):
    base, paths = setup
    out = subprocess.run(cli("generate", base, "--prompt", PROMPTS[0], "--max-tokens", "8",
                             "--temperature", "0", "--lora", paths["a1"],
                             "--num-gpu-blocks-override", "32"),
                         capture_output=True, text=True, cwd=REPO, env=_env(), timeout=300)
    assert out.returncode == 0, out.stderr
    llm_text = offline["a1"][0]
    # Greedy: the first 8 tokens of the offline 16 (unless an EOS came first, which the CLI
    # stops at).
    assert llm_text.startswith(out.stdout.rstrip("\n"))
    assert out.stdout.strip()
    bad = subprocess.run(cli("generate", base, "--prompt", "hi", "--max-tokens", "2",
                             "--lora", paths["head"], "--num-gpu-blocks-override", "32"),
                         capture_output=True, text=True, cwd=REPO, env=_env(), timeout=300)
    assert bad.returncode != 0 and "lm_head" in bad.stderr and "Traceback" not in bad.stderr


def test_lora_modules_flag_names_are_checked():
    import argparse
    assert parse_lora_module("sql=/p").name == "sql"
    for bad in ("a,b=/p", '{"name": "a\\u0000b", "path": "/p"}', "=/p", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)
