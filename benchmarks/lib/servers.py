"""How benchmarks/compare.py starts and stops each system's server: the systems it knows
(SystemSpec), the settings one workload gives every server (ServerSettings), a LaunchPlan
(command line, environment, version) per system and workload, and a Server that runs one in its
own process group, waits until it answers, and stops everything it started.

Each peer is launched as its own documentation recommends (benchmarks/README.md lists every
setting with its source): a fresh server per workload, sized for that workload's concurrency.
The plan_* functions only build command lines (they take the installs as arguments), so they can
be checked without the peers installed; `plan` finds the installs and calls them.
"""
from __future__ import annotations

import glob
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from lib import peers

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVED_NAME = "bench-model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]            # set on top of this process's environment
    version: str
    notes: dict = field(default_factory=dict)
    crash_hint: str = ""           # added to the error when the server dies from a signal


class Server:
    """A server process in its own session, so that stopping it stops everything it started."""

    def __init__(self, name: str, plan: LaunchPlan, port: int, log_path: Path,
                 startup_timeout: float, poll_interval: float = 1.0):
        self.name, self.plan, self.port, self.log_path = name, plan, port, log_path
        self.startup_timeout = startup_timeout
        # startup_s is only this precise; gguf_models.py polls faster, as load time is a figure
        # there.
        self.poll_interval = poll_interval
        self.proc: subprocess.Popen | None = None
        self.startup_s = float("nan")

    def __enter__(self) -> "Server":
        if port_in_use(self.port):
            raise RuntimeError(f"{self.name}: port {self.port} is already in use")
        self.log_file = open(self.log_path, "w")
        self.log_file.write(f"$ {shlex.join(self.plan.argv)}\n# env: {self.plan.env}\n")
        self.log_file.flush()
        start = time.perf_counter()
        self.proc = subprocess.Popen(self.plan.argv, env={**os.environ, **self.plan.env},
                                     stdin=subprocess.DEVNULL, stdout=self.log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=REPO_ROOT)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.startup_s = time.perf_counter() - start
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        # One client for all polls: a new one per poll builds an SSL context each time, which
        # costs the starting server measurable CPU on a 2-core machine.
        with httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=5) as client:
            while True:
                if self.proc.poll() is not None:
                    hint = self.plan.crash_hint if self.proc.returncode < 0 else ""
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while "
                                       f"starting{hint}; last lines of {self.log_path}:\n"
                                       f"{self.tail()}")
                try:
                    # llama-server answers /health with 503 while it loads the model.
                    if (client.get("/health").status_code == 200
                            and client.get("/v1/models").status_code == 200):
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} was not ready after "
                                       f"{self.startup_timeout:.0f} s; last lines of "
                                       f"{self.log_path}:\n{self.tail()}")
                time.sleep(self.poll_interval)

    def tail(self, n: int = 30) -> str:
        self.log_file.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid  # the session leader's pid is its group id
        for sig, wait_s in ((signal.SIGTERM, 60.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.proc.poll()  # reap the leader, or the group never empties
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
            else:
                print(f"warning: {self.name} still running {wait_s:.0f} s after {sig.name}",
                      file=sys.stderr)
                continue
            break
        self.proc.wait(timeout=10)
        self.log_file.close()
        self.proc = None
        deadline = time.monotonic() + 10
        while port_in_use(self.port) and time.monotonic() < deadline:
            time.sleep(0.2)
        if port_in_use(self.port):
            print(f"warning: port {self.port} still answers after {self.name} stopped",
                  file=sys.stderr)


# ---- what to run ----

VLLM_DTYPES = {"bf16": "bfloat16", "f32": "float32"}
VLLM_SWITCHES = ("notcmalloc", "noreserve")


@dataclass(frozen=True)
class SystemSpec:
    """One entry of --systems: a base system and its variant, and for `NAME:LABEL=ARGS` extra
    server arguments."""
    name: str  # as given on the command line, and in the tables
    base: str  # pagedlm | vllm | llamacpp
    gguf_type: str | None = None  # llama.cpp's weight type (F32, Q4_1, Q4_K_M, ...)
    dtype: str | None = None  # vLLM's --dtype; None: its own default (bfloat16 on CPU)
    tcmalloc: bool = True  # vLLM: preload tcmalloc (and Intel OpenMP), as its CPU docs say
    # vLLM: keep the core its auto binding reserves for the scheduler process. On 2 vCPUs that
    # leaves its model one core, so -noreserve (VLLM_CPU_NUM_OF_RESERVED_CPU=0) is measured too.
    reserve_cpu: bool = True
    extra_args: tuple[str, ...] = ()


def parse_system(text: str) -> SystemSpec:
    """pagedlm | vllm[-bf16|-f32][-notcmalloc][-noreserve] | llamacpp-TYPE, each optionally
    followed by :LABEL=EXTRA_SERVER_ARGS."""
    head, _, extra = text.partition("=")
    base, _, label = head.partition(":")
    if ":" in head and not label:
        raise ValueError(f"--systems entry {text!r}: the label after ':' is empty")
    if "=" in text and ":" not in head:
        raise ValueError(f"--systems entry {text!r}: extra arguments need a label, as in "
                         f"'{base}:label={extra}'")
    try:
        extra_args = tuple(shlex.split(extra))
    except ValueError as e:
        raise ValueError(f"--systems entry {text!r}: cannot split its arguments: {e}") from None
    name = text if not label else f"{base}:{label}"
    if base == "pagedlm":
        return SystemSpec(name, "pagedlm", extra_args=extra_args)
    if base == "vllm" or base.startswith("vllm-"):
        parts = base.split("-")[1:]
        dtypes = [VLLM_DTYPES[p] for p in parts if p in VLLM_DTYPES]
        unknown = [p for p in parts if p not in VLLM_DTYPES and p not in VLLM_SWITCHES]
        if unknown or len(dtypes) > 1 or len(set(parts)) != len(parts):
            raise ValueError(f"--systems entry {text!r}: expected vllm, vllm-bf16 or vllm-f32, "
                             f"optionally with -notcmalloc and/or -noreserve")
        return SystemSpec(name, "vllm", dtype=dtypes[0] if dtypes else None,
                          tcmalloc="notcmalloc" not in parts,
                          reserve_cpu="noreserve" not in parts, extra_args=extra_args)
    if base.startswith("llamacpp-") and len(base) > len("llamacpp-"):
        return SystemSpec(name, "llamacpp", gguf_type=base[len("llamacpp-"):].upper(),
                          extra_args=extra_args)
    raise ValueError(f"--systems entry {text!r}: unknown system {base!r}; expected pagedlm, "
                     f"vllm[-bf16|-f32][-notcmalloc][-noreserve] or llamacpp-TYPE (f32, q4_1 = "
                     f"the shipped file, q4_0, q4_k_m, q8_0 or another llama-quantize type), "
                     f"optionally as "
                     f"NAME:LABEL=EXTRA_SERVER_ARGS")


@dataclass(frozen=True)
class ServerSettings:
    """What one workload gives every server: room for exactly its concurrency at its longest
    length, on the same number of compute threads."""
    concurrency: int  # sequences at once: --max-num-seqs, llama.cpp's -np slots
    max_model_len: int  # prompt + output of the workload's longest request
    threads: int
    model: str | None  # the GGUF file (None: the embedded default)


def kv_blocks(concurrency: int, max_len: int, block_size: int = 16) -> int:
    return concurrency * -(-max_len // block_size)


def git_describe() -> str:
    out = subprocess.run(["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty"],
                         capture_output=True, text=True).stdout.strip()
    return out or "unknown commit"


def compile_pagedlm() -> None:
    """Write the bytecode of the pagedlm package the servers import (this tree's: they run
    `python -m` from REPO_ROOT), as `pip install` does for an installed package. A source tree
    run with PYTHONDONTWRITEBYTECODE=1 (as these machines set it) otherwise compiles every
    module at every start: 0.25 s of `pagedlm serve`'s ready time (2.77 -> 2.52 s for
    importing the server's modules, 2-vCPU Zen 4 EPYC)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO_ROOT / "pagedlm")],
                   check=True, stdout=subprocess.DEVNULL)


def plan_pagedlm(spec: SystemSpec, settings: ServerSettings, port: int,
                 version: str) -> LaunchPlan:
    compile_pagedlm()
    argv = [sys.executable, "-m", "pagedlm.entrypoints.cli", "serve",
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
            "--max-num-seqs", str(settings.concurrency),
            "--max-model-len", str(settings.max_model_len),
            # Room for every sequence at full length: no system is held back by preemption.
            "--num-gpu-blocks-override", str(kv_blocks(settings.concurrency,
                                                       settings.max_model_len)),
            "--uvicorn-log-level", "warning"]
    if settings.model:
        argv += ["--model", settings.model]
    env = {"OMP_NUM_THREADS": str(settings.threads), "MKL_NUM_THREADS": str(settings.threads)}
    return LaunchPlan(argv + list(spec.extra_args), env, f"pagedlm {version}")


def kv_bytes_per_token(hf_dir: str, element_size: int) -> int:
    """K and V of every layer for one token, from the model's config.json."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return (2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
            * element_size)


def find_tcmalloc() -> str | None:
    """libtcmalloc_minimal.so.4 (Debian's libtcmalloc-minimal4), where the loader looks."""
    for pattern in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                    "/usr/lib/*/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4",
                    "/usr/lib/libtcmalloc_minimal.so.4",
                    "/usr/local/lib/libtcmalloc_minimal.so.4"):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def find_iomp(venv_python: str) -> str | None:
    """Intel OpenMP (libiomp5.so), which vLLM's CPU wheels install into their environment."""
    # Not resolved: a venv's python is a link to the system's, whose prefix has no libiomp5.
    venv = Path(venv_python).absolute().parent.parent
    found = sorted(glob.glob(str(venv / "lib" / "**" / "libiomp5.so"), recursive=True))
    return found[0] if found else None


def plan_vllm(spec: SystemSpec, settings: ServerSettings, port: int, install: peers.VllmInstall,
              hf_dir: str, tcmalloc: str | None, iomp: str | None,
              cpu_count: int) -> LaunchPlan:
    element_size = 4 if spec.dtype == "float32" else 2  # its K/V are in the model's dtype
    # Room for every sequence at full length, as the others get. With exactly that room its CPU
    # backend refused the single stream (288 tokens: "0.02 GiB needed, 0.01 available", its
    # own block rounding), so it gets at least 64 MiB; more than the requests need changes
    # nothing.
    kv_bytes = max(kv_blocks(settings.concurrency, settings.max_model_len) * 16
                   * kv_bytes_per_token(hf_dir, element_size), 64 * 2**20)
    argv = [install.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", hf_dir, "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", str(settings.concurrency),
            "--max-model-len", str(settings.max_model_len),
            # The model's generation_config.json would otherwise set sampling defaults that the
            # other servers do not apply.
            "--generation-config", "vllm", "--kv-cache-memory-bytes", str(kv_bytes),
            "--uvicorn-log-level", "warning"]
    if spec.dtype is not None:
        argv += ["--dtype", spec.dtype]
    env = {"VLLM_TARGET_DEVICE": "cpu"}
    notes: dict = {"kv_cache_bytes": kv_bytes, "dtype": spec.dtype or "vLLM's default"}
    # Its thread binding is left at its default ("auto": one OpenMP thread per core it may use,
    # pinned); only a thread count below the machine's is given, as the core list to bind.
    if settings.threads < cpu_count:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{settings.threads - 1}"
    if not spec.reserve_cpu:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    if spec.tcmalloc:
        preload = [p for p in (tcmalloc, iomp) if p]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        notes["preload"] = {"tcmalloc": tcmalloc or "not found (install libtcmalloc-minimal4)",
                            "iomp": iomp or "not found"}
    return LaunchPlan(argv + list(spec.extra_args), env, f"vllm-cpu {install.version}", notes)


def plan_llamacpp(spec: SystemSpec, settings: ServerSettings, port: int,
                  install: peers.LlamaCppInstall, model: str) -> LaunchPlan:
    argv = [install.server, "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "--alias", SERVED_NAME, "-t", str(settings.threads), "-tb", str(settings.threads),
            # One slot per sequence the workload runs at once, on a server started for this
            # workload alone: slots reused after another workload were taken in a scattered
            # order, and its batches then held about one sequence each.
            "-np", str(settings.concurrency),
            # -c is the whole cache, shared by the slots: every sequence at full length.
            "-c", str(settings.concurrency * settings.max_model_len)]
    # Seen on a 2-vCPU Sapphire Rapids-class VM: the shipped Q4_1 file segfaults while loading
    # into llama.cpp's AMX buffers (SIGSEGV, exit -11); --no-repack keeps the plain CPU path,
    # which is slower where the repacked kernels run, so it is never the default.
    hint = ("" if "--no-repack" in spec.extra_args else
            f" (a crash while loading: try its plain CPU path, "
            f"'llamacpp-{spec.gguf_type.lower()}:no-repack=--no-repack')")
    return LaunchPlan(argv + list(spec.extra_args), {}, install.version, {"gguf": model}, hint)


def default_gguf() -> str:
    from pagedlm.model_executor.model_loader.model_path import default_model_file
    return default_model_file()


def source_type(path: str) -> str:
    """The GGUF file's weight type as llama-quantize names it (general.file_type)."""
    import gguf
    reader = gguf.GGUFReader(path)
    field_ = reader.fields.get("general.file_type")
    if field_ is None:
        return "unknown"
    name = gguf.LlamaFileType(int(field_.parts[field_.data[0]][0])).name
    return name.removeprefix("MOSTLY_").removeprefix("ALL_").upper()


def plan(spec: SystemSpec, settings: ServerSettings, port: int, peers_dir: Path) -> LaunchPlan:
    """The launch plan of `spec` for one workload, setting up the peer on first use."""
    if spec.base == "pagedlm":
        return plan_pagedlm(spec, settings, port, git_describe())
    if spec.base == "vllm":
        install = peers.setup_vllm(peers_dir)
        # vLLM reads the HF directory's weights: a GGUF file's float32 copy.
        from pagedlm.model_executor.model_loader.model_path import float_model_dir
        return plan_vllm(spec, settings, port, install, float_model_dir(settings.model),
                         find_tcmalloc(), find_iomp(install.python), os.cpu_count() or 1)
    install = peers.setup_llamacpp(peers_dir)
    source = settings.model or default_gguf()
    model = (source if spec.gguf_type == source_type(source)
             else peers.gguf_file(peers_dir, install, source, spec.gguf_type))
    return plan_llamacpp(spec, settings, port, install, model)


def trim_log(path: Path, max_bytes: int = 256 * 1024) -> None:
    """Keep a server log small enough to commit: its head and tail, with a note between."""
    size = path.stat().st_size
    if size <= max_bytes:
        return
    data = path.read_bytes()
    half = max_bytes // 2
    note = f"\n[... {size - 2 * half} bytes of this log left out ...]\n".encode()
    path.write_bytes(data[:half] + note + data[-half:])
