"""The benchmark library (benchmarks/lib) and benchmarks/compare.py, without the peers (vLLM,
llama.cpp) they compare against: requests, statistics, count checks, the capacity search on a
fake latency model, the server command lines each workload gets, the report (medians, ranges,
ratios), the fresh-process legs and the server lifecycle (a stand-in HTTP server)."""
from __future__ import annotations

import importlib
import json
import math
import random
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    """compare.py and the lib modules, imported as `python benchmarks/compare.py` imports
    them (its folder first on sys.path); removed again afterwards."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield {name: importlib.import_module(name)
               for name in ("compare", "lib.capacity", "lib.client", "lib.legs", "lib.peers",
                            "lib.report", "lib.servers", "lib.stalls", "lib.stats",
                            "lib.workload")}
    finally:
        sys.path.remove(str(BENCHMARKS))
        for name in [m for m in sys.modules if m in ("compare", "lib") or m.startswith("lib.")]:
            sys.modules.pop(name)


@pytest.fixture(scope="module")
def compare(bench):
    return bench["compare"]


@pytest.fixture(scope="module")
def servers(bench):
    return bench["lib.servers"]


@pytest.fixture(scope="module")
def capacity(bench):
    return bench["lib.capacity"]


def test_system_specs(servers, compare):
    s = servers.parse_system("pagedlm:gguf=--quantization gguf --max-num-batched-tokens 512")
    assert (s.name, s.base, s.extra_args) == (
        "pagedlm:gguf", "pagedlm", ("--quantization", "gguf", "--max-num-batched-tokens", "512"))
    s = servers.parse_system("llamacpp-q4_k_m")
    assert (s.name, s.base, s.gguf_type, s.extra_args) == (
        "llamacpp-q4_k_m", "llamacpp", "Q4_K_M", ())
    assert servers.parse_system("vllm").base == "vllm"
    assert servers.parse_system("vllm").dtype is None  # vLLM's own default
    s = servers.parse_system("vllm-bf16")
    assert (s.dtype, s.tcmalloc) == ("bfloat16", True)
    s = servers.parse_system("vllm-f32-notcmalloc:long=--max-num-batched-tokens 4096")
    assert (s.name, s.dtype, s.tcmalloc, s.extra_args) == (
        "vllm-f32-notcmalloc:long", "float32", False, ("--max-num-batched-tokens", "4096"))
    s = servers.parse_system("vllm-f32-noreserve")
    assert (s.dtype, s.tcmalloc, s.reserve_cpu) == ("float32", True, False)
    assert servers.parse_system("vllm-bf16").reserve_cpu
    for bad in ("tgi", "pagedlm=--x", "pagedlm:=--x", "llamacpp-", "vllm-f16", "vllm-bf16-f32",
                "vllm-notcmalloc-notcmalloc", "vllm-noreserve-noreserve"):
        with pytest.raises(ValueError, match="--systems entry"):
            servers.parse_system(bad)
    with pytest.raises(SystemExit):
        compare.parse_args(["--systems", "pagedlm", "pagedlm"])
    args = compare.parse_args([])
    assert args.runs == 3 and args.workloads == ["batch", "single", "capacity"]
    assert (args.slo.ttft_p99_ms, args.slo.tpot_p99_ms) == (1000.0, 100.0)
    assert (args.capacity_duration, args.capacity_min_requests) == (60.0, 200)
    assert {"vllm-bf16", "vllm-f32", "llamacpp-q4_0", "llamacpp-q4_k_m", "llamacpp-q4_1"} <= {
        s.name for s in args.system_specs}


def test_requests_are_ordinary_tokens_in_range(bench, compare, default_model_dir):
    from transformers import AutoTokenizer
    workload = bench["lib.workload"]
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    vocab = workload.ordinary_token_ids(tokenizer)
    template_tokens = {tokenizer.convert_tokens_to_ids(t)
                       for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}
    assert not template_tokens & set(vocab)
    assert len(vocab) > 0.9 * len(tokenizer.get_vocab())
    # Every id decodes to text and back to itself alone: ordinary tokens only.
    sample = random.Random(0).sample(vocab, 200)
    assert sum(tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t]
               for t in sample) > 150

    args = compare.parse_args(["--num-prompts", "50", "--input-len", "32:512",
                               "--output-len", "16:256", "--serving-num-prompts", "20"])
    first = compare.make_workloads(args, vocab)
    assert first == compare.make_workloads(args, vocab)  # seeded: every system, same tokens
    assert len(first.batch) == 50 and len(first.serving) == 20 == len(first.serving_arrivals)
    assert all(32 <= len(r.prompt) <= 512 and 16 <= r.max_tokens <= 256 for r in first.batch)
    assert len({len(r.prompt) for r in first.batch}) > 10
    assert all(len(r.prompt) == 32 and r.max_tokens == 256 for r in first.single)
    assert {t for r in first.batch for t in r.prompt} <= set(vocab)
    assert first.serving_arrivals == sorted(first.serving_arrivals)
    # Another batch size leaves the other workloads' tokens alone.
    args.num_prompts = 10
    assert compare.make_workloads(args, vocab).serving == first.serving
    # The warm-up has the workload's shapes, with few output tokens and other tokens.
    warm = compare.warmup_requests("batch", first, args)
    assert len(warm) == 10 and all(32 <= len(r.prompt) <= 512 and r.max_tokens == 8
                                   for r in warm)
    assert len(compare.warmup_requests("single", first, args)[0].prompt) == 32


def test_workload_parsing_and_arrivals(bench):
    import argparse
    workload = bench["lib.workload"]
    assert workload.parse_len("7") == (7, 7) and workload.parse_len("3:9") == (3, 9)
    for bad in ("0", "9:3", "x", "1:y"):
        with pytest.raises(argparse.ArgumentTypeError):
            workload.parse_len(bad)
    rng = random.Random(0)
    times = workload.arrival_times(4.0, rng, num=2000)
    assert len(times) == 2000 and times[0] == 0.0 and times == sorted(times)
    assert times[-1] / 1999 == pytest.approx(0.25, rel=0.1)  # mean gap 1 / rate
    within = workload.arrival_times(4.0, random.Random(0), duration=10.0)
    assert within[-1] < 10.0 and 25 < len(within) < 60
    assert workload.arrival_times(math.inf, rng, num=3) == [0.0] * 3
    for kwargs in ({}, {"num": 3, "duration": 1.0}):
        with pytest.raises(ValueError, match="exactly one"):
            workload.arrival_times(1.0, rng, **kwargs)
    with pytest.raises(ValueError):
        workload.arrival_times(math.inf, rng, duration=1.0)
    r = workload.Request([1, 2, 3], 4)
    prompt, n = r  # a tuple: the offline scripts unpack it
    assert (prompt, n) == ([1, 2, 3], 4)


def test_count_check(bench):
    client = bench["lib.client"]
    r = bench["lib.workload"].Request(prompt=[5, 6, 7], max_tokens=4)
    client.check_counts("s", "batch", 0, r, 3, 4)
    for prompt_tokens, completion_tokens in ((3, 3), (4, 4), (None, 4), (3, None)):
        with pytest.raises(client.CountMismatch, match="s batch request 0"):
            client.check_counts("s", "batch", 0, r, prompt_tokens, completion_tokens)
    done = client.RequestResult(ok=True, prompt_len=3, output_tokens=4, ttft=0.1, latency=0.4)
    assert done.tpot == pytest.approx(0.1)
    client.check_streamed("s", "single", [r], [done])
    with pytest.raises(RuntimeError, match="request 0 failed: boom"):
        client.check_streamed("s", "single", [r], [client.RequestResult(error="boom")])
    # A server that sent no usage (prompt_len -1) cannot be checked.
    with pytest.raises(client.CountMismatch, match="no usage"):
        client.check_streamed("s", "single", [r], [client.RequestResult(ok=True,
                                                                        output_tokens=4)])


def test_stats(bench):
    stats = bench["lib.stats"]
    values = [float(v) for v in range(1, 101)]
    random.Random(0).shuffle(values)
    assert stats.quantile(values, 0.5) == 50 and stats.quantile(values, 0.99) == 99
    assert stats.quantile([3.0], 0.99) == 3.0 and math.isnan(stats.quantile([], 0.5))
    # Nearest rank: with fewer than 100 values p99 is the maximum.
    assert stats.quantile(values[:50], 0.99) == max(values[:50])
    d = stats.distribution([0.001, 0.002, 0.003, 0.010], scale=1000)
    assert d == pytest.approx({"mean": 4.0, "median": 2.5, "p99": 10.0, "max": 10.0})
    assert all(math.isnan(v) for v in stats.distribution([]).values())
    assert stats.median_range([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0,
                                                   "runs": 3}
    fig = stats.throughput([([1, 2], 3), ([4], 5)], elapsed=2.0, load_s=1.23456)
    assert fig == {"load_s": 1.235, "elapsed_s": 2.0, "num_requests": 2, "prompt_tokens": 3,
                   "output_tokens": 8, "requests_per_s": 1.0, "total_tokens_per_s": 5.5,
                   "output_tokens_per_s": 4.0}
    client = bench["lib.client"]
    results = [client.RequestResult(ok=True, prompt_len=-1, output_tokens=3, ttft=0.1,
                                    latency=0.3, itl=[0.1, 0.1]),
               client.RequestResult(error="HTTP 500")]
    summary = stats.serving_summary(results, elapsed=1.0, prompt_len_estimate=16)
    assert (summary["successful_requests"], summary["failed_requests"]) == (1, 1)
    assert summary["total_input_tokens"] == 16 and summary["tpot_ms"]["p99"] == pytest.approx(100)


def test_ratios_render_and_best_variant(bench, servers):
    report = bench["lib.report"]
    runs = {"a": [{"batch": {"output_tokens_per_s": 200.0}, "capacity": {"rate": 2.0}},
                  {"batch": {"output_tokens_per_s": 180.0}, "capacity": {"rate": 3.0}},
                  {"batch": {"output_tokens_per_s": 210.0}}],  # its capacity run failed
            "b": [{"batch": {"output_tokens_per_s": 100.0}, "capacity": {"rate": 1.0},
                   "serving": {"ttft_ms": {"p99": 20.0}}}],
            "c": [{"single": {"tokens_per_s": 10.0}}]}
    figures = report.figures_of(runs)
    assert figures["a"]["batch_output_tps"] == {"median": 200.0, "min": 180.0, "max": 210.0,
                                                "runs": 3}
    assert figures["a"]["capacity_rps"]["median"] == 2.5
    ratios = report.ratios_of(figures, ["b", "missing"])
    assert set(ratios) == {"b"}
    # Above 1 means better, of the medians.
    assert ratios["b"]["a"] == {"batch_output_tps": 2.0, "capacity_rps": 2.5}
    assert ratios["b"]["c"] == {}
    specs = [servers.parse_system(s) for s in ("vllm-bf16", "vllm-f32", "pagedlm")]
    figures2 = {"vllm-bf16": {"single_tps": {"median": 60.0}, "serving_ttft_p99": {"median": 9}},
                "vllm-f32": {"single_tps": {"median": 40.0}, "serving_ttft_p99": {"median": 5}},
                "pagedlm": {"single_tps": {"median": 50.0}}}
    best = report.best_of_each_peer(figures2, specs)
    assert best["vllm"] == {"single_tps": "vllm-bf16", "serving_ttft_p99": "vllm-f32"}
    text = report.render(figures, ratios, {"d": "RuntimeError: boom"}, {"vllm": {}})
    assert "| a | 200.0 (180.0-210.0) | - | 2.5 (2.0-3.0) | - |" in text
    assert "| b | 100.0 | - | 1.0 | 20.0 |" in text
    assert "2.00x" in text and "FAILED d" in text


def test_llamacpp_build_options(bench, tmp_path, monkeypatch):
    """Native builds where the CPU has no AMX; with AMX (its backend crashed here), every other
    instruction set the CPU has, by name, and AMX off. A peers folder built the other way is
    rebuilt: its marker is dropped before the build starts."""
    peers = bench["lib.peers"]
    assert peers.simd_options({"avx2", "fma", "avx512f"}) == ["-DGGML_NATIVE=ON"]
    opts = peers.simd_options({"avx2", "fma", "f16c", "avx512f", "avx512_vnni", "amx_tile",
                               "amx_bf16", "amx_int8"})
    assert opts[0] == "-DGGML_NATIVE=OFF" and "-DGGML_NATIVE=ON" not in opts
    assert {"-DGGML_AVX2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX=OFF",
            "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
            "-DGGML_AMX_BF16=OFF"} <= set(opts)
    home = tmp_path / "llama.cpp"
    home.mkdir()
    (home / peers.MARKER).write_text(json.dumps({"version": "old native build"}))
    monkeypatch.setattr(peers, "cpu_flags", lambda: {"avx2", "amx_tile"})

    def stop(cmd, **kw):
        raise RuntimeError(f"build started: {cmd[:3]}")
    monkeypatch.setattr(peers, "run", stop)
    with pytest.raises(RuntimeError, match="build started"):
        peers.setup_llamacpp(tmp_path)
    assert not (home / peers.MARKER).exists()
    (home / peers.MARKER).write_text(json.dumps({"version": "v", "simd": opts}))
    monkeypatch.setattr(peers, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f",
                                                     "avx512_vnni", "amx_tile", "amx_bf16",
                                                     "amx_int8"})
    assert peers.setup_llamacpp(tmp_path).version == "v"  # built as wanted: kept


def test_capacity_search_on_a_fake_latency_model(capacity):
    """TPOT grows as the rate nears a saturation rate; the search must land within its
    precision below the true capacity, measuring only rates it needs."""
    slo, search = capacity.Slo(), capacity.Search(start_rate=1.0, precision=0.1, max_points=8)

    def model(true_capacity: float, failed_at: float = math.inf):
        seen = []

        def measure(rate: float):
            seen.append(rate)
            # 50 ms a token at rate 0, 100 ms (the SLO) exactly at true_capacity.
            tpot = 50.0 / max(1e-9, 1 - rate / (2 * true_capacity))
            return capacity.Point(rate, 200, int(rate >= failed_at), 300.0, tpot, 10.0, 60.0)
        return measure, seen

    measure, seen = model(3.3)
    found = capacity.find_capacity(measure, slo, search)
    assert found.bracketed and 3.3 * (1 - search.precision) <= found.rate <= 3.3
    assert seen[:3] == [1.0, 2.0, 4.0] and len(seen) <= search.max_points
    assert [p.rate for p in found.points] == seen

    # A start rate above capacity: halve until a rate passes, then bisect.
    measure, seen = model(0.3)
    found = capacity.find_capacity(measure, slo, search)
    assert seen[:3] == [1.0, 0.5, 0.25] and 0.27 <= found.rate <= 0.3

    # Nothing passes: capacity 0, and the search stops at the minimum rate.
    measure, seen = model(0.001)
    found = capacity.find_capacity(measure, slo, capacity.Search(min_rate=0.1))
    assert found.rate == 0.0 and min(seen) >= 0.1

    # A failed request fails the point however fast the others were.
    measure, seen = model(100.0, failed_at=1.5)
    found = capacity.find_capacity(measure, slo, search)
    assert 1.0 <= found.rate < 1.5 and found.bracketed

    # Never bracketed within the point budget: a lower bound, said so.
    measure, seen = model(1000.0)
    found = capacity.find_capacity(measure, slo, capacity.Search(max_points=3))
    assert found.rate == 4.0 and not found.bracketed and len(seen) == 3
    doc = found.to_json(slo)
    assert doc["slo"] == {"ttft_p99_ms": 1000.0, "tpot_p99_ms": 100.0}
    assert [p["meets_slo"] for p in doc["points"]] == [True, True, True]

    with pytest.raises(ValueError):
        capacity.Search(precision=0)


def test_capacity_points(capacity, bench):
    client = bench["lib.client"]
    assert capacity.point_size(1.0, 60, 200) == 200  # p99 of 60 requests is their maximum
    assert capacity.point_size(10.0, 60, 200) == 600
    vocab = list(range(100, 200))
    reqs, arrivals = capacity.point_workload(vocab, 2.0, 50, 128, 128, seed=0)
    assert (reqs, arrivals) == capacity.point_workload(vocab, 2.0, 50, 128, 128, seed=0)
    assert reqs != capacity.point_workload(vocab, 2.5, 50, 128, 128, seed=0)[0]
    assert all(len(r.prompt) == 128 and r.max_tokens == 128 for r in reqs)
    assert len(arrivals) == 50 and arrivals == sorted(arrivals)
    results = [client.RequestResult(ok=True, output_tokens=11, ttft=t / 1000, latency=t / 1000 + 1)
               for t in range(1, 101)]
    point = capacity.point_of(2.0, results, elapsed=10.0)
    assert point.ttft_p99_ms == pytest.approx(99) and point.tpot_p99_ms == pytest.approx(100)
    assert point.meets(capacity.Slo()) and point.output_throughput == 110.0
    assert not point.meets(capacity.Slo(tpot_p99_ms=99.9))


def test_capacity_point_stops_once_its_ttft_p99_is_decided(capacity, bench):
    """A point whose TTFT p99 is known to miss the SLO stops there: the requests in flight are
    cancelled, the rest never sent; counts and meets() say so. Streamed from a stand-in
    transport whose first tokens come late from the 10th request on."""
    import asyncio

    import httpx
    client = bench["lib.client"]
    assert capacity.ttft_bound(200, capacity.Slo()).misses == 3  # p99 = the 198th of 200
    assert capacity.ttft_bound(480, capacity.Slo()).misses == 5  # the 476th of 480
    assert capacity.ttft_bound(50, capacity.Slo(ttft_p99_ms=250)).seconds == 0.25

    async def handler(request: httpx.Request) -> httpx.Response:
        slow = json.loads(request.content)["prompt"][0] >= 10

        async def body():
            await asyncio.sleep(0.6 if slow else 0.01)
            for _ in range(3):
                yield b'data: {"choices": [{"text": "x"}]}\n\n'
            yield (b'data: {"choices": [], "usage": {"prompt_tokens": 1, '
                   b'"completion_tokens": 3}}\n\ndata: [DONE]\n\n')
        return httpx.Response(200, content=body())

    async def run(bound):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler),
                                     base_url="http://stand-in") as http:
            return await client.run_streamed(
                http, client.Endpoint(model="m"), [[i] for i in range(40)], [3] * 40,
                [0.02 * i for i in range(40)], ttft_bound=bound)

    slo = capacity.Slo(ttft_p99_ms=200)
    bound = capacity.ttft_bound(40, slo)
    results, elapsed = asyncio.run(run(bound))
    point = capacity.point_of(1.0, results, elapsed, bound)
    # The 10th-12th requests (sent at 0.20-0.24 s) are over 0.2 s without a token at ~0.44 s.
    assert bound.misses == 1 and 0.35 < point.stopped_at_s < 0.6 and elapsed < 0.7
    assert 20 <= point.requests == bound.sent < 40 and point.failed == 0
    assert not point.meets(slo) and point.ttft_p99_ms < 200  # only answered requests: a bound
    assert all(r.ok for r in results[:10])

    results, elapsed = asyncio.run(run(None))  # without a bound: every request, to the end
    full = capacity.point_of(1.0, results, elapsed)
    assert full.requests == 40 and full.failed == 0 and full.stopped_at_s is None
    assert full.ttft_p99_ms > 590 and not full.meets(slo)


def test_stall_timeline_places_slow_first_tokens_and_gaps(bench, tmp_path, monkeypatch):
    """A pause every stream shares shows as one time; a Triton cache entry written since the
    run's start is listed with its metadata, an older one is not."""
    import os
    client, stalls = bench["lib.client"], bench["lib.stalls"]
    R = client.RequestResult
    results = [R(ok=True, start=0.0, ttft=0.05, itl=[0.01, 0.3, 0.01], prompt_len=10),
               R(ok=True, start=0.1, ttft=0.25, itl=[0.01], prompt_len=20),
               R(ok=False, start=0.2, error="HTTP 500")]
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    old, new = tmp_path / "old", tmp_path / "new"
    for d in (old, new):
        d.mkdir()
        (d / "k.json").write_text('{"name": "gemv_kernel"}')
        (d / "__grp__k.json").write_text("{}")
    t_wall = time.time()
    os.utime(old, (t_wall - 10, t_wall - 10))
    os.utime(new, (t_wall + 1.5, t_wall + 1.5))
    out = stalls.stall_timeline(results, t_wall)
    assert [s["ttft_ms"] for s in out["slowest_ttft"]] == [250.0, 50.0]
    assert out["gaps_over_100ms"] == [{"at_s": 0.06, "gap_ms": 300.0}]
    (compiled,) = out["triton_compiles"]
    assert compiled["at_s"] == pytest.approx(1.5, abs=0.01)
    assert compiled["files"] == ["__grp__k.json", "k.json"]
    assert compiled["metadata"] == '{"name": "gemv_kernel"}'


def test_server_command_lines_per_workload(compare, servers, tmp_path):
    """Each workload's servers are sized for it: llama.cpp with one slot per concurrent request
    and its repacked kernels on, vLLM with its own thread binding and tcmalloc preloaded."""
    args = compare.parse_args(["--threads", "2"])
    batch, single, cap = (compare.settings_for(w, args) for w in ("batch", "single", "capacity"))
    assert (batch.concurrency, batch.max_model_len) == (128, 768)
    assert (single.concurrency, single.max_model_len) == (1, 288)
    assert (cap.concurrency, cap.max_model_len) == (64, 256)

    def value(argv, flag):
        return argv[argv.index(flag) + 1]

    llama = servers.peers.LlamaCppInstall("/peers/llama-server", "/peers/llama-quantize", "b1")
    for settings in (batch, single, cap):
        spec = servers.parse_system("llamacpp-q4_0")
        launch = servers.plan_llamacpp(spec, settings, 8080, llama, "/m/q4_0.gguf")
        argv = launch.argv
        assert value(argv, "-np") == str(settings.concurrency)
        assert value(argv, "-c") == str(settings.concurrency * settings.max_model_len)
        assert value(argv, "-t") == value(argv, "-tb") == "2"
        assert value(argv, "-m") == "/m/q4_0.gguf"
        assert "--no-repack" not in argv and "--no-kv-unified" not in argv
        assert "no-repack" in launch.crash_hint and launch.env == {}
    spec = servers.parse_system("llamacpp-q4_1:plain=--no-repack")
    assert servers.plan_llamacpp(spec, single, 1, llama, "m").crash_hint == ""

    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "num_hidden_layers": 30}))
    vllm = servers.peers.VllmInstall("/peers/venv/bin/python", "0.32.0")
    kv = {}
    for name in ("vllm-f32", "vllm-bf16", "vllm"):
        launch = servers.plan_vllm(servers.parse_system(name), batch, 8000, vllm, str(tmp_path),
                                   "/usr/lib/libtcmalloc_minimal.so.4", "/v/libiomp5.so", 2)
        argv, env = launch.argv, launch.env
        assert value(argv, "--max-num-seqs") == "128" and value(argv, "--max-model-len") == "768"
        assert "VLLM_CPU_OMP_THREADS_BIND" not in env and "OMP_NUM_THREADS" not in env
        assert env["LD_PRELOAD"] == "/usr/lib/libtcmalloc_minimal.so.4:/v/libiomp5.so"
        assert env["VLLM_TARGET_DEVICE"] == "cpu"
        kv[name] = int(value(argv, "--kv-cache-memory-bytes"))
        if name == "vllm":
            assert "--dtype" not in argv  # its own default
        else:
            assert value(argv, "--dtype") == {"vllm-f32": "float32",
                                              "vllm-bf16": "bfloat16"}[name]
    # Every sequence at full length: 128 x 768 tokens of 30 layers' K and V, 3 heads of 64.
    assert kv["vllm-f32"] == 128 * 768 * 2 * 30 * 3 * 64 * 4 == 2 * kv["vllm-bf16"]
    plain = servers.plan_vllm(servers.parse_system("vllm-bf16-notcmalloc"), single, 8000, vllm,
                              str(tmp_path), "/usr/lib/libtcmalloc_minimal.so.4", None, 2)
    assert "LD_PRELOAD" not in plain.env
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in plain.env  # its default reservation
    unreserved = servers.plan_vllm(servers.parse_system("vllm-f32-noreserve"), single, 8000,
                                   vllm, str(tmp_path), None, None, 2)
    assert unreserved.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert int(value(plain.argv, "--kv-cache-memory-bytes")) == 64 * 2**20  # its floor
    missing = servers.plan_vllm(servers.parse_system("vllm-bf16"), single, 8000, vllm,
                                str(tmp_path), None, None, 2)
    assert "LD_PRELOAD" not in missing.env and "not found" in missing.notes["preload"]["tcmalloc"]
    # Fewer threads than cores: the core list to bind, its documented way.
    fewer = compare.parse_args(["--threads", "1"])
    launch = servers.plan_vllm(servers.parse_system("vllm-bf16"),
                               compare.settings_for("single", fewer), 8000, vllm,
                               str(tmp_path), None, None, 2)
    assert launch.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-0"

    launch = servers.plan_pagedlm(servers.parse_system("pagedlm:gguf=--quantization gguf"),
                                  cap, 9000, "abc123")
    assert value(launch.argv, "--max-num-seqs") == "64"
    assert value(launch.argv, "--num-gpu-blocks-override") == str(64 * 16)
    assert launch.argv[-2:] == ["--quantization", "gguf"]
    assert launch.env["OMP_NUM_THREADS"] == "2" and launch.version == "pagedlm abc123"


def test_fresh_process_legs(bench, tmp_path):
    legs = bench["lib.legs"]
    argv = ["--a", "1", "--b=2", "--flag", "--c", "3"]
    assert legs.strip_option(argv, "--a") == ["--b=2", "--flag", "--c", "3"]
    assert legs.strip_option(argv, "--b") == ["--a", "1", "--flag", "--c", "3"]
    assert legs.strip_flag(argv, "--flag") == ["--a", "1", "--b=2", "--c", "3"]
    # A leg runs with its tree first on PYTHONPATH, and a script that imported pagedlm from
    # elsewhere is refused.
    tree = tmp_path / "tree"
    (tree / "bench").mkdir(parents=True)
    (tree / "bench" / "leg.py").write_text(textwrap.dedent("""
        import json, os, sys
        out = sys.argv[sys.argv.index("--output-json") + 1]
        first = os.environ["PYTHONPATH"].split(os.pathsep)[0]
        path = sys.argv[1] if sys.argv[1] != "own" else os.path.join(first, "pagedlm")
        json.dump({"config": {"pagedlm_path": path}}, open(out, "w"))
    """))
    got = legs._run(str(tree), "bench/leg.py", ["own"], str(tmp_path))
    assert got["config"]["pagedlm_path"] == str(tree / "pagedlm")
    with pytest.raises(RuntimeError, match="not from its own tree"):
        legs._run(str(tree), "bench/leg.py", ["/elsewhere/pagedlm"], str(tmp_path))


STAND_IN = textwrap.dedent("""
    import http.server, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print("child", child.pid, flush=True)
    if sys.argv[2] == "slow":
        time.sleep(1)
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path in ("/health", "/v1/models") else 404)
            self.end_headers()
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
""")


def test_server_lifecycle_leaves_nothing_behind(servers, tmp_path):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    port = servers.free_port()
    plan = servers.LaunchPlan([sys.executable, str(script), str(port), "slow"], {}, "stand-in")
    log = tmp_path / "server.log"
    with servers.Server("stand-in", plan, port, log, startup_timeout=60) as server:
        assert servers.port_in_use(port)
        leader = psutil.Process(server.proc.pid)
        processes = [leader] + leader.children(recursive=True)
        assert len(processes) == 2
        # A second server cannot take a port in use.
        with pytest.raises(RuntimeError, match="already in use"):
            with servers.Server("again", plan, port, tmp_path / "again.log", 60):
                pass
    gone, alive = psutil.wait_procs(processes, timeout=5)
    assert not alive, f"left behind: {alive}"
    assert not servers.port_in_use(port)
    assert log.read_text().startswith("$ ") and "child" in log.read_text()

    # A server that dies while starting fails at once, with its log's last lines.
    dying = servers.LaunchPlan([sys.executable, "-c", "print('no model here'); exit(3)"], {},
                               "dying")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 3(.|\n)*no model here"):
        with servers.Server("dying", dying, servers.free_port(), tmp_path / "dying.log", 60):
            pass
    assert time.monotonic() - start < 30

    # One killed by a signal while starting (llama.cpp's AMX crash) gets the plan's hint.
    crashing = servers.LaunchPlan(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"], {},
        "crashing", crash_hint=" (try --no-repack)")
    with pytest.raises(RuntimeError, match=r"exited with -11 while starting \(try --no-repack\)"):
        with servers.Server("crashing", crashing, servers.free_port(), tmp_path / "c.log", 60):
            pass


def test_logs_are_trimmed_to_a_committable_size(servers, tmp_path):
    log = tmp_path / "big.log"
    log.write_bytes(b"head\n" + b"x" * 10_000 + b"\ntail\n")
    servers.trim_log(log, max_bytes=1000)
    text = log.read_text()
    assert text.startswith("head\n") and text.endswith("\ntail\n") and "left out" in text
    assert log.stat().st_size < 1100
    small = tmp_path / "small.log"
    small.write_text("ok\n")
    servers.trim_log(small, max_bytes=1000)
    assert small.read_text() == "ok\n"


def test_copy_workload_is_sized_and_answers_are_compared(compare, bench):
    """The copy workload (speculative decoding's) runs one stream with room for its prompts,
    and the report counts each system's answers equal to the first baseline's."""
    from lib.copy_prompts import COPY_PROMPTS
    args = compare.parse_args(["--workloads", "copy", "--copy-output-len", "128"])
    copy = compare.settings_for("copy", args)
    assert (copy.concurrency, copy.max_model_len) == (1, 640)
    assert len(COPY_PROMPTS) >= 8

    def run(*texts):
        return {"copy": {"answers": [{"text": t} for t in texts]}}

    results = {"plain": [run("a", "b", "c")], "ngram": [run("a", "b", "x")],
               "peer": [run("q", "b", "c")], "batch-only": [{"batch": {}}]}
    agreement = compare.copy_agreement(results, ["missing", "plain"])
    assert agreement == {"ngram": "2/3 equal to plain", "peer": "2/3 equal to plain"}
    assert compare.copy_agreement(results, ["batch-only"]) == {}
    figures = bench["lib.report"].figures_of({"ngram": [{"copy": {"tokens_per_s": 5.0}}]})
    assert figures["ngram"]["copy_tps"]["median"] == 5.0
