"""The AMX bfloat16 GEMM (csrc/amx_bf16.c) on SmolLM2-135M's four linear shapes, this tree's
build against another commit's, taking turns in one process (issue 32).

A step multiplies M rows of float32 x by each layer's four bfloat16 k-pair panel sets (qkv
960x576, o 576x576, gate_up 3072x576, down 576x1536). Two cases:
  cold: 30 layers' distinct weights (212 MB of bfloat16 panels, the model's), cycled through
        as a forward pass does, so the weights come from memory as they do in the engine;
  warm: one layer's four matrices (7 MB) repeated, which stay in the caches: the kernel's
        in-cache speed.
Each round runs the libraries in turn (old, new, old, new, ...); the table gives each one's
median over the rounds, its range, and GFLOP/s at the median.

    python benchmarks/amx_gemm.py                       # HEAD's build against this tree's
    python benchmarks/amx_gemm.py --against HEAD~1 --rows 16 128 --rounds 7
    python benchmarks/amx_gemm.py --check               # bits equal to HEAD's build?
    python benchmarks/amx_gemm.py --threads 1 --clock thread --torch   # on a loaded machine

On a shared machine 2-thread wall times swing tenfold (a team member descheduled at a
barrier); --threads 1 --clock thread times the kernel on the calling thread's own CPU time,
which only the caches it shares with other jobs still move (--clock thread with more threads
would count the calling thread's share alone). For a team's work, not its wall time:
    OMP_WAIT_POLICY=passive python benchmarks/amx_gemm.py --threads 2 --clock process

--huge adds, for each build, the cold case with the 30 layers copied into one buffer of 2 MiB
transparent huge pages, each run right after its 4 KiB one (whose page tables it evicts, as a
step's other ops do in the engine): the cost of the weights' page walks (amx_bf16.c's header).

--check compares this tree's outputs with the other build's bit for bit on random inputs (the
shapes and rows of tests/kernels/test_amx_bf16.py, plus the model's shapes at 128, 300, 1000
and 2048 rows: several row chunks, ragged at 1000), at 1 and 2 threads: a change that keeps
each output's float32 sum and its k order keeps them equal.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pagedlm.kernels import amx, loader

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) per layer
CHECK_SHAPES = [(37, 32), (1000, 576), (576, 1536), (64, 64), (40, 2144), (100, 4160)]
CHECK_ROWS = [1, 2, 15, 16, 17, 31, 32, 33, 48, 70, 128, 300]


def build_at(rev: str) -> ctypes.CDLL:
    """The kernel library from commit `rev`'s csrc (all of it, so that it builds as it did)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tempfile.mkdtemp(prefix="amx-gemm-")
    archive = subprocess.run(["git", "-C", repo, "archive", rev, "pagedlm/csrc"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    return build_dir(os.path.join(tmp, "pagedlm", "csrc"))


def build_dir(csrc: str) -> ctypes.CDLL:
    """The kernel library from the C sources in `csrc` (a copy of pagedlm/csrc)."""
    sources = tuple(sorted(p.path for p in os.scandir(csrc) if p.name.endswith(".c")))
    headers = tuple(sorted(p.path for p in os.scandir(os.path.join(csrc, "include"))))
    lib = ctypes.CDLL(str(loader.build(tuple(map(Path, sources)), tuple(map(Path, headers)))))
    return typed(lib)


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    _p, _i = ctypes.c_void_p, ctypes.c_int
    lib.gemm_panels_bf16_amx.argtypes = [_p, _p, _p, _i, _i, _i, _i]
    lib.gemm_panels_bf16_amx.restype = None
    lib.amx_bf16_available.restype = _i
    if not lib.amx_bf16_available():
        raise SystemExit("AMX-BF16 is not available here")
    return lib


def pairs(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] as k-pair panels [ceil(N / 32), K / 2, 32, 2] (gemv.pack_panels' AMX layout)."""
    n, k = w.shape
    p = (n + 31) // 32
    padded = torch.zeros(p * 32, k, dtype=torch.bfloat16)
    padded[:n] = w
    return padded.view(p, 32, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def huge_copy(layers: list) -> list:
    """The cold case's panels copied into one buffer of 2 MiB transparent huge pages
    (madvise(MADV_HUGEPAGE) before the first touch; THP "madvise" mode lets it fault them in
    whole), to time the kernel with few TLB misses against the 4 KiB pages torch allocates."""
    total = sum(p.numel() for layer in layers for p, _ in layer)
    buf = torch.empty(total + (1 << 20), dtype=torch.bfloat16)  # 2 MiB spare, not touched
    skip = (-buf.data_ptr() % (2 << 20)) // 2
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(buf.data_ptr() + skip * 2, total * 2 // (2 << 20) * (2 << 20), 14) != 0:
        raise SystemExit(f"madvise(MADV_HUGEPAGE) failed: errno {ctypes.get_errno()}")
    out, off = [], skip
    for layer in layers:
        row = []
        for p, n in layer:
            v = buf[off:off + p.numel()].view(p.shape)
            v.copy_(p)
            off += p.numel()
            row.append((v, n))
        out.append(row)
    return out


def call(lib, y, x, panels, n, threads):
    lib.gemm_panels_bf16_amx(y.data_ptr(), x.data_ptr(), panels.data_ptr(), x.shape[0], n,
                             x.shape[1], threads)


def check(libs: dict, threads_list=(1, 2)) -> None:
    (old_name, old), (new_name, new) = list(libs.items())[:2]
    g = torch.Generator().manual_seed(0)
    cases = 0
    for n, k in CHECK_SHAPES + SHAPES:
        panels = pairs(torch.randn(n, k, generator=g).bfloat16())
        for m in CHECK_ROWS + ([1000, 2048] if (n, k) in SHAPES else []):
            x = torch.randn(m, k, generator=g) * 3
            for threads in threads_list:
                a, b = torch.empty(m, n), torch.empty(m, n)
                call(old, a, x, panels, n, threads)
                call(new, b, x, panels, n, threads)
                if not torch.equal(a, b):
                    raise SystemExit(f"DIFFERENT bits: M={m} N={n} K={k} threads={threads}")
                cases += 1
    print(f"{new_name} == {old_name} bit for bit in all {cases} cases")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", default="HEAD", help="commit whose build is the baseline")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 512, 2048])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=30, help="distinct layers in the cold case")
    p.add_argument("--cases", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    p.add_argument("--clock", choices=["wall", "thread", "process"], default="wall",
                   help="thread: this thread's CPU time (with --threads 1 the kernel runs on "
                        "it), which leaves out the time other jobs on a shared machine take; "
                        "process: all threads' CPU time, the work done at --threads > 1 where "
                        "OMP_WAIT_POLICY=passive (a waiting thread sleeps rather than spins)")
    p.add_argument("--torch", action="store_true",
                   help="also time torch's bfloat16 F.linear (oneDNN) on x already bfloat16 and "
                        "plain [N, K] bfloat16 weights, at --threads threads")
    p.add_argument("--huge", action="store_true",
                   help="also time each build (cold case) with the weights in 2 MiB pages")
    p.add_argument("--check", action="store_true", help="only compare the outputs' bits")
    p.add_argument("--csrc", nargs="+", default=[],
                   help="build the new side from these copies of pagedlm/csrc instead (several: "
                        "each takes its turn)")
    args = p.parse_args()
    if not amx.available():
        raise SystemExit("AMX-BF16 is not available here")
    libs = {args.against: build_at(args.against)}
    libs.update({d: build_dir(d) for d in args.csrc} or {"this tree": typed(amx.library())})
    if args.check:
        check(libs)
        return
    g = torch.Generator().manual_seed(0)
    plain = [[torch.randn(n, k, generator=g).bfloat16() for n, k in SHAPES]
             for _ in range(args.layers)]
    layers = [[(pairs(w), w.shape[0]) for w in ws] for ws in plain]
    huge = huge_copy(layers) if args.huge else None
    if huge is not None:  # each build's 2 MiB run right after its 4 KiB one, so that every
        # 4 KiB pass starts with the page tables another pass evicted, as the engine's do
        libs = {key: lib for name, lib in libs.items() for key in (name, f"{name} 2M")}
    if args.torch:
        libs["torch"] = None
        torch.set_num_threads(args.threads)
    clock = {"wall": time.perf_counter, "thread": time.thread_time,
             "process": time.process_time}[args.clock]
    print(f"{args.clock} clock, threads {args.threads}, rounds {args.rounds}, load average at "
          f"start {os.getloadavg()[0]:.2f}")
    print(f"{'case':5} {'rows':>5} " + " ".join(f"{name[-30:]:>30}" for name in libs))
    for case in args.cases:
        steps = layers if case == "cold" else layers[:1] * args.layers
        for m in args.rows:
            xs = {k: torch.randn(m, k, generator=g) for k in {k for _, k in SHAPES}}
            x16 = {k: x.bfloat16() for k, x in xs.items()}
            wsteps = plain if case == "cold" else plain[:1] * args.layers
            ys = {n: torch.empty(m, n) for n, _ in SHAPES}
            flops = 2 * m * sum(n * k for n, k in SHAPES) * len(steps)
            times = {name: [] for name in libs}
            for _ in range(args.rounds + 1):  # the first round warms up, not counted
                for name, lib in libs.items():
                    t0 = clock()
                    if lib is None:
                        for ws in wsteps:
                            for w in ws:
                                torch.nn.functional.linear(x16[w.shape[1]], w)
                        times[name].append(clock() - t0)
                        continue
                    big = name.endswith(" 2M") and case == "cold"
                    for layer in (huge if big else steps):
                        for (panels, n), (_, k) in zip(layer, SHAPES):
                            call(lib, ys[n], xs[k], panels, n, args.threads)
                    times[name].append(clock() - t0)
            cells = []
            for name in libs:
                t = times[name][1:]
                med = statistics.median(t)
                cells.append(f"{med * 1e3:8.2f} ms [{min(t) * 1e3:.2f}-{max(t) * 1e3:.2f}] "
                             f"{flops / med / 1e9:5.0f}")
            print(f"{case:5} {m:5d} " + " ".join(f"{c:>30}" for c in cells), flush=True)
    print(f"load average at end {os.getloadavg()[0]:.2f}; cells: median ms per pass of "
          f"{args.layers} layers [range] GFLOP/s")


if __name__ == "__main__":
    main()
