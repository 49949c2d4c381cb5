"""What a built wheel ships, through setuptools' own reading of pyproject.toml (no build): every
C source and header the native kernels compile from. Without one, a non-editable install runs
on the PyTorch fallbacks (scripts/check_wheel.sh builds and runs a real wheel in CI)."""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def package_data_files(root: Path, monkeypatch) -> set[Path]:
    """The package-data files setuptools copies into a wheel built from ``root``."""
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(root)  # setuptools finds the packages and their files from here
    dist = Distribution()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # setuptools' deprecation notices about other fields
        apply_configuration(dist, str(root / "pyproject.toml"))
    build_py = dist.get_command_obj("build_py")
    build_py.ensure_finalized()
    # Without the manifest: its files come from an egg-info this test must not write.
    return {root / src_dir / name
            for _, src_dir, _, names in build_py.get_data_files_without_manifest()
            for name in names}


def native_sources(root: Path) -> set[Path]:
    return {p for p in (root / "pagedlm").rglob("*") if p.suffix in (".c", ".h")}


def test_wheel_ships_every_c_source_and_header(monkeypatch):
    native = native_sources(ROOT)
    # What the loader compiles (every .c in pagedlm/csrc) and the headers they include.
    csrc = ROOT / "pagedlm" / "csrc"
    assert {csrc / "include" / h for h in ("pagedlm_ops.h", "kv_types.h", "vec_math.h",
                                            "parallel.h")} <= native
    assert {csrc / c for c in ("paged_attention.c", "prefill_attention.c", "fused_ops.c",
                               "gemv_f32.c", "quant_matmul.c", "llama_decode.c")} <= native
    assert sorted(map(str, native - package_data_files(ROOT, monkeypatch))) == []


def test_a_source_in_a_new_folder_ships_too(tmp_path, monkeypatch):
    """Moving or adding kernel sources must not need an edit of the package-data list."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "README.md").write_text("x\n")
    for package in ("pagedlm", "pagedlm/kernels2"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    for name in ("pagedlm/kernels2/deep/er/csrc/k.c", "pagedlm/kernels2/deep/er/csrc/k.h",
                 "pagedlm/top.h"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("/* */\n")
    native = native_sources(tmp_path)
    assert len(native) == 3
    assert native <= package_data_files(tmp_path, monkeypatch)
