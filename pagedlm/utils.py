"""Small helpers shared across modules."""
from __future__ import annotations

import os
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
    import threading
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except OSError:
        pass
