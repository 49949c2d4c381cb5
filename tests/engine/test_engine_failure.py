"""The engine failure policy, as vLLM's: when a step raises or a worker process dies, the requests
in flight get an error, the cause is logged once, and `pagedlm serve` exits non-zero within
10 s (for a supervisor to restart it) instead of answering 500 forever; /health never keeps
answering 200 meanwhile. And a script with no main guard may start worker processes at module
level, as it may with vLLM.

Real faults only: the disk of the trace file fills up while serving (RLIMIT_FSIZE set on the
running server), and worker processes are killed with SIGKILL, mid-request and while idle.
Every test checks that no worker process is left behind."""
from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.metrics.tracer import records_path
from tests.compare_utils import assert_greedy_outputs_match
from tests.conftest import make_tiny_model
from tests.server_utils import free_port

REPO = Path(__file__).resolve().parents[2]
EXIT_BOUND_S = 10.0
SERVE_FLAGS = ["--max-model-len", "256", "--num-gpu-blocks-override", "32"]
LONG_REQUEST = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_dir) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("failure"), "llama", default_model_dir)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@dataclass
class Served:
    url: str
    proc: subprocess.Popen
    output: list[str] = field(default_factory=list)  # its stdout and stderr, by line

    @property
    def log(self) -> str:
        return "".join(self.output)

    def workers(self) -> list[psutil.Process]:
        return [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                if "pagedlm-worker-rank" in " ".join(_cmdline(p))]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


@contextlib.contextmanager
def serve(model: str, *flags: str, env: dict[str, str] | None = None):
    """`pagedlm serve` as a subprocess, its output read through a pipe (a file would be subject
    to the file-size limit that one test sets)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedlm.entrypoints.cli", "serve", model,
                             "--port", str(port), *SERVE_FLAGS, *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, env=_env(**(env or {})))
    served = Served(f"http://127.0.0.1:{port}", proc)
    reader = threading.Thread(target=lambda: served.output.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"pagedlm serve exited:\n{served.log}"
            try:
                if httpx.get(served.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"pagedlm serve did not come up:\n{served.log}"
            time.sleep(0.2)
        yield served
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)


def assert_exits_failed(served: Served, since: float, *, request_while_up: bool = True
                        ) -> list[int | None]:
    """The server exits non-zero within EXIT_BOUND_S of `since`; /health, polled meanwhile,
    never answers 200 again once it has stopped doing so, and a request sent meanwhile gets a
    5xx naming the failure at once (or finds the server gone). /health's answers (None:
    refused). request_while_up=False sends requests only once /health is down: a request sent
    before the engine noticed an idle death would find the dead worker itself."""
    answers: list[int | None] = []
    while served.proc.poll() is None:
        assert time.monotonic() - since < EXIT_BOUND_S, (
            f"still running {EXIT_BOUND_S} s after the failure; /health: {answers}\n"
            f"{served.log}")
        try:
            answers.append(httpx.get(served.url + "/health", timeout=1).status_code)
            if answers[-1] == 200 and not request_while_up:
                time.sleep(0.1)
                continue
            r = httpx.post(served.url + "/v1/completions", json=LONG_REQUEST, timeout=5)
            if answers[-1] != 200:
                assert r.status_code in (500, 503), r.text
                assert "not running" in r.json()["error"]["message"]
        except httpx.TransportError as e:
            assert not isinstance(e, httpx.TimeoutException), "a request hung"
            answers.append(None)
        time.sleep(0.1)
    assert served.proc.returncode not in (0, None), served.log
    first_down = next((i for i, a in enumerate(answers) if a != 200), len(answers))
    assert 200 not in answers[first_down:], answers
    assert set(answers[first_down:]) <= {503, None}, answers
    return answers


def assert_logged_once(log: str, cause: str) -> None:
    assert log.count("engine loop failed") == 1, log
    assert log.count("Traceback (most recent call last)") == 1, log
    assert log.count(cause) == 1, log


def assert_gone(workers: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, alive


def test_a_step_that_raises_fails_its_request_and_stops_the_server(tiny_model, tmp_path):
    """The disk of --trace-file fills up mid-request: the step's trace write raises OSError
    (EFBIG, the file-size limit standing in for a full disk)."""
    trace = tmp_path / "trace.json"
    with serve(tiny_model, "--trace-file", str(trace)) as served:
        records = Path(f"{records_path(str(trace))}.tmp-{served.proc.pid}")
        assert records.exists()
        # Records are written through an 8 KiB buffer: its first flush meets the limit.
        limit = records.stat().st_size + 1024
        resource.prlimit(served.proc.pid, resource.RLIMIT_FSIZE, (limit, limit))
        r = httpx.post(served.url + "/v1/completions", json=LONG_REQUEST, timeout=60)
        failed_at = time.monotonic()
        assert r.status_code == 500, r.text
        assert "File too large" in r.json()["error"]["message"]
        assert_exits_failed(served, failed_at)
    log = served.log
    assert_logged_once(log, "OSError: [Errno 27] File too large")
    assert "the engine failed" in log and "stopping the server" in log


def _generation_tokens(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    m = re.search(r"^pagedlm:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.slow
def _signal_mid_request(served: Served, victim: psutil.Process, sig: int
                        ) -> tuple[str, float]:
    """Send `sig` to a worker while a request generates: (the request's 500 message, when)."""
    result: dict[str, httpx.Response] = {}
    request = threading.Thread(target=lambda: result.update(r=httpx.post(
        served.url + "/v1/completions", json=LONG_REQUEST, timeout=60)))
    request.start()
    deadline = time.monotonic() + 60
    while _generation_tokens(served.url) < 2:  # it is generating
        assert time.monotonic() < deadline and request.is_alive(), result
        time.sleep(0.05)
    victim.send_signal(sig)
    sent_at = time.monotonic()
    request.join(30)
    r = result["r"]
    assert r.status_code == 500, r.text
    return r.json()["error"]["message"], sent_at


def test_a_worker_killed_mid_request_fails_it_and_stops_the_server(tiny_model):
    with serve(tiny_model, "-tp", "2", "--distributed-executor-backend", "mp") as served:
        workers = served.workers()
        assert len(workers) == 2, workers
        threads = str(max(1, (os.cpu_count() or 1) // 2))  # the node's cores, split
        assert all(w.environ().get("OMP_NUM_THREADS") == threads for w in workers)
        victim = next(w for w in workers if "pagedlm-worker-rank-1" in w.cmdline())
        message, killed_at = _signal_mid_request(served, victim, signal.SIGKILL)
        assert f"worker rank 1 (pid {victim.pid}) was killed by signal 9" in message
        assert_exits_failed(served, killed_at)
    assert_gone(workers)
    assert_logged_once(served.log, "was killed by signal 9")


def test_a_stopped_worker_fails_the_step_after_the_timeout(tiny_model):
    """A worker that stops answering (SIGSTOP stands in for one stuck in a collective): the
    step fails after PAGEDLM_ENGINE_ITERATION_TIMEOUT_S as if it had died. Every request hung
    for good, /health answered 200, and SIGTERM waited for the hung stream."""
    with serve(tiny_model, "-tp", "2", "--distributed-executor-backend", "mp",
               env={"PAGEDLM_ENGINE_ITERATION_TIMEOUT_S": "2"}) as served:
        workers = served.workers()
        assert len(workers) == 2, workers
        victim = next(w for w in workers if "pagedlm-worker-rank-1" in w.cmdline())
        message, stopped_at = _signal_mid_request(served, victim, signal.SIGSTOP)
        assert "did not finish 'execute_model' within 2 s" in message, message
        assert "worker rank 1 is stopped" in message, message  # of the ranks that missed it
        assert_exits_failed(served, stopped_at)
    assert_gone(workers)
    assert_logged_once(served.log, "PAGEDLM_ENGINE_ITERATION_TIMEOUT_S")


@pytest.mark.slow
def test_a_worker_killed_while_idle_stops_the_server(tiny_model):
    with serve(tiny_model, "-tp", "2", "--distributed-executor-backend", "mp") as served:
        workers = served.workers()
        assert len(workers) == 2, workers
        victim = next(w for w in workers if "pagedlm-worker-rank-0" in w.cmdline())
        victim.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        answers = assert_exits_failed(served, killed_at, request_while_up=False)
        assert answers and answers[-1] != 200
    assert_gone(workers)
    assert_logged_once(served.log, f"worker rank 0 (pid {victim.pid}) was killed by signal 9 "
                                   f"while the engine was idle")


SCRIPT = """\
from pagedlm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
llm = LLM({model!r}, tensor_parallel_size=2, max_model_len=128,
          kv_cache_memory_bytes=4 * 2**20)
out = llm.generate(["Hello"], GREEDY, use_tqdm=False)
print("TOP-LEVEL", type(llm.llm_engine.executor).__name__, out[0].outputs[0].token_ids)
llm.shutdown()

if __name__ == "__main__":  # the README's example
    with LLM({model!r}, tensor_parallel_size=2, max_model_len=128,
             kv_cache_memory_bytes=4 * 2**20) as llm:
        out = llm.generate("Hello", GREEDY, use_tqdm=False)
        print("GUARDED", type(llm.llm_engine.executor).__name__, out[0].outputs[0].token_ids)
"""


def _processes_with_env(name: str, value: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(name) == value:
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.mark.slow
def test_a_script_without_a_main_guard_starts_its_workers(tiny_model, tmp_path):
    """`llm = LLM(..., tensor_parallel_size=2)` at a script's top level, then the README's
    guarded example in the same script: both run, and every worker is gone at the end."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(model=tiny_model))
    marker = uuid.uuid4().hex  # inherited by the script's workers: finds them once orphaned
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env=_env(PAGEDLM_TEST_MARKER=marker))
    assert run.returncode == 0, run.stderr
    assert "bootstrapping" not in run.stderr
    with LLM(tiny_model, max_model_len=128, kv_cache_memory_bytes=4 * 2**20) as llm:
        expected = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=6,
                                                          ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].token_ids
    assert run.stdout.splitlines() == [f"TOP-LEVEL MultiprocExecutor {expected}",
                                       f"GUARDED MultiprocExecutor {expected}"]
    deadline = time.monotonic() + 10
    while (left := _processes_with_env("PAGEDLM_TEST_MARKER", marker)) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, left


def test_an_interrupted_generate_leaves_nothing_for_the_next(tiny_model):
    """Ctrl-C during LLM.generate: its requests are aborted and their blocks freed. They stayed
    queued: the next call ran them to the end and returned their outputs beside its own (5 for
    1 prompt). The KeyboardInterrupt comes out of the engine's 5th step, as Ctrl-C's would
    mid-step (a timer's interrupt_main raced the run's end, and pytest-xdist's workers)."""
    llm = LLM(tiny_model, num_gpu_blocks_override=256)
    engine = llm.llm_engine
    free = engine.block_manager.num_free_blocks
    real_step, steps = engine.step, 0

    def step():
        nonlocal steps
        steps += 1
        outputs = real_step()
        if steps == 5:
            raise KeyboardInterrupt
        return outputs

    engine.step = step
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([f"Tell me a long story {i}" for i in range(64)],
                         SamplingParams(max_tokens=500, ignore_eos=True), use_tqdm=False)
    finally:
        del engine.step
    assert steps == 5
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == free
    outs = llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 2
    llm.shutdown()


def test_ctrl_c_while_prompts_are_added_leaves_none_queued(tiny_model):
    """Ctrl-C while generate queues its prompts (tokenizing a long list): the ones queued are
    taken back. They stayed (the add loop took back only on Exception), and the next call ran
    them and returned their outputs beside its own. Interrupted here in the 3rd prompt's
    tokenization, and just after the 3rd was queued (a Ctrl-C there missed it too)."""
    llm = LLM(tiny_model, num_gpu_blocks_override=256)
    engine = llm.llm_engine
    free = engine.block_manager.num_free_blocks
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(["Hi", "Ho"], greedy, use_tqdm=False)]
    for where in ("tokenizing", "queued"):
        real = (engine.input_preprocessor.process if where == "tokenizing"
                else engine.add_request)
        calls = 0

        def interrupted(*args, real=real, **kwargs):
            nonlocal calls
            calls += 1
            if calls == 3 and where == "tokenizing":
                raise KeyboardInterrupt
            out = real(*args, **kwargs)
            if calls == 3:
                raise KeyboardInterrupt
            return out

        target = engine.input_preprocessor if where == "tokenizing" else engine
        name = "process" if where == "tokenizing" else "add_request"
        setattr(target, name, interrupted)
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate([f"Tell me a story {i}" for i in range(8)], greedy,
                             use_tqdm=False)
        finally:
            delattr(target, name)
        assert calls == 3
        assert not engine.has_unfinished_requests(), where
        assert engine.get_num_unfinished_requests() == 0, where
        outs = llm.generate(["Hi", "Ho"], greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, where
        assert engine.block_manager.num_free_blocks == free
    llm.shutdown()


def test_an_interrupted_step_leaves_no_unwritten_block_in_the_prefix_cache(tiny_model):
    """A KeyboardInterrupt in the model's forward (a Ctrl-C on the single-process executor),
    or in the scheduler after it admitted prompts (a second Ctrl-C, which does not wait for
    the step): the blocks the schedule had registered in the prefix cache (before the step
    computes them, so that a prompt admitted in the same step can share them) hold K/V never
    written. They stayed findable, and the same prompts asked again read that garbage as
    their cached prefix: every token differed, for good. Prompts of 8+ blocks."""
    from pagedlm.core.block_manager import BlockManager
    llm = LLM(tiny_model, num_gpu_blocks_override=256, block_size=16)
    reference = LLM(tiny_model, num_gpu_blocks_override=256, block_size=16,
                    enable_prefix_caching=False)
    engine = llm.llm_engine
    assert engine.config.cache_config.enable_prefix_caching
    free = engine.block_manager.num_free_blocks
    words = "river valley station flow method study report north south stone water".split()
    # (A cached prefix is read by another kernel than a computed one: other float sums, so
    # near-ties may part; the garbage a poisoned block gives is no near-tie.)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    layers = engine.executor.worker.model.layers
    last = layers[str(len(layers) - 1)]
    real_allocate = BlockManager.allocate_slots

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def admit_then_interrupt(self, *args, **kwargs):
        copies = real_allocate(self, *args, **kwargs)
        if kwargs.get("admission"):
            raise KeyboardInterrupt
        return copies

    for case, (owner, name, fn) in enumerate([(last, "forward", interrupted),
                                              (BlockManager, "allocate_slots",
                                               admit_then_interrupt)]):
        prompts = [f"Item {case} {i}: " + " ".join(words[(i + j) % len(words)]
                                                   for j in range(120)) for i in range(4)]
        want = [o.outputs[0] for o in reference.generate(prompts, greedy, use_tqdm=False)]
        setattr(owner, name, fn)
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(prompts, greedy, use_tqdm=False)
        finally:
            if owner is last:
                del last.forward
            else:
                BlockManager.allocate_slots = real_allocate
        assert engine.block_manager.num_free_blocks == free
        got = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert assert_greedy_outputs_match(want, got) >= 3, name
        # Caching still works: the prompts' blocks are found on a third ask.
        hits = engine.block_manager.prefix_hits
        got = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert assert_greedy_outputs_match(want, got) >= 3, name
        assert engine.block_manager.prefix_hits > hits
    llm.shutdown()
    reference.shutdown()


@contextlib.contextmanager
def _sigint_at(code, event: str, nth: int | tuple[int, ...], seen: list):
    """A real SIGINT (Ctrl-C) sent when `code` reaches its nth `event` ('call', 'return'), or
    each of its nths."""
    nths = (nth,) if isinstance(nth, int) else nth

    def tracer(frame, ev, arg):
        if frame.f_code is not code:
            return None
        if ev == event:
            seen.append(1)
            if len(seen) in nths:
                os.kill(os.getpid(), signal.SIGINT)
        return tracer

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # xdist ignores it
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGINT, before)


def test_a_ctrl_c_in_the_schedulers_bookkeeping_waits_for_the_step_to_end(tiny_model):
    """A real Ctrl-C (SIGINT) sent as the scheduler admits the 2nd prompt, between taking its
    group out of the waiting queue and putting it in the running one: the step ends first,
    then generate raises. Raised there, it left the group in no queue, where no abort found
    it: its blocks leaked, it stayed in the engine's requests, and the blocks it had
    registered in the prefix cache were never computed (wrong tokens for those prompts, for
    good). A second Ctrl-C there (at the 3rd admission) waits for the model's run to begin. A
    Ctrl-C as the run begins, its requests queued, takes them back too."""
    from pagedlm.core.scheduler import Scheduler
    llm = LLM(tiny_model, num_gpu_blocks_override=256)
    reference = LLM(tiny_model, num_gpu_blocks_override=256, enable_prefix_caching=False)
    engine = llm.llm_engine
    free = engine.block_manager.num_free_blocks
    words = "river valley station flow method study report north south stone water".split()
    prompts = [f"Entry {i}: " + " ".join(words[(3 * i + j) % len(words)] for j in range(60))
               for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    want = [o.outputs[0] for o in reference.generate(prompts, greedy, use_tqdm=False)]
    for code, event, nth in [(Scheduler._add_scheduled.__code__, "return", 2),
                             (Scheduler._add_scheduled.__code__, "return", (2, 3)),
                             (LLM._run_engine.__code__, "call", 1)]:
        seen: list = []
        with _sigint_at(code, event, nth, seen), pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, greedy, use_tqdm=False)
        assert len(seen) >= max((nth,) if isinstance(nth, int) else nth), code.co_name
        assert not engine.requests and not engine.has_unfinished_requests(), code.co_name
        assert engine.block_manager.num_free_blocks == free
        got = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert assert_greedy_outputs_match(want, got) >= 3, code.co_name
    llm.shutdown()
    reference.shutdown()
