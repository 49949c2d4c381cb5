"""Figures from timings: percentiles, the median and range of repeated runs, throughput, and the
facts about the machine that a figure needs beside it."""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Iterable

from lib.client import RequestResult
from lib.workload import Request


def quantile(values: Iterable[float], q: float) -> float:
    """Nearest-rank quantile: the smallest value with at least a share q of the values at or
    below it (p99 of 100 values is the 99th smallest, never an interpolation)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def distribution(values: list[float], scale: float = 1.0) -> dict[str, float]:
    """mean, median, p99 and max of values (times scale, e.g. 1000 for s -> ms); NaN if none."""
    if not values:
        nan = float("nan")
        return {"mean": nan, "median": nan, "p99": nan, "max": nan}
    return {"mean": statistics.fmean(values) * scale,
            "median": statistics.median(values) * scale,
            "p99": quantile(values, 0.99) * scale, "max": max(values) * scale}


def median_range(values: list[float]) -> dict[str, float]:
    """What repeated runs of one measurement report: the median, the lowest and the highest."""
    if not values:
        raise ValueError("no values")
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": len(values)}


def throughput(requests: list[Request] | list[tuple[list[int], int]], elapsed: float,
               load_s: float | None = None) -> dict[str, float]:
    """Each request counts its prompt once and only the output it asked for; load_s (start-up,
    not timed) is carried along when given."""
    prompt_tokens = sum(len(prompt) for prompt, _ in requests)
    output_tokens = sum(n for _, n in requests)
    fig = {} if load_s is None else {"load_s": round(load_s, 3)}
    return fig | {"elapsed_s": round(elapsed, 3), "num_requests": len(requests),
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "requests_per_s": len(requests) / elapsed,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
            "output_tokens_per_s": output_tokens / elapsed}


def serving_summary(results: list[RequestResult], elapsed: float,
                    prompt_len_estimate: int = 0) -> dict:
    """vLLM's serving figures over the successful requests: counts, throughputs, and the
    distributions (ms) of TTFT, TPOT (after the first token), ITL and end-to-end latency.
    A request whose server sent no usage counts prompt_len_estimate prompt tokens."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len if r.prompt_len >= 0 else prompt_len_estimate for r in ok)
    return {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "duration_s": elapsed,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / elapsed,
        "output_throughput": out_tokens / elapsed,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed,
        "ttft_ms": distribution([r.ttft for r in ok], 1000),
        "tpot_ms": distribution([r.tpot for r in ok if r.tpot is not None], 1000),
        "itl_ms": distribution([x for r in ok for x in r.itl], 1000),
        "e2el_ms": distribution([r.latency for r in ok], 1000),
    }


def print_throughput(name: str, fig: dict) -> None:
    load = f"load {fig['load_s']:.2f}s (not timed) | " if "load_s" in fig else ""
    print(f"[{name}] {load}elapsed {fig['elapsed_s']:.2f}s | {fig['num_requests']} reqs, "
          f"{fig['prompt_tokens']} prompt + {fig['output_tokens']} output tokens")
    print(f"[{name}] {fig['requests_per_s']:.2f} requests/s, "
          f"{fig['total_tokens_per_s']:.1f} total tokens/s, "
          f"{fig['output_tokens_per_s']:.1f} output tokens/s", flush=True)


def git_commit(repo: Path) -> str:
    """HEAD's hash, with '-dirty' when tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                              text=True).stdout.strip()
    sha = git("rev-parse", "HEAD") or "unknown"
    return sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine_info(threads: int | None = None) -> dict:
    """The CPU (lscpu's model name and SIMD flags), memory and load: CPU figures mean little
    without them."""
    info: dict = {"platform": platform.platform(), "python": platform.python_version(),
                  "cpu_count": os.cpu_count(), "loadavg_start": os.getloadavg()}
    if threads is not None:
        info["threads_per_server"] = threads
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in lscpu.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                info["cpu_model"] = value.strip()
            elif key.strip() == "Flags":
                info["simd_flags"] = sorted(f for f in value.split()
                                            if f.startswith(("avx", "amx", "fma", "f16c")))
    except OSError:
        pass
    try:
        meminfo = Path("/proc/meminfo").read_text().split()
        info["mem_total_gib"] = round(int(meminfo[meminfo.index("MemTotal:") + 1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    return info


def write_json(path: str | Path, payload: dict) -> None:
    """payload as JSON at path, written whole or not at all (temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, path)
    print("wrote", path)
