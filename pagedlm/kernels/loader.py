"""Builds the native kernel library once per process and loads it: the only place that runs
the compiler or opens our shared objects.

Every C source under ``pagedlm/csrc/`` goes into one shared object, with the system C compiler
and no torch headers, so a build takes a few seconds. The library is cached in
``$PAGEDLM_CACHE_DIR/kernels`` (default ``~/.cache/pagedlm/kernels``) under a name keyed by the
sources and headers, the compiler, its flags and the machine (``-march=native`` output depends
on the CPU), and is written to a temporary name first and moved into place with
``os.replace``, so concurrent processes never see a half-written file. One process builds it
while the others wait, and the temporary of a build killed mid-way is removed by the next
start (``pagedlm/staging.py``).

If the compiler is missing or the build fails, one warning is logged and :func:`available`
returns False, so callers fall back to their PyTorch paths. ``PAGEDLM_DISABLE_KERNELS=1``
forces that fallback.

Each op family (a module of this package, named after its .c file) declares its functions'
ctypes signatures next to its Python wrappers and gets the library through
:func:`typed_library`.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from pagedlm import envs
from pagedlm.staging import (build_lock, remove_leftovers, remove_stale_temporaries,
                             staging_prefix)
from pagedlm.utils import cache_root

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parents[1] / "csrc"
SOURCES = tuple(sorted(CSRC.glob("*.c")))
HEADERS = tuple(sorted((CSRC / "include").glob("*.h")))
LIBRARY_NAME = "pagedlm_kernels"
COMPILER = "gcc"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

# A C function's ctypes argument types and result type (None: void).
Signature = tuple[list, type | None]


def kernels_disabled() -> bool:
    return envs.PAGEDLM_DISABLE_KERNELS


def _cpu_signature() -> str:
    """-march=native output depends on the CPU, not just the architecture name."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def build(sources: tuple[Path, ...], headers: tuple[Path, ...] = (),
          name: str = LIBRARY_NAME) -> Path:
    """Compile `sources` into a shared object (or find the one already cached) and return its
    path; raises RuntimeError when the compiler is missing or fails."""
    compiler = shutil.which(COMPILER)
    if compiler is None:
        raise RuntimeError(f"{COMPILER} not found on PATH")
    key = hashlib.sha256()
    for part in (*(f.read_bytes() for f in (*sources, *headers)), compiler.encode(),
                 " ".join(CFLAGS).encode(), platform.machine().encode(),
                 _cpu_signature().encode()):
        key.update(part)
        key.update(b"\0")
    out_dir = cache_root() / "kernels"
    lock_dir = cache_root() / "locks" / "kernels"
    target = out_dir / f"{name}-{key.hexdigest()[:16]}.so"
    # Temporaries of builds killed mid-compile (staging.py), every library's, at every start.
    remove_leftovers(out_dir, lock_dir)
    _remove_legacy_temporaries(out_dir)
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # One build per library at a time (tensor-parallel workers start together): the others
    # wait, then load the first one's.
    with build_lock(out_dir, lock_dir, target.name):
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=staging_prefix(target.name))
        os.close(fd)
        try:
            proc = subprocess.run([compiler, *CFLAGS, *map(str, sources), "-o", tmp, "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"{compiler} failed ({proc.returncode}): {proc.stderr[-2000:]}")
            os.chmod(tmp, 0o755)  # mkstemp makes it owner-only
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


# Earlier versions named their temporaries ".NAME-XXXXXXXX.so.tmp" and took no lock. A build
# is killed after 120 s, so one that old has no live writer.
_LEGACY_TEMPORARY_MAX_AGE_S = 3600


def _remove_legacy_temporaries(out_dir: Path) -> None:
    try:
        names = os.listdir(out_dir)
    except FileNotFoundError:
        return
    remove_stale_temporaries((str(out_dir / n) for n in names
                              if n.startswith(".") and n.endswith(".so.tmp")),
                             _LEGACY_TEMPORARY_MAX_AGE_S)


@functools.lru_cache(maxsize=None)
def load_library() -> ctypes.CDLL | None:
    """Build (if needed) and load the kernel library, once; None, with one warning, when it
    cannot be built or loaded."""
    try:
        return ctypes.CDLL(str(build(SOURCES, HEADERS)))
    except Exception as exc:  # noqa: BLE001 - any failure means "use the PyTorch path"
        logger.warning("pagedlm native kernels unavailable, using the PyTorch fallback: %s",
                       exc)
        return None


def available() -> bool:
    """True when the native kernels can be used (not disabled, and they build and load)."""
    return not kernels_disabled() and load_library() is not None


def typed_library(signatures: Mapping[str, Signature]) -> Callable[[], ctypes.CDLL | None]:
    """A function returning the loaded library (None where it is not) with the ctypes types
    of `signatures`' functions set, which it does once per loaded library."""
    typed: list[ctypes.CDLL] = []  # the library the types were set on

    def library() -> ctypes.CDLL | None:
        lib = load_library()
        if lib is not None and (not typed or typed[0] is not lib):
            for name, (argtypes, restype) in signatures.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, restype
            typed[:] = [lib]
        return lib

    return library
