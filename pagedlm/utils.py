"""Small helpers shared across modules."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from pagedlm import envs


def cache_root() -> Path:
    """Where converted models and built kernels live: ``$PAGEDLM_CACHE_DIR``, else
    ``~/.cache/pagedlm``."""
    configured = envs.PAGEDLM_CACHE_DIR
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "pagedlm"


def dtype_name(dtype) -> str:
    """A torch dtype's name without its module: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else a conservative 4 GiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The nice value of background work a request can make long (compiling its grammar,
# tokenizing its lists), so that it slows the engine's steps by at most about a tenth: on a core
# the engine keeps busy, the kernel gives a nice-10 thread 110/(1024 + 110) of it (weights of
# nice 10 and 0). 19 would give it 1.5%, so little that grammars wait for minutes on a busy
# server.
BACKGROUND_NICE = 10


def lower_thread_priority() -> None:
    """Run the calling thread, and the threads and processes it starts, at BACKGROUND_NICE.
    Linux only, where a thread's nice value is its own (elsewhere setpriority would take the
    thread id for a process id)."""
    import sys
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except OSError:
        pass


@contextlib.contextmanager
def ctrl_c_deferred(note: str | None = None) -> Iterator[None]:
    """Holds back a Ctrl-C until the block ends, then raises it as it would have been: for what
    must not stop half done, as a message on a worker's pipe (a KeyboardInterrupt inside its
    write left part of it there, which no later call could follow: every worker had to be
    stopped, and the LLM was lost) or a step sent to some Ray actors and not the others. A
    second Ctrl-C within the block raises at once (a write held by a stopped worker waits up
    to the step's deadline). `note`: written to stderr at the first, where the block may last
    (os.write: a handler that printed could meet the print it interrupted). Only the main
    thread takes signals, and only where Python set the handler can it be put back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed = []

    def hold(signum: int, frame: object) -> None:
        pressed.append(signum)
        if len(pressed) > 1:
            raise KeyboardInterrupt
        if note:
            with contextlib.suppress(OSError):
                os.write(2, note.encode())

    before = signal.getsignal(signal.SIGINT)
    if before is None or getattr(before, "holds_ctrl_c", False):  # or held already, outside
        yield
        return
    hold.holds_ctrl_c = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        if len(pressed) == 1:
            signal.raise_signal(signal.SIGINT)
