"""The step tracer: on a cache small enough to force preemption (recompute and swap), with shared
prefixes and n > 1 forks, its records add up against the engine's own counters and block pool,
its Chrome trace is well-formed, and `pagedlm trace` renders the HTML and PNGs."""
from __future__ import annotations

import json
import os
import random

import pytest

from tests.conftest import make_tiny_model
from pagedlm import LLM, SamplingParams
from pagedlm.entrypoints.cli import main
from pagedlm.metrics.tracer import BLOCK_STATES, load_records, records_path

# 10 host blocks: K and V, 3 layers, 8 tokens, 2 KV heads of 16 dims, fp32. Fewer than a
# preempted group may hold, so some swap preemptions fall back to recompute.
HOST_BLOCK_BYTES = 2 * 3 * 8 * 2 * 16 * 4


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("tracer")
    path = make_tiny_model(root, "llama", default_model_dir)
    trace_file = str(root / "run.json")
    llm = LLM(path, block_size=8, num_gpu_blocks_override=24, max_num_seqs=6,
              max_num_batched_tokens=48, max_model_len=160, preemption_mode="swap",
              swap_space=10 * HOST_BLOCK_BYTES / 2**30, trace_file=trace_file)
    engine = llm.llm_engine
    rng = random.Random(0)
    shared = [rng.randint(100, 3000) for _ in range(24)]  # three full blocks every prompt shares
    prompts = [{"prompt_token_ids": shared + [rng.randint(100, 3000)
                                              for _ in range(rng.randint(4, 30))]}
               for _ in range(8)]
    params = [SamplingParams(n=2 if i % 3 == 0 else 1, temperature=1.0, seed=i,
                             max_tokens=rng.randint(20, 40), ignore_eos=True)
              for i in range(8)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = engine.stats
    pool = engine.block_manager.device
    final_free = pool.num_free_blocks
    llm.shutdown()
    meta, steps = load_records(records_path(trace_file))
    return dict(root=root, model=path, trace_file=trace_file, meta=meta, steps=steps, stats=stats,
                outs=outs, prompts=prompts, params=params, final_free=final_free,
                num_blocks=pool.num_blocks)


def test_run_exercises_what_the_trace_must_show(traced_run):
    steps, stats = traced_run["steps"], traced_run["stats"]
    modes = {p["mode"] for s in steps for p in s["preempted"]}
    assert modes == {"recompute", "swap"}, modes
    assert any(s["swapped_in"] for s in steps)
    assert sum(s["prefix_hit_tokens"] for s in steps) > 0
    assert sum(s["device"]["shared"] for s in steps) > 0  # forks share their parent's blocks
    assert sum(s["cow_copies"] for s in steps) > 0  # and copy the block they write into
    assert sum(s["device"]["evicted"] for s in steps) > 0
    # The trace's counts are the scheduler's own.
    assert sum(len(s["preempted"]) for s in steps) == stats.num_preemptions
    assert sum(p["mode"] == "swap" for s in steps for p in s["preempted"]) == \
        stats.num_swapped_out
    assert sum(len(s["swapped_in"]) for s in steps) == stats.num_swapped_in


def test_tokens_per_step_add_up(traced_run):
    steps, stats = traced_run["steps"], traced_run["stats"]
    executed = [s for s in steps if s["scheduled"]]
    assert len(executed) == stats.num_steps
    for s in steps:
        assert sum(x["num_tokens"] for x in s["scheduled"]) == s["num_batched_tokens"]
        assert s["num_batched_tokens"] <= s["token_budget"] == traced_run["meta"]["token_budget"]
    prefill = sum(x["num_tokens"] for s in steps for x in s["scheduled"]
                  if x["kind"] == "prefill")
    assert prefill == stats.num_prompt_tokens
    # Every sequence computes its tokens in order, once (from scratch again after a recompute).
    progress: dict[int, int] = {}
    recomputed = {p["request_id"] for s in steps for p in s["preempted"]
                  if p["mode"] == "recompute"}
    for s in steps:
        for x in s["scheduled"]:
            if x["num_computed_tokens"] < progress.get(x["seq_id"], 0):
                assert x["request_id"] in recomputed
            elif x["seq_id"] in progress:
                assert x["num_computed_tokens"] == progress[x["seq_id"]]
            progress[x["seq_id"]] = x["num_computed_tokens"] + x["num_tokens"]
    # ... up to its whole prompt and output, but the last sampled token (never fed back).
    by_request = {out.request_id: out for out in traced_run["outs"]}
    seq_len = {}
    for s in steps:
        for x in s["scheduled"]:
            seq_len.setdefault(x["request_id"], set()).add(progress[x["seq_id"]])
    for rid, out in by_request.items():
        want = {len(out.prompt_token_ids) + len(c.token_ids) - 1 for c in out.outputs}
        assert seq_len[rid] == want, rid


def test_every_allocated_block_is_freed(traced_run):
    steps, n = traced_run["steps"], traced_run["num_blocks"]
    used = 0
    for s in steps:
        g = s["device"]
        used += g["allocated"] + g["revived"] - g["freed"]
        bm = s["block_map"]
        assert len(bm) == n and set(bm) <= set(BLOCK_STATES)
        assert used == n - bm.count(".") - bm.count("c"), s["step"]
        cpu = s["cpu"]
        assert cpu["allocated"] >= 0 and cpu["freed"] >= 0
    assert used == 0 and traced_run["final_free"] == n
    assert sum(s["cpu"]["allocated"] - s["cpu"]["freed"] for s in steps) == 0
    assert "u" not in steps[-1]["block_map"] and "s" not in steps[-1]["block_map"]
    assert any("s" in s["block_map"] for s in steps) and any("c" in s["block_map"]
                                                             for s in steps)


def test_chrome_trace_is_well_formed(traced_run):
    with open(traced_run["trace_file"]) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    steps = traced_run["steps"]
    for e in events:
        assert {"ph", "pid", "tid", "name"} <= e.keys()
        assert e["ph"] in ("X", "i", "C", "M")
        if e["ph"] != "M":
            assert isinstance(e["ts"], float) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
        if e["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in e["args"].values())
    step_events = [e for e in events if e.get("cat") == "step"]
    assert len(step_events) == len(steps)
    # Phases tile their step.
    for s in steps:
        t = s["times"]
        assert sum(t.values()) == pytest.approx(s["duration"], abs=1e-6)
        assert all(v >= -1e-6 for v in t.values())
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {out.request_id for out in traced_run["outs"]} <= names
    assert sum(e.get("cat") == "preemption" for e in events) == \
        sum(len(s["preempted"]) for s in steps)
    assert not [p for p in os.listdir(traced_run["root"]) if ".tmp-" in p]


def test_pagedlm_trace_renders_html_and_png(traced_run, tmp_path):
    out_dir = tmp_path / "render"
    # The Chrome JSON's path finds its records beside it.
    main(["trace", traced_run["trace_file"], "-o", str(out_dir)])
    html = (out_dir / "trace.html").read_text()
    assert "<svg" in html and "http://" not in html.replace("http://www.w3.org", "")
    assert "https://" not in html
    for rid in {out.request_id for out in traced_run["outs"]}:
        assert f">{rid}<" in html
    for png in ("timeline.png", "kv_blocks.png"):
        data = (out_dir / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


def test_trace_file_errors(tmp_path, default_model_dir):
    with pytest.raises(ValueError, match="trace_file"):
        LLM(default_model_dir, trace_file=str(tmp_path / "missing" / "t.json"))
    with pytest.raises(SystemExit, match="error: no step records at .*nope"):
        main(["trace", str(tmp_path / "nope.json"), "-o", str(tmp_path / "o")])


def test_pagedlm_trace_names_bad_records_and_outputs(traced_run, tmp_path):
    """Each was a traceback (JSONDecodeError without the file, AttributeError, KeyError,
    FileExistsError); now one error line naming the file, line or directory."""
    records = records_path(traced_run["trace_file"])
    lines = open(records).read().splitlines()
    cases = {"cut.steps.jsonl": (lines[:2] + [lines[2][:40]], r"cut\.steps\.jsonl:3: not a JSON"),
             "list.steps.jsonl": (lines[:1] + ["[1, 2]"], r"list\.steps\.jsonl:2: a record must"),
             "keys.steps.jsonl": (lines[:1] + ['{"step": 0}'], "malformed step records")}
    for name, (content, match) in cases.items():
        (tmp_path / name).write_text("\n".join(content) + "\n")
        with pytest.raises(SystemExit, match=match):
            main(["trace", str(tmp_path / name), "-o", str(tmp_path / "o")])
    taken = tmp_path / "a-file"
    taken.write_text("")
    with pytest.raises(SystemExit, match="cannot write to the output directory"):
        main(["trace", records, "-o", str(taken)])


def test_async_engine_writes_its_trace_on_shutdown(traced_run, tmp_path):
    """The server's engine (`pagedlm serve --trace-file`) writes the trace when it stops."""
    import asyncio

    from pagedlm.engine.arg_utils import EngineArgs
    from pagedlm.engine.async_llm_engine import AsyncLLMEngine

    trace_file = str(tmp_path / "serve.json")
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(traced_run["model"], num_gpu_blocks_override=32, trace_file=trace_file),
        log_stats=False)

    async def run():
        async for out in engine.generate({"prompt_token_ids": [5, 6, 7, 8]},
                                         SamplingParams(max_tokens=5, ignore_eos=True),
                                         request_id="a"):
            last = out
        return last

    try:
        out = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(out.outputs[0].token_ids) == 5
    meta, steps = load_records(records_path(trace_file))
    assert meta["num_blocks"] == 32
    assert [x["kind"] for s in steps for x in s["scheduled"]] == ["prefill"] + ["decode"] * 4
    assert steps[-1]["finished"] == ["a"] and "u" not in steps[-1]["block_map"]
    with open(trace_file) as f:
        assert json.load(f)["traceEvents"]
