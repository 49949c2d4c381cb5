"""Calls from the engine thread onto the callers' asyncio event loops, woken without giving up
the GIL.

loop.call_soon_threadsafe wakes a loop by writing a byte to its self-pipe with socket.send, which
releases the GIL. The loop thread, woken by that byte, takes the GIL at once and runs its share of
the stream (the chunk's JSON, the HTTP write) while the engine thread, back from its send, waits
for the GIL, and on a busy 2-CPU host for the CPU too: every token, the engine's next step waited
for the frontend. Here the byte is written with libc's write called through ctypes.PyDLL, which
keeps the GIL: the woken loop thread waits for it until the engine thread releases it itself (in
the next step's native kernels), and the two then run side by side. Measured on the 2-CPU EPYC
(one stream of 256 tokens through `pagedlm serve`, a 1-layer random model on 1 thread, so that
the per-token path dominates; fresh servers, interleaved, medians): 124 -> 362 tok/s at load 7,
394 -> 490 at load 2.5. With the gguf model on 2 threads no difference was measurable (about 93
tok/s either way on the streams the shared host did not stall).

Calls keep their order: one FIFO per loop, drained by the loop in the order they were made.
Without glibc, calls go through call_soon_threadsafe.
"""
from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
import os
import weakref

logger = logging.getLogger(__name__)


def _gil_holding_write():
    """libc's write(fd, buf, n), called with the GIL held (ctypes.PyDLL); None without glibc."""
    try:
        write = ctypes.PyDLL("libc.so.6").write
    except (OSError, AttributeError):
        return None
    write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    write.restype = ctypes.c_ssize_t
    return write


def _close(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class _Channel:
    """One loop's FIFO of calls and the pipe that wakes it. A byte per call at most: a full
    pipe (the loop is not draining) drops the byte, and the bytes already there wake it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, write) -> None:
        self._calls: collections.deque = collections.deque()
        self._write = write
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        loop.add_reader(self._rfd, self._drain)
        weakref.finalize(loop, _close, self._rfd, self._wfd)
        self._loop = weakref.ref(loop)

    def call(self, fn, args: tuple) -> None:  # any thread
        self._calls.append((fn, args))
        self._write(self._wfd, b"\0", 1)

    def _drain(self) -> None:  # on the loop
        try:
            while os.read(self._rfd, 4096):
                pass
        except BlockingIOError:
            pass
        while self._calls:
            fn, args = self._calls.popleft()
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - as the loop treats a failing callback
                loop = self._loop()
                if loop is not None:
                    loop.call_exception_handler({"message": f"exception in {fn!r}",
                                                 "exception": e})


class LoopChannels:
    """The engine's channels, one per caller loop. `register` runs on the loop (before the
    engine may call onto it); `call` from the engine thread."""

    def __init__(self) -> None:
        self._write = _gil_holding_write()
        self._channels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def register(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._write is not None and loop not in self._channels:
            self._channels[loop] = _Channel(loop, self._write)

    def call(self, loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        """fn(*args) on `loop`, after the calls made before it; nothing if the loop is
        closed (nobody is listening)."""
        if loop.is_closed():
            return
        channel = self._channels.get(loop)
        if channel is None:
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # closed meanwhile
                pass
            return
        channel.call(fn, args)
