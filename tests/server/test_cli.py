"""The `pagedlm` command line: flags generated from EngineArgs, and `serve`, `generate` and `chat`
run as real subprocesses on the default model."""
from __future__ import annotations

import dataclasses
import enum
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
import typing
from pathlib import Path

import httpx
import openai
import pytest
import torch

from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.entrypoints.cli import make_parser
from pagedlm.entrypoints.cli_args import (DEFAULT_MAX_REQUEST_BODY_VALUES,
                                           engine_args_from_namespace, parse_size)
from tests.server_utils import free_port

REPO = Path(__file__).resolve().parents[2]
ENGINE_FLAGS = ["--max-model-len", "256", "--num-gpu-blocks-override", "64"]
API_KEY = "sk-cli-test"
PROMPT = "The best way to learn a language is"


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedlm.entrypoints.cli", *args]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("PAGEDLM_API_KEY", None)
    # The thread count conftest chose for this xdist worker: a child with a thread per core,
    # beside the other worker's processes, spin-waits against them (a chat once ran past 300 s).
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    return env


def _sample_value(name: str, tp):
    """A value of the field's type that differs from its default, and its command-line form."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if tp is bool:
        return None, None  # handled separately: --flag / --no-flag
    if typing.get_origin(tp) is typing.Literal:
        v = typing.get_args(tp)[-1]
        return v, str(v)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        member = list(tp)[-1]
        return member, member.name.lower()
    if tp is int:
        return 4096, "4096"
    if tp is float:
        return 0.5, "0.5"
    return "float32" if name == "dtype" else "some-value", ("float32" if name == "dtype"
                                                            else "some-value")


def _serve_actions():
    serve = next(a for a in make_parser()._subparsers._group_actions[0].choices.values()
                 if a.prog.endswith("serve"))
    return serve._actions


def test_every_engine_arg_has_a_flag():
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        if not f.init:
            continue
        flag = "--" + f.name.replace("_", "-")
        base = hints[f.name]
        if base is bool:
            for argv, expected in (([flag], True), (["--no-" + flag[2:]], False)):
                ns = make_parser().parse_args(["serve", *argv])
                assert getattr(engine_args_from_namespace(ns), f.name) is expected, f.name
            continue
        value, text = _sample_value(f.name, base)
        if f.name == "kv_cache_memory_bytes":
            value = 4096
        if f.name == "pooler_config":  # a JSON object on the command line
            value, text = {"pooling_type": "MEAN"}, '{"pooling_type": "MEAN"}'
        if f.name == "speculative_config":  # likewise
            value = {"method": "ngram", "num_speculative_tokens": 3}
            text = '{"method": "ngram", "num_speculative_tokens": 3}'
        choices = next(a.choices for a in _serve_actions() if a.dest == f.name)
        if choices:  # a str field with fixed choices: one that is not the default
            value = text = [c for c in choices if c != f.default][-1]
        ns = make_parser().parse_args(["serve", flag, text])
        assert getattr(engine_args_from_namespace(ns), f.name) == value, f.name
    # Unset flags keep EngineArgs' defaults.
    assert engine_args_from_namespace(make_parser().parse_args(["serve"])) == EngineArgs()


def test_vllm_style_flags_and_sizes():
    ns = make_parser().parse_args(["serve", "model.gguf", "--kv-cache-memory", "2GiB",
                                   "--max-model-len", "1024", "--max-num-seqs", "8",
                                   "--max-num-batched-tokens", "2048", "--block-size", "32",
                                   "--dtype", "bfloat16", "--seed", "3",
                                   "--tokenizer", "tokenizer-dir"])
    args = engine_args_from_namespace(ns)
    assert args == EngineArgs(model="model.gguf", kv_cache_memory_bytes=2 * 2**30,
                              max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=2048,
                              block_size=32, dtype="bfloat16", seed=3, tokenizer="tokenizer-dir")
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    assert parse_size("1e9") == 10**9
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--kv-cache-memory", "lots"])
    # Refused before the model loads (a port out of range was an OverflowError at bind).
    assert make_parser().parse_args(["serve", "--port", "0"]).port == 0
    for bad in ("99999", "-1", "http"):
        with pytest.raises(SystemExit):
            make_parser().parse_args(["serve", "--port", bad])
    assert make_parser().parse_args(["serve", "--allowed-origins", "a.test, b.test"]
                                    ).allowed_origins == ["a.test", "b.test"]
    with pytest.raises(SystemExit):  # JSON with a typo, not a comma list named "[bad"
        make_parser().parse_args(["serve", "--allowed-origins", "[bad"])
    # An empty key turned authentication off; a model named "" no client could ask for.
    for flags in (["--api-key", ""], ["--served-model-name", ""], ["--served-model-name", " m"],
                  ["--timeout-keep-alive", "-1"], ["--log-stats-interval", "0"]):
        with pytest.raises(SystemExit):
            make_parser().parse_args(["serve", *flags])


def test_help():
    out = subprocess.run(cli("serve", "--help"), capture_output=True, text=True, cwd=REPO,
                         env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                 "--block-size", "--dtype", "--seed", "--kv-cache-memory", "--api-key",
                 "--served-model-name", "--allowed-origins", "--port", "MODEL"):
        assert flag in out.stdout, flag
    top = subprocess.run(cli("--help"), capture_output=True, text=True, cwd=REPO, env=_env(),
                         timeout=120)
    assert all(cmd in top.stdout for cmd in ("serve", "generate", "chat"))


def _start_serve(log: Path, *flags: str, hangup=None) -> tuple[str, subprocess.Popen]:
    """`pagedlm serve *flags` as a real subprocess, once /health answers. hangup: SIGHUP's
    disposition to start it with (SIG_DFL, SIG_IGN), where not this process's (an ignored
    one is inherited: a suite run under nohup)."""
    port = free_port()
    command = cli("serve", "--port", str(port), *flags)
    if hangup is not None:
        command[1:3] = ["-c", f"import runpy, signal, sys; signal.signal(signal.SIGHUP, "
                              f"signal.Handlers({int(hangup)})); del sys.argv[0]; "
                              f"runpy.run_module('pagedlm.entrypoints.cli', run_name='__main__')",
                        "pagedlm"]
    with open(log, "w") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                env=_env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"pagedlm serve exited: {log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"pagedlm serve did not come up: {log.read_text()}")
        time.sleep(0.3)
    return url, proc


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    url, proc = _start_serve(log, "--api-key", API_KEY, "--served-model-name", "cli-model",
                             "--log-stats-interval", "1", *ENGINE_FLAGS)
    yield url, proc, log
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_serve_subprocess(served):
    url, proc, log = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["cli-model"]
    r = client.completions.create(model="cli-model", prompt=PROMPT, max_tokens=8,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8 and r.choices[0].text
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    time.sleep(1.2)  # one stats interval
    text = log.read_text()
    assert "serving cli-model on http://127.0.0.1" in text
    assert "Avg prompt throughput" in text and "KV cache usage" in text


def test_generate_subprocess_matches_the_server(served):
    url = served[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    expected = client.completions.create(model="cli-model", prompt=PROMPT, max_tokens=10,
                                         temperature=0).choices[0].text
    out = subprocess.run(cli("generate", "--prompt", PROMPT, "--max-tokens", "10",
                             "--temperature", "0", *ENGINE_FLAGS),
                         capture_output=True, text=True, cwd=REPO, env=_env(), timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"


def test_chat_subprocess_keeps_history(served):
    url = served[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    questions = ["What is the capital of France?", "And of Italy?"]
    history, replies = [], []
    for q in questions:
        history.append({"role": "user", "content": q})
        reply = client.chat.completions.create(model="cli-model", messages=history,
                                               max_tokens=12,
                                               temperature=0).choices[0].message.content
        history.append({"role": "assistant", "content": reply})
        replies.append(reply)
    out = subprocess.run(cli("chat", "--max-tokens", "12", "--temperature", "0", *ENGINE_FLAGS),
                         input="\n".join(questions) + "\n", capture_output=True, text=True,
                         cwd=REPO, env=_env(), timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "".join(r + "\n" for r in replies)


def _gc_collections(url: str) -> int:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    [line] = [ln for ln in text.splitlines()
              if ln.startswith('python_gc_collections_total{generation="0"}')]
    return int(float(line.split()[-1]))


def test_serve_collects_garbage_once_started(served):
    """The start runs with the cyclic collector off (cli.main); the server it hands over to
    must collect again, or every request's cycles would stay for good."""
    url = served[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    before = now = _gc_collections(url)
    for _ in range(40):  # a pass comes every 700 objects kept; a few requests keep fewer
        client.chat.completions.create(model="cli-model", max_tokens=4,
                                       messages=[{"role": "user", "content": PROMPT}])
        now = _gc_collections(url)
        if now > before:
            break
    assert now > before


def test_large_bodies_do_not_stall_the_event_loop(served):
    """pydantic parses a body holding the GIL: a 24 MB body of 12M token ids (under the body
    limit) kept /health waiting 4.3-4.9 s. Past --max-request-body-values it is a 413 unparsed;
    at the limit the pause stays short. In a server of its own: in this process the probe
    would be waiting for the GIL, not for the event loop."""
    url = served[0]
    limit = DEFAULT_MAX_REQUEST_BODY_VALUES
    latencies, stop = [], threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                t0 = time.monotonic()
                assert client.get(url + "/health").status_code == 200
                latencies.append(time.monotonic() - t0)
                time.sleep(0.02)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    try:
        for n, status in ((12_000_000, 413), (limit - 1, 400)):
            ids = b",".join([b"5"] * n)
            for path, body in (("/v1/completions", b'{"max_tokens": 1, "prompt": [' + ids + b"]}"),
                               ("/detokenize", b'{"tokens": [' + ids + b"]}")):
                r = httpx.post(url + path, content=body, timeout=120, headers={
                    "Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
                assert r.status_code == status, r.text[:300]
        time.sleep(0.2)
    finally:
        stop.set()
        thread.join(60)
    assert len(latencies) > 10 and max(latencies) < 1.0, \
        f"/health took {max(latencies):.2f} s ({len(latencies)} probes)"
    assert "unhandled error" not in served[2].read_text()


def test_serve_stops_cleanly_on_sigint(served):
    proc = served[1]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["term", "hup"])
def test_serve_shuts_the_engine_down_on_sigterm(tmp_path, signum):
    """A supervisor's SIGTERM, or a closed terminal's SIGHUP, stops the server as Ctrl-C does:
    a stream under way gets its end, the engine's shutdown runs (the trace file is written,
    no temporary file left) and the exit status is 0. uvicorn raised SIGTERM again under its
    default action, which killed the process (-15) first; SIGHUP's default killed it at once
    (-1), the stream cut without its [DONE]."""
    log, trace = tmp_path / "serve.log", tmp_path / "run.json"
    # A long grace: a busy machine must not turn the stream's end into the grace's cut.
    url, proc = _start_serve(log, "--trace-file", str(trace),
                             "--timeout-graceful-shutdown", "120", hangup=signal.SIG_DFL)
    try:
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"prompt": PROMPT, "max_tokens": 3})
        assert r.status_code == 200, r.text
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signum)
            rest = list(lines)
        assert "data: [DONE]" in rest, rest[-3:]
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert json.loads(trace.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["serve.log", "run.json", "run.steps.jsonl"])


def test_serve_under_nohup_keeps_ignoring_sighup(tmp_path):
    """Started with SIGHUP ignored (nohup), the server stays so: a closed terminal does not
    stop it."""
    url, proc = _start_serve(tmp_path / "serve.log", hangup=signal.SIG_IGN)
    try:
        proc.send_signal(signal.SIGHUP)
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"prompt": PROMPT, "max_tokens": 3})
        assert r.status_code == 200 and proc.poll() is None, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_long_stream_cannot_hold_the_shutdown(tmp_path):
    """A stream of 4000 tokens (tens of seconds on two cores) is cancelled and aborted
    --timeout-graceful-shutdown seconds after SIGINT; uvicorn alone waited for its end."""
    log = tmp_path / "serve.log"
    url, proc = _start_serve(log, "--max-model-len", "4200", "--num-gpu-blocks-override", "300",
                             "--timeout-graceful-shutdown", "1")
    chunks, ended = [], threading.Event()

    def read() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True,
                    "stream": True}) as r:
                for line in r.iter_lines():
                    chunks.append(line)
        except httpx.TransportError:
            pass  # the connection closed under the read: the stream ended too
        ended.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while len(chunks) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(chunks) >= 10, log.read_text()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert ended.wait(10)
    assert took < 8, f"exit took {took:.1f} s"
    assert len(chunks) < 3000  # the stream did not run to its end
    text = log.read_text()
    assert "timeout graceful shutdown exceeded" in text
    assert "unhandled error" not in text
    # The client is told, and the log has a line, not a traceback per stream.
    events = [c for c in chunks if c]
    assert "The server is shutting down" in events[-2] and events[-1] == "data: [DONE]", \
        events[-3:]
    assert "Exception in ASGI application" not in text and "CancelledError" not in text


def test_configs_check_their_own_fields_and_are_frozen(monkeypatch):
    """Each config refuses a bad value itself, whoever builds it, and cannot change after."""
    from pagedlm import envs
    from pagedlm.config import CacheConfig, LoRAConfig, ParallelConfig, SchedulerConfig
    from pagedlm.request_limits import RequestLimits
    cases = [(lambda: CacheConfig(block_size=0), "block_size must be a positive integer"),
             (lambda: CacheConfig(block_size=10**6), "block_size must be at most 256"),
             (lambda: LoRAConfig(max_lora_rank=10**7), "max_lora_rank must be at most 512"),
             (lambda: CacheConfig(prefix_caching_hash_algo="md5"), "prefix_caching_hash_algo"),
             (lambda: CacheConfig(cache_dtype=torch.int8), "cache_dtype"),
             (lambda: SchedulerConfig(8, 16, 8), r"max_num_batched_tokens \(8\) must be >= "),
             (lambda: SchedulerConfig(64, 8, 128, enable_chunked_prefill=False),
              r"max_num_batched_tokens \(64\) is smaller than max_model_len \(128\)"),
             (lambda: SchedulerConfig(64, 8, 64, policy="lifo"), "scheduling_policy"),
             (lambda: LoRAConfig(max_loras=2, max_cpu_loras=1), r"max_cpu_loras \(1\) must be"),
             (lambda: RequestLimits(max_bad_words=-1), "max_bad_words must be an integer >= 0"),
             (lambda: ParallelConfig(2, 1, "uni"), "distributed_executor_backend 'uni'"),
             (lambda: ParallelConfig(0), "tensor_parallel_size must be a positive integer"),
             # before the load (it was torch's "Overflow when unpacking long long" after it)
             (lambda: EngineArgs(seed=2**70).create_engine_config(),
              "seed must be a 64-bit integer")]
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()
    # A backend left to ParallelConfig is resolved once, with the workers' share of the cores.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    pc = ParallelConfig(2, 1)
    assert pc.distributed_executor_backend == "mp"
    assert pc.threads_per_worker == max(1, (os.cpu_count() or 1) // 2)
    assert ParallelConfig().distributed_executor_backend == "uni"
    # EngineArgs only assembles: what it is given reaches the configs' constructors.
    config = EngineArgs(max_model_len=256, max_logprobs=5, max_num_seqs=4).create_engine_config()
    assert (config.model_config.max_logprobs, config.model_config.runner) == (5, "generate")
    assert config.scheduler_config.max_num_seqs == 4
    for part in (config, config.model_config, config.cache_config, config.scheduler_config,
                 config.parallel_config, config.request_limits):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(part, dataclasses.fields(part)[0].name, None)
    # Environment variables are read when asked for, not at import.
    monkeypatch.setenv("PAGEDLM_DISABLE_ONEDNN", "yes")
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "yes")  # vLLM takes 1/true only
    assert envs.PAGEDLM_DISABLE_ONEDNN and not envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING
    monkeypatch.delenv("PAGEDLM_DISABLE_ONEDNN")
    assert not envs.PAGEDLM_DISABLE_ONEDNN
    with pytest.raises(AttributeError):
        envs.PAGEDLM_NOT_A_SETTING
