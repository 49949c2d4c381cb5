"""pagedlm and llama.cpp's llama-server on the same realistic model files (issue 33): load time,
one stream, peak memory, optionally a 128-request batch, and the memory roofline.

The model is make_gguf_model.py's (a 1B-class Llama with random weights under --model-dir:
bf16/, model-F16.gguf, model-Q4_K_M.gguf, ...). Each system's server is started fresh for every
workload of every run, sized for that workload (compare.py's rules, lib/servers.py), and the
runs are interleaved:

- load:   process start until /health and /v1/models answer (the single workload's server);
- single: one stream of --single-output-len (256) greedy tokens after a --single-input-len (32)
          token prompt, --single-repeats times: tokens/s over the request and decode-only;
- batch:  (with --workloads batch) --num-prompts (128) requests of --input-len (32:512) prompt
          tokens and --output-len (16:256) output tokens, all at once: output tokens/s;
- memory: peak RSS of the server's process tree: the sum of VmHWM over its processes read just
          before it stops (exact for one process, an upper bound for several), and the peak of
          the tree's summed VmRSS sampled every 0.1 s;
- page cache: every system's model files are read once before the first run, so that no
          system's first start pays for reading its file from disk (on the Zen 4 VM the bf16
          folder's first start took 21 s, 18 of them reading 2.15 GB, where the next ones took
          under 5; llama.cpp maps its file and reads it as it runs, so there a cold file slows
          the first run's decode instead). --cold-files skips this;
- roofline: the weight bytes one decode step reads (every tensor once; the token embedding only
          when it is also the LM head), over the machine's read bandwidth (torch.sum over a
          1 GiB float32 tensor, best of 5, the better of 4 KiB and 2 MiB pages), read before
          the first run and again after each round of systems, the best reading taken: the
          decode rate at which reading the weights is the whole cost, and the share of it each
          system reaches. One reading at the start was not enough on the Zen 4 VM, whose
          memory read 36.8 GB/s in one invocation and 70.1 in the next, minutes apart.

Systems: BASE-FORMAT[:LABEL=ARGS], BASE pagedlm or llamacpp, FORMAT bf16 (the safetensors
folder; pagedlm only) or a GGUF type with its file under --model-dir (f16, q4_k_m, q6_k, q8_0),
ARGS extra server arguments.

    python benchmarks/gguf_models.py --model-dir /work/peers/models/llama1b \\
        --peers-dir /work/peers
    python benchmarks/gguf_models.py --model-dir /work/peers/models/llama1b \\
        --peers-dir /work/peers --workloads single batch --runs 3

Compare figures from one invocation on a quiet machine only. On a 2-core machine shared with
other work, llama.cpp's two threads wait at every operation's barrier for a descheduled peer:
one stream of the Q4_K_M file fell from about 6 tok/s at --threads 1 to 0.4 at 2 (load
average 7); --threads 1 keeps a busy machine's figures sane, if lower.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import psutil

import compare
from lib import client, peers, stats
from lib.roofline import bytes_per_token, read_bandwidth, roofline
from lib.servers import (REPO_ROOT, SERVED_NAME, LaunchPlan, Server, ServerSettings, SystemSpec,
                         free_port, git_describe, plan_llamacpp, plan_pagedlm, trim_log)
from lib.workload import Request, format_len, make_requests, ordinary_token_ids, parse_len

WORKLOADS = ("single", "batch")
DEFAULT_SYSTEMS = ("pagedlm-q4_k_m:gguf=--quantization gguf",
                   "pagedlm-bf16:bf16=--dtype bfloat16", "llamacpp-q4_k_m", "llamacpp-f16")


@dataclass(frozen=True)
class System:
    name: str  # as given, and in the tables
    base: str  # pagedlm | llamacpp
    fmt: str  # "bf16" (the safetensors folder) or a GGUF type, upper case
    extra_args: tuple[str, ...] = ()

    def model_path(self, model_dir: Path) -> Path:
        return model_dir / "bf16" if self.fmt == "BF16" else model_dir / f"model-{self.fmt}.gguf"


def parse_system(text: str) -> System:
    head, _, extra = text.partition("=")
    base_fmt, _, label = head.partition(":")
    if ("=" in text) != bool(label):
        raise ValueError(f"--systems entry {text!r}: extra arguments go with a label, as in "
                         f"'{base_fmt}:label=ARGS'")
    base, _, fmt = base_fmt.partition("-")
    if base not in ("pagedlm", "llamacpp") or not fmt:
        raise ValueError(f"--systems entry {text!r}: expected pagedlm-FORMAT or "
                         f"llamacpp-FORMAT (FORMAT: bf16 or a GGUF type such as q4_k_m, f16), "
                         f"optionally with :LABEL=ARGS")
    if base == "llamacpp" and fmt.lower() == "bf16":
        raise ValueError(f"--systems entry {text!r}: llama.cpp serves GGUF files only")
    try:
        extra_args = tuple(shlex.split(extra))
    except ValueError as e:
        raise ValueError(f"--systems entry {text!r}: cannot split its arguments: {e}") from None
    return System(base_fmt + (f":{label}" if label else ""), base, fmt.upper(), extra_args)


# ---- the model files ----

def warm_page_cache(paths, chunk: int = 16 << 20) -> int:
    """Read every file of `paths` (a file, or a folder's files) once, so that the timed starts
    find them in the page cache; returns the bytes read."""
    buf = bytearray(chunk)
    total = 0
    for path in paths:
        path = Path(path)
        for f in sorted(path.iterdir()) if path.is_dir() else [path]:
            if not f.is_file():
                continue
            with open(f, "rb", buffering=0) as fh:
                while n := fh.readinto(buf):
                    total += n
    return total


# ---- memory of a server's process tree ----

def status_kib(pid: int, field: str) -> int:
    """A /proc/PID/status field in KiB (VmHWM, VmRSS); 0 if the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def tree_pids(pid: int) -> list[int]:
    try:
        root = psutil.Process(pid)
        return [pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


class TreeMemory:
    """Samples the summed VmRSS of a process tree every `interval` s in a thread; `read()` gives
    that peak and the summed VmHWM of the processes alive at the time."""

    def __init__(self, pid: int, interval: float = 0.1):
        self.pid, self.interval = pid, interval
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> int:
        now = sum(status_kib(p, "VmRSS") for p in tree_pids(self.pid))
        self.peak_kib = max(self.peak_kib, now)
        return now

    def __enter__(self) -> "TreeMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def read(self) -> dict:
        sampled = max(self.peak_kib, self.sample())
        pids = tree_pids(self.pid)
        return {"vmhwm_sum_bytes": 1024 * sum(status_kib(p, "VmHWM") for p in pids),
                "sampled_rss_peak_bytes": 1024 * sampled, "processes": len(pids)}


# ---- runs ----

def launch_plan(system: System, settings: ServerSettings, port: int, peers_dir: Path,
                model_dir: Path) -> LaunchPlan:
    model = system.model_path(model_dir)
    if not model.exists():
        raise FileNotFoundError(f"{system.name}: {model} does not exist (make_gguf_model.py "
                                f"--out {model_dir} --types {system.fmt})")
    settings = ServerSettings(settings.concurrency, settings.max_model_len, settings.threads,
                              str(model))
    spec = SystemSpec(system.name, system.base, gguf_type=system.fmt,
                      extra_args=system.extra_args)
    if system.base == "pagedlm":
        return plan_pagedlm(spec, settings, port, git_describe())
    return plan_llamacpp(spec, settings, port, peers.setup_llamacpp(peers_dir), str(model))


def settings_for(workload: str, args) -> ServerSettings:
    if workload == "single":
        return ServerSettings(1, args.single_input_len + args.single_output_len, args.threads,
                              None)
    return ServerSettings(args.num_prompts, args.input_len[1] + args.output_len[1],
                          args.threads, None)


def requests_for(workload: str, vocab: list[int], args, warmup: bool) -> list[Request]:
    """compare.py's requests for the same seed (its generators' names), and warm-ups of the
    same shapes with 8 output tokens."""
    rng = random.Random(f"{args.seed}-{'warmup-' if warmup else ''}{workload}")
    if workload == "single":
        out = 8 if warmup else args.single_output_len
        return make_requests(vocab, 1 if warmup else args.single_repeats,
                             (args.single_input_len,) * 2, (out, out), rng)
    return make_requests(vocab, args.num_prompts, args.input_len,
                         (8, 8) if warmup else args.output_len, rng)


async def measure(base_url: str, endpoint: client.Endpoint, system: str, workload: str,
                  warmup: list[Request], timed: list[Request], timeout: float) -> dict:
    async with client.http_client(base_url, timeout) as http:
        await client.run_batch(http, endpoint, f"{system} warm-up", warmup)
        if workload == "single":
            return await compare.run_single(http, endpoint, system, timed)
        return stats.throughput(timed, await client.run_batch(http, endpoint, system, timed))


def run_one(system: System, workload: str, vocab: list[int], endpoint: client.Endpoint,
            log: Path, args) -> dict:
    port = free_port()
    launch = launch_plan(system, settings_for(workload, args), port, args.peers_dir,
                         args.model_dir)
    print(f"  {launch.version}: {shlex.join(launch.argv)}", flush=True)
    # Polled every 0.1 s: the load time is a figure here.
    with Server(system.name, launch, port, log, args.startup_timeout, 0.1) as server:
        memory = TreeMemory(server.proc.pid)
        memory.sample()
        after_load = memory.read()
        load_before = os.getloadavg()
        with memory:
            fig = asyncio.run(measure(f"http://127.0.0.1:{port}", endpoint, system.name,
                                      workload, requests_for(workload, vocab, args, True),
                                      requests_for(workload, vocab, args, False),
                                      args.request_timeout))
        fig["memory"] = memory.read()
        fig["memory"]["rss_after_load_bytes"] = after_load["sampled_rss_peak_bytes"]
        fig["load_s"] = server.startup_s
        # Figures from a shared machine mean little without the load beside them.
        fig["loadavg_before"], fig["loadavg_after"] = load_before, os.getloadavg()
    fig["server"] = {"argv": launch.argv, "env": launch.env, "version": launch.version,
                     "log": log.name}
    return fig


def summary(runs: list[dict], workload: str) -> dict:
    """Median and range of each figure over the runs."""
    keys = {"load_s": lambda f: f["load_s"],
            "peak_rss_gb": lambda f: f["memory"]["vmhwm_sum_bytes"] / 1e9,
            "sampled_rss_peak_gb": lambda f: f["memory"]["sampled_rss_peak_bytes"] / 1e9}
    if workload == "single":
        keys |= {"tokens_per_s": lambda f: f["tokens_per_s"],
                 "decode_tokens_per_s": lambda f: f["decode_tokens_per_s"],
                 "ttft_ms": lambda f: f["ttft_ms"]}
    else:
        keys |= {"output_tokens_per_s": lambda f: f["output_tokens_per_s"],
                 "total_tokens_per_s": lambda f: f["total_tokens_per_s"]}
    return {k: stats.median_range([get(f) for f in runs]) for k, get in keys.items()}


def render(figures: dict, errors: dict) -> str:
    lines = []
    for workload, per_system in figures.items():
        if not per_system:
            continue
        cols = list(next(iter(per_system.values())))
        lines.append(f"{workload}: median (min-max)")
        lines.append("  " + " | ".join(["system".ljust(36), *(c.ljust(22) for c in cols)]))
        for name, fig in per_system.items():
            cells = [f"{fig[c]['median']:.3g} ({fig[c]['min']:.3g}-{fig[c]['max']:.3g})"
                     .ljust(22) for c in cols]
            lines.append("  " + " | ".join([name.ljust(36), *cells]))
    for name, error in errors.items():
        lines.append(f"FAILED {name}: {error.splitlines()[0]}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True,
                   help="make_gguf_model.py's --out (bf16/, model-TYPE.gguf).")
    p.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), metavar="SYSTEM",
                   help="BASE-FORMAT[:LABEL=ARGS]: BASE pagedlm or llamacpp; FORMAT bf16 (the "
                        "safetensors folder, pagedlm only) or a GGUF type under --model-dir.")
    p.add_argument("--workloads", nargs="+", default=["single"], choices=WORKLOADS,
                   help="Load time and peak RSS come with every workload's server.")
    p.add_argument("--runs", type=int, default=3,
                   help="Runs of every system and workload, each on a fresh server, "
                        "interleaved.")
    p.add_argument("--single-input-len", type=int, default=32)
    p.add_argument("--single-output-len", type=int, default=256)
    p.add_argument("--single-repeats", type=int, default=3,
                   help="single: streams one after another on one server (median).")
    p.add_argument("--num-prompts", type=int, default=128, help="batch: requests.")
    p.add_argument("--input-len", type=parse_len, default=(32, 512),
                   help="batch: prompt tokens, N or LO:HI.")
    p.add_argument("--output-len", type=parse_len, default=(16, 256),
                   help="batch: output tokens, N or LO:HI.")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="Compute threads of every server (llama.cpp -t/-tb, pagedlm "
                        "OMP_NUM_THREADS) and of the bandwidth measurement.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers-dir", type=Path, default=peers.DEFAULT_PEERS_DIR,
                   help="Where llama.cpp is built (lib/peers.py), e.g. /work/peers.")
    p.add_argument("--output-dir", type=Path, default=None,
                   help="Default: benchmarks/results/gguf-models-<UTC time>.")
    p.add_argument("--cold-files", action="store_true",
                   help="Do not read the model files into the page cache before the first "
                        "run (the first start of each system then reads its file from disk).")
    p.add_argument("--no-roofline", action="store_true",
                   help="Skip the bandwidth measurement (about 5 s).")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=3600.0)
    args = p.parse_args(argv)
    try:
        args.system_list = [parse_system(s) for s in args.systems]
    except ValueError as e:
        p.error(str(e))
    for flag in ("runs", "single_input_len", "single_output_len", "single_repeats",
                 "num_prompts", "threads"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", *(sys.argv if argv is None else ["gguf_models.py", *argv])])
    print("command:", command)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = args.output_dir or REPO_ROOT / "benchmarks" / "results" / f"gguf-models-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "lscpu.txt").write_text(compare.lscpu_text())

    from transformers import AutoTokenizer
    vocab = ordinary_token_ids(AutoTokenizer.from_pretrained(args.model_dir / "bf16"))
    endpoint = client.Endpoint(SERVED_NAME, sampling=client.sampling_fields(0.0))
    files = {s.fmt: s.model_path(args.model_dir) for s in args.system_list}
    report = {"command": command, "commit": stats.git_commit(REPO_ROOT), "started_utc": stamp,
              "machine": stats.machine_info(args.threads),
              "config": {k: (format_len(v) if k in ("input_len", "output_len") else
                             str(v) if isinstance(v, Path) else v)
                         for k, v in vars(args).items() if k != "system_list"},
              "model_files": {fmt: {"path": str(p), "bytes": _size(p)}
                              for fmt, p in files.items() if p.exists()},
              "results": {w: {s.name: [] for s in args.system_list} for w in args.workloads},
              "errors": {}}
    readings: list[dict[str, float]] = []

    def read_now() -> None:
        """One more reading of the read bandwidth; the roofline takes the best of them."""
        rates = read_bandwidth(args.threads)
        readings.append(rates)
        report["read_bandwidth_readings"] = readings
        report["read_bandwidth_bytes_per_s"] = max(r["best"] for r in readings)
        print(f"read bandwidth (torch.sum, {args.threads} threads): {rates['best'] / 1e9:.1f} "
              "GB/s (" + ", ".join(f"{k.replace('_', ' ')} {v / 1e9:.1f}" for k, v in rates.items()
                                   if k != "best") + ")", flush=True)

    if not args.no_roofline:
        read_now()
        for fmt, p in files.items():
            if p.exists():
                report["model_files"][fmt]["weight_bytes_per_token"] = bytes_per_token(p)
    if not args.cold_files:
        t0 = time.perf_counter()
        warmed = warm_page_cache(p for p in files.values() if p.exists())
        seconds = time.perf_counter() - t0
        report["page_cache_warmed"] = {"bytes": warmed, "seconds": seconds}
        print(f"read {warmed / 1e9:.2f} GB of model files into the page cache in "
              f"{seconds:.1f} s", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    for run in range(1, args.runs + 1):
        for system in args.system_list:
            for workload in args.workloads:
                if system.name in report["errors"]:
                    break
                name = f"{system.name} run {run} {workload}"
                print(f"== {name}", flush=True)
                log = out_dir / (f"{system.name.replace(':', '_').replace('/', '_')}-run{run}-"
                                 f"{workload}.log")
                try:
                    fig = run_one(system, workload, vocab, endpoint, log, args)
                    report["results"][workload][system.name].append(fig)
                    print(f"  {brief(workload, fig)}", flush=True)
                except KeyboardInterrupt:
                    print("interrupted; the server was stopped", file=sys.stderr)
                    return 130
                except Exception as e:  # noqa: BLE001 - one system failing must not lose others
                    report["errors"][system.name] = f"{name}: {e.__class__.__name__}: {e}"
                    print(f"  FAILED: {report['errors'][system.name]}", file=sys.stderr,
                          flush=True)
                finally:
                    if log.exists():
                        trim_log(log)
                stats.write_json(out_dir / "results.json", report)
        if not args.no_roofline:
            read_now()

    report["machine"]["loadavg_end"] = os.getloadavg()
    figures = {w: {name: summary(runs, w) for name, runs in per.items() if runs}
               for w, per in report["results"].items()}
    if "read_bandwidth_bytes_per_s" in report and "single" in figures:
        for system in args.system_list:
            fig = figures["single"].get(system.name)
            weights = report["model_files"].get(system.fmt, {}).get("weight_bytes_per_token")
            if fig and weights:
                fig["roofline"] = roofline(weights, report["read_bandwidth_bytes_per_s"],
                                           fig["decode_tokens_per_s"]["median"])
    report["figures"] = figures
    print()
    print(render({w: {n: {k: v for k, v in f.items() if k != "roofline"}
                      for n, f in per.items()} for w, per in figures.items()}, report["errors"]))
    if readings:
        print("read bandwidth over the invocation: best "
              f"{report['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s of "
              + ", ".join(f"{r['best'] / 1e9:.1f}" for r in readings))
    for name, fig in figures.get("single", {}).items():
        if "roofline" in fig:
            r = fig["roofline"]
            print(f"roofline {name}: {r['weight_bytes_per_token'] / 1e6:.0f} MB/token, ceiling "
                  f"{r['roofline_tokens_per_s']:.1f} tok/s, decode at "
                  f"{100 * r['share_of_roofline']:.0f}% of it "
                  f"({r['implied_read_bytes_per_s'] / 1e9:.1f} GB/s)")
    m = report["machine"]
    print(f"\n{m.get('cpu_model')}, {m['cpu_count']} CPUs, {args.threads} threads per server; "
          f"load average {m['loadavg_start'][0]:.2f} at the start, "
          f"{m['loadavg_end'][0]:.2f} at the end. Results and logs: {out_dir}")
    stats.write_json(out_dir / "results.json", report)
    return 1 if report["errors"] else 0


def brief(workload: str, fig: dict) -> str:
    mem = fig["memory"]
    head = (f"load {fig['load_s']:.1f} s, peak RSS {mem['vmhwm_sum_bytes'] / 1e9:.2f} GB "
            f"(sampled {mem['sampled_rss_peak_bytes'] / 1e9:.2f}, after load "
            f"{mem['rss_after_load_bytes'] / 1e9:.2f}), ")
    return (head + compare.brief(workload, fig)
            + f"; load average {fig['loadavg_before'][0]:.1f} -> {fig['loadavg_after'][0]:.1f}")


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


if __name__ == "__main__":
    sys.exit(main())
