"""glibc malloc settings for a process that runs the model.

Torch's CPU allocator does not cache: every activation of every step is a fresh malloc and
free. glibc serves blocks above its mmap threshold (which adapts, up to 32 MiB) with mmap, and
gives freed memory at the top of the heap back to the kernel past its trim threshold, so a
step's tensors fault their pages in again and the kernel zeroes each one. The 128-request
benchmark (`benchmarks/throughput.py --num-prompts 128 --input-len 32:512 --output-len 16:256`)
took 5.3 million page faults and 67.0 / 66.3 s (two runs); with the threshold fixed at 32 MiB,
a 1 GiB trim threshold and a 64 MiB top pad, freed memory stays in the heap for the next step:
1.05 million faults (most of them the KV cache's first touch) and 63.8 / 62.7 s. The cost is
up to the trim threshold of freed memory kept by the process.

While a bfloat16 or float16 checkpoint loads, the opposite holds: every allocation of 1 MiB or
more (each weight matrix) gets a map of its own, which free() hands back at once. Layers are
packed as their weights arrive (model_loader.loader.process_as_loaded), and a plain weight
freed into the heap stayed resident, under the settings above and under glibc's own (whose mmap
threshold had risen past the weights' sizes): 0.2-0.3 GiB of a 1B bfloat16 Llama's load peak
in `pagedlm serve`. Other loads keep the settings above (worker.py says why).

`PAGEDLM_DEFAULT_MALLOC=1` leaves glibc's defaults (and other C libraries are left alone).
"""
from __future__ import annotations

import ctypes
import logging
import sys

from pagedlm import envs

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h) and the values set.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_SETTINGS = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))
_LOADING_SETTINGS = ((_M_MMAP_THRESHOLD, 1 << 20),)


def keep_freed_memory() -> bool:
    """Apply the settings for running steps to this process; whether they took (glibc on
    Linux only)."""
    return _apply(_SETTINGS)


def map_each_weight() -> bool:
    """Apply the settings for loading a model (above) to this process; whether they took.
    keep_freed_memory replaces them once it is loaded."""
    return _apply(_LOADING_SETTINGS)


def _apply(settings: tuple[tuple[int, int], ...]) -> bool:
    if envs.PAGEDLM_DEFAULT_MALLOC or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in settings)
    if not ok:
        logger.warning("glibc mallopt refused pagedlm's settings; allocations keep the defaults")
    return ok


def release_freed_memory() -> None:
    """Give the memory that is free in the heap back to the kernel now (glibc's malloc_trim),
    once, after the model is loaded: the settings above keep up to 1 GiB that loading freed
    (checkpoint tensors read and dropped, plain weights replaced by their packed form), which
    would otherwise stay in the process's RSS and out of the KV cache's budget."""
    if envs.PAGEDLM_DEFAULT_MALLOC or not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
