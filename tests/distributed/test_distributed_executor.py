"""Distributed execution through the engine: worker processes (mp) and Ray actors, tensor and
pipeline parallelism, against one in-process worker; the per-step message; failures; cleanup.

Marked slow (they start processes): `pytest -m "not slow"` skips them; CI runs them."""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.executor.abstract import WorkerFailedError
from tests.compare_utils import assert_greedy_logprobs_match, assert_greedy_outputs_match
from tests.conftest import make_tiny_model
from tests.server_utils import free_port

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,",
           "def fibonacci(n):", "The three primary colors are"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)


def worker_children() -> list[psutil.Process]:
    """This test process's children, less multiprocessing's own resource tracker."""
    return [p for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(_cmdline(p))]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def assert_no_workers_left(timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (left := [p for p in worker_children() if p.is_running()
                    and p.status() != psutil.STATUS_ZOMBIE]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"worker processes left behind: {left}"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("dist")
    return {arch: make_tiny_model(root, arch, default_model_dir)
            for arch in ("llama", "qwen2", "mistral")}


def run(path, params=GREEDY, prompts=PROMPTS, **engine_kwargs):
    with LLM(path, max_model_len=256, kv_cache_memory_bytes=8 * 2**20,
             **engine_kwargs) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def assert_same(ref, got, atol=1e-3):
    """Greedy outputs of another layout: its shards sum in another order, so the tokens are the
    same up to a near-tie (tests/compare_utils.py), and so are the logprobs, up to there."""
    assert_greedy_logprobs_match(ref, got, atol)


BOTH = dict(tensor_parallel_size=2, pipeline_parallel_size=2)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tp_and_pp_over_mp_match_one_worker(tiny_models, arch):
    """Llama runs each layout; the others (their own attention biases, windows) only TP=2 x
    PP=2, which exercises both splits (each layout is ~7 s of worker start-up here)."""
    path = tiny_models[arch]
    ref = run(path)
    layouts = ([dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2), BOTH]
               if arch == "llama" else [BOTH])
    for layout in layouts:
        assert_same(ref, run(path, distributed_executor_backend="mp", **layout))
    assert_no_workers_left()


SEEDED = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12, ignore_eos=True)
          for i in range(len(PROMPTS))]
MIXED_PROMPTS = PROMPTS + ["Noise one", "Noise two", "Noise three"]
MIXED_PARAMS = SEEDED + [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 3


def assert_seeded_draws_ignore_the_engine_seed(path, **layout) -> None:
    """A seeded request draws from its own generator, kept by the worker that samples: another
    engine seed changes the unseeded requests' draws, never the seeded ones'.

    Compared within one layout and one batch shape, where the seeded rows' logits are the same
    bit for bit (the unseeded rows change only values, never shapes: ignore_eos). Across
    layouts, batch sizes or CPUs the logits differ in the last bits, which can move any draw."""
    runs = [[o.token_ids for o in run(path, MIXED_PARAMS, MIXED_PROMPTS, seed=engine_seed,
                                      **layout)] for engine_seed in (0, 1)]
    (seeded, unseeded), (seeded_again, unseeded_again) = (
        (r[:len(SEEDED)], r[len(SEEDED):]) for r in runs)
    assert unseeded_again != unseeded  # the engine seed did reach the sampler
    assert seeded_again == seeded
    assert all(len(t) == 12 for t in seeded) and len({tuple(t) for t in seeded}) > 1


def test_seeded_sampling_ignores_the_engine_seed(tiny_models):
    """With one worker and with TP=2 over mp (Ray: test_ray_executor.py)."""
    assert_seeded_draws_ignore_the_engine_seed(tiny_models["llama"])
    assert_seeded_draws_ignore_the_engine_seed(tiny_models["llama"], tensor_parallel_size=2,
                                               distributed_executor_backend="mp")


def test_smollm2_tp3_over_mp_matches_one_worker(default_model_dir):
    """9 heads, 3 KV heads: each rank one KV head. Float sums in another order may flip an
    exact near-tie, so at least 7 of 8 prompts must match and any difference must start at a
    near-tie of the one-worker run."""
    prompts = [f"Question {i}: what is {i} times {i + 3}? Answer:" for i in range(4)] + [
        "Write a haiku about the sea.", "List three fruits:", "The history of Rome",
        "import numpy as np\n"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    with LLM(kv_cache_memory_bytes=64 * 2**20) as llm:
        ref = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(kv_cache_memory_bytes=64 * 2**20, tensor_parallel_size=3) as llm:
        assert llm.llm_engine.config.parallel_config.distributed_executor_backend == "mp"
        got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert assert_greedy_outputs_match(ref, got) >= 7
    assert_no_workers_left()


def test_decode_steps_send_only_new_ids(tiny_models):
    """After a request's first step its decode steps carry a few integers per sequence,
    however long the sequences grow: the message scales with the batch, not the context."""
    largest = {}
    for batch in (4, 16):
        with LLM(tiny_models["llama"], max_model_len=256, block_size=8,
                 kv_cache_memory_bytes=16 * 2**20) as llm:
            engine = llm.llm_engine
            sizes, reqs = [], []
            real = engine.executor.execute_model

            def spy(req):
                sizes.append(len(pickle.dumps(req)))
                reqs.append(req)
                return real(req)

            engine.executor.execute_model = spy
            prompts = [{"prompt_token_ids": [100 + i] * 60} for i in range(batch)]
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                         use_tqdm=False)
        first, decodes = sizes[0], sizes[1:]
        assert reqs[0].new_requests and len(reqs[0].new_seqs) == batch
        assert all(not r.new_requests and not r.new_seqs for r in reqs[1:])
        assert all(all(len(t) == 1 for t in r.cached_seqs.new_token_ids) for r in reqs[1:])
        assert first > batch * 60 * 2  # every prompt in full, once
        # A block id joins every 8 tokens; otherwise the size stays flat as contexts grow
        # from 61 to 107 tokens.
        assert max(decodes) - min(decodes) <= 8 * batch + 16, decodes
        largest[batch] = max(decodes)
    per_seq = (largest[16] - largest[4]) / 12
    assert per_seq < 40, largest  # about a dozen small ints and list overheads
    assert largest[4] < 1000, largest  # the rest is the message's fixed shape


def test_deleting_an_llm_stops_its_worker_processes(tiny_models):
    llm = LLM(tiny_models["llama"], pipeline_parallel_size=2, max_model_len=256,
              kv_cache_memory_bytes=8 * 2**20)
    procs = llm.llm_engine.executor.procs
    workers = [psutil.Process(p.pid) for p in procs]
    assert all(w.is_running() for w in workers)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    del llm  # no explicit shutdown: the LLM's last reference goes
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, alive
    assert [p.exitcode for p in procs] == [0, 0]  # each left on its own, not killed
    assert_no_workers_left()


def test_a_killed_worker_fails_generate_naming_the_rank(tiny_models):
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, max_model_len=512,
              kv_cache_memory_bytes=16 * 2**20)
    victim = llm.llm_engine.executor.procs[1]
    timer = threading.Timer(1.0, os.kill, (victim.pid, signal.SIGKILL))
    timer.start()
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match="rank 1"):
        llm.generate(PROMPTS * 8, SamplingParams(temperature=0, max_tokens=400,
                                                 ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 11
    timer.join()
    del llm
    assert_no_workers_left()


INTERRUPTED = """\
import json, os, signal, sys, threading
# An ignored SIGINT is inherited (pytest-xdist's workers ignore it), and Python then leaves it.
signal.signal(signal.SIGINT, signal.default_int_handler)
from pagedlm import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=512,
          kv_cache_memory_bytes=16 * 2**20)
prompts = json.loads(sys.argv[2])
greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ref = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
try:
    llm.generate(prompts * 8, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
                 use_tqdm=False)
    interrupted = False
except KeyboardInterrupt:
    interrupted = True
again = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
         for _ in range(2)]
bm = llm.llm_engine.block_manager
print(json.dumps({"interrupted": interrupted, "same": again == [ref, ref],
                  "free": bm.num_free_blocks == bm.num_blocks}))
"""


def test_ctrl_c_mid_generate_leaves_the_llm_usable(tiny_models):
    """Ctrl-C (a notebook's interrupt) while the workers run a step: the next generate reads
    that step's answers first. It read each step's answer one step late instead, for good
    (KeyError in the output processor at every later call)."""
    out = subprocess.run([sys.executable, "-c", INTERRUPTED, tiny_models["llama"],
                          json.dumps(PROMPTS)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "interrupted": True, "same": True, "free": True}


# The subprocess scripts' shared parts: a tp=2 LLM on argv[1] and greedy references for the
# prompts in argv[2] (SIGINT raising: pytest-xdist's workers pass it on ignored); after the
# interrupted call, the next call's tokens against them ("same", or the executor's error).
TP2_SCRIPT_HEAD = """\
import inspect, json, os, signal, sys, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from pagedlm import LLM, SamplingParams
from pagedlm.executor.abstract import WorkerFailedError
from pagedlm.executor.multiproc_executor import MultiprocExecutor
llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=512,
          kv_cache_memory_bytes=16 * 2**20)
prompts = json.loads(sys.argv[2])
greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ref = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
"""
TP2_SCRIPT_AFTER = """\
try:
    same = [list(o.outputs[0].token_ids)
            for o in llm.generate(prompts, greedy, use_tqdm=False)] == ref
    after = "same" if same else "differs"
except WorkerFailedError as e:
    after = str(e)
"""
INTERRUPTED_SEND = TP2_SCRIPT_HEAD + """\
presses = int(sys.argv[3])
# A stopped worker holds the send of a step past the pipe's buffer for as long as it is
# stopped: the Ctrl-Cs come while the parent writes that step.
victim = llm.llm_engine.executor.procs[1]
os.kill(victim.pid, signal.SIGSTOP)
for i in range(presses):
    threading.Timer(0.5 + 0.5 * i, os.kill, (os.getpid(), signal.SIGINT)).start()
threading.Timer(2.0, os.kill, (victim.pid, signal.SIGCONT)).start()
try:
    llm.generate("Hello", SamplingParams(max_tokens=4, allowed_token_ids=list(range(40_000))),
                 use_tqdm=False)
    interrupted = False
except KeyboardInterrupt:
    interrupted = True
""" + TP2_SCRIPT_AFTER + """\
bm = llm.llm_engine.block_manager
print(json.dumps({"interrupted": interrupted, "after": after,
                  "free": bm.num_free_blocks == bm.num_blocks}))
"""


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_while_a_step_is_sent(tiny_models, presses):
    """Ctrl-C while the parent writes a step to the workers' pipes: the write ends first, so
    the pipes stay whole and the LLM usable (it stopped every worker, for good: a pipe holding
    part of a message cannot be followed). A second Ctrl-C gives up on the write: the workers
    are stopped and the next call says why."""
    out = subprocess.run([sys.executable, "-c", INTERRUPTED_SEND, tiny_models["llama"],
                          json.dumps(PROMPTS), str(presses)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["interrupted"] and result["free"], result
    if presses == 1:
        assert result["after"] == "same", result
    else:
        assert "interrupted while sending 'execute_model'" in result["after"], result
    assert_no_workers_left()


INTERRUPTED_READ = TP2_SCRIPT_HEAD + """\
# A second Ctrl-C on the line after an answer's read (as a trace hook can place one): raised
# from a trace function, the exception comes at that line.
code = MultiprocExecutor._gather.__code__
lines, first = inspect.getsourcelines(code)
recv_line = first + next(i for i, text in enumerate(lines) if ".recv()" in text)
state = {"armed": True, "after_recv": False}
def local(frame, event, arg):
    if event == "line" and state["armed"]:
        if state["after_recv"]:
            state["armed"] = False
            raise KeyboardInterrupt
        state["after_recv"] = frame.f_lineno == recv_line
    return local
sys.settrace(lambda frame, event, arg: local if frame.f_code is code else None)
try:
    llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)
    interrupted = False
except KeyboardInterrupt:
    interrupted = True
sys.settrace(None)
start = time.monotonic()
""" + TP2_SCRIPT_AFTER + """\
print(json.dumps({"interrupted": interrupted, "after": after,
                  "seconds": time.monotonic() - start}))
"""


def test_an_answer_read_as_the_call_is_interrupted_is_not_awaited_again(tiny_models):
    """A second Ctrl-C on the line after a worker's answer was read (found by a line-level
    SIGINT injection: 3 of 124 double-press points) left that rank pending: the next call
    waited for an answer already taken, until the deadline, then stopped the workers blaming
    a healthy rank."""
    out = subprocess.run([sys.executable, "-c", INTERRUPTED_READ, tiny_models["llama"],
                          json.dumps(PROMPTS)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PAGEDLM_ENGINE_ITERATION_TIMEOUT_S": "30"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["interrupted"] and result["after"] == "same", result
    assert result["seconds"] < 20, result
    assert_no_workers_left()


def test_a_stopped_worker_cannot_block_the_send_past_the_deadline(tiny_models, monkeypatch):
    """A stopped worker stops reading its pipe: a step larger than the socket's buffer (here a
    request's 40,000 allowed_token_ids) blocked the send for good, before the step's deadline
    was ever checked. Now the step fails at the deadline, naming the rank."""
    monkeypatch.setenv("PAGEDLM_ENGINE_ITERATION_TIMEOUT_S", "2")
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, max_model_len=512,
              kv_cache_memory_bytes=16 * 2**20)
    victim = llm.llm_engine.executor.procs[1]
    os.kill(victim.pid, signal.SIGSTOP)
    errors = []

    def generate(llm: LLM) -> None:
        try:
            llm.generate("Hello", SamplingParams(max_tokens=4, allowed_token_ids=list(
                range(40_000))), use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - checked below
            errors.append(e)
    thread = threading.Thread(target=generate, args=(llm,), daemon=True)
    try:
        start = time.monotonic()
        thread.start()
        thread.join(30)  # without the deadline: blocked until the victim is killed below
        assert not thread.is_alive(), "the send blocked past the deadline"
        assert time.monotonic() - start < 8
        assert len(errors) == 1 and isinstance(errors[0], WorkerFailedError), errors
        assert "worker rank 1 did not read" in str(errors[0])
        assert "worker rank 1 is stopped" in str(errors[0])
    finally:
        if victim.is_alive():
            os.kill(victim.pid, signal.SIGKILL)
        thread.join(30)
    del llm
    assert_no_workers_left()


def test_a_killed_worker_fails_the_request_and_stops_the_server(tiny_models):
    from pagedlm.engine.async_llm_engine import AsyncLLMEngine
    from tests.server_utils import serve_in_thread
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        model=tiny_models["llama"], tensor_parallel_size=2, max_model_len=512,
        kv_cache_memory_bytes=16 * 2**20))
    victim = engine.engine.executor.procs[0]
    with serve_in_thread(engine) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        timer = threading.Timer(1.0, os.kill, (victim.pid, signal.SIGKILL))
        timer.start()
        r = httpx.post(server.base_url + "/completions", timeout=60,
                       json={"prompt": "Hello", "max_tokens": 400, "ignore_eos": True})
        timer.join()
        assert r.status_code == 500 and "rank 0" in r.json()["error"]["message"]
        deadline = time.monotonic() + 10  # the app stops its server (test_engine_failure.py)
        with pytest.raises(httpx.TransportError):
            while time.monotonic() < deadline:
                assert httpx.get(server.url + "/health", timeout=2).status_code == 503
                time.sleep(0.05)
    engine.shutdown()
    assert_no_workers_left()


def test_bad_parallel_settings_fail_before_any_process_starts(tiny_models, monkeypatch):
    path = tiny_models["llama"]  # 4 heads, 2 KV heads, 3 layers
    cases = [(dict(tensor_parallel_size=3), "tensor_parallel_size"),
             (dict(pipeline_parallel_size=4), "pipeline_parallel_size"),
             (dict(tensor_parallel_size=0), "tensor_parallel_size"),
             (dict(tensor_parallel_size=2, distributed_executor_backend="uni"),
              "distributed_executor_backend"),
             (dict(distributed_executor_backend="threads"), "distributed_executor_backend")]
    for kwargs, field in cases:
        with pytest.raises(ValueError, match=field):
            LLM(path, **kwargs)
    # KV heads: 12 heads, 4 KV heads; 3 divides the heads but neither divides the other.
    from pagedlm.config import ModelConfig
    cfg = ModelConfig(None, path, torch.float32, 64, "LlamaForCausalLM",
                      {"num_attention_heads": 12, "num_key_value_heads": 4,
                       "num_hidden_layers": 2, "hidden_size": 48, "vocab_size": 100})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        cfg.verify_with_parallel_config(3, 1)
    cfg.verify_with_parallel_config(12, 1)  # a multiple of the KV heads: replicated, fine
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match="distributed_executor_backend 'ray' needs Ray"):
        LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert not worker_children()


def test_serve_tp2_answers_the_openai_client_and_leaves_no_worker(tiny_models):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([sys.executable, "-m", "pagedlm.entrypoints.cli", "serve",
                             tiny_models["llama"], "-tp", "2", "--port", str(port),
                             "--max-model-len", "256", "--kv-cache-memory", "16MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "pagedlm serve -tp 2 did not come up"
            time.sleep(0.3)
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert sum("pagedlm" in " ".join(_cmdline(p)) or "multiprocessing" in
                   " ".join(_cmdline(p)) for p in workers) >= 2
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(model=client.models.list().data[0].id,
                                      prompt="Hello", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5
        expected = run(tiny_models["llama"], SamplingParams(temperature=0, max_tokens=5,
                                                            ignore_eos=True), ["Hello"])
        assert r.choices[0].text == expected[0].text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, alive
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_engine_interrupted_after_its_workers_started_stops_them(tiny_models, monkeypatch):
    """A Ctrl-C (or an error) in LLMEngine's construction after the executor started left its
    workers to whatever collected the executor: with Ray, its actors and placement group and
    Ray itself stayed up (a retry in the process waited 120 s for their CPUs, then failed);
    with mp, for as long as the traceback kept the engine (a notebook keeps the last one)."""
    from pagedlm.engine import llm_engine

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(llm_engine, "Scheduler", interrupted)
    try:
        LLM(tiny_models["llama"], tensor_parallel_size=2, max_model_len=512,
            kv_cache_memory_bytes=16 * 2**20)
    except KeyboardInterrupt:
        # While the traceback still holds the half-built engine and its executor.
        assert_no_workers_left(timeout=1.0)
    else:
        raise AssertionError("the construction was not interrupted")


def test_an_llm_built_on_a_thread_that_ended_keeps_its_workers(tiny_models):
    """Workers die with the thread that started them (PR_SET_PDEATHSIG), not the process: an
    LLM built on a thread that then ended (a pool's, a framework's start-up) found both
    workers killed (signal 9) at its first call."""
    built = []
    thread = threading.Thread(target=lambda: built.append(LLM(
        tiny_models["llama"], tensor_parallel_size=2, max_model_len=512,
        kv_cache_memory_bytes=16 * 2**20)))
    thread.start()
    thread.join()
    (llm,) = built
    time.sleep(0.5)  # the kernel's signal, where one comes, is not instant
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    llm.llm_engine.executor.shutdown()
    assert_no_workers_left()


GROUP_SIGNALED = """\
import json, signal, sys
from pagedlm import LLM, SamplingParams
from pagedlm.executor.abstract import WorkerFailedError
llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=512,
          kv_cache_memory_bytes=16 * 2**20)
caught = []
for s in (signal.SIGHUP, signal.SIGTERM):  # as a server stopping gracefully takes them
    signal.signal(s, lambda signum, frame: caught.append(signum))
print("ready", flush=True)
sys.stdin.readline()  # the test signals the whole group, then writes a line
try:
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    after = len(out[0].outputs[0].token_ids)
except WorkerFailedError as e:
    after = str(e)
print(json.dumps({"caught": caught, "after": after}), flush=True)
"""


def test_a_signal_to_the_whole_process_group_leaves_the_workers_to_the_engine(tiny_models):
    """A closed terminal (SIGHUP) or systemd's control-group stop (SIGTERM) signals every
    process of the group: the workers, which ignored only SIGINT, died at once, under a server
    that was stopping gracefully (every stream failed, exit 1)."""
    proc = subprocess.Popen([sys.executable, "-c", GROUP_SIGNALED, tiny_models["llama"]],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        for signum in (signal.SIGHUP, signal.SIGTERM):
            os.killpg(proc.pid, signum)
        time.sleep(1.0)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        result = json.loads(proc.stdout.readline())
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert sorted(result["caught"]) == [signal.SIGHUP, signal.SIGTERM] and result["after"] == 4, \
        result
    assert_no_workers_left()


SECOND_PRESS_IN_READ = TP2_SCRIPT_HEAD + """\
code = MultiprocExecutor._gather.__code__
lines, first = inspect.getsourcelines(code)
recv_line = first + next(i for i, text in enumerate(lines) if ".recv()" in text)
state = {"calls": 0, "presses": 0}
def local(frame, event, arg):
    # The second press as an answer that is already on its pipe is read.
    if event == "line" and state["presses"] == 1 and frame.f_lineno == recv_line:
        state["presses"] = 2
        os.kill(os.getpid(), signal.SIGINT)
    return local
def calls(frame, event, arg):
    if frame.f_code is not code:
        return None
    state["calls"] += 1
    if state["calls"] == 3 and state["presses"] == 0:  # the first, held by the step
        state["presses"] = 1
        os.kill(os.getpid(), signal.SIGINT)
    return local
sys.settrace(calls)
try:
    llm.generate(prompts, greedy, use_tqdm=False)
    interrupted = False
except KeyboardInterrupt:
    interrupted = True
sys.settrace(None)
""" + TP2_SCRIPT_AFTER + """\
print(json.dumps({"interrupted": interrupted, "presses": state["presses"], "after": after}))
"""


def test_a_second_ctrl_c_waits_for_the_answer_being_read(tiny_models):
    """A second Ctrl-C while a worker's answer, already on its pipe, was read: raised inside
    the read, it stopped every worker (part of a message read), and the LLM was lost. The
    read is short (the message is there), so the press now waits for its end."""
    out = subprocess.run([sys.executable, "-c", SECOND_PRESS_IN_READ, tiny_models["llama"],
                          json.dumps(PROMPTS)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result == {"interrupted": True, "presses": 2, "after": "same"}, result
    assert_no_workers_left()
