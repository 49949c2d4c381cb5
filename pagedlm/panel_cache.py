"""A 2-byte checkpoint's weight panels kept in a file of the cache, which a later load of the
same checkpoint maps instead of packing the checkpoint again.

Why: packing writes every panel byte into memory the process has not touched before, and on
these VMs that first touch is most of the load. `pagedlm serve` of the 1B bfloat16 Llama
(2.15 GB of panels) was ready in 4.0-4.6 s, its weights loaded in 2.2-2.7 s after other
servers had run, against 0.55 s for llama.cpp on the same weights as an F16 GGUF file, which it
maps (Zen 4 EPYC, 2 vCPUs; benchmarks/results/gguf-models-20261129T005037Z-zen4-gc). Mapped
from the panels' file, which the page cache holds after the first load, it was ready in 2.0 s
(gguf-models-20261129T090948Z-zen4-panel-file), and in process LLM() took 0.6-1.1 s against
4.1-5.2 packing.

Which loads: one worker on the CPU, bfloat16 or float16 weights (ModelConfig.dtype) from a
safetensors directory, no quantization; PAGEDLM_PANEL_CACHE chooses between "auto" (panels of
at least AUTO_MIN_BYTES: a small model loads in under a second either way),
"always" and "off". The first load packs as before and a thread writes the panels into the
file once the model is loaded (at lowered priority; tmp file, fsync, rename: a reader sees a
whole file or none). Its name is a hash of the checkpoint (each file's name, size, mtime and
inode, config.json's too), the dtype and this module's FORMAT; the file ends with an index of
every layer's panels (name, offset, shape, dtype) and the panel kernel's layout, which a load
checks against the model it builds: any difference, a truncated or foreign file, and the load
packs from the checkpoint again (and rewrites the file). A changed checkpoint gets another
name; writing a file removes those of the folder's older versions and of folders that no
longer exist.

The file is mapped privately (copy on write; nothing writes the panels), with the advice for
huge pages, and the layers' panels are views of it: the checkpoint's matrices are not read at
all. The bytes live in the page cache, shared with any other process that maps the same file.

This module imports nothing heavy at its top: `pagedlm serve` asks `is_cached` before torch is
imported (prefault.py's head start is not needed when the panels come from the file).
"""
from __future__ import annotations

import atexit
import glob
import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pagedlm import envs
from pagedlm.staging import (remove_leftovers, remove_stale_temporaries, staging_prefix,
                             try_build_lock)
from pagedlm.utils import cache_root, dtype_name, lower_thread_priority

if TYPE_CHECKING:
    import torch
    from torch import nn

logger = logging.getLogger(__name__)

# Bumped whenever the file's layout or the meaning of a panel's bytes changes.
FORMAT = 1
_MAGIC = b"PGLMPNL1"
# The file's last 16 bytes: the index's length, then the magic.
_TRAILER = struct.Struct("<Q8s")
# Each panel starts on a cache line, as huge_pages.Arena's do.
_ALIGN = 64
# "auto" writes the file for panels of at least this many bytes. The file is a second copy of
# the weights on the disk: worth it where it saves seconds (the 1B Llama, above), less so for
# SmolLM2-135M in bfloat16 (270 MB of panels: its weights loaded in 0.56-0.68 s packed, 0.09 s
# mapped; Zen 4 EPYC, "always" against "off").
AUTO_MIN_BYTES = 1 << 30
# The index is JSON of a few hundred bytes a layer; more than this is not our file.
_MAX_INDEX = 64 << 20
# A file is not written unless the disk keeps this much free beside it.
_DISK_MARGIN = 1 << 30
# Write this many bytes a call: each releases the GIL.
_WRITE_PIECE = 64 << 20
_MODES = {"auto": "auto", "always": "always", "1": "always", "on": "always",
          "off": "off", "0": "off", "never": "off"}


def mode() -> str:
    """PAGEDLM_PANEL_CACHE as one of "auto", "always", "off" (unset or empty: "auto")."""
    raw = (envs.PAGEDLM_PANEL_CACHE or "auto").strip().lower()
    if raw not in _MODES:
        raise ValueError(f"PAGEDLM_PANEL_CACHE={envs.PAGEDLM_PANEL_CACHE!r}: expected one of "
                         f"auto, always (or 1, on), off (or 0, never).")
    return _MODES[raw]


def _directory() -> str:
    return os.path.join(cache_root(), "panels")


def _lock_directory() -> Path:
    return cache_root() / "locks" / "panels"


def _checkpoint_files(model_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors"))
                  + [os.path.join(model_dir, "config.json")])


def cache_file(model_dir: str, dtype_name: str) -> str | None:
    """The path of the panels' file for the checkpoint in `model_dir` as `dtype_name`
    ("bfloat16" or "float16"), whether it exists or not; None where a file of the checkpoint
    cannot be read (the loader reports that)."""
    folder = os.path.realpath(model_dir)
    stats = []
    for path in _checkpoint_files(folder):
        try:
            st = os.stat(path)
        except OSError:
            return None
        stats.append([os.path.basename(path), st.st_size, st.st_mtime_ns, st.st_ino])
    key = hashlib.sha256(json.dumps([FORMAT, folder, dtype_name, stats]).encode()).hexdigest()
    return os.path.join(_directory(), f"{_folder_tag(folder)}-{key[:32]}.panels")


def _folder_tag(folder: str) -> str:
    """What every version's file of one checkpoint folder starts with."""
    return hashlib.sha256(folder.encode()).hexdigest()[:16]


def is_cached(model_dir: str, dtype_name: str) -> bool:
    """Whether a panels' file of this checkpoint exists (not yet checked: a load does that).
    False under a PAGEDLM_PANEL_CACHE that is off or wrong (the load reports the latter)."""
    try:
        if mode() == "off":
            return False
    except ValueError:
        return False
    path = cache_file(model_dir, dtype_name)
    return path is not None and os.path.isfile(path)


@dataclass(frozen=True)
class PanelEntry:
    """One layer's panels in the file."""
    offset: int
    shape: tuple[int, ...]
    dtype: str  # "bfloat16" or "float16"

    @property
    def nbytes(self) -> int:
        n = 2
        for d in self.shape:
            n *= d
        return n


def _read_index(m: mmap.mmap) -> tuple[dict, int]:
    """A panels' file's index, read from its map, and the offset where it starts; ValueError
    where the map does not end with one of this FORMAT."""
    size = len(m)
    if size < _TRAILER.size:
        raise ValueError("shorter than its trailer")
    length, magic = _TRAILER.unpack_from(m, size - _TRAILER.size)
    if magic != _MAGIC or length > min(_MAX_INDEX, size - _TRAILER.size):
        raise ValueError("no panels' trailer")
    index_at = size - _TRAILER.size - length
    index = json.loads(bytes(m[index_at:index_at + length]))
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError("another format")
    return index, index_at


class MappedPanels:
    """A panels' file, mapped and its index read and checked; `view` gives one layer's panels
    as a tensor on the map (the loader makes them the layers' panels)."""

    def __init__(self, path: str) -> None:
        """Raises ValueError (or OSError) where the file is not a whole panels' file."""
        import torch
        self.path = path
        with open(path, "rb") as f:  # an empty file cannot be mapped: a ValueError too
            self._map = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # THP compiled out
                pass
        index, index_at = _read_index(self._map)
        self.layout = index.get("layout")
        self.entries: dict[str, PanelEntry] = {}
        for name, (offset, shape, dtype) in index["panels"].items():
            entry = PanelEntry(int(offset), tuple(int(d) for d in shape), str(dtype))
            if (entry.offset % _ALIGN or entry.offset < 0
                    or entry.offset + entry.nbytes > index_at
                    or entry.dtype not in ("bfloat16", "float16")):
                raise ValueError(f"entry {name!r} out of the file")
            self.entries[name] = entry
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def view(self, name: str) -> torch.Tensor:
        """Layer `name`'s panels: a view of the map, which it keeps mapped."""
        import torch
        entry = self.entries[name]
        dtype = torch.bfloat16 if entry.dtype == "bfloat16" else torch.float16
        return self._bytes[entry.offset:entry.offset + entry.nbytes].view(dtype).view(entry.shape)


# Writers before the staging files named theirs PATH.PID.THREAD.tmp and took no lock; one
# that has not been written to for this long has no live writer (the 1B Llama's 2.15 GB take
# seconds).
_LEGACY_TEMPORARY_MAX_AGE_S = 3600


def _remove_leftovers() -> None:
    """The staging files of writers that died (killed mid-write: up to the panels' size)."""
    folder = _directory()
    try:
        remove_leftovers(Path(folder), _lock_directory())
    except OSError as e:  # a read-only cache
        logger.debug("panels' leftovers not removed: %s", e)
    remove_stale_temporaries(glob.glob(os.path.join(glob.escape(folder), "*.panels.*.tmp")),
                             _LEGACY_TEMPORARY_MAX_AGE_S)


def open_cached(path: str) -> MappedPanels | None:
    """The panels' file at `path` mapped, or None where there is none or it is not a whole
    one of this format (logged: the load packs from the checkpoint and rewrites it)."""
    _remove_leftovers()
    if not os.path.isfile(path):
        return None
    try:
        return MappedPanels(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        logger.warning("panels' file %s unusable (%s): packing from the checkpoint", path, e)
        return None


def _free_disk(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _checkpoint_of(path: str) -> str | None:
    """The checkpoint folder a panels' file was written for, from its index; None where the
    file is not a readable one of this format."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            folder = _read_index(m)[0].get("checkpoint")
    except (OSError, ValueError):
        return None
    return folder if isinstance(folder, str) else None


def _remove_stale(path: str) -> None:
    """Remove the panels' files beside `path` that no load will map again: the other versions
    of its checkpoint folder's, and those of folders that no longer exist."""
    tag = os.path.basename(path).split("-", 1)[0]
    for other in glob.glob(os.path.join(glob.escape(os.path.dirname(path)), "*.panels")):
        if other == path:
            continue
        if not os.path.basename(other).startswith(tag + "-"):
            folder = _checkpoint_of(other)
            if folder is None or os.path.isdir(folder):
                continue
        try:
            os.unlink(other)
        except OSError:
            pass


def write_panels(path: str, checkpoint: str, layers: dict[str, nn.Module],
                 layout: dict, stop: threading.Event | None = None) -> bool:
    """Write the layers' panels (each one's `panel_weight`, as loaded) of the checkpoint in
    folder `checkpoint`, and `layout` (what decides the panels' bytes besides the checkpoint:
    the kernel's panel width, ...), into the file at `path` (a staging file of staging.py,
    fsync, rename), having removed the files no load will map again (_remove_stale); False,
    nothing written, where a layer has no 2-byte panels, the disk lacks the room, another
    process writes the same file, or `stop` was set meanwhile."""
    import torch
    panels = {name: getattr(module, "panel_weight", None) for name, module in layers.items()}
    if not panels or any(not isinstance(t, torch.Tensor) or t.element_size() != 2
                         or not t.is_contiguous() for t in panels.values()):
        return False
    index, offset = {}, 0
    for name, t in panels.items():
        index[name] = [offset, list(t.shape), dtype_name(t.dtype)]
        offset += -(-t.nbytes // _ALIGN) * _ALIGN
    blob = json.dumps({"format": FORMAT, "checkpoint": os.path.realpath(checkpoint),
                       "layout": layout, "panels": index}).encode()
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    entry = os.path.basename(path)
    # Held until the staging file is gone: a writer killed meanwhile leaves a file as large
    # as the panels, which the next load removes once this lock is free (open_cached).
    with try_build_lock(Path(folder), _lock_directory(), entry) as mine:
        if not mine:
            return False
        _remove_stale(path)  # first: the room they take may be what the new file needs
        if _free_disk(folder) < offset + len(blob) + _DISK_MARGIN:
            logger.info("panels' file not written: %.2f GB would leave under %.1f GB free in "
                        "%s", offset / 1e9, _DISK_MARGIN / 2**30, folder)
            return False
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=staging_prefix(entry))
        try:
            os.fchmod(fd, 0o644)  # mkstemp's is owner-only; other users' loads map it too
            with os.fdopen(fd, "wb") as f:
                for name, t in panels.items():
                    raw = t.view(torch.uint8).view(-1).numpy()
                    for start in range(0, raw.size, _WRITE_PIECE):
                        if stop is not None and stop.is_set():
                            return False
                        f.write(memoryview(raw[start:start + _WRITE_PIECE]))
                    f.write(b"\0" * (-t.nbytes % _ALIGN))
                f.write(blob)
                f.write(_TRAILER.pack(len(blob), _MAGIC))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return True


@dataclass
class PanelCacheWrite:
    """A pending write of a loaded model's panels (get_model decides it; the worker starts it
    once the panels are where they stay)."""
    path: str
    checkpoint: str  # the checkpoint's folder
    layers: dict[str, nn.Module]
    layout: dict
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> threading.Thread | None:
        """Write in a thread at lowered priority; None where "auto" finds the panels too small
        to be worth a file."""
        total = sum(getattr(getattr(m, "panel_weight", None), "nbytes", 0)
                    for m in self.layers.values())
        if mode() == "auto" and total < AUTO_MIN_BYTES:
            return None
        self._thread = threading.Thread(target=self._run, name="pagedlm-panel-cache",
                                        daemon=True)
        # The write outlives the engine's shutdown, but not the process: a daemon thread is
        # dropped at exit wherever it is, and a server stopped seconds after it started left
        # its staging file (2.15 GB for the 1B bfloat16 Llama) behind at every stop.
        atexit.register(self.cancel)
        self._thread.start()
        return self._thread

    def cancel(self, timeout: float = 5.0) -> None:
        """Stop a write still under way and wait until its staging file is removed (the
        process exits). One killed instead leaves that file to the next load (open_cached)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        lower_thread_priority()
        began = time.perf_counter()
        try:
            if write_panels(self.path, self.checkpoint, self.layers, self.layout, self._stop):
                logger.info("panels written to %s for the next load (%.1f s)", self.path,
                            time.perf_counter() - began)
        except OSError as e:
            logger.warning("panels' file %s not written: %s", self.path, e)
        finally:
            self.layers = {}
            atexit.unregister(self.cancel)
