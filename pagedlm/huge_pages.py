"""Host tensors on 2 MiB transparent huge pages, for the memory the model's steps stream: the
KV cache (cache_engine.py), the linear layers' weight panels (gather_panels, after loading) and
a GGUF file's blocks (mapped_blocks.py).

A decode step reads the KV cache in scattered blocks and streams every weight panel once. With
4 KiB pages each 36 KiB weight panel or 6 KiB bfloat16 K/V block crosses pages whose
translations no longer sit in the TLB or the caches, and the page walks stall the reads. On the
2-vCPU Sapphire Rapids-class Xeon (THP mode "madvise", so nothing is huge unless it asks):
- a decode step's attention (benchmarks/attention.py's decode case: 128 tokens of 300-700
  keys, SmolLM2's 30 layers, bfloat16 cache; one thread, medians of 7 interleaved rounds):
  200 ms with the cache on 4 KiB pages, 158 ms on 2 MiB pages;
- the AMX GEMM over 30 layers' cold weights at 16-128 rows: 1.2-1.75x faster on 2 MiB pages,
  and up to 3.6x while the other core streams memory (csrc/amx_bf16.c's header).

Memory is mapped anonymously, rounded up to whole 2 MiB pages and aligned to them, and marked
MADV_HUGEPAGE before the first touch, so the kernel backs it with huge pages where it can
(THP "always" or "madvise"; with "never", or off Linux, it is ordinary memory). The tensor
keeps the map alive. Rounding up costs less than 2 MiB a tensor, which is why only large
tensors (MIN_BYTES) come here.
"""
from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys
from typing import TYPE_CHECKING, Callable

import torch

from pagedlm import envs

if TYPE_CHECKING:
    from pagedlm.prefault import PrefaultedMemory

HUGE_PAGE = 2 << 20
# Below this a tensor stays on torch's allocator: rounding it up to a huge page would waste
# more than an eighth of it.
MIN_BYTES = 8 * HUGE_PAGE
# gather_panels hands freed heap memory back after this many bytes moved.
RELEASE_EVERY = 256 << 20


def supported() -> bool:
    """Whether anonymous maps can ask for huge pages here (Linux with MADV_HUGEPAGE) and
    PAGEDLM_DISABLE_HUGE_PAGES does not say no."""
    return (sys.platform == "linux" and hasattr(mmap, "MADV_HUGEPAGE")
            and not envs.PAGEDLM_DISABLE_HUGE_PAGES)


@functools.lru_cache(maxsize=None)
def libc() -> ctypes.CDLL:
    """The C library with the memory calls this module makes on raw addresses (Python's mmap
    module works only on its own maps) typed; ctypes lets the GIL go during each."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    libc.mremap.restype = ctypes.c_void_p  # variadic: its arguments are typed at the call
    return libc


def madvise(addr: int, length: int, advice: int) -> int:
    """madvise(2) on a raw address range: 0, or -1 with errno set."""
    return libc().madvise(addr, length, advice)


def empty(shape: tuple[int, ...], dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """An uninitialised (or, with zero, zeroed and faulted in) CPU tensor, on huge pages where
    it is MIN_BYTES or more and the OS supports them; else torch's own."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES or not supported():
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtype)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    # One huge page more than needed, so that the tensor can start on a 2 MiB boundary (the
    # map itself is only 4 KiB-aligned); the untouched slack is never backed.
    buf = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out: ordinary pages
        pass
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # holds a reference to buf
    start = -raw.data_ptr() % HUGE_PAGE
    out = raw[start:start + nbytes].view(dtype).view(shape)
    if zero:
        out.zero_()  # anonymous memory reads as zeros; this faults it in now
    return out


class Arena:
    """Tensors too small for a map of their own (under MIN_BYTES) carved one after another,
    each on a cache line, out of maps on huge pages of `chunk_bytes` (a new map when one is
    full; the rest of the old one is never touched, so never backed); larger ones get their own
    map (`empty`). For the panels a loader packs as a checkpoint arrives (linear_method.py), which
    gather_panels otherwise copies onto huge pages after the load: the 1B bfloat16 Llama's
    attention panels, 320 MB, a copy and a second first touch.

    Given `memory` (prefault.PrefaultedMemory, which `pagedlm serve` faults in while it
    imports), every tensor asked for by `zeros`, whatever its size, is first carved from that,
    in the order asked for; the maps above take over once it is used up."""

    def __init__(self, chunk_bytes: int = 64 << 20,
                 memory: PrefaultedMemory | None = None) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0
        self._memory = memory
        self._memory_bytes: torch.Tensor | None = None  # memory.buffer as uint8

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """As `empty`, zeroed. Bytes of the prefaulted memory are zero already, as the kernel
        faulted them in, and each is handed out once: not writing them again saved 0.28 s of
        the 1B bfloat16 Llama's 1.08 s load (Zen 4 EPYC)."""
        out = self._prefaulted(shape, dtype)
        return out if out is not None else self.empty(shape, dtype).zero_()

    def _prefaulted(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        if self._memory is None:
            return None
        nbytes = math.prod(shape) * dtype.itemsize
        offset = self._memory.take(nbytes)
        if offset is None:
            return None
        if self._memory_bytes is None:
            self._memory_bytes = torch.frombuffer(self._memory.buffer, dtype=torch.uint8)
        return self._memory_bytes[offset:offset + nbytes].view(dtype).view(shape)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes >= MIN_BYTES or not supported():
            return empty(shape, dtype)
        if self._chunk is None or self._used + nbytes > self._chunk.numel():
            self._chunk, self._used = empty((max(self.chunk_bytes, MIN_BYTES),), torch.uint8), 0
        out = self._chunk[self._used:self._used + nbytes].view(dtype).view(shape)
        self._used += aligned_bytes(nbytes)
        return out


def gather_panels(model: torch.nn.Module, release: Callable[[], None] | None = None) -> int:
    """Move the bfloat16 and float16 weight panels of the model's linear layers (their
    `panel_weight`, which every decode step streams from memory) that are smaller than
    MIN_BYTES into one map on huge pages; returns the bytes moved (0 where they are too few,
    or the OS has no huge pages). The larger ones were packed onto huge pages in the first
    place (linear_method.py passes `empty` to gemv.pack_panels), and so were the small ones a loader
    packed into an Arena's maps: both are left where they are.

    Only 2-byte panels: the copy faults its pages in a second time, at about 11 us a 4 KiB page
    on this VM (cache_engine.py), which added 0.46 s to loading SmolLM2 in bfloat16; the
    float32 default model has twice the bytes, and its gain is unmeasured.

    The panels are copied one matrix at a time and each original is dropped at once, so the
    process grows by about one matrix, plus what the heap keeps of the freed ones: `release`
    (malloc_tuning.release_freed_memory) hands that back every RELEASE_EVERY bytes. A tensor
    several layers share (a tied LM head) is moved once and stays shared. Runs before the first
    step: the fused decode stack takes the panels' addresses then."""
    held: dict[int, tuple[torch.Tensor, list[Callable[[torch.Tensor], None]]]] = {}
    for module in model.modules():
        t = getattr(module, "panel_weight", None)
        if (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
                and t.element_size() == 2 and t.nbytes < MIN_BYTES
                # a view into a larger allocation (an Arena's map) stays: moving it out would
                # not free that allocation
                and t.untyped_storage().nbytes() < MIN_BYTES):
            held.setdefault(t.data_ptr(), (t, []))[1].append(
                lambda new, m=module: setattr(m, "panel_weight", new))
    since_release = 0

    def copied(t: torch.Tensor) -> None:
        nonlocal since_release
        since_release += t.nbytes
        if release is not None and since_release >= RELEASE_EVERY:
            release()
            since_release = 0

    total = move_to_arena(held, copied)
    if total and release is not None:
        release()
    return total


def move_to_arena(held: dict[int, tuple[torch.Tensor, list[Callable[[torch.Tensor], None]]]],
                   copied: Callable[[torch.Tensor], None] | None = None) -> int:
    """Copy each held tensor (by address: each once, however many hold it) into one map on
    huge pages and hand the copy to its setters; `copied(original)` after each. Returns the
    bytes moved: 0, and nothing moved, below MIN_BYTES or without huge pages. The originals are
    dropped as they go, so the process grows by about one tensor beyond the map."""
    total = sum(aligned_bytes(t.nbytes) for t, _ in held.values())
    if total < MIN_BYTES or not supported():
        return 0
    arena = empty((total,), torch.uint8)
    offset = 0
    while held:
        t, setters = held.popitem()[1]
        moved = arena[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
        moved.copy_(t)
        for put in setters:
            put(moved)
        offset += aligned_bytes(t.nbytes)
        if copied is not None:
            copied(t)
        del t, setters  # the original's last reference here
    return total


def aligned_bytes(nbytes: int) -> int:
    """nbytes rounded up to a cache line: each panel in the arena starts on one."""
    return -(-nbytes // 64) * 64
