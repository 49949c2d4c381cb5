"""The Ray executor: worker actors in a placement group give the same results as one worker,
a killed actor fails the call naming its rank, and nothing is left running afterwards.

Marked slow; skipped only where the ray extra is not installed (CI installs it)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.executor.abstract import WorkerFailedError
from tests.distributed import test_distributed_executor
from tests.distributed.test_distributed_executor import (
    PROMPTS, assert_same, assert_seeded_draws_ignore_the_engine_seed, run)

pytestmark = pytest.mark.slow
# The module-scoped fixture of the multiprocessing tests, shared here by name.
tiny_models = test_distributed_executor.tiny_models
ray = pytest.importorskip("ray", reason="the ray extra is not installed")


@pytest.fixture(scope="module")
def ray_cluster():
    """A local cluster shared by this module's tests (starting one takes several seconds);
    after it shuts down, none of its processes may remain."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        left = [p for p in psutil.Process().children(recursive=True)
                if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
        if not left:
            break
        time.sleep(0.2)
    assert not left, f"Ray processes left behind: {left}"


def test_tp_over_ray_matches_one_worker(tiny_models, ray_cluster):
    for path in tiny_models.values():
        assert_same(run(path), run(path, tensor_parallel_size=2,
                                   distributed_executor_backend="ray"))


def test_seeded_sampling_over_ray(tiny_models, ray_cluster):
    path = tiny_models["llama"]
    assert_seeded_draws_ignore_the_engine_seed(path, tensor_parallel_size=2,
                                               distributed_executor_backend="ray")


def test_a_killed_actor_fails_generate_naming_the_rank(tiny_models, ray_cluster):
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, distributed_executor_backend="ray",
              max_model_len=256, kv_cache_memory_bytes=8 * 2**20)
    executor = llm.llm_engine.executor
    pids = executor.worker_pids()
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match="rank 1"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=8), use_tqdm=False)
    assert time.monotonic() - start < 10
    # The executor killed the surviving actor too (psutil raises TimeoutExpired otherwise).
    try:
        psutil.Process(pids[0]).wait(15)
    except psutil.NoSuchProcess:
        pass


def test_a_stopped_actor_fails_the_step_after_the_timeout(tiny_models, ray_cluster,
                                                          monkeypatch):
    """An actor that stops answering (SIGSTOP stands in for one stuck in a collective): the
    step fails after PAGEDLM_ENGINE_ITERATION_TIMEOUT_S, as with the mp executor. ray.wait had
    no timeout: every request hung for good, with nothing in the log."""
    monkeypatch.setenv("PAGEDLM_ENGINE_ITERATION_TIMEOUT_S", "2")
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, distributed_executor_backend="ray",
              max_model_len=256, kv_cache_memory_bytes=8 * 2**20)
    pids = llm.llm_engine.executor.worker_pids()
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    os.kill(pids[1], signal.SIGSTOP)
    # Without the timeout the step waits for good: the actor resumes after 20 s, so the test
    # fails (no error raised) instead of hanging the suite.
    resume = threading.Timer(20, os.kill, (pids[1], signal.SIGCONT))
    resume.start()
    try:
        start = time.monotonic()
        with pytest.raises(WorkerFailedError, match="within 2 s"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=8), use_tqdm=False)
        assert time.monotonic() - start < 8
    finally:
        resume.cancel()
        try:
            os.kill(pids[1], signal.SIGCONT)
        except ProcessLookupError:
            pass
    for pid in pids:  # the executor killed both actors
        try:
            psutil.Process(pid).wait(15)
        except psutil.NoSuchProcess:
            pass


def test_ctrl_c_stops_a_ray_server_at_once(tiny_models):
    """The engine shuts its executor down on its own thread: Ray's head processes die with the
    thread that started them, and the executor's shutdown after that thread's exit waited 60 s
    for Ray's GCS (then exit status 1)."""
    from tests.engine.test_engine_failure import serve
    with serve(tiny_models["llama"], "-tp", "2", "--distributed-executor-backend",
               "ray") as served:
        r = httpx.post(served.url + "/v1/completions", timeout=60,
                       json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        start = time.monotonic()
        served.proc.send_signal(signal.SIGINT)
        assert served.proc.wait(60) == 0, served.log
        assert time.monotonic() - start < 15, served.log


def test_a_ctrl_c_in_shutdown_still_releases_the_actors(tiny_models, ray_cluster, monkeypatch):
    """shutdown() marked itself done first: a Ctrl-C in its middle left the other actor and
    the placement group up, and a second shutdown() did nothing (a later Ray LLM in the
    process waited 120 s for their CPUs)."""
    from ray.util.placement_group import placement_group_table
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, distributed_executor_backend="ray",
              max_model_len=256, kv_cache_memory_bytes=8 * 2**20)
    executor = llm.llm_engine.executor
    pids, group = executor.worker_pids(), executor.placement_group
    kill = ray.kill
    calls = []

    def interrupted_kill(actor, **kwargs):
        calls.append(actor)
        kill(actor, **kwargs)
        if len(calls) == 1:
            raise KeyboardInterrupt  # as a Ctrl-C after the first actor's kill
    monkeypatch.setattr(ray, "kill", interrupted_kill)
    with pytest.raises(KeyboardInterrupt):
        llm.llm_engine.executor.shutdown()
    assert len(set(map(str, calls))) == 2  # both actors killed
    assert placement_group_table(group)["state"] == "REMOVED"
    deadline = time.monotonic() + 20
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
              for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


RAY_STARTED_HERE = """\
import json, sys
import psutil
from pagedlm import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="ray",
          max_model_len=256, kv_cache_memory_bytes=8 * 2**20)
masks = {}
for p in psutil.Process().children(recursive=True):
    try:
        with open(f"/proc/{p.pid}/status") as f:
            blocked = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk"))
        masks[" ".join(p.cmdline())[:120]] = blocked
    except (OSError, psutil.Error):
        pass
llm.llm_engine.executor.shutdown()
print(json.dumps(masks))
"""


def test_the_ray_it_starts_leaves_sighup_to_the_engine(tiny_models):
    """A closed terminal signals the whole process group: the Ray daemons pagedlm started
    died of the SIGHUP, and the engine's shutdown then waited about 35 s on their timeouts
    (the server's exit took 41 s). They, and the actors, start with it blocked."""
    out = subprocess.run([sys.executable, "-c", RAY_STARTED_HERE, tiny_models["llama"]],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    masks = json.loads(out.stdout.splitlines()[-1])
    daemons = {cmd: m for cmd, m in masks.items()
               if "gcs_server" in cmd or "raylet" in cmd or "RayWorkerWrapper" in cmd}
    assert any("gcs_server" in c for c in daemons) and any("raylet" in c for c in daemons), masks
    hup = 1 << (signal.SIGHUP - 1)
    assert all(m & hup for m in daemons.values()), daemons
