"""AsyncLLMEngine on the default model: streaming, cancellation, rejected requests, engine death."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from pagedlm import EngineArgs, SamplingParams
from pagedlm.engine.async_llm_engine import AsyncEngineDeadError, AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.sampling_params import RequestOutputKind
from tests.server_utils import assert_all_blocks_free, serve_in_thread, wait_until_idle

ARGS = dict(max_model_len=256, num_gpu_blocks_override=128)


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(**ARGS), log_stats=False)
    yield eng
    eng.shutdown()


def params(kind: RequestOutputKind, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 12)
    return SamplingParams(temperature=0.8, seed=5, ignore_eos=True, output_kind=kind, **kw)


async def collect(engine, prompt, p, rid):
    return [out async for out in engine.generate(prompt, p, rid)]


def test_deltas_add_up_to_the_final_output(engine):
    async def run():
        return await asyncio.gather(
            collect(engine, "Once upon a time", params(RequestOutputKind.DELTA, n=2), "delta"),
            collect(engine, "Once upon a time", params(RequestOutputKind.FINAL_ONLY, n=2),
                    "final"))

    deltas, finals = asyncio.run(run())
    assert len(finals) == 1 and finals[0].finished
    assert len(deltas) >= 12 and deltas[-1].finished and not deltas[0].finished
    for c in finals[0].outputs:
        mine = [d for o in deltas for d in o.outputs if d.index == c.index]
        text = "".join(d.text for d in mine)
        ids = [t for d in mine for t in d.token_ids]
        assert text == c.text and ids == c.token_ids and len(ids) == 12
    wait_until_idle(engine)
    assert_all_blocks_free(engine)


def test_a_finished_sequence_reports_its_finish_once(engine):
    """n > 1 under DELTA: a sequence that finished before its siblings came again, empty but
    with its finish_reason, in every later output of its group: a stream's choice got a
    finish chunk per step (the server sends one wherever finish_reason is set)."""
    p = SamplingParams(temperature=1.0, seed=3, max_tokens=40, n=4, ignore_eos=True,
                       stop=["e"],  # each stops after a few tokens, at its own step
                       output_kind=RequestOutputKind.DELTA)
    deltas = asyncio.run(collect(engine, "Once upon a time", p, "finish-once"))
    finishes = [(k, d.index) for k, o in enumerate(deltas) for d in o.outputs if d.finish_reason]
    assert sorted(i for _, i in finishes) == [0, 1, 2, 3], finishes
    assert len({k for k, _ in finishes}) > 1, "all four finished in one step: nothing tested"
    for k, i in finishes:  # nothing more of a sequence after its finish
        assert not [d for o in deltas[k + 1:] for d in o.outputs if d.index == i]
    wait_until_idle(engine)
    assert_all_blocks_free(engine)


def test_cancelled_consumers_abort_their_requests(engine):
    aborted_before = engine.metrics.num_finished.get("abort", 0)

    async def consume(i, stop_after):
        seen = 0
        async for _ in engine.generate(f"Count to {i}:", params(RequestOutputKind.DELTA,
                                                                  max_tokens=100), f"c{i}"):
            seen += 1
            if seen == stop_after:
                await asyncio.sleep(3600)  # parked until cancelled
        return seen

    async def run():
        tasks = [asyncio.create_task(consume(i, 2)) for i in range(6)]
        # A consumer that breaks out of its loop also ends its request.
        async def breaker():
            gen = engine.generate("Break", params(RequestOutputKind.DELTA, max_tokens=100), "b")
            async for _ in gen:
                break
            await gen.aclose()
        await breaker()
        while engine.metrics.snapshot.num_running < 6:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        for t in tasks:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results)

    asyncio.run(run())
    wait_until_idle(engine)
    assert engine.metrics.num_finished["abort"] - aborted_before == 7
    assert_all_blocks_free(engine)


def test_rejected_request_raises_and_the_engine_keeps_going(engine):
    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(engine, "word " * 400, params(RequestOutputKind.DELTA), "too-long")
        with pytest.raises(ValueError, match="already in use"):
            stream = await engine.add_request("dup", "Hi", params(RequestOutputKind.DELTA))
            await engine.add_request("dup", "Hi", params(RequestOutputKind.DELTA))
        async for _ in stream:
            pass
        outs = await collect(engine, "Hello", params(RequestOutputKind.FINAL_ONLY), "after")
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12

    asyncio.run(run())
    assert engine.is_running and not engine.errored


def test_engine_error_fails_in_flight_requests_instead_of_hanging():
    """A step() that raises (fault injected at the LLMEngine boundary) must fail every waiting
    request with that error, mark the engine dead, and refuse new requests."""
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(**ARGS), log_stats=False)
    try:
        real_step = eng.engine.step
        calls = 0

        def failing_step():
            nonlocal calls
            calls += 1
            if calls == 4:
                raise RuntimeError("injected step failure")
            return real_step()

        eng.engine.step = failing_step

        async def run():
            tasks = [collect(eng, f"Prompt {i}", params(RequestOutputKind.DELTA, max_tokens=50),
                             f"r{i}") for i in range(5)]
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
            for r in results:
                assert isinstance(r, RuntimeError) and "injected step failure" in str(r)
            with pytest.raises(AsyncEngineDeadError):
                await collect(eng, "After", params(RequestOutputKind.DELTA), "after")

        asyncio.run(run())
        assert eng.errored and not eng.is_running
        with pytest.raises(AsyncEngineDeadError):
            eng.check_health()
        bm = eng.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks  # the failed requests were released
    finally:
        eng.shutdown()


def test_the_engine_is_built_and_stepped_on_one_thread():
    """from_engine_args loads the model on the engine thread (a second OpenMP team would make
    every kernel wait for a sleeping worker: see AsyncLLMEngine.__init__)."""
    threads = []

    def build():
        threads.append(threading.current_thread())
        return LLMEngine.from_engine_args(EngineArgs(**ARGS))

    eng = AsyncLLMEngine(build, log_stats=False)
    try:
        real_step = eng.engine.step

        def step():
            threads.append(threading.current_thread())
            return real_step()

        eng.engine.step = step
        outs = asyncio.run(collect(eng, "Hello", params(RequestOutputKind.FINAL_ONLY), "one"))
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12
        assert len(threads) > 12 and {t.name for t in threads} == {"pagedlm-engine"}
        assert len(set(threads)) == 1 and threads[0] is not threading.main_thread()
    finally:
        eng.shutdown()
    assert not eng.is_running


def test_a_failing_build_raises_from_the_constructor_and_leaves_no_thread():
    before = threading.active_count()
    with pytest.raises(ValueError, match="max_model_len"):
        AsyncLLMEngine.from_engine_args(EngineArgs(max_model_len=-5), log_stats=False)
    assert threading.active_count() == before


def test_shutdown_fails_waiting_requests():
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(**ARGS), log_stats=False)

    async def run():
        stream = await eng.add_request("s", "Hello", params(RequestOutputKind.DELTA,
                                                             max_tokens=200))
        await stream.__anext__()
        await asyncio.to_thread(eng.shutdown)
        with pytest.raises(AsyncEngineDeadError):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(run(), 60))
    assert not eng.is_running and not eng.errored


def test_server_fails_requests_and_stops_when_the_engine_dies():
    """Over HTTP: a failing step() turns the in-flight requests into errors (a 500 body, or an
    error event in the stream) instead of hanging them; the app then stops its server (as
    vLLM's does: `pagedlm serve` exits non-zero, tests/engine/test_engine_failure.py), and /health
    answers 503 until it has."""
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(**ARGS), log_stats=False)
    real_step = eng.engine.step
    calls = 0

    def failing_step():
        nonlocal calls
        calls += 1
        if calls == 8:
            raise RuntimeError("injected step failure")
        return real_step()

    eng.engine.step = failing_step
    body = {"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True}
    try:
        with serve_in_thread(eng) as server:
            async def run():
                async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
                    async def streamed():
                        lines = []
                        async with c.stream("POST", "/completions",
                                            json={**body, "stream": True}) as r:
                            assert r.status_code == 200
                            async for line in r.aiter_lines():
                                if line:
                                    lines.append(line)
                        return lines

                    return await asyncio.gather(c.post("/completions", json=body), streamed())

            response, lines = asyncio.run(asyncio.wait_for(run(), 120))
            assert response.status_code == 500
            err = response.json()["error"]
            assert err["code"] == 500 and "injected step failure" in err["message"]
            assert len(lines) > 2 and lines[-1] == "data: [DONE]"
            assert lines[0].startswith("data: {") and '"text"' in lines[0]  # it was streaming
            event = json.loads(lines[-2][len("data: "):])
            assert "injected step failure" in event["error"]["message"]
            answers = []
            deadline = time.monotonic() + 10
            while True:  # 503s, then the server is gone
                try:
                    health = httpx.get(server.url + "/health", timeout=2)
                except httpx.TransportError:
                    break
                answers.append(health.status_code)
                assert health.status_code == 503 and "injected" in health.text
                assert time.monotonic() < deadline, answers
                time.sleep(0.05)
    finally:
        eng.shutdown()
