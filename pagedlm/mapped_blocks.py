"""The quantized weight blocks a GGUF model streams every step, which lie in a map of the file,
onto 2 MiB pages: left in place where the page cache holds the file in 2 MiB folios
(advise_file_map, on_huge_file_pages), copied into one map on huge pages at the load
(gather_blocks), or moved under their own addresses while the engine serves (FileMapMove).
Why huge pages at all: huge_pages.py; why fresh memory rather than the page cache's:
gather_blocks.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from pagedlm import huge_pages
from pagedlm.huge_pages import HUGE_PAGE

# A file map counts as on huge pages (on_huge_file_pages) when this share of its mapped bytes
# is on 2 MiB entries. Not all: the 2 MiB around the header, the file's tail and a range that
# was mapped before the map was advised stay on 4 KiB entries (the 1B Q4_K_M file: 3 of 200
# huge pages' worth, populating 400 MB from 1 MB on).
HUGE_FILE_MAP_SHARE = 0.9
# madvise(2)'s MADV_POPULATE_READ (Linux 5.14): map a range's pages without touching them.
_MADV_POPULATE_READ = 22
# mremap(2)'s flags: the pages may move, to exactly the address given.
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
# FileMapMove moves this much at a time: the memory it holds beyond the weights.
_MOVE_PIECE = 16 * HUGE_PAGE


def advise_file_map(m: mmap.mmap) -> None:
    """Ask for huge pages in a file map before its pages are first read. Where the file
    system keeps large folios in the page cache (ext4 since Linux 6.16), a page the cache
    lacks then comes in with its whole 2 MiB folio, which the map maps with one entry: the
    weights are then on huge pages as they lie in the file (gather_blocks leaves them)."""
    if huge_pages.supported():
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP compiled out
            pass


def on_huge_file_pages(tensors: list[torch.Tensor]) -> set[int]:
    """The data_ptr of each tensor that lies in a file map mapped 2 MiB at a time: its pages
    mapped (MADV_POPULATE_READ; a cheap walk when the page cache holds them), and then nearly
    all of the map's mapped pages in FilePmdMapped (/proc/self/smaps, file_maps).
    That is the case when the page cache keeps the file in 2 MiB folios (advise_file_map).

    A file the cache already holds in small folios (faulted in through a map without the
    advice, as llama.cpp's, or by a reader that disabled readahead) stays in them for as long
    as it is cached, so its map is re-read once (reread_on_huge_folios): on the 2-vCPU Xeon
    the 1B Q4_K_M file's 667 MB came back from the disk in 0.31 s, where copying them onto
    fresh huge pages took 1.4-1.6 s."""
    if not tensors or not huge_pages.supported():
        return set()

    def populate() -> bool:
        for t in tensors:
            first = t.data_ptr() - t.data_ptr() % mmap.PAGESIZE
            if huge_pages.madvise(first, t.data_ptr() + t.nbytes - first, _MADV_POPULATE_READ):
                return False  # an older kernel, or not a map of a file
        return True

    def inside(t: torch.Tensor, m: FileMap) -> bool:
        return m.start <= t.data_ptr() and t.data_ptr() + t.nbytes <= m.end

    if not populate():
        return set()
    maps = _own_file_maps()
    small = [m for m in maps if not m.huge and any(inside(t, m) for t in tensors)]
    reread = [reread_on_huge_folios(m) for m in small]  # each, not up to the first True
    if any(reread) and populate():
        maps = _own_file_maps()
    return {t.data_ptr() for t in tensors if any(m.huge and inside(t, m) for m in maps)}


@dataclass(frozen=True)
class FileMap:
    """One map of a file, as /proc/<pid>/smaps describes it."""
    start: int
    end: int
    offset: int        # in the file, of `start`
    inode: int
    path: str
    rss: int           # bytes mapped
    pmd_mapped: int    # of those, mapped by 2 MiB entries (FilePmdMapped)
    anonymous: int     # bytes written in a private map: copies only this process holds

    @property
    def huge(self) -> bool:
        """Nearly all of its mapped pages are on 2 MiB entries (HUGE_FILE_MAP_SHARE)."""
        return self.pmd_mapped > 0 and self.pmd_mapped >= HUGE_FILE_MAP_SHARE * self.rss


def file_maps(smaps: str) -> list[FileMap]:
    """Each file map in a /proc/<pid>/smaps text."""
    found, head, fields_seen = [], None, {}
    for line in smaps.splitlines() + ["0-0 ---p 0 00:00 0"]:  # the sentinel ends the last
        fields = line.split()
        if not fields:
            continue
        if "-" in fields[0] and not fields[0].endswith(":"):  # a map's first line
            if head is not None:
                found.append(FileMap(*head, rss=fields_seen.get("Rss:", 0),
                                     pmd_mapped=fields_seen.get("FilePmdMapped:", 0),
                                     anonymous=fields_seen.get("Anonymous:", 0)))
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            head = ((lo, hi, int(fields[2], 16), int(fields[4]), " ".join(fields[5:]))
                    if len(fields) >= 6 and fields[4] != "0" else None)  # inode 0: anonymous
            fields_seen = {}
        elif head is not None and len(fields) >= 2 and fields[1].isdigit():
            fields_seen[fields[0]] = int(fields[1]) * 1024
    return found


def _own_file_maps() -> list[FileMap]:
    try:
        with open("/proc/self/smaps") as f:
            return file_maps(f.read())
    except OSError:
        return []


def reread_on_huge_folios(m: FileMap) -> bool:
    """Drop `m`'s pages from this process and from the page cache, so that they are read again
    through the map's huge-page advice; True if that was done. Only a map with no written
    pages (they would be lost) of a file still at its path qualifies. The page cache keeps
    pages another process maps: those stay as they were, and gather_blocks copies what is
    still on small pages. The cost is one read of the map's range from the disk."""
    try:
        st = os.stat(m.path)
    except OSError:
        return False
    if m.anonymous or st.st_ino != m.inode or not stat.S_ISREG(st.st_mode):
        return False
    if huge_pages.madvise(m.start, m.end - m.start, mmap.MADV_DONTNEED):
        return False
    try:
        fd = os.open(m.path, os.O_RDONLY)
    except OSError:
        return True  # unmapped only: the next touch maps the cached pages again
    try:
        os.posix_fadvise(fd, m.offset, m.end - m.start, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def streamed_blocks(model: torch.nn.Module) -> dict[int, tuple[torch.Tensor, list[Callable]]]:
    """The quantized weight blocks the model's layers stream every step (a quantized layer's
    `qweight_data`, a sharded GGUF layer's uint8 shards), by address, each with the setters that
    would point its holders at a copy: its layers, and an embedding whose row lookups read the
    same blocks (a tied LM head's table)."""
    held: dict[int, tuple[torch.Tensor, list[Callable[[torch.Tensor], None]]]] = {}

    def hold(t, setter):
        if (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
                and t.dtype in (torch.uint8, torch.int8) and t.numel()):
            held.setdefault(t.data_ptr(), (t, []))[1].append(setter)

    def set_shard(module, i):
        def put(new):
            shards = list(module.quant_shards)
            shards[i] = (*shards[i][:2], new)
            module.quant_shards = tuple(shards)
        return put

    for module in model.modules():
        hold(getattr(module, "qweight_data", None),
             lambda new, m=module: setattr(m, "qweight_data", new))
        for i, shard in enumerate(getattr(module, "quant_shards", None) or ()):
            hold(shard[2], set_shard(module, i))
    for module in model.modules():  # only tables a layer streams anyway
        rows = getattr(getattr(module, "row_lookup", None), "blocks", None)
        if isinstance(rows, torch.Tensor) and rows.data_ptr() in held:
            held[rows.data_ptr()][1].append(
                lambda new, m=module: setattr(m.row_lookup, "blocks", new))
    return held


def gather_blocks(model: torch.nn.Module,
                  release: Callable[[torch.Tensor], None] | None = None,
                  in_place: bool = False, stay_in: tuple[int, int] | None = None) -> int:
    """Move the quantized weight blocks the model's layers stream every step (streamed_blocks)
    into one fresh map on huge pages; returns the bytes moved (0 where the OS has no huge
    pages). `release(t)` is called on each original once it is copied (GGUFConfig: drop the
    file map's pages under it, so the process never holds a weight twice). Blocks that lie
    inside the address range `stay_in` (a file map whose pages FileMapMove will move under
    them) are left where they are.

    Why: a GGUF file's blocks are views of its memory map, on the page cache's 4 KiB pages, and
    the copies loading makes (fused or permuted rows) are on malloc's. On the 2-vCPU Xeon,
    the 1B Q4_K_M file's greedy stream (LLM.generate, 256 tokens, medians of 4) ran 29.0-29.5
    tok/s against 21.3 with PAGEDLM_DISABLE_HUGE_PAGES=1, and torch.sum reads 29.0-29.4 GB/s
    on 2 MiB pages against 23.6-24.8 on 4 KiB ones. The price is at load: 1.4-1.6 s for this
    file's 667 MB there against 0.15 s for the copy into pages already faulted in (this VM's
    first touch of memory it has not used lately, not the copy: 2.0 s to fault in 667 MB of
    huge pages the first time, 0.075 s the next); FileMapMove pays it after the load.

    With in_place (PAGEDLM_GGUF_IN_PLACE), blocks that are views of a file map already on
    2 MiB entries stay where they are for good (on_huge_file_pages: the page cache holds the
    file in 2 MiB folios, as advise_file_map gets where the file system can, or as
    on_huge_file_pages reads a file cached in small ones again): no fresh memory at all. Not
    the default, because on the Xeon VM the page cache a file was just read into streams
    slower than fresh memory: torch.sum over the 1B Q4_K_M file's map read 27.2 GB/s (through
    4 KiB entries) while the cache had held it for a day, and right after evicting and reading
    it again 19.3 (4 KiB entries) and 22.7 (2 MiB ones; 4 times on an earlier day, each
    19.2-21.4); 20.3-21.2 for a copy of the file just written by `cp`; 25.2-26.8 for the copy
    onto fresh huge pages each time. The 1B stream ran 22.7-23.0 tok/s in place against 27.2
    copied on such a day, and at the copy's speed when the cache was old. How the host backs
    the guest's memory is not this process's to see; a cold start, the file just read from
    the disk, is the slow case, and the copy lands on memory the CPU touched first. (On the
    Zen 4 EPYC both read 34-37 GB/s, cold or not.)"""
    held = streamed_blocks(model)
    if held and in_place and huge_pages.supported():
        # Views of a file map already on 2 MiB entries stay: no copy, and no fresh memory.
        for ptr in on_huge_file_pages([t for t, _ in held.values()]):
            del held[ptr]
    if stay_in is not None:
        for t in blocks_within(held, *stay_in):
            del held[t.data_ptr()]
    return huge_pages.move_to_arena(held, release)


def blocks_within(held: dict[int, tuple[torch.Tensor, list[Callable]]], lo: int,
                  hi: int) -> list[torch.Tensor]:
    """The tensors of `held` (streamed_blocks's) that lie wholly in the address range
    [lo, hi)."""
    return [t for t, _ in held.values() if lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi]


class FileMapMove:
    """Move the pages under given spans of a private file map onto fresh anonymous huge pages,
    at the same addresses, in a thread: each piece (_MOVE_PIECE) is copied into a new map
    advised for huge pages, and mremap(2) then puts that map's pages in place of the file's
    (MREMAP_FIXED replaces what lay there). Tensors, and the raw pointers the fused decode
    stack took, stay valid throughout: every read sees the same bytes (nothing writes the
    blocks), from the file's pages before a piece's move and from its copy after, so the engine
    serves while this runs.

    Why: the blocks a GGUF model streams are fastest on memory this process faulted in fresh
    (gather_blocks says where the page cache read slower), but faulting 667 MB of it took the
    1B Q4_K_M load 1.4-1.6 s on the Xeon VM; copied before ready, `pagedlm serve` of that file
    was ready in 3.3-3.9 s on the Zen 4 EPYC, moved after the load in 2.7-3.2 s (the move
    ending ~1.7 s later): the server is ready on the file's pages and the fresh ones follow.
    The memory it holds beyond the weights is one piece; the spans are rounded out to whole
    huge pages (within the map), so up to 2 MiB of a neighbouring tensor on each side of a gap
    comes along.

    After a move the range is anonymous memory: nothing may MADV_DONTNEED it (that zeroes
    anonymous pages), so the loader drops the file's pages (release_pages) before it starts.
    Where a call fails (no mremap, out of memory) the move stops, the rest staying on the
    file's pages. `owner` (the map) is held until the thread ends, so it outlives the copy."""

    def __init__(self, owner: object, lo: int, hi: int, spans: list[tuple[int, int]]) -> None:
        """lo, hi: the map's first and past-the-last address; spans: (address, bytes) in it."""
        self.pieces = _pieces(lo, hi, spans)
        self.moved = 0  # bytes now on fresh pages
        self._owner = owner
        self._thread = threading.Thread(target=self._run, name="pagedlm-blocks-move",
                                        daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the move has ended (every piece moved, or it stopped), waiting up to
        `timeout` seconds for it."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        libc = huge_pages.libc()
        try:
            for dst, n in self.pieces:
                if not _move_piece(libc, dst, n):
                    return
                self.moved += n
        finally:
            self._owner = None


def _pieces(lo: int, hi: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(address, bytes) pieces that cover the spans, each span rounded out to huge pages and
    clipped to [lo, hi) rounded out to 4 KiB pages; spans less than a huge page apart are
    joined; pieces end on multiples of _MOVE_PIECE, so all but a clipped end are whole huge
    pages."""
    lo = lo - lo % mmap.PAGESIZE
    hi = -(-hi // mmap.PAGESIZE) * mmap.PAGESIZE
    ranges: list[list[int]] = []
    for start, n in sorted(spans):
        a = max(lo, start - start % HUGE_PAGE)
        b = min(hi, -(-(start + n) // HUGE_PAGE) * HUGE_PAGE)
        if ranges and a <= ranges[-1][1]:
            ranges[-1][1] = max(ranges[-1][1], b)
        elif a < b:
            ranges.append([a, b])
    pieces = []
    for a, b in ranges:
        while a < b:
            end = min(b, (a // _MOVE_PIECE + 1) * _MOVE_PIECE)
            pieces.append((a, end - a))
            a = end
    return pieces


def _move_piece(libc: ctypes.CDLL, dst: int, n: int) -> bool:
    """Put fresh anonymous pages holding a copy of [dst, dst + n) at dst; False if a call
    failed (the range then unchanged)."""
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    raw = libc.mmap(None, n + HUGE_PAGE, prot, flags, -1, 0)
    if raw is None or raw == ctypes.c_void_p(-1).value:
        return False
    # The copy sits at dst's offset within a huge page, so that mremap moves whole 2 MiB
    # entries; the slack around it goes back unused.
    tmp = raw + (dst - raw) % HUGE_PAGE
    if tmp > raw:
        libc.munmap(raw, tmp - raw)
    if raw + n + HUGE_PAGE > tmp + n:
        libc.munmap(tmp + n, raw + n + HUGE_PAGE - (tmp + n))
    libc.madvise(tmp, n, mmap.MADV_HUGEPAGE)  # without THP: ordinary pages, still fresh
    libc.memcpy(tmp, dst, n)
    moved = libc.mremap(ctypes.c_void_p(tmp), ctypes.c_size_t(n), ctypes.c_size_t(n),
                        ctypes.c_int(_MREMAP_MAYMOVE | _MREMAP_FIXED), ctypes.c_void_p(dst))
    if moved != dst:
        libc.munmap(tmp, n)
        return False
    return True
