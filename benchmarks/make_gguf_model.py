"""Build the realistic benchmark model of issue 33: a 1B-class Llama with random weights and the
default model's tokenizer, as the files people download (bf16 safetensors, F16 GGUF, K-quants).

    python benchmarks/make_gguf_model.py --out /work/peers/models/llama1b \\
        --llama-cpp /work/peers/llama.cpp

Steps, each skipped when its output exists (every output is written under a temporary name and
renamed when complete, so an interrupted run redoes only the step it was in):

1. `bf16/`: transformers' LlamaConfig (2048 hidden, 16 layers, 32 heads / 8 KV heads, 8192 MLP,
   SmolLM2's 49152-token vocabulary, tied embeddings: 1.07B parameters), its own random init
   (normal(0, 0.02)), saved as bfloat16 safetensors with SmolLM2's tokenizer (make_random_model);
2. `model-F16.gguf`: llama.cpp's convert_hf_to_gguf.py, run with its own gguf-py first on
   PYTHONPATH (the pip `gguf` package may be another version); it needs sentencepiece (the
   `bench` extra). The converter comes from the same llama-cpp-python sdist the llama.cpp build
   does (lib/peers.py), fetched into --converter-dir's parent when missing;
3. `model-Q4_K_M.gguf`, `model-Q6_K.gguf`, `model-Q8_0.gguf`: llama-quantize from the F16 file.

Random weights measure speed and memory only; the outputs are noise.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from lib import peers

# Issue 33's 1B-class shape.
SHAPE = {"hidden_size": 2048, "intermediate_size": 8192, "layers": 16, "heads": 32,
         "kv_heads": 8}
QUANT_TYPES = ("Q4_K_M", "Q6_K", "Q8_0")
# Needed free on the output's filesystem before a step starts: bf16 2.2 GB, F16 2.2 GB,
# Q4_K_M 0.7, Q6_K 0.9, Q8_0 1.2, and each step's partial file beside the last.
STEP_BYTES = {"bf16": 2.3e9, "F16": 2.3e9, "Q4_K_M": 0.8e9, "Q6_K": 1.0e9, "Q8_0": 1.3e9}


@dataclass(frozen=True)
class ModelFiles:
    """Where each format of the benchmark model lives under --out."""
    out: Path

    @property
    def hf_dir(self) -> Path:
        return self.out / "bf16"

    def gguf(self, qtype: str) -> Path:
        return self.out / f"model-{qtype}.gguf"


def partial_path(target: Path) -> Path:
    """A temporary name beside target (same filesystem, so the rename is atomic) that no
    reader takes for the finished file: no .gguf suffix, and not a model directory name."""
    return target.with_name(f".{target.name}.partial-{os.getpid()}")


def check_space(directory: Path, needed: float, what: str) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise SystemExit(f"{what} needs about {needed / 1e9:.1f} GB free in {directory}; "
                         f"{free / 1e9:.1f} GB are")


def converter_dir(default_root: Path, given: Path | None) -> Path:
    """vendor/llama.cpp of llama-cpp-python's sdist (convert_hf_to_gguf.py and its gguf-py):
    the given folder, or the sdist's under default_root, downloaded with pip when missing."""
    if given is not None:
        if not (given / "convert_hf_to_gguf.py").is_file():
            raise SystemExit(f"{given} has no convert_hf_to_gguf.py")
        return given
    version = peers.LLAMA_CPP_PYTHON_VERSION
    found = default_root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (found / ".converter-extracted").is_file():
        return found
    default_root.mkdir(parents=True, exist_ok=True)
    sdist = default_root / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        peers.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "download",
                   "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={version}",
                   "-d", str(default_root)], log_path=default_root / "download.log")
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        # The converter, the modules beside it it imports, its `conversion` package and gguf-py;
        # not the C++ tree.
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (
            "/" not in m.name[len(prefix):] and m.name.endswith(".py")
            or m.name.startswith((prefix + "conversion/", prefix + "gguf-py/")))]
        tar.extractall(default_root, members=members, filter="data")
    (found / ".converter-extracted").write_text("")
    return found


def llama_quantize(llama_cpp: Path) -> str:
    """llama-quantize from a lib/peers.py build folder (built there when missing)."""
    binary = llama_cpp / "bin" / "llama-quantize"
    if binary.is_file():
        return str(binary)
    return peers.setup_llamacpp(llama_cpp.parent).quantize


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def step(name: str, target: Path, needed: float, make) -> None:
    """make(partial) writes the output under a temporary name; it is renamed to target."""
    if target.exists():
        print(f"[{name}] {target} exists, skipped", flush=True)
        return
    check_space(target.parent, needed, name)
    partial = partial_path(target)
    remove(partial)
    started = time.perf_counter()
    print(f"[{name}] writing {target}", flush=True)
    try:
        make(partial)
        os.replace(partial, target)
    except BaseException:
        remove(partial)
        raise
    print(f"[{name}] done in {time.perf_counter() - started:.0f} s: {size_text(target)}",
          flush=True)


def size_of(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def size_text(path: Path) -> str:
    return f"{size_of(path) / 1e6:.0f} MB"


def make_hf(partial: Path, seed: int) -> None:
    import torch
    from make_random_model import write_random_llama
    write_random_llama(str(partial), dtype=torch.bfloat16, seed=seed, **SHAPE)


def make_f16(partial: Path, hf_dir: Path, convert: Path, log_path: Path) -> None:
    env = dict(os.environ)
    # The converter's own gguf-py first: it writes the metadata its llama.cpp build reads.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(convert / "gguf-py"), *filter(None, [env.get("PYTHONPATH")])])
    peers.run([sys.executable, str(convert / "convert_hf_to_gguf.py"), str(hf_dir),
               "--outtype", "f16", "--outfile", str(partial)], log_path=log_path, env=env,
              nice=True)


def make_quant(partial: Path, f16: Path, qtype: str, quantize: str, log_path: Path) -> None:
    peers.run([quantize, str(f16), str(partial), qtype, str(os.cpu_count() or 1)],
              log_path=log_path, nice=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, required=True,
                   help="Output folder (outside the repository: about 7 GB).")
    p.add_argument("--llama-cpp", type=Path, default=peers.DEFAULT_PEERS_DIR / "llama.cpp",
                   help="llama.cpp as lib/peers.py builds it (bin/llama-quantize); built "
                        "there when missing.")
    p.add_argument("--converter-dir", type=Path, default=None,
                   help="The sdist's vendor/llama.cpp (convert_hf_to_gguf.py, gguf-py). "
                        "Default: under --llama-cpp's parent/src, downloaded when missing.")
    p.add_argument("--types", nargs="+", default=list(QUANT_TYPES), metavar="TYPE",
                   help="llama-quantize types made from the F16 file.")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    files = ModelFiles(args.out.resolve())
    files.out.mkdir(parents=True, exist_ok=True)
    log_path = files.out / "build.log"

    step("bf16", files.hf_dir, STEP_BYTES["bf16"], lambda part: make_hf(part, args.seed))
    f16 = files.gguf("F16")
    step("F16", f16, STEP_BYTES["F16"], lambda part: make_f16(
        part, files.hf_dir, converter_dir(args.llama_cpp.parent / "src", args.converter_dir),
        log_path))
    for qtype in args.types:
        step(qtype, files.gguf(qtype), STEP_BYTES.get(qtype, STEP_BYTES["F16"]),
             lambda part, q=qtype: make_quant(part, f16, q, llama_quantize(args.llama_cpp),
                                              log_path))
    for path in (files.hf_dir, f16, *(files.gguf(q) for q in args.types)):
        print(f"{size_text(path):>8}  {path}")


if __name__ == "__main__":
    main()
