"""MultiprocExecutor: one worker process per rank on this node, started with spawn.

Each worker runs an execution loop (`_worker_main`): it reads a call (method, args) from its
pipe, runs it on its Worker and answers with the result or the error. A step's
ExecuteModelRequest is pickled once and written to every pipe; the ranks then run the model
together over torch.distributed (gloo on CPU) and only the output rank answers with the sampled
tokens (the others answer None).

Failures never hang the engine: while it waits for answers it also watches every worker
process, so a worker that dies (SIGKILL, out of memory) or raises makes the call fail within a
second with a WorkerFailedError naming the rank, and every other worker is stopped (they may be
blocked in a collective with the dead one). Workers ignore Ctrl-C (the engine decides when they
stop), die with the engine process (PR_SET_PDEATHSIG), and are stopped when the executor is
shut down, garbage-collected or the interpreter exits.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedlm.config import EngineConfig
from pagedlm.executor.abstract import Executor, WorkerFailedError

logger = logging.getLogger(__name__)

_SHUTDOWN = "__shutdown__"
# How long a worker gets to leave on its own at shutdown before it is killed.
_JOIN_TIMEOUT_S = 5.0


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


def _worker_main(config: EngineConfig, eos_token_ids: frozenset[int], rank: int,
                 distributed_init_method: str, conn: Connection, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        return
    from pagedlm.worker.worker import Worker
    worker = Worker(config, eos_token_ids, rank=rank, local_rank=rank,
                    distributed_init_method=distributed_init_method)
    try:
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
    finally:
        worker.shutdown()


def _stop_workers(procs: list[mp.Process], conns: list[Connection]) -> None:
    """Ask every worker to leave, then kill the ones that do not. Used at shutdown and by the
    finalizer (it must not refer to the executor)."""
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


class MultiprocExecutor(Executor):

    def _init_executor(self) -> None:
        pc = self.config.parallel_config
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        self.procs: list[mp.Process] = []
        self.conns: list[Connection] = []
        # Set before the children start: their OpenMP runtime (the attention kernel) reads it
        # when it loads, before any of our code runs there.
        saved = os.environ.get("OMP_NUM_THREADS")
        if pc.threads_per_worker:
            os.environ["OMP_NUM_THREADS"] = str(pc.threads_per_worker)
        try:
            for rank in range(pc.world_size):
                ours, theirs = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=_worker_main, name=f"pagedlm-worker-{rank}",
                                   args=(self.config, self.eos_token_ids, rank, init_method,
                                         theirs, os.getpid()), daemon=True)
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(ours)
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns)
        logger.info("started %d worker processes (tp=%d, pp=%d, %s threads each)",
                    pc.world_size, pc.tensor_parallel_size, pc.pipeline_parallel_size,
                    pc.threads_per_worker)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None
                       ) -> list[Any]:
        if self.is_shutdown:
            raise WorkerFailedError("the executor's workers have been shut down.")
        payload = pickle.dumps((method, args, kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(payload)
        except OSError:
            self._fail(f"could not send {method!r}")
        results: list[Any] = [None] * len(self.conns)
        pending = dict(enumerate(self.conns))
        while pending:
            sentinels = {self.procs[r].sentinel: r for r in pending}
            for ready in wait([*pending.values(), *sentinels], timeout=1.0):
                rank = sentinels.get(ready)
                if rank is None:
                    rank = next(r for r, c in pending.items() if c is ready)
                    try:
                        status, value = pending[rank].recv()
                    except (EOFError, OSError):
                        self._fail(f"worker rank {rank} closed its pipe during {method!r}")
                    if status == "error":
                        self._fail(f"worker rank {rank} failed in {method!r}: {value}")
                    results[rank] = value
                    del pending[rank]
                elif rank in pending and not pending[rank].poll():
                    code = self.procs[rank].exitcode
                    how = (f"was killed by signal {-code}" if code is not None and code < 0
                           else f"exited with code {code}")
                    self._fail(f"worker rank {rank} (pid {self.procs[rank].pid}) {how} "
                               f"during {method!r}")
        return results

    def _fail(self, message: str) -> None:
        logger.error("%s; stopping all workers", message)
        # The others may be blocked in a collective with the failed one: no polite shutdown.
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        self.shutdown()
        raise WorkerFailedError(message)

    def shutdown(self) -> None:
        if not self.is_shutdown and hasattr(self, "_finalizer"):
            self._finalizer()
        super().shutdown()
