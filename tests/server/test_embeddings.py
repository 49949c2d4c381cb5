"""The pooling runner (LLM(runner="pooling"), LLM.embed, /v1/embeddings) and the tokenizer
endpoints (/tokenize, /detokenize).

The reference is transformers: the base model's last_hidden_state (after the final norm), pooled
at the last token or averaged, then L2-normalised. Prompts longer than the step's token budget
are prefilled in chunks, so the pooled vectors also prove that pooling spans every chunk.
"""
from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from pagedlm import LLM, EngineArgs
from pagedlm.entrypoints.cli import make_parser
from pagedlm.entrypoints.cli_args import engine_args_from_namespace
from pagedlm.engine.async_llm_engine import AsyncLLMEngine
from pagedlm.pooling_params import PoolerConfig, PoolingParams
from tests.conftest import make_tiny_model
from tests.server_utils import assert_all_blocks_free, serve_in_thread, wait_until_idle

BUDGET = 32  # max_num_batched_tokens: LONG is prefilled in several chunks
SHORT = "The capital of France is"
LONG = ("Paged attention stores the key and value cache in fixed-size blocks, so memory is "
        "allocated on demand and shared between sequences. ") * 3
MODEL = "smollm2-embed"


def cosine(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def hf_hidden(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states [len(ids), hidden] (after the final norm)."""
    with torch.no_grad():
        return hf_model.model(torch.tensor([ids])).last_hidden_state[0].float()


def reference(hf_model, ids: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    h = hf_hidden(hf_model, ids)
    vec = h[-1] if pooling == "LAST" else h.mean(dim=0)
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


def assert_all_free(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    assert not llm.llm_engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks


# ---- offline, the default model ----

@pytest.fixture(scope="module")
def pool_llm():
    llm = LLM(runner="pooling", max_model_len=512, max_num_batched_tokens=BUDGET,
              max_num_seqs=8)
    yield llm
    llm.shutdown()


def test_last_token_default_model_equals_transformers(pool_llm, hf_default_model):
    outs = pool_llm.embed([SHORT, LONG], use_tqdm=False)
    tok = pool_llm.get_tokenizer()
    assert len(outs[1].prompt_token_ids) > 2 * BUDGET  # chunked over 3+ steps
    for text, out in zip([SHORT, LONG], outs):
        assert out.prompt_token_ids == tok.encode(text)
        vec = torch.tensor(out.outputs.embedding)
        assert vec.shape == (hf_default_model.config.hidden_size,)
        assert abs(vec.norm().item() - 1) < 1e-5  # normalised by default
        ref = reference(hf_default_model, out.prompt_token_ids, "LAST", True)
        assert cosine(vec, ref) >= 0.9999
    raw = pool_llm.embed(LONG, PoolingParams(normalize=False), use_tqdm=False)[0]
    ref = reference(hf_default_model, raw.prompt_token_ids, "LAST", False)
    assert cosine(raw.outputs.embedding, ref) >= 0.9999
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), ref, atol=2e-3, rtol=1e-3)
    assert_all_free(pool_llm)


def test_last_token_with_a_prefix_cache_hit(pool_llm):
    """LAST pooling keeps prefix caching: a repeated prompt reuses its blocks (the last token is
    always computed) and gets the same vector."""
    first = pool_llm.embed(LONG, use_tqdm=False)[0]
    again = pool_llm.embed({"prompt_token_ids": first.prompt_token_ids}, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert cosine(first.outputs.embedding, again.outputs.embedding) >= 0.99999
    assert_all_free(pool_llm)


def test_pooling_engine_refuses_generation_and_bad_params(pool_llm):
    with pytest.raises(ValueError, match="runner='pooling'"):
        pool_llm.generate(SHORT, use_tqdm=False)
    with pytest.raises(ValueError, match="runner='pooling'"):
        pool_llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    with pytest.raises(ValueError, match="^dimensions .*matryoshka"):
        pool_llm.embed(SHORT, PoolingParams(dimensions=64), use_tqdm=False)
    with pytest.raises(ValueError, match="^pooling_params has 1 entries but there are 2"):
        pool_llm.embed([SHORT, SHORT], [PoolingParams()], use_tqdm=False)
    for bad in (dict(dimensions=0), dict(dimensions="8"), dict(normalize="yes")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PoolingParams(**bad)
    assert_all_free(pool_llm)


@pytest.mark.parametrize("kwargs, field", [
    (dict(runner="embed"), "runner"),
    (dict(runner="pooling", pooling_type="CLS"), "pooling_type"),
    (dict(runner="pooling", pooler_config={"pooling_type": "MAX"}), "pooling_type"),
    (dict(runner="pooling", pooler_config={"nope": 1}), "pooler_config"),
    (dict(pooling_type="MEAN"), "pooling_type"),
])
def test_bad_engine_settings(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(**kwargs).create_engine_config()


def test_serve_flags():
    ns = make_parser().parse_args(["serve", "--runner", "pooling", "--pooling-type", "MEAN"])
    config = engine_args_from_namespace(ns).create_engine_config()
    mc = config.model_config
    assert mc.runner == "pooling" and mc.pooler_config == PoolerConfig("MEAN", True)
    assert config.cache_config.enable_prefix_caching is False
    ns = make_parser().parse_args(["serve", "--runner", "pooling", "--pooler-config",
                                   '{"pooling_type": "LAST", "normalize": false}'])
    mc = engine_args_from_namespace(ns).create_engine_config().model_config
    assert mc.pooler_config == PoolerConfig("LAST", False)


# ---- offline, a tiny random model: MEAN and LAST, chunked, matryoshka dimensions ----

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_model_dir):
    # is_matryoshka: lets a request ask for a prefix of the vector (dimensions).
    return make_tiny_model(tmp_path_factory.mktemp("embed"), "llama", default_model_dir,
                           is_matryoshka=True)


@pytest.fixture(scope="module")
def tiny_hf(tiny_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("pooling", ["MEAN", "LAST"])
def test_tiny_model_pooling_chunked_equals_transformers(tiny_dir, tiny_hf, pooling):
    with LLM(tiny_dir, runner="pooling", pooler_config=PoolerConfig(pooling, normalize=False),
             max_num_batched_tokens=16, max_num_seqs=4) as llm:
        # MEAN must see every prompt token: prefix caching (which skips them) is off.
        assert llm.llm_engine.config.cache_config.enable_prefix_caching is (pooling == "LAST")
        prompts = [SHORT, LONG, LONG]  # the repeat: MEAN recomputes it whole
        outs = llm.embed(prompts, use_tqdm=False)
        for out in outs:
            ref = reference(tiny_hf, out.prompt_token_ids, pooling, False)
            assert cosine(out.outputs.embedding, ref) >= 0.9999
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref,
                                       atol=1e-4, rtol=1e-4)
        normed = llm.embed(LONG, PoolingParams(normalize=True), use_tqdm=False)[0]
        ref = reference(tiny_hf, normed.prompt_token_ids, pooling, True)
        assert cosine(normed.outputs.embedding, ref) >= 0.9999
        cut = llm.embed(LONG, PoolingParams(dimensions=16, normalize=True), use_tqdm=False)[0]
        raw = reference(tiny_hf, cut.prompt_token_ids, pooling, False)
        assert len(cut.outputs.embedding) == 16
        assert cosine(cut.outputs.embedding, raw[:16]) >= 0.9999
        with pytest.raises(ValueError, match="dimensions .*hidden size"):
            llm.embed(SHORT, PoolingParams(dimensions=65), use_tqdm=False)
        assert_all_free(llm)


def test_generating_engine_refuses_embed(tiny_dir):
    """Offline, then the same engine behind a server."""
    with LLM(tiny_dir, max_num_seqs=4) as llm:
        with pytest.raises(ValueError, match="runner='pooling'"):
            llm.embed(SHORT, use_tqdm=False)
        with pytest.raises(ValueError, match="runner='pooling'"):
            llm.generate(SHORT, PoolingParams(), use_tqdm=False)
        assert_all_free(llm)
        engine = AsyncLLMEngine(llm.llm_engine, log_stats=False)
        try:
            with serve_in_thread(engine) as running:
                c = openai.OpenAI(base_url=running.base_url, api_key="none", max_retries=0)
                with pytest.raises(openai.BadRequestError, match="--runner pooling"):
                    c.embeddings.create(model=tiny_dir, input="hello")
                r = httpx.post(running.url + "/tokenize", json={"prompt": "hello"}).json()
                assert r["tokens"] == engine.get_tokenizer().encode("hello")
        finally:
            engine.shutdown()


# ---- the server, default model, --runner pooling ----

@pytest.fixture(scope="module")
def server(pool_llm):
    # The offline tests' engine (they ran before: tests run in file order), now behind the
    # server: one model load for the module.
    engine = AsyncLLMEngine(pool_llm.llm_engine, log_stats=False, model_name=MODEL)
    try:
        with serve_in_thread(engine, served_model_names=[MODEL]) as running:
            yield running
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def test_embeddings_endpoint_equals_transformers(server, client, hf_default_model):
    tok = server.engine.get_tokenizer()
    texts = [SHORT, LONG]
    res = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert res.model == MODEL and [d.index for d in res.data] == [0, 1]
    ids = [tok.encode(t) for t in texts]
    assert res.usage.prompt_tokens == res.usage.total_tokens == sum(map(len, ids))
    for d, i in zip(res.data, ids):
        assert cosine(d.embedding, reference(hf_default_model, i, "LAST", True)) >= 0.9999
    # base64: little-endian float32, as OpenAI sends it (the client decodes it when it chose
    # the format itself).
    raw = client.embeddings.create(model=MODEL, input=texts, encoding_format="base64")
    for d, f in zip(raw.data, res.data):
        vec = np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
        np.testing.assert_allclose(vec, f.embedding, rtol=0, atol=1e-6)
    decoded = client.embeddings.create(model=MODEL, input=texts)
    np.testing.assert_allclose(decoded.data[1].embedding, res.data[1].embedding, atol=1e-6)
    # Token arrays give the same vectors as their texts.
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    one = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    for a, b in zip(by_ids.data + one.data, res.data + res.data[1:]):
        assert cosine(a.embedding, b.embedding) >= 0.99999
    wait_until_idle(server.engine)
    assert_all_blocks_free(server.engine)


def _error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["param"] == param, err
    return err


@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "dimensions": 8}, 400, "dimensions"),
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [[1, 2], []]}, 400, "input[1]"),
    ({"input": [1, 99999999]}, 400, "input"),
    ({"input": [[5, 6], [-1]]}, 400, "input"),
    ({"input": "hello " * 600}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "model": "gpt-9"}, 404, "model"),
])
def test_bad_embedding_requests(server, body, status, param):
    _error(httpx.post(server.base_url + "/embeddings", json=body, timeout=60), status, param)


@pytest.mark.parametrize("bad", [[1] * 600, [1, 99999999]], ids=["too long", "bad id"])
def test_a_bad_input_among_many_is_refused_before_any_runs(server, bad):
    """The last of 2,048 inputs too long (or holding an id outside the vocabulary): the
    engine refused it after the others were added, and those ran for nobody (64 of 2,047
    embeddings computed, measured). Now every input is checked first."""
    wait_until_idle(server.engine)
    before = server.engine.metrics.snapshot.prompt_tokens
    err = _error(httpx.post(server.base_url + "/embeddings", timeout=60,
                            json={"input": [[8, 9]] * 2047 + [bad]}), 400, "input[2047]")
    assert err["message"].startswith("input[2047]"), err
    wait_until_idle(server.engine)
    assert server.engine.metrics.snapshot.prompt_tokens == before


@pytest.mark.parametrize("max_tokens", [2, 600])  # 600: past the context, checked later
def test_generation_on_a_pooling_server_is_400(server, client, max_tokens):
    with pytest.raises(openai.BadRequestError, match="runner='pooling'") as e:
        client.completions.create(model=MODEL, prompt=SHORT, max_tokens=max_tokens)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="runner='pooling'"):
        client.chat.completions.create(model=MODEL, max_tokens=max_tokens,
                                       messages=[{"role": "user", "content": "hi"}])
    assert client.embeddings.create(model=MODEL, input="still serving").data


def test_tokenize_detokenize_round_trip(server):
    tok = server.engine.get_tokenizer()
    url = server.url
    for special in (True, False):
        r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": LONG,
                                                "add_special_tokens": special,
                                                "return_token_strs": True}).json()
        assert r["tokens"] == tok.encode(LONG, add_special_tokens=special)
        assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
        assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
        back = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]})
        assert back.json() == {"prompt": tok.decode(r["tokens"])}
        assert LONG in back.json()["prompt"]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."}]
    for gen in (True, False):
        r = httpx.post(url + "/tokenize", json={"messages": messages,
                                                "add_generation_prompt": gen}).json()
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert r["tokens"] == tok.encode(text, add_special_tokens=False)
        assert r["token_strs"] is None
        back = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json()
        assert back["prompt"] == text


@pytest.mark.parametrize("path, body, status, param", [
    ("/detokenize", {"tokens": [1, 99999999]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-3]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-9"}, 404, "model"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "chat_template": "{% for %}"}, 400, "chat_template"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "add_generation_prompt": True, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
])
def test_bad_tokenizer_requests(server, path, body, status, param):
    _error(httpx.post(server.url + path, json=body), status, param)
