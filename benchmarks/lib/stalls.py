"""Where a serving run's stalls fall: the slowest first tokens and the long gaps between
chunks, in seconds from the run's start, and the Triton kernels compiled meanwhile. A pause of
the whole server (a compile, a kernel loaded at its first launch) shows as one time shared by
every request in flight; load shows as many times."""
from __future__ import annotations

import os
from pathlib import Path

from lib.client import RequestResult


def stall_timeline(results: list[RequestResult], t_wall: float, slow_s: float = 0.1) -> dict:
    """results of a run that started at time.time() == t_wall: its 8 slowest first tokens, its
    gaps over slow_s (the first 40 in time), and the Triton cache entries written since t_wall
    (the first 40)."""
    ok = sorted((r for r in results if r.ok), key=lambda r: -r.ttft)
    slowest = [{"start_s": round(r.start, 3), "ttft_ms": round(1000 * r.ttft, 1),
                "prompt_len": r.prompt_len} for r in ok[:8]]
    gaps = []
    for r in ok:
        t = r.start + r.ttft  # when the gap's chunk before it arrived
        for gap in r.itl:
            if gap > slow_s:
                gaps.append({"at_s": round(t, 3), "gap_ms": round(1000 * gap, 1)})
            t += gap
    gaps.sort(key=lambda g: g["at_s"])
    return {"slowest_ttft": slowest, "gaps_over_100ms": gaps[:40],
            "triton_compiles": triton_compiles(t_wall)[:40]}


def triton_compiles(t_wall: float) -> list[dict]:
    """Triton's cache entries written since t_wall, by time: a compile during the run. Each
    keeps its metadata, which names the specialization (the arguments that were 1 or multiples
    of 16, the constexprs): what a warm-up would have to cover."""
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    compiled = []
    if cache.is_dir():
        for entry in cache.iterdir():
            when = entry.stat().st_mtime - t_wall
            if when < 0:
                continue
            jsons = sorted(f for f in entry.iterdir() if f.suffix == ".json")
            meta = next((f for f in jsons if not f.name.startswith("__grp__")), None)
            compiled.append({"at_s": round(when, 3), "files": [f.name for f in jsons[:3]],
                             "metadata": meta.read_text()[:1500] if meta else None})
    return sorted(compiled, key=lambda c: c["at_s"])
