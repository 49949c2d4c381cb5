"""benchmarks/compare.py's own parts, without the peers (vLLM, llama.cpp) it compares against:
requests, count checks, ratios, and the server lifecycle of compare_servers.py (a stand-in HTTP
server)."""
from __future__ import annotations

import importlib.util
import random
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def compare():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("compare")
    finally:
        sys.path.remove(str(BENCHMARKS))
        for name in ("compare", "compare_servers", "peers", "serving"):
            sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def servers(compare):
    return sys.modules["compare_servers"]


def test_system_specs(compare):
    s = compare.parse_system("pagedlm:gguf=--quantization gguf --max-num-batched-tokens 512")
    assert (s.name, s.base, s.extra_args) == (
        "pagedlm:gguf", "pagedlm", ("--quantization", "gguf", "--max-num-batched-tokens", "512"))
    s = compare.parse_system("llamacpp-q4_1")
    assert (s.name, s.base, s.gguf_type, s.extra_args) == ("llamacpp-q4_1", "llamacpp", "Q4_1", ())
    assert compare.parse_system("vllm").base == "vllm"
    for bad in ("tgi", "pagedlm=--x", "pagedlm:=--x", "llamacpp-"):
        with pytest.raises(ValueError, match="--systems entry"):
            compare.parse_system(bad)
    with pytest.raises(SystemExit):
        compare.parse_args(["--systems", "pagedlm", "pagedlm"])


def test_requests_are_ordinary_tokens_in_range(compare, default_model_dir):
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(Path(default_model_dir) / "tokenizer.json"))
    vocab = compare.ordinary_token_ids(default_model_dir)
    template_tokens = {tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>",
                                                          "<|endoftext|>")}
    assert None not in template_tokens and not template_tokens & set(vocab)
    assert len(vocab) > 0.9 * tokenizer.get_vocab_size()
    # Every id decodes to text and back to itself alone: ordinary tokens only.
    sample = random.Random(0).sample(vocab, 200)
    assert sum(tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False).ids == [t]
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


def test_count_check(compare):
    r = compare.Request(prompt=[5, 6, 7], max_tokens=4)
    compare.check_counts("s", "batch", 0, r, 3, 4)
    for prompt_tokens, completion_tokens in ((3, 3), (4, 4), (None, 4), (3, None)):
        with pytest.raises(compare.CountMismatch, match="s batch request 0"):
            compare.check_counts("s", "batch", 0, r, prompt_tokens, completion_tokens)


def test_quantile_and_ratios(compare):
    values = [float(v) for v in range(1, 101)]
    random.Random(0).shuffle(values)
    assert compare.quantile(values, 0.5) == 50 and compare.quantile(values, 0.99) == 99
    assert compare.quantile([3.0], 0.99) == 3.0
    figures = {"a": {"batch_output_tps": 200.0, "serving_tpot_p50": 40.0},
               "b": {"batch_output_tps": 100.0, "serving_tpot_p50": 20.0},
               "c": {"single_tps": 10.0}}
    ratios = compare.ratios_of(figures, ["b", "missing"])
    assert set(ratios) == {"b"}
    # Above 1 means better: twice b's throughput, half b's speed per token.
    assert ratios["b"]["a"] == {"batch_output_tps": 2.0, "serving_tpot_p50": 0.5}
    assert ratios["b"]["c"] == {}
    text = compare.render(figures, ratios, {"d": "RuntimeError: boom"})
    assert "| a | 200.0 | - | 40.0 |" in text and "2.00x" in text and "FAILED d" in text


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
