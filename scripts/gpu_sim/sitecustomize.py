"""The GPU machine's missing packages, simulated here: with this folder on PYTHONPATH and
GPU_SIM_BLOCK set (comma-separated top-level module names), importing any of them raises
ImportError, in this process and in every subprocess that inherits the environment (the
`pagedlm serve` the benchmark starts). scripts/gpu_check.sh --dry-run sets both, so its CPU run
imports only what the bare GPU machine has plus the carried wheels."""
import os
import sys

_BLOCKED = frozenset(filter(None, os.environ.get("GPU_SIM_BLOCK", "").split(",")))


class _Blocker:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"{name!r} is blocked: the GPU machine does not have it "
                              f"(scripts/gpu_sim, GPU_SIM_BLOCK)", name=name)
        return None


if _BLOCKED:
    sys.meta_path.insert(0, _Blocker())
