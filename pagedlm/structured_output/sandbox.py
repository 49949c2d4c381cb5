"""Compile a structured-output spec in a child process that is killed when it runs too long.

A compile on a thread cannot be stopped, and a spec's size says little about its compile time
(one thread: 1024 choices of 1024 characters take 32 s, a 128 KiB object of 2872 optional
string properties over a minute). So every new spec is first compiled here: in a child process
with one compiler thread, at low CPU priority, under a memory limit, and killed once it has used
structured_outputs_compile_timeout seconds of CPU time (the kernel's RLIMIT_CPU: CPU time, so
that a busy server, which leaves the child less of it, does not refuse grammars it would
compile). A wall-clock limit (WALL_TIME_FACTOR times as long, plus WALL_TIME_SLACK_S) bounds the
wait where the child gets almost no CPU at all. Only a spec that compiled here within the limit
is compiled again in the engine's process (manager.py), where it takes about as long. The second
compile costs less than moving the result over: serializing a compiled grammar took 1 to 13
times as long as compiling it (nested JSON schemas, 1 thread), and reading it back a third of
that again.

The child speaks length-prefixed JSON on its stdin and stdout (JSON, not pickle, both ways: the
child runs a library on hostile input, and its replies must not be able to run code here). It
also arms an alarm for each spec, so that one the parent can no longer kill (the parent died)
ends by itself.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Callable, IO

from pagedlm.sampling_params import StructuredOutputsParams
from pagedlm.utils import lower_thread_priority

# Address space the child may add once started (xgrammar and torch are loaded by then). A
# compiled JSON-schema grammar for a 49k vocabulary takes 0.1 to 10 MB.
MEMORY_LIMIT_BYTES = 2 * 2**30
# Starting the child imports xgrammar, which imports torch and transformers: seconds on a busy
# machine. Not counted in a spec's compile time.
STARTUP_TIMEOUT_S = 120.0
WALL_TIME_FACTOR = 3
WALL_TIME_SLACK_S = 30.0
_LEN = struct.Struct(">I")


def _write_frame(out: IO[bytes], payload: bytes) -> None:
    out.write(_LEN.pack(len(payload)) + payload)
    out.flush()


def _read_exact(fd: int, n: int, deadline: float) -> bytes | None:
    """n bytes from fd, or None at end of file; TimeoutError past the deadline."""
    buf = bytearray()
    while len(buf) < n:
        if deadline != math.inf:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _read_frame(fd: int, deadline: float = math.inf) -> bytes | None:
    head = _read_exact(fd, _LEN.size, deadline)
    if head is None:
        return None
    return _read_exact(fd, _LEN.unpack(head)[0], deadline)


class GrammarSandbox:
    """The parent's side: one child, started on first use and again after one was killed. Used
    from one thread at a time (the manager's check thread); close() from any."""

    def __init__(self, backend: str, state: Callable[[], bytes], timeout: float,
                 memory_limit: int = MEMORY_LIMIT_BYTES) -> None:
        self.backend = backend
        self._state_fn = state  # the backend's tokenizer data, fetched once when first needed
        self._state: bytes | None = None
        self.timeout = timeout
        self.memory_limit = memory_limit
        self._proc: subprocess.Popen | None = None
        self._started_ok = False  # the current child said it is ready
        self._closed = False

    def check(self, params: StructuredOutputsParams) -> float:
        """Compile params in the child: its compile time in seconds, or ValueError naming the
        field (invalid, past the time limit, or the child died compiling it)."""
        proc = self._ready()
        spec = dataclasses.asdict(params)
        wall = WALL_TIME_FACTOR * self.timeout + WALL_TIME_SLACK_S
        try:
            _write_frame(proc.stdin, json.dumps(spec).encode())
            reply = _read_frame(proc.stdout.fileno(), time.monotonic() + wall)
        except TimeoutError:
            self._kill()
            self._start()  # the next spec should not wait for a new child's imports
            raise ValueError(f"{params.field_name} did not compile within {wall:g} s on this "
                             f"busy server ({WALL_TIME_FACTOR} x structured_outputs_compile_timeout"
                             f" + {WALL_TIME_SLACK_S:g} s).") from None
        except OSError:  # the child is gone (BrokenPipeError)
            reply = None
        if reply is None:
            code = self._kill()
            if self._closed:
                raise RuntimeError("the engine is shutting down")
            if code == -signal.SIGXCPU:
                self._start()
                raise ValueError(f"{params.field_name} did not compile within {self.timeout:g} s "
                                 f"of CPU time, the limit (structured_outputs_compile_timeout).")
            raise ValueError(f"{params.field_name} could not be compiled: the compiler process "
                             f"ended while compiling it (exit status {code}; its memory limit "
                             f"is {self.memory_limit // 2**20} MiB).")
        result = json.loads(reply)
        if not result["ok"]:
            raise ValueError(result["error"])
        return result["seconds"]

    def _ready(self) -> subprocess.Popen:
        """The child, started if need be, once it has said it is ready."""
        if self._closed:
            raise RuntimeError("the engine is shutting down")
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self._start()
        proc = self._proc
        if not self._started_ok:
            try:
                ready = _read_frame(proc.stdout.fileno(), time.monotonic() + STARTUP_TIMEOUT_S)
            except (OSError, TimeoutError):
                ready = None
            if ready is None:
                code = self._kill()
                raise RuntimeError(f"the structured-output compiler process did not start "
                                   f"(exit status {code}); see its errors above")
            self._started_ok = True
        return proc

    def _start(self) -> None:
        """Start a child without waiting for it: it imports its libraries meanwhile."""
        if self._closed:
            return
        if self._state is None:
            self._state = self._state_fn()
        code = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
                "from pagedlm.structured_output.sandbox import child_main; child_main()")
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(sys.path)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._proc, self._started_ok = proc, False
        header = json.dumps({"backend": self.backend, "timeout": self.timeout,
                             "memory_limit": self.memory_limit}).encode()

        def send() -> None:  # the pipe takes 64 KiB until the child reads, after its imports
            try:
                _write_frame(proc.stdin, header)
                _write_frame(proc.stdin, self._state)
            except OSError:
                pass  # it died: _ready() finds out

        threading.Thread(target=send, name="pagedlm-grammar-sandbox-start", daemon=True).start()

    def _kill(self) -> int | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        proc.kill()
        code = proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        return code

    def close(self) -> None:
        self._closed = True
        self._kill()


def _set_soft_limit(which: int, soft: int) -> None:
    import resource
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(which, (soft, hard))


def _limit_memory(extra: int) -> None:
    """Address space: what the child holds now plus `extra`."""
    import resource
    try:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        _set_soft_limit(resource.RLIMIT_AS, size + extra)
    except (OSError, ValueError, StopIteration):
        pass  # not Linux: the time limit still holds


def _cpu_seconds() -> float:
    import resource
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child_main() -> None:
    import resource
    lower_thread_priority()  # as the thread that started it, whichever that was
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a library's stray prints must not corrupt the replies
    fd = sys.stdin.fileno()
    header = json.loads(_read_frame(fd))
    state = _read_frame(fd)
    from pagedlm.structured_output.registry import backend_class
    compile_spec = backend_class(header["backend"]).sandbox_compiler(state)
    _limit_memory(header["memory_limit"])
    _set_soft_limit(resource.RLIMIT_CORE, 0)  # killed for its CPU time: no core file
    timeout = header["timeout"]
    # The parent kills a spec at its wall-clock limit; this only ends an orphaned child.
    alarm = math.ceil(WALL_TIME_FACTOR * timeout + WALL_TIME_SLACK_S) + 10
    _write_frame(out, b'{"ready": true}')
    while (frame := _read_frame(fd)) is not None:
        params = StructuredOutputsParams(**json.loads(frame))
        start = _cpu_seconds()
        # SIGXCPU (default action: end the process) once the spec has used `timeout` seconds.
        _set_soft_limit(resource.RLIMIT_CPU, math.ceil(start + timeout))
        signal.alarm(alarm)
        try:
            compile_spec(params)
            reply = {"ok": True}
        except ValueError as e:
            reply = {"ok": False, "error": str(e)}
        except MemoryError:
            reply = {"ok": False, "error": f"{params.field_name} needs more memory to compile "
                                           f"than the limit of {header['memory_limit'] // 2**20} "
                                           f"MiB."}
        signal.alarm(0)
        _set_soft_limit(resource.RLIMIT_CPU, resource.RLIM_INFINITY)
        reply["seconds"] = _cpu_seconds() - start
        _write_frame(out, json.dumps(reply).encode())
