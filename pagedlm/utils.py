"""Small helpers shared across modules."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
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


class _CtrlCHold:
    """The SIGINT handler while a Ctrl-C is held (ctrl_c_deferred)."""

    def __init__(self, note: str | None, second_stops: bool) -> None:
        self.note = note
        self.second_stops = second_stops  # may a second Ctrl-C raise now
        self.pressed = 0
        self.raised = False

    def __call__(self, signum: int, frame: object) -> None:
        self.pressed += 1
        if self.pressed == 1 and self.note:
            with contextlib.suppress(OSError):
                os.write(2, self.note.encode())
        if self.pressed > 1 and self.second_stops:
            self.stop()

    def stop(self) -> None:
        self.raised = True
        raise KeyboardInterrupt


@contextlib.contextmanager
def ctrl_c_deferred(note: str | None = None, second_stops: bool = True) -> Iterator[None]:
    """Holds back a Ctrl-C until the block ends, then raises it as it would have been: for what
    must not stop half done, as a message on a worker's pipe (a KeyboardInterrupt inside its
    write left part of it there, which no later call could follow: every worker had to be
    stopped, and the LLM was lost) or a step sent to some Ray actors and not the others. A
    second Ctrl-C within the block raises at once (a write held by a stopped worker waits up
    to the step's deadline); with second_stops=False, only inside ctrl_c_stoppable(). `note`:
    written to stderr at the first, where the block may last (os.write: a handler that
    printed could meet the print it interrupted). A block inside another only looks. Only the
    main thread takes signals, and only where Python set the handler can it be put back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGINT)
    if before is None or isinstance(before, _CtrlCHold):
        yield
        return
    hold = _CtrlCHold(note, second_stops)
    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        if hold.pressed and not hold.raised:
            signal.raise_signal(signal.SIGINT)


@contextlib.contextmanager
def ctrl_c_stoppable() -> Iterator[None]:
    """Inside ctrl_c_deferred(second_stops=False): where a second Ctrl-C may stop at once (one
    pressed before raises on entry)."""
    hold = (signal.getsignal(signal.SIGINT)
            if threading.current_thread() is threading.main_thread() else None)
    if not isinstance(hold, _CtrlCHold) or hold.second_stops:
        yield
        return
    if hold.pressed > 1:
        hold.stop()
    hold.second_stops = True
    try:
        yield
    finally:
        hold.second_stops = False


@contextlib.contextmanager
def ctrl_c_held_whole() -> Iterator[None]:
    """A short block that must run whole, as reading a message that is already on its pipe:
    every Ctrl-C waits for its end, even inside ctrl_c_stoppable() (a second one there, inside
    a worker's answer being read, stopped every worker for good). One pressed meanwhile is
    raised as the block ends, where a second one could have stopped."""
    hold = (signal.getsignal(signal.SIGINT)
            if threading.current_thread() is threading.main_thread() else None)
    if not isinstance(hold, _CtrlCHold):
        with ctrl_c_deferred(second_stops=False):
            yield
        return
    stops, hold.second_stops = hold.second_stops, False
    try:
        yield
    finally:
        hold.second_stops = stops
    if stops and hold.pressed > 1 and not hold.raised:
        hold.stop()


def run_through_ctrl_c(fn: Callable[[], None]) -> None:
    """fn() to its end whatever Ctrl-Cs come, then one KeyboardInterrupt if any came: for
    cleanups (a call's dropped requests, stopping workers). A Ctrl-C as the cleanup began
    skipped it (the call's requests ran in the next one; the workers were never reaped). fn
    runs once: a Ctrl-C before the hold starts comes before fn does."""
    done = interrupted = False
    while not done:
        try:
            with ctrl_c_deferred(second_stops=False):
                fn()
                done = True
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:
        raise KeyboardInterrupt
