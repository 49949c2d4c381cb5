"""Memory for a 2-byte checkpoint's weight panels, faulted in while `pagedlm serve` is still
importing.

Packing a bfloat16 checkpoint into its panels (linear_method.py's put_rows) writes every byte of
fresh memory, and on these VMs the first write to a fresh page is most of that cost: the 1B
Llama's 2.15 GB of panels took 1.9-3.0 s to load in process, 0.7 s into memory already faulted
in (Zen 4 EPYC, 2 vCPUs; `prefault.py` in the session notes). Meanwhile `pagedlm serve` spends
its first ~1.7 s importing torch and transformers on one core while the other idles. So it maps
the panels' bytes on huge pages before those imports, a thread faults them in by writing zeros
over them, and the loader's Arena (huge_pages.py) carves the panels from that memory in load
order, behind the thread, without zeroing it again. 1B bf16 directory, `gguf_models.py`: ready
5.58 -> 3.98 s; right after llama.cpp's server ran, when this VM's host hands memory back
slowly (0.45 GB/s), 4.3-4.9 s against 5.1-5.3 (three alternating pairs).

How the thread writes: ctypes.memset, which lets the GIL go, in 64 MiB pieces. The 2.15 GB took
0.25-0.5 s so, the imports beside it 1.64-1.91 s against 1.55-1.66 alone. madvise
(MADV_POPULATE_WRITE) holds the process's memory-map lock while it faults a piece in, which
the imports' own mmap calls wait for (imports 1.71-2.10 s in 32 MiB pieces); in 2 MiB pieces
each call also waited for the GIL again, which the importing thread holds for up to 5 ms at a
time (4-5 s to fault the memory in; `pf_imp2.py`, `pf_gil2.py`). A write fault takes only its
own mapping's lock. The thread never writes a byte that was handed out (`take` waits while the
piece being written would overlap) and stops once the loader has caught up with it: faulting
in beside the loader made the slow-host starts slower (5.0-9.4 s).

This module imports nothing heavy: it runs before torch is imported. The bytes to map come
from the safetensors headers (`panel_bytes`); what the load leaves is handed back
(MADV_DONTNEED) when it ends (`finish`), so a wrong guess costs time on the idle core, not
memory.
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import glob
import json
import logging
import mmap
import os
import struct
import threading
import time
from typing import Callable, Iterator, TypeVar

from pagedlm.utils import available_memory_bytes

HUGE_PAGE = 2 << 20
# Faulted in this many bytes a call (see above).
_PIECE = 64 << 20
# At most this share of the memory the system has available is faulted in ahead: a model that
# does not fit is the engine's check to report (memory_check.py), before anything is loaded.
_MAX_SHARE = 0.8
# madvise(2): drop a range's pages.
_MADV_DONTNEED = 4
# The widest panels gemv.pack_panels makes (the AVX-512 build's 32 rows): N is padded to it.
_PANEL_ROWS = 32
# Each carved tensor starts on a cache line, as huge_pages.Arena's do.
_ALIGN = 64
# A header larger than this is not a safetensors file's.
_MAX_HEADER = 100 << 20
_TWO_BYTE = ("BF16", "F16")

T = TypeVar("T")

logger = logging.getLogger(__name__)


def panel_bytes(model_dir: str) -> int:
    """The bytes that the 2-byte matrices of the safetensors checkpoint in `model_dir` take as
    weight panels (gemv.pack_panels's layout, N padded to 32 rows), from the files' headers:
    every 2-D BF16 or F16 tensor, but of those whose rows are the vocabulary (config.json's
    vocab_size) only one: the LM head's panels, packed from its own tensor or, tied, from the
    embedding, which is otherwise kept as it is. 0 where the directory holds no readable
    safetensors files. An estimate for mapping ahead of the load: a file the loader rejects is
    reported by the loader."""
    files = sorted(glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors")))
    vocab = _vocab_size(model_dir)
    total = head = 0
    for path in files:
        try:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > _MAX_HEADER:
                    return 0
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error):
            return 0
        for name, info in header.items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            shape = info.get("shape")
            if (info.get("dtype") not in _TWO_BYTE or not isinstance(shape, list)
                    or len(shape) != 2 or not all(isinstance(d, int) for d in shape)):
                continue
            rows, cols = shape
            padded = -(-rows // _PANEL_ROWS) * _PANEL_ROWS * (cols + cols % 2) * 2
            padded = -(-padded // _ALIGN) * _ALIGN
            if vocab is not None and rows >= vocab:
                head = max(head, padded)
            else:
                total += padded
    return total + head


def for_checkpoint(model_dir: str, min_bytes: int) -> PrefaultedMemory | None:
    """The panels' memory for the checkpoint in `model_dir`, being faulted in; None where they
    take less than `min_bytes` (not worth a thread), more than _MAX_SHARE of the memory
    available, or the map fails."""
    nbytes = panel_bytes(model_dir)
    if not nbytes or nbytes < min_bytes or nbytes > _MAX_SHARE * available_memory_bytes():
        return None
    try:
        return PrefaultedMemory(nbytes)
    except OSError:
        return None


def _vocab_size(model_dir: str) -> int | None:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for scope in (config, config.get("text_config") or {}):
        if isinstance(scope, dict) and isinstance(scope.get("vocab_size"), int):
            return scope["vocab_size"]
    return None


class PrefaultedMemory:
    """`nbytes` (rounded up to whole huge pages) of anonymous memory on huge pages, which a
    thread faults in from the start on; `take` hands out its bytes in order. One load's:
    `finish` stops the thread and drops the pages nothing took."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        # One huge page more, so that the memory can start on a 2 MiB boundary.
        self.buffer = mmap.mmap(-1, self.nbytes + HUGE_PAGE,
                                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self.buffer.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # THP compiled out, or not Linux: ordinary pages
            pass
        address = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))
        self.start = -address % HUGE_PAGE  # the usable bytes: buffer[start:start + nbytes]
        self._address = address + self.start
        self._used = self._populated = 0
        self._populate_s = 0.0
        # Set while the thread writes zeros from this offset (past every byte handed out) on.
        self._writing_from: int | None = None
        self._cond = threading.Condition()
        self._finished = False
        self._caught_up = False  # the loader wanted bytes the thread was still writing
        self._libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self._libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._thread = threading.Thread(target=self._populate, name="pagedlm-prefault",
                                        daemon=True)
        self._thread.start()

    def _populate(self) -> None:
        began = time.perf_counter()
        while True:
            with self._cond:
                # From where both the thread and the loader have got to: never a byte handed
                # out (the loader, ahead, faults its own pages in as it writes them).
                start = max(self._populated, self._used)
                if self._finished or self._caught_up or start >= self.nbytes:
                    break
                end = min(start + _PIECE, self.nbytes)
                self._writing_from = start
            ctypes.memset(self._address + start, 0, end - start)
            with self._cond:
                self._populated, self._writing_from = end, None
                self._cond.notify_all()
        self._populate_s = time.perf_counter() - began

    def take(self, nbytes: int) -> int | None:
        """The offset into `buffer` of the next `nbytes` (on a cache line), or None once they
        do not fit or `finish` was called. Waits while the thread writes over them."""
        size = -(-nbytes // _ALIGN) * _ALIGN
        with self._cond:
            while (self._writing_from is not None and not self._finished
                   and self._used + size > self._writing_from):
                # The loader has caught up: from here the thread would only fault pages in
                # beside it, which measured slower than the loader alone.
                self._caught_up = True
                self._cond.wait()
            if self._finished or self._used + size > self.nbytes:
                return None
            offset, self._used = self.start + self._used, self._used + size
        return offset

    @property
    def used(self) -> int:
        return self._used

    @property
    def reserved(self) -> int:
        """Bytes faulted in and not handed out yet: memory the system no longer counts as
        available, held for this load."""
        return 0 if self._finished else max(0, self._populated - self._used)

    def finish(self) -> None:
        """Stop faulting in and give back the whole huge pages past what was taken (they stay
        mapped, so the views of `buffer` stay valid); nothing more is handed out."""
        with self._cond:
            if self._finished:
                return
            self._finished = True
            self._cond.notify_all()
        self._thread.join()  # it stops after the piece it is writing
        logger.debug("panels' memory: %.2f of %.2f GB faulted in ahead (%.2f s), %.2f GB used",
                     self._populated / 1e9, self.nbytes / 1e9, self._populate_s,
                     self._used / 1e9)
        kept = -(-self._used // HUGE_PAGE) * HUGE_PAGE
        if kept < self.nbytes:
            self._libc.madvise(self._address + kept, self.nbytes - kept, _MADV_DONTNEED)


# The memory the model being loaded on this thread carves its panels from (linear_method.py's
# panels_in_arena reads it): set around one engine build by `loading_into`.
_LOADING: contextvars.ContextVar[PrefaultedMemory | None] = contextvars.ContextVar(
    "pagedlm_prefaulted", default=None)


def current() -> PrefaultedMemory | None:
    """The memory `loading_into` set for this thread's load, if any."""
    return _LOADING.get()


def reserved_bytes() -> int:
    """What this thread's load has faulted in ahead and not used yet (0 without any): the
    engine's memory check adds it to what the system reports available."""
    memory = _LOADING.get()
    return 0 if memory is None else memory.reserved


@contextlib.contextmanager
def _loading(memory: PrefaultedMemory | None) -> Iterator[None]:
    token = _LOADING.set(memory)
    try:
        yield
    finally:
        _LOADING.reset(token)
        if memory is not None:
            memory.finish()


def loading_into(memory: PrefaultedMemory | None, build: Callable[[], T]) -> Callable[[], T]:
    """`build` run with `memory` as the memory its model's panels are carved from; the memory
    is finished when it returns or raises, used or not."""
    def run() -> T:
        with _loading(memory):
            return build()
    return run
