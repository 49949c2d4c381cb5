"""Prepare what scripts/gpu_check.sh needs on a bare GPU machine, which has no network and
lacks some of pagedlm's packages (issue 35):

- .gpu_assets/smollm2/: SmolLM2-135M-Instruct's config.json, generation config and tokenizer
  files (tokenizer.json, tokenizer_config.json, chat template), from the embedded GGUF's
  metadata through pagedlm's own conversion (model_path.resolve_model), without weights: the
  95 MB GGUF does not fit the 64 MiB the working tree may take along; the GPU side gives the
  config random weights (tests/gpu/assets.py).
- .whl/: wheels (CPython 3.12, manylinux x86-64) of what `pagedlm serve` imports and the
  machine lacks, at the versions of this venv, fetched with pip download as the device
  README says.

Both folders are git-ignored (.gitignore) and travel with `carry`.

    .venv/bin/python scripts/gpu_assets.py            # assets and wheels
    .venv/bin/python scripts/gpu_assets.py --no-wheels
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.gpu.assets import ASSET_FILES, ASSETS_DIR  # noqa: E402

WHEEL_DIR = REPO_ROOT / ".whl"
# Missing on the GPU machine (issue 35's list, checked against the device notes' package list)
# and imported by `pagedlm serve` or pagedlm at import time. typing-extensions is there, but
# pydantic 2.14 needs >= 4.16, so a newer one travels too. opentelemetry-api: fastapi's
# telemetry module imports it. xgrammar (and its apache-tvm-ffi) only for a structured-output
# request; carried since they are small, so such a request works there too.
WHEELS = ("fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "annotated-types",
          "typing-inspection", "typing-extensions", "opentelemetry-api", "gguf", "xgrammar",
          "apache-tvm-ffi")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
# The working tree and the carried folders travel up to 64 MiB together.
TRAVEL_LIMIT = 64 * 2**20


def write_assets() -> None:
    from pagedlm.model_executor.model_loader.model_path import resolve_model
    source = Path(resolve_model(None))  # metadata only: no float weights are written
    ASSETS_DIR.mkdir(parents=True, exist_ok=True)
    for name in ASSET_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, ASSETS_DIR / name)
        else:
            print(f"note: {source} has no {name}")
    for leftover in ASSETS_DIR.glob("*.safetensors"):
        leftover.unlink()
    print(f"wrote {ASSETS_DIR}: {sorted(p.name for p in ASSETS_DIR.iterdir())}")


def download_wheels() -> None:
    WHEEL_DIR.mkdir(exist_ok=True)
    pins = [f"{name}=={metadata.version(name)}" for name in WHEELS]
    for pin in pins:
        stem = pin.split("==")[0].replace("-", "_").lower()
        for old in WHEEL_DIR.glob("*.whl"):  # one version of each, or the install stops
            if (old.name.lower().startswith(stem + "-")
                    and f"-{pin.split('==')[1]}-" not in old.name):
                old.unlink()
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp",
           *[arg for p in PLATFORMS for arg in ("--platform", p)], "-d", str(WHEEL_DIR), *pins]
    subprocess.run(cmd, check=True)
    print(f"wheels in {WHEEL_DIR}: {sorted(p.name for p in WHEEL_DIR.glob('*.whl'))}")


def travelling_bytes() -> int:
    """Tracked and untracked-not-ignored files, plus the two carried folders."""
    listed = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files", "-z", "--cached",
                             "--others", "--exclude-standard"], capture_output=True,
                            check=True).stdout.split(b"\0")
    total = sum((REPO_ROOT / p.decode()).stat().st_size for p in listed
                if p and (REPO_ROOT / p.decode()).is_file())
    for folder in (ASSETS_DIR.parent, WHEEL_DIR):
        total += sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-wheels", action="store_true")
    args = parser.parse_args()
    write_assets()
    if not args.no_wheels:
        download_wheels()
    size = travelling_bytes()
    print(f"travelling: {size / 2**20:.1f} MiB of {TRAVEL_LIMIT / 2**20:.0f}")
    if size > TRAVEL_LIMIT * 0.8:
        raise SystemExit("too close to the device tool's 64 MiB limit")


if __name__ == "__main__":
    main()
