"""Compiles Triton kernels for an H100/H200 (sm_90) where there is no GPU: a child process
(the tests' own runs Triton in interpreter mode) runs a script that compiles them and prints
ptxas's report, one line a variant."""
import os
import subprocess
import sys


def sm90_report(script: str) -> list[str]:
    """The lines `script` prints, run in a child process without TRITON_INTERPRET and with
    this checkout first on its path; fails the test with its stderr if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_CACHE_DIR"] = env.get("TRITON_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".triton", "cache")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split("\n")[:-1]
