"""MultiprocExecutor: one worker process per rank on this node.

Each worker is a fresh interpreter (`python -c`, as multiprocessing's spawn starts one) that
imports pagedlm but never the parent's `__main__`. So a script that builds
`LLM(tensor_parallel_size=2)` at module level, with no `if __name__ == "__main__":` guard, works
as it does with vLLM: spawn would run the script again in every worker (and fail in its
"bootstrapping phase"), and fork is unsafe on CPU once the parent has used OpenMP (the child's
first parallel region waits forever for the parent's pool threads, which it does not have).
Nor can fork be kept for a parent with no thread pool yet: `import torch` alone starts numpy's
OpenBLAS thread, so no thread count tells a safe parent from an unsafe one. The worker's
settings (OMP_NUM_THREADS) are in its environment from its first instruction.

Each worker runs an execution loop (`_worker_main`): it reads a call (method, args) from its
pipe, runs it on its Worker and answers with the result or the error. A step's
ExecuteModelRequest is pickled once and written to every pipe; the ranks then run the model
together over torch.distributed (gloo on CPU) and only the output rank answers with the sampled
tokens (the others answer None).

Failures never hang the engine: while it waits for answers it also watches every worker
process, so a worker that dies (SIGKILL, out of memory) or raises makes the call fail within a
second with a WorkerFailedError naming the rank, and every other worker is stopped (they may be
blocked in a collective with the dead one); `check_health` finds a worker that died between
calls. Workers ignore Ctrl-C, SIGHUP and SIGTERM (the engine decides when they stop), die with
the thread that started them (PR_SET_PDEATHSIG: the main thread, or one of the executor's own
that lasts until the workers are stopped), and are stopped when the executor is shut down,
garbage-collected or the interpreter exits.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import multiprocessing as mp
import os
import pickle
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from pagedlm import envs
from pagedlm.config import EngineConfig
from pagedlm.executor.abstract import Executor, WorkerFailedError
from pagedlm.utils import ctrl_c_deferred, ctrl_c_held_whole, run_through_ctrl_c

if TYPE_CHECKING:
    from pagedlm.worker.worker import Worker

logger = logging.getLogger(__name__)

_SHUTDOWN = "__shutdown__"
# How long a worker gets to leave on its own at shutdown before it is killed.
_JOIN_TIMEOUT_S = 5.0
# The worker's first lines: ignore Ctrl-C, and the SIGHUP / SIGTERM a closed terminal or a
# supervisor (systemd's control-group stop) sends the whole process group, before anything else
# can be interrupted (those killed the workers under a server stopping gracefully); take the
# parent's sys.path (pagedlm may be importable only through it), then hand over.
_BOOTSTRAP = ("import signal\n"
              "for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):\n"
              "    signal.signal(s, signal.SIG_IGN)\n"
              "import pickle, sys\n"
              "from multiprocessing.connection import Connection\n"
              "conn = Connection(int(sys.argv[1]))\n"
              "sys.path[:] = pickle.loads(conn.recv_bytes())\n"
              "from pagedlm.executor.multiproc_executor import _worker_main\n"
              "_worker_main(conn)\n")


def get_open_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans, whatever happens)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to build its Worker (sent pickled on its pipe)."""
    config: EngineConfig
    eos_token_ids: frozenset[int]
    rank: int
    distributed_init_method: str
    parent_pid: int


def _worker_main(conn: Connection) -> None:
    spec: WorkerSpec = pickle.loads(conn.recv_bytes())
    _die_with_parent()
    if os.getppid() != spec.parent_pid:  # the parent died before prctl took effect
        return
    from pagedlm.worker.worker import Worker
    worker = Worker(spec.config, spec.eos_token_ids, rank=spec.rank, local_rank=spec.rank,
                    distributed_init_method=spec.distributed_init_method)
    try:
        _serve(conn, worker)
    finally:
        worker.shutdown()
    # A clean leave skips the interpreter's teardown of torch's modules: 1.0-2.1 s a worker
    # (measured, tp=2), which an offline script waited for at its end. What atexit holds
    # (a panel file's write to cancel, logging) runs first; an error above is raised instead.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve(conn: Connection, worker: Worker) -> None:
    """Run the engine's calls until it says to leave or goes away."""
    while True:
        try:
            method, args, kwargs = pickle.loads(conn.recv_bytes())
        except EOFError:  # the engine went away
            return
        if method == _SHUTDOWN:
            return
        try:
            reply = ("ok", getattr(worker, method)(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - reported to the engine, which fails the call
            reply = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        conn.send(reply)


class WorkerProcess:
    """One worker's process: its pid, exit status, and a sentinel (a pipe's read end that turns
    readable when the process has exited, as multiprocessing's Process.sentinel does)."""

    def __init__(self, rank: int, popen: subprocess.Popen, sentinel: int) -> None:
        self.rank = rank
        self.popen = popen
        self.sentinel = sentinel

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def is_stopped(self) -> bool:
        """Stopped by a signal (SIGSTOP, Ctrl-Z) or held by a debugger: /proc's state T or t
        (Linux; elsewhere False)."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
        except (OSError, IndexError):
            return False

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def describe_exit(self) -> str:
        code = self.exitcode
        how = (f"was killed by signal {-code}" if code is not None and code < 0
               else f"exited with code {code}")
        return f"worker rank {self.rank} (pid {self.pid}) {how}"

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


class _LastingThread:
    """Runs calls on a daemon thread of its own until closed. A worker dies with the thread
    that started it (PR_SET_PDEATHSIG), not with the process: an LLM built on a thread that
    then ended (a pool's, a framework's start-up) found both its workers killed at its first
    call. Built off the main thread, the executor starts its workers from one of these, closed
    once they are stopped. Not a ThreadPoolExecutor: the interpreter joins its threads at exit
    before the executor's finalizer runs, so the workers would be killed, not stopped."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="pagedlm-worker-starter", daemon=True).start()

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, future = call
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the caller raises it
                future.set_exception(e)

    def call(self, fn: Callable[[], Any]) -> Any:
        future: Future = Future()
        self._calls.put((fn, future))
        return future.result()

    def close(self) -> None:
        self._calls.put(None)


def _start_worker(spec: WorkerSpec, env: dict[str, str]) -> tuple[WorkerProcess, Connection]:
    ours, theirs = mp.Pipe(duplex=True)
    sentinel, child_end = os.pipe()  # the child holds child_end open until it exits
    try:
        popen = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, str(theirs.fileno()),
             f"pagedlm-worker-rank-{spec.rank}"],
            pass_fds=(theirs.fileno(), child_end), env=env, stdin=subprocess.DEVNULL)
    except BaseException:
        ours.close()
        os.close(sentinel)
        raise
    finally:
        theirs.close()
        os.close(child_end)
    proc = WorkerProcess(spec.rank, popen, sentinel)
    try:
        ours.send_bytes(pickle.dumps(sys.path))
        ours.send_bytes(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
    except OSError:
        pass  # it died at once: the first call reports how
    return proc, ours


def _send_within(conn: Connection, data: bytes, deadline: float | None) -> bool:
    """conn.send_bytes(data) (the same framing: a 4-byte length, or -1 and an 8-byte one),
    written without blocking past the deadline; False if it passed first. A stopped worker
    stops reading its pipe, and a step past the socket's buffer (about 200 KB: a request's
    40,000 allowed_token_ids) blocked send_bytes for good, before the step's deadline was
    ever checked."""
    n = len(data)
    header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    fd = conn.fileno()
    os.set_blocking(fd, False)
    try:
        for buf in (memoryview(header), memoryview(data)):
            while buf:
                try:
                    buf = buf[os.write(fd, buf):]
                except BlockingIOError:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    select.select([], [fd], [], left)
    finally:
        os.set_blocking(fd, True)
    return True


def _ranks(ranks: list[int]) -> str:
    return f"worker rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _stop_workers(procs: list[WorkerProcess], conns: list[Connection],
                  starter: _LastingThread | None = None) -> None:
    """Ask every worker to leave, then kill the ones that do not. Used at shutdown and by the
    finalizer (it must not refer to the executor), which runs once: a Ctrl-C waits for the
    workers to be gone (at most _JOIN_TIMEOUT_S each, then they are killed), or they were
    never reaped."""
    run_through_ctrl_c(lambda: _stop_and_reap(procs, conns))
    if starter is not None:
        starter.close()


def _stop_and_reap(procs: list[WorkerProcess], conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps((_SHUTDOWN, (), {})))
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(_JOIN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(_JOIN_TIMEOUT_S)
    for conn in conns:
        conn.close()
    for proc in procs:
        proc.close()


class MultiprocExecutor(Executor):

    def _init_executor(self) -> None:
        pc = self.config.parallel_config
        self.step_timeout_s = envs.PAGEDLM_ENGINE_ITERATION_TIMEOUT_S
        # A call sent whose answers were not all read (interrupted): its method, whether it
        # has a deadline, and the ranks still to answer.
        self._unanswered: tuple[str, bool, dict[int, Connection]] | None = None
        self._stopped_because = ""  # the failure that stopped the workers, for later calls
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        self.procs: list[WorkerProcess] = []
        self.conns: list[Connection] = []
        # In the children's environment from the start: their OpenMP runtime reads it when it
        # loads, before any of our code runs there.
        env = dict(os.environ)
        if pc.threads_per_worker:
            env["OMP_NUM_THREADS"] = str(pc.threads_per_worker)
        # Registered first: workers started before a failure below are stopped too.
        starter = (None if threading.current_thread() is threading.main_thread()
                   else _LastingThread())
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns, starter)
        for rank in range(pc.world_size):
            spec = WorkerSpec(self.config, self.eos_token_ids, rank, init_method, os.getpid())
            proc, conn = (_start_worker(spec, env) if starter is None
                          else starter.call(functools.partial(_start_worker, spec, env)))
            self.procs.append(proc)
            self.conns.append(conn)
        logger.info("started %d worker processes (tp=%d, pp=%d, %s threads each)",
                    pc.world_size, pc.tensor_parallel_size, pc.pipeline_parallel_size,
                    pc.threads_per_worker)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None
                       ) -> list[Any]:
        self._check_running()
        if self._unanswered:
            # A call interrupted while the workers ran it (Ctrl-C in a notebook): its answers
            # come first, or every later call would read the one before's (KeyError in the
            # output processor, for good).
            old, timed, pending = self._unanswered
            self._gather(old, time.monotonic() + self.step_timeout_s if timed else None,
                         pending)
            self._unanswered = None
        payload = pickle.dumps((method, args, kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)
        # Steps only: loading a model or an adapter may rightly take longer.
        deadline = (time.monotonic() + self.step_timeout_s if method == "execute_model"
                    else None)
        sent, error = 0, None
        with ctrl_c_deferred():
            try:
                for conn in self.conns:
                    if not _send_within(conn, payload, deadline):
                        error = (f"worker rank {sent} did not read {method!r} within "
                                 f"{self.step_timeout_s:g} s "
                                 f"(PAGEDLM_ENGINE_ITERATION_TIMEOUT_S): "
                                 f"{self._why_late([sent])}")
                        break
                    sent += 1
            except OSError:  # (failed outside the except: the cause is not this OSError)
                error = self._cause(f"could not send {method!r} to the workers", method)
            except BaseException:
                # A second Ctrl-C inside a write: that pipe holds part of a message, which no
                # later call can follow.
                self._fail_quietly(f"interrupted while sending {method!r} to the workers")
                raise
            if error is not None:
                self._fail(error)
            # Before the Ctrl-C held back is raised: the next call reads these answers first.
            pending = dict(enumerate(self.conns))
            self._unanswered = (method, deadline is not None, pending)
        results = self._gather(method, deadline, pending)
        self._unanswered = None
        return results

    def _gather(self, method: str, deadline: float | None, pending: dict[int, Connection]
                ) -> list[Any]:
        """The answers of the ranks in `pending` (taken out as they come) to the call sent."""
        results: list[Any] = [None] * len(self.conns)
        while pending:
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"{_ranks(sorted(pending))} did not finish {method!r} within "
                           f"{self.step_timeout_s:g} s (PAGEDLM_ENGINE_ITERATION_TIMEOUT_S): "
                           f"{self._why_late(sorted(pending))}")
            sentinels = {self.procs[r].sentinel: r for r in pending}
            for ready in wait([*pending.values(), *sentinels], timeout=1.0):
                rank = sentinels.get(ready)
                if rank is None:
                    rank = next(r for r, c in pending.items() if c is ready)
                    with ctrl_c_held_whole():  # a message read is a message used
                        try:
                            # Out of pending in the read's own line: a second Ctrl-C on the
                            # line after it left an answer read and its rank pending, and the
                            # next call waited out the deadline for it, then lost the workers.
                            status, value = pending.pop(rank).recv()
                        except (EOFError, OSError):
                            status, value = "closed", None
                        except BaseException:  # (not a Ctrl-C: held) part of a message read
                            self._fail_quietly(f"interrupted while reading {method!r}'s "
                                               f"answers")
                            raise
                        if status == "closed":
                            self._fail(self._cause(
                                f"worker rank {rank} closed its pipe during {method!r}",
                                method))
                        if status == "error":
                            self._fail(self._cause(f"worker rank {rank} failed in "
                                                   f"{method!r}: {value}", method))
                        results[rank] = value
                elif rank in pending and not pending[rank].poll():
                    self.procs[rank].join(1.0)  # its exit status comes a moment after
                    self._fail(f"{self.procs[rank].describe_exit()} during {method!r}")
        return results

    def _why_late(self, ranks: list[int]) -> str:
        """The stopped ones among ranks that missed the deadline, where /proc tells: the
        others, in a collective, wait for them."""
        stopped = [r for r in ranks if self.procs[r].is_stopped()]
        if not stopped:
            return "stopped, or stuck in a collective"
        one = len(stopped) == 1
        return (f"{_ranks(stopped)} {'is' if one else 'are'} stopped (a signal or a debugger)"
                + (f", the others wait for {'it' if one else 'them'}"
                   if len(stopped) < len(ranks) else ""))

    def _check_running(self) -> None:
        if self.is_shutdown:
            raise WorkerFailedError("the executor's workers have been shut down"
                                    + (f" ({self._stopped_because})."
                                       if self._stopped_because else "."))

    def check_health(self) -> None:
        self._check_running()
        if (message := self._dead_worker("while the engine was idle")) is not None:
            self._fail(message)

    def _cause(self, error: str, method: str) -> str:
        """A worker's error is most often the consequence of another's death (a collective
        that lost its peer fails at once): then the dead worker is the cause to report."""
        wait([proc.sentinel for proc in self.procs], timeout=0.2)
        return self._dead_worker(f"during {method!r}") or error

    def _dead_worker(self, when: str) -> str | None:
        """How the first worker that exited did, or None while all run."""
        exited = wait([proc.sentinel for proc in self.procs], timeout=0)
        for proc in self.procs:
            if proc.sentinel in exited:
                proc.join(1.0)  # its exit status comes a moment after its files close
                return f"{proc.describe_exit()} {when}"
        return None

    def _fail(self, message: str) -> None:
        self._fail_quietly(message)
        raise WorkerFailedError(message)

    def _fail_quietly(self, message: str) -> None:
        # Not logged here: the caller gets the error (the engine loop logs it, once).
        logger.debug("%s; stopping all workers", message)
        self._stopped_because = message
        # The others may be blocked in a collective with the failed one: no polite shutdown.
        for proc in self.procs:
            proc.kill()
        self.shutdown()

    def shutdown(self) -> None:
        if not self.is_shutdown and hasattr(self, "_finalizer"):
            self._finalizer()
        super().shutdown()
