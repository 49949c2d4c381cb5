"""The K-quant matmul kernels alone (qmm_<fmt> of the native library), against another build.

Runs one format's kernel over random valid blocks of one weight shape at a few rows, from
memory (--matrices of them, well past the last-level cache) or hot (one matrix, --hot), and
prints the blocks' bytes per second. With --baseline-commit REV the same kernel built from
REV's pagedlm/csrc (the loader's compiler and flags, in a temporary folder) runs on the same
blocks, the two taking turns call by call in this process, so that a change of the host's
memory speed hits both alike; their outputs are compared bit for bit.

    python benchmarks/kquant_kernels.py --format q4_k --shape 8192 2048 --baseline-commit HEAD~1
    python benchmarks/kquant_kernels.py --format q6_k --hot --rows 1 4 8

From memory against hot tells which bounds the kernel: where the two read alike the
arithmetic does, and a faster memory would not help.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedlm.kernels import loader  # noqa: E402

# bytes a 256-weight block, and where its float16 super-scales lie (d, then dmin if any)
FORMATS = {"q4_k": (144, (0, 2)), "q5_k": (176, (0, 2)), "q6_k": (210, (208,)),
           "q3_k": (110, (108,)), "q2_k": (84, (80, 82))}


def random_blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes with small finite super-scales: every block valid, sums far from overflow."""
    size, scales = FORMATS[fmt]
    w = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
    for i, off in enumerate(scales):
        w[:, :, off:off + 2] = np.frombuffer(np.float16(0.01 / (1 + i)).tobytes(), np.uint8)
    return np.ascontiguousarray(w)


def build_at(rev: str, out: Path) -> Path:
    """REV's kernel library, built as the loader builds this tree's."""
    src = out / "src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "pagedlm/csrc"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    csrc = src / "pagedlm" / "csrc"
    lib = out / "baseline.so"
    subprocess.run([loader.COMPILER, *loader.CFLAGS, *map(str, sorted(csrc.glob("*.c"))),
                    "-o", str(lib), "-lm"], check=True)
    return lib


def kernel(lib: ctypes.CDLL, fmt: str):
    fn = getattr(lib, f"qmm_{fmt}")
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
    fn.restype = None
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", choices=sorted(FORMATS), default="q4_k")
    ap.add_argument("--shape", nargs=2, type=int, default=[8192, 2048], metavar=("N", "K"))
    ap.add_argument("--rows", nargs="+", type=int, default=[1])
    ap.add_argument("--matrices", type=int, default=24, help="from memory: this many copies")
    ap.add_argument("--hot", action="store_true", help="one matrix, from cache")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--baseline-commit", default=None, metavar="REV")
    args = ap.parse_args()
    n, k = args.shape
    if k % 256:
        ap.error("--shape: K must be a multiple of 256")
    lib = loader.load_library()
    if lib is None:
        sys.exit("the native kernels did not build here")
    fns = {"this tree": kernel(lib, args.format)}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline_commit:
            base = ctypes.CDLL(str(build_at(args.baseline_commit, Path(tmp))))
            fns = {args.baseline_commit: kernel(base, args.format), **fns}
        rng = np.random.default_rng(0)
        mats = [random_blocks(args.format, n, k, rng)
                for _ in range(1 if args.hot else args.matrices)]
        total = sum(m.nbytes for m in mats)
        print(f"{args.format} {n}x{k}, {len(mats)} matrices ({total / 2**20:.0f} MiB), "
              f"{args.threads} threads; GB/s of blocks, median (best) of {args.repeats}")
        for rows in args.rows:
            x = rng.standard_normal((rows, k)).astype(np.float32)
            ys = {name: np.zeros((rows, n), np.float32) for name in fns}
            times: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    y = ys[name]
                    t = time.perf_counter()
                    for m in mats:
                        fn(y.ctypes.data, x.ctypes.data, m.ctypes.data, rows, n, k, args.threads)
                    times[name].append(time.perf_counter() - t)
            rates = {name: (total / statistics.median(t) / 1e9, total / min(t) / 1e9)
                     for name, t in times.items()}
            line = "  ".join(f"{name}: {med:.1f} ({best:.1f})"
                             for name, (med, best) in rates.items())
            if len(fns) == 2:
                (a, _), (b, _) = rates.values()
                same = np.array_equal(*ys.values())
                line += f"  -> {b / a:.3f}x, outputs {'bit for bit the same' if same else 'DIFFER'}"
            print(f"  rows {rows}: {line}", flush=True)


if __name__ == "__main__":
    main()
