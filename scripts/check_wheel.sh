#!/usr/bin/env bash
# Build pagedlm's wheel, install it (not editable) into a fresh virtual environment and run
# examples/offline_inference.py from it with every native kernel built from the installed C
# sources. A wheel missing a .c or .h still runs, on the PyTorch fallbacks with a warning, so
# this asserts the kernels are available rather than that the example exits 0.
#
# Offline (with a recent setuptools in .venv): the wheel is built with .venv's setuptools and
# installed without dependencies; the fresh environment sees .venv's packages (torch,
# transformers, ...) through a .pth file, after its own site-packages, so `import pagedlm`
# finds the wheel's copy, never the editable one.
# Needs scripts/setup.sh to have run. Takes about a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
VENV_PY="$repo/.venv/bin/python"
work=$(mktemp -d "${TMPDIR:-/tmp}/pagedlm-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$SECONDS

# Build from a copy of the files git knows (tracked, or new and not ignored): an in-tree build
# would leave build/ behind, and a stale build/lib would put files into the wheel that the
# tree no longer has.
"$VENV_PY" - "$work/src" <<'EOF'
import shutil
import subprocess
import sys
from pathlib import Path

dst = Path(sys.argv[1])
listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        capture_output=True, check=True).stdout.decode().split("\0")
for name in listed:
    if name and Path(name).is_file():  # a tracked file deleted in the work tree is skipped
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(name, dst / name)
EOF
# .venv's setuptools (torch pulls a recent one) builds wheels itself from 70.1 on: then no
# download; an older one builds in an isolated environment from PyPI, as pyproject.toml says.
isolation=--no-build-isolation
"$VENV_PY" -c 'import setuptools.command.bdist_wheel' 2>/dev/null || isolation=
"$VENV_PY" -m pip wheel --disable-pip-version-check -q --no-deps $isolation \
  -w "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/pagedlm-*.whl)
echo "check_wheel: built $(basename "$wheel")"
# Every C source and header of the tree is in it (a missing one would leave the kernels off).
"$VENV_PY" - "$wheel" "$work/src" <<'EOF'
import sys
import zipfile
from pathlib import Path

wheel, src = sys.argv[1], Path(sys.argv[2])
native = {str(p.relative_to(src)) for p in (src / "pagedlm").rglob("*")
          if p.suffix in (".c", ".h")}
shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith((".c", ".h"))}
assert native and native == shipped, (f"missing {sorted(native - shipped)}, "
                                      f"extra {sorted(shipped - native)}")
print(f"check_wheel: the wheel has all {len(native)} C sources and headers")
EOF

"$VENV_PY" -m venv --without-pip "$work/venv"
fresh_py="$work/venv/bin/python"
"$VENV_PY" -m pip --disable-pip-version-check -q --python "$fresh_py" install --no-deps \
  "$wheel"
fresh_site=$("$fresh_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$VENV_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
  > "$fresh_site/pagedlm-check-deps.pth"

# Outside the repository, so neither the working directory nor the editable install can
# stand in for the installed package.
cd "$work"
"$fresh_py" - "$fresh_site" "$repo/examples/offline_inference.py" <<'EOF'
import runpy
import sys
from pathlib import Path

site, example = Path(sys.argv[1]), sys.argv[2]
import pagedlm

installed = Path(pagedlm.__file__).resolve()
assert installed.is_relative_to(site.resolve()), f"pagedlm imported from {installed}"
from pagedlm import kernels
from pagedlm.kernels import loader

# One library from every source; each op family's functions resolve in it.
assert kernels.available(), "the installed wheel's kernels did not build (see the warning)"
assert {p.name for p in loader.SOURCES} >= {"paged_attention.c", "gemv_f32.c",
                                            "quant_matmul.c", "llama_decode.c"}
for family in (kernels.attention, kernels.fused_ops, kernels.gemv, kernels.quant,
               kernels.decode_stack):
    assert family.library() is not None, family.__name__
runpy.run_path(example, run_name="__main__")
print(f"check_wheel: the example ran from {installed.parent} on the native kernels")
EOF
echo "check_wheel: passed in $((SECONDS - start)) s"
