"""Time `LLM()` until ready, in fresh processes: first with an empty cache (the GGUF is converted
and the attention kernel compiled), then again with the cache warm.

    python benchmarks/load_time.py [--model PATH] [--runs 2]
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

SNIPPET = """
import time, sys
t = time.perf_counter()
from pagedlm import LLM
llm = LLM({model})
print(f"READY {{time.perf_counter() - t:.2f}}")
"""


def timed_run(model: str | None, cache_dir: str) -> tuple[float, float]:
    """(wall seconds for the whole process, seconds from import to LLM() ready)."""
    env = dict(os.environ, PAGEDLM_CACHE_DIR=cache_dir)
    code = SNIPPET.format(model=repr(model) if model else "")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"LLM() failed:\n{proc.stderr[-3000:]}")
    ready = float(next(line.split()[1] for line in proc.stdout.splitlines()
                       if line.startswith("READY")))
    return wall, ready


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--runs", type=int, default=2, help="warm-cache runs after the first")
    args = p.parse_args()
    print("command:", " ".join(sys.argv))
    with tempfile.TemporaryDirectory(prefix="pagedlm-load-") as cache:
        wall, ready = timed_run(args.model, cache)
        print(f"first load (empty cache): LLM() ready in {ready:.2f}s "
              f"(process wall {wall:.2f}s, target < 15s)")
        for i in range(args.runs):
            wall, ready = timed_run(args.model, cache)
            print(f"cached load {i + 1}: LLM() ready in {ready:.2f}s "
                  f"(process wall {wall:.2f}s, target < 4s)")


if __name__ == "__main__":
    main()
