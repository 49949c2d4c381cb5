"""The worker's malloc settings keep freed memory for the next allocation: tensors of the size
of a step's large activations (24-27 MiB), allocated again after being freed, find their pages
still there instead of faulting them in anew. Each case runs in a fresh interpreter, since the
settings are process-wide."""
import os
import subprocess
import sys

import pytest

SCRIPT = """
import resource, torch
from pagedlm.worker.malloc_tuning import keep_freed_memory
applied = keep_freed_memory()
faults = []
for mib in (24, 25, 26, 27, 28) * 2:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(mib << 18).fill_(1.0)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(int(applied), sum(faults[5:9]))
"""


def _second_round_faults(env_extra: dict) -> tuple[bool, int]:
    """(settings applied, page faults of the second round's 24-27 MiB tensors)."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], env={**os.environ, **env_extra},
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0] == "1", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc settings")
def test_freed_memory_is_reused():
    applied, tuned = _second_round_faults({})
    default_applied, default = _second_round_faults({"PAGEDLM_DEFAULT_MALLOC": "1"})
    assert applied and not default_applied
    # 26 MiB is 6656 pages: with the settings the four tensors fault almost none of theirs;
    # glibc's defaults (measured here: about 20,000 faults) give most of them back.
    assert tuned < 1000, tuned
    assert default > 5 * max(tuned, 1000), (default, tuned)



def _rss_anon_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) // 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc settings")
def test_memory_freed_by_loading_is_released_once():
    """In this process: the settings are the ones every in-process engine of the suite applies
    (applying them again changes nothing), and a trim only hands back free pages."""
    import torch

    from pagedlm.worker.malloc_tuning import keep_freed_memory, release_freed_memory
    if not keep_freed_memory():
        pytest.skip("not glibc, or PAGEDLM_DEFAULT_MALLOC is set")
    # 2 MiB tensors (heap, under the 32 MiB mmap threshold), every other one freed: holes
    # inside the heap, as loading leaves when plain weights are dropped for their packed form.
    tensors = [torch.ones(1 << 19) for _ in range(100)]
    del tensors[::2]
    kept = _rss_anon_mib()
    release_freed_memory()
    released = _rss_anon_mib()
    # 50 freed tensors of 2 MiB stay with the settings (1 GiB trim threshold) until released.
    assert kept - released >= 80, (kept, released)
