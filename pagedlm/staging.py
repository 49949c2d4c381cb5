"""Cache entries built by one process at a time, and the leftovers of builders that died.

A cache entry (a converted GGUF model directory, a compiled kernel library, a checkpoint's
weight panels) is written under a staging name ``.NAME.tmp-XXXXXXXX`` beside its final name
``NAME`` and renamed into place, so a reader sees either nothing or the complete entry. The
builder holds an exclusive ``flock`` on ``LOCK_DIR/NAME.lock`` from before its staging entry
exists until after it is gone. A staging entry whose lock can be taken therefore belongs to a
builder that died (SIGKILL, OOM killer, power loss) and will never be finished:
:func:`remove_leftovers` deletes it. The kernel drops a flock with the holder's last file
descriptor however the process ends, and the lock works across processes of different pid
namespaces (containers sharing a cache volume), where a pid written into the name could not be
checked for liveness.

Lock files stay (empty, one per entry ever built): deleting a lock file while another process
may be opening it would let two builders hold "the" lock at once.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

_STAGING_INFIX = ".tmp-"


def staging_prefix(name: str) -> str:
    """Prefix for ``tempfile.mkdtemp``/``mkstemp`` when building the entry ``name``."""
    return f".{name}{_STAGING_INFIX}"


def _entry_of(staging_name: str) -> str | None:
    """The entry a staging name belongs to, or None if it is not a staging name."""
    if not staging_name.startswith(".") or _STAGING_INFIX not in staging_name:
        return None
    # The random part (tempfile's [a-z0-9_]) never contains the infix, so the last one is ours.
    return staging_name[1:staging_name.rindex(_STAGING_INFIX)]


@contextlib.contextmanager
def _flock(lock_dir: Path, name: str, *, blocking: bool) -> Iterator[bool]:
    lock_dir.mkdir(parents=True, exist_ok=True)
    # O_CLOEXEC: a compiler or other child must not inherit the lock and outlive us with it.
    fd = os.open(lock_dir / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
        else:
            yield True
    finally:
        os.close(fd)  # releases the lock


def _remove_staging_of(directory: Path, name: str) -> list[Path]:
    """Delete ``name``'s staging entries; the caller holds ``name``'s lock."""
    removed = []
    for entry in os.scandir(directory):
        if _entry_of(entry.name) != name:
            continue
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def remove_leftovers(directory: Path, lock_dir: Path) -> list[Path]:
    """Delete the staging entries in ``directory`` whose builder is gone; return their paths.

    An entry whose builder is alive (its lock is held) is left alone. Cheap when there is
    nothing to remove (one directory listing), so it runs at every start.
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    removed = []
    for name in sorted({e for n in names if (e := _entry_of(n)) is not None}):
        try:
            with _flock(lock_dir, name, blocking=False) as held:
                if held:
                    removed += _remove_staging_of(directory, name)
        except OSError as exc:
            # A read-only cache still serves its complete entries; the leftover just stays.
            logger.debug("cannot remove the leftovers of %s in %s: %s", name, directory, exc)
    return removed


def remove_stale_temporaries(paths: Iterable[str], max_age_s: float) -> None:
    """Delete the files among `paths` not written to for `max_age_s`: the temporaries of
    builders from before staging entries, which took no lock, so only their age tells that
    the builder is gone."""
    now = time.time()
    for path in paths:
        try:
            if now - os.stat(path, follow_symlinks=False).st_mtime > max_age_s:
                os.unlink(path)
        except OSError:  # another process removed it first, or a read-only cache
            pass


@contextlib.contextmanager
def try_build_lock(directory: Path, lock_dir: Path, name: str) -> Iterator[bool]:
    """build_lock without the wait, for an entry that whoever comes first writes: yields False,
    having done nothing, while another builder holds the lock."""
    with _flock(lock_dir, name, blocking=False) as held:
        if held:
            _remove_staging_of(directory, name)
        yield held


@contextlib.contextmanager
def build_lock(directory: Path, lock_dir: Path, name: str) -> Iterator[None]:
    """Hold the lock for building ``directory/name`` (waiting while another process builds it).

    On entry, staging entries of ``name`` left by dead builders are gone. The caller checks
    again whether the entry exists: the process it waited for may have built it.
    """
    with _flock(lock_dir, name, blocking=True):
        _remove_staging_of(directory, name)
        yield
