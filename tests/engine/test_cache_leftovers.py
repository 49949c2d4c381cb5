"""Leftovers of killed builders (pagedlm/staging.py): a GGUF conversion or a kernel build that
is SIGKILLed mid-way leaves its staging directory or temporary library, which the next start
removes; one whose builder is still alive is kept. Real child processes, real files."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedlm.kernels import loader
from pagedlm.model_executor.model_loader.model_path import CONVERSION_MARKER, resolve_model
from pagedlm.staging import staging_prefix
from tests.models.test_model_loading import _tiny_hf_state, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]

# Converts for real into its staging directory, says where, then stalls as a long conversion
# would: the parent kills it there.
STALLED_CONVERSION = """
import sys, time
from pagedlm.model_executor.model_loader import gguf_loader, model_path
convert = gguf_loader.convert_gguf_metadata
def convert_then_stall(gguf_path, out_dir):
    convert(gguf_path, out_dir)
    print(out_dir, flush=True)
    time.sleep(600)
gguf_loader.convert_gguf_metadata = convert_then_stall
model_path.resolve_model(sys.argv[1])
"""

STALLED_BUILD = """
import sys
from pathlib import Path
from pagedlm.kernels import loader
loader.build((Path(sys.argv[1]),), name="stalled")
"""


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(root))
    return root


def start_child(script: str, *args: str, env: dict[str, str]) -> subprocess.Popen:
    # Its own session, so killing its group also kills what it started (the stalled compiler).
    return subprocess.Popen([sys.executable, "-c", script, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()


def wait_for(predicate, what: str, proc: subprocess.Popen, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert proc.poll() is None, f"the child exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.05)
    return found


def test_killed_conversion_is_removed_and_a_live_one_kept(cache, tmp_path):
    stalled = write_tiny_gguf(tmp_path / "stalled.gguf", _tiny_hf_state(False, False, seed=1))
    other = write_tiny_gguf(tmp_path / "other.gguf", _tiny_hf_state(False, False, seed=2))
    child = start_child(STALLED_CONVERSION, str(stalled), env=dict(os.environ))
    try:
        staging = Path(child.stdout.readline().strip())
        assert staging.name.startswith("."), f"the child said {staging!r}"
        assert (staging / "config.json").is_file() and (staging / "tokenizer.json").is_file()

        # Another model resolved while the child is still converting: its staging stays.
        other_dir = resolve_model(str(other))
        assert staging.is_dir()
        assert child.poll() is None

        child_pid = child.pid
        kill_group(child)
        with pytest.raises(ProcessLookupError):
            os.kill(child_pid, 0)
        assert staging.is_dir()  # nothing removed it yet

        # The next start, even a cache hit for another model, removes the dead one's staging.
        assert resolve_model(str(other)) == other_dir
        assert not staging.exists()
    finally:
        kill_group(child)

    # Its model converts normally: the dead builder's lock went with it.
    converted = Path(resolve_model(str(stalled)))
    assert (converted / CONVERSION_MARKER).is_file()
    assert sorted(p.name for p in converted.parent.iterdir()) == sorted(
        [converted.name, Path(other_dir).name])


def test_staging_directory_without_a_builder_is_removed(cache, tmp_path):
    """As a conversion from before the lock existed, or one whose lock file was lost, leaves
    it: nobody holds its lock."""
    gguf_file = write_tiny_gguf(tmp_path / "m.gguf", _tiny_hf_state(False, False))
    gguf_dir = cache / "gguf"
    leftover = gguf_dir / f"{staging_prefix('m-0123456789abcdef')}k2j4_x9z"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"\0" * 4096)
    converted = Path(resolve_model(str(gguf_file)))
    assert [p.name for p in gguf_dir.iterdir()] == [converted.name]


def fake_compiler_dir(tmp_path: Path) -> Path:
    """A `gcc` that never finishes, first on the child's PATH: a build killed mid-compile."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcc = bin_dir / "gcc"
    gcc.write_text("#!/bin/sh\nexec sleep 600\n")
    gcc.chmod(0o755)
    return bin_dir


def test_killed_kernel_build_is_removed_and_a_live_one_kept(cache, tmp_path):
    source = tmp_path / "k.c"
    source.write_text("int answer(void) { return 42; }\n")
    env = dict(os.environ, PATH=f"{fake_compiler_dir(tmp_path)}{os.pathsep}{os.environ['PATH']}")
    kernel_dir = cache / "kernels"

    def temporaries() -> list[Path]:
        return sorted(kernel_dir.glob(".stalled-*.so.tmp-*")) if kernel_dir.is_dir() else []

    child = start_child(STALLED_BUILD, str(source), env=env)
    try:
        [temporary] = wait_for(temporaries, "temporary library", child)
        # Another library built (for real) while the child compiles: its temporary stays.
        built = loader.build((source,), name="other")
        assert built.is_file() and temporary.is_file()
        kill_group(child)
        assert temporary.is_file()
        # The next build, here a cache hit, removes it.
        assert loader.build((source,), name="other") == built
        assert temporaries() == []
    finally:
        kill_group(child)
    assert [p.name for p in kernel_dir.iterdir()] == [built.name]


def test_old_style_kernel_temporaries_are_removed_once_stale(cache, tmp_path):
    """Earlier versions left `.NAME-XXXXXXXX.so.tmp` and took no lock: removed once older
    than any build can run, kept while they could still be a build in progress."""
    source = tmp_path / "k.c"
    source.write_text("int answer(void) { return 42; }\n")
    kernel_dir = cache / "kernels"
    kernel_dir.mkdir(parents=True)
    old, fresh = kernel_dir / ".pagedlm_kernels-a1b2c3d4.so.tmp", kernel_dir / ".x-e5f6.so.tmp"
    old.write_bytes(b"\x7fELF")
    fresh.write_bytes(b"\x7fELF")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    loader.build((source,), name="k")
    assert not old.exists() and fresh.exists()
