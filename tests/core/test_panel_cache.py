"""The panels' file (panel_cache.py): a 2-byte checkpoint's first load writes its weight panels
into the cache, a later load of the same checkpoint maps them instead of packing, and any file
that does not match (another checkpoint version, a truncated or altered file) is packed again
from the checkpoint."""
from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from pagedlm import LLM, SamplingParams, panel_cache
from pagedlm.entrypoints import cli
from tests.conftest import make_tiny_model, needs_kernels

pytestmark = needs_kernels  # the panels are the native panel kernel's

PROMPTS = ["Hello there", "The capital of France is"]
GREEDY = SamplingParams(max_tokens=10, temperature=0)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of its own, the file written for any model size."""
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PAGEDLM_PANEL_CACHE", "always")
    return tmp_path / "cache" / "panels"


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory, default_model_dir):
    # Tied: the LM head's panels are packed from the embedding, whose lookups then read them.
    # Stored in bfloat16, as checkpoints on the hub are.
    from safetensors.torch import load_file, save_file
    path = make_tiny_model(tmp_path_factory.mktemp("panel_cache"), "llama", default_model_dir,
                           hidden_size=256, intermediate_size=512, tie_word_embeddings=True)
    for weights_file in glob.glob(os.path.join(path, "*.safetensors")):
        weights = {k: v.to(torch.bfloat16) for k, v in load_file(weights_file).items()}
        save_file(weights, weights_file, metadata={"format": "pt"})
    return path


def _files(cache) -> list[str]:
    return sorted(glob.glob(str(cache / "*.panels")))


def _wait_for_file(cache, old: list[str] = ()) -> str:
    """The panels' file the last load's thread writes (renamed into place whole)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = [f for f in _files(cache) if f not in old]
        if new:
            return new[0]
        time.sleep(0.05)
    raise AssertionError(f"no panels' file appeared in {cache}")


def _load(path: str, dtype: str = "bfloat16"):
    """(tokens for PROMPTS, {layer: panels' bytes}, {layer: mapped from the file?}); the engine
    shut down, every KV block back in its pool."""
    llm = LLM(path, dtype=dtype, kv_cache_memory_bytes=32 << 20)
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        model = llm.llm_engine.executor.worker.model
        panels = {name: m.panel_weight.clone() for name, m in model.named_modules()
                  if isinstance(getattr(m, "panel_weight", None), torch.Tensor)}
        mapped = {name: getattr(m, "panels_mapped", False) for name, m in model.named_modules()
                  if name in panels}
        bm = llm.llm_engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    finally:
        llm.llm_engine.shutdown()
    return tokens, panels, mapped


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_second_load_maps_the_panels_the_first_wrote(cache, tied_model, dtype):
    tokens, panels, mapped = _load(tied_model, dtype)
    assert not any(mapped.values())
    path = _wait_for_file(cache)
    assert path == panel_cache.cache_file(tied_model, dtype)
    assert panel_cache.is_cached(tied_model, dtype)
    assert not panel_cache.is_cached(tied_model, "float16" if dtype == "bfloat16" else "bfloat16")
    again, mapped_panels, mapped = _load(tied_model, dtype)
    # Every layer's panels come from the file, the tied LM head's (packed from the embedding)
    # too: 3 layers x (qkv, o, gate_up, down) + the head.
    assert len(mapped) == 13 and all(mapped.values()), mapped
    assert again == tokens
    assert mapped_panels.keys() == panels.keys()
    for name, t in panels.items():  # the same bytes, not just close
        assert torch.equal(mapped_panels[name].view(torch.int16), t.view(torch.int16)), name


def test_the_layers_read_the_file_s_map(cache, tied_model):
    _load(tied_model)
    path = _wait_for_file(cache)
    llm = LLM(tied_model, dtype="bfloat16", kv_cache_memory_bytes=32 << 20)
    try:
        model = llm.llm_engine.executor.worker.model
        with open("/proc/self/maps") as f:
            maps = [line.split() for line in f if line.rstrip().endswith(os.path.realpath(path))]
        spans = [tuple(int(x, 16) for x in m[0].split("-")) for m in maps]
        layers = [m for m in model.modules() if getattr(m, "panels_mapped", False)]
        assert layers and spans
        for m in layers:
            start = m.panel_weight.data_ptr()
            end = start + m.panel_weight.nbytes
            assert any(lo <= start and end <= hi for lo, hi in spans)
            assert m.weight.is_meta  # no plain copy of the checkpoint's matrix either
    finally:
        llm.llm_engine.shutdown()


def _rewrite_index(path: str, change) -> None:
    with open(path, "r+b") as f:
        data = f.read()
        length, magic = struct.unpack_from("<Q8s", data, len(data) - 16)
        index = json.loads(data[len(data) - 16 - length:len(data) - 16])
        change(index)
        blob = json.dumps(index).encode()
        f.seek(len(data) - 16 - length)
        f.write(blob + struct.pack("<Q8s", len(blob), magic))
        f.truncate()


def _truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


def _flip_magic(path):
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"X")


def _other_shape(path):
    def change(index):
        name = sorted(index["panels"])[0]
        index["panels"][name][1][0] += 1
    _rewrite_index(path, change)


def _missing_layer(path):
    _rewrite_index(path, lambda index: index["panels"].pop(sorted(index["panels"])[0]))


def _other_layout(path):
    def change(index):
        index["layout"]["width"] = index["layout"]["width"] // 2
    _rewrite_index(path, change)


def _out_of_the_file(path):
    def change(index):
        name = sorted(index["panels"])[0]
        index["panels"][name][0] = os.path.getsize(path)
    _rewrite_index(path, change)


def _not_an_index(path):
    def change(index):
        index["panels"] = list(index["panels"])
    _rewrite_index(path, change)


@pytest.mark.parametrize("damage", [_truncate, _flip_magic, _other_shape, _missing_layer,
                                    _other_layout, _out_of_the_file, _not_an_index])
def test_a_file_that_does_not_match_is_packed_again_and_rewritten(cache, tied_model, damage):
    tokens, panels, _ = _load(tied_model)
    path = _wait_for_file(cache)
    damage(path)
    damaged = os.path.getsize(path), os.path.getmtime(path)
    again, repacked, mapped = _load(tied_model)
    assert not any(mapped.values()) and again == tokens
    for name, t in panels.items():
        assert torch.equal(repacked[name].view(torch.int16), t.view(torch.int16)), name
    deadline = time.monotonic() + 60  # and the next load has a whole file again
    while (os.path.getsize(path), os.path.getmtime(path)) == damaged:
        assert time.monotonic() < deadline, "the damaged file was not rewritten"
        time.sleep(0.05)
    assert all(_load(tied_model)[2].values())


def test_a_changed_checkpoint_gets_its_own_file_and_the_old_one_goes(cache, tmp_path,
                                                                     default_model_dir):
    model = make_tiny_model(tmp_path / "changing", "llama", default_model_dir, hidden_size=256,
                            intermediate_size=512)
    tokens, _, _ = _load(model)
    first = _wait_for_file(cache)
    # Other weights under the same name: a later version of the checkpoint.
    from safetensors.torch import load_file, save_file
    weights_file = glob.glob(os.path.join(model, "*.safetensors"))[0]
    weights = load_file(weights_file)
    weights = {k: (-v if k.endswith("down_proj.weight") else v) for k, v in weights.items()}
    save_file(weights, weights_file, metadata={"format": "pt"})
    assert panel_cache.cache_file(model, "bfloat16") != first
    changed, _, mapped = _load(model)
    assert not any(mapped.values()) and changed != tokens
    second = _wait_for_file(cache, old=[first])
    deadline = time.monotonic() + 10
    while first in _files(cache):
        assert time.monotonic() < deadline, "the old version's file stayed"
        time.sleep(0.05)
    assert _files(cache) == [second]
    assert all(_load(model)[2].values())


def test_the_file_of_a_deleted_folder_goes_when_another_is_written(cache, tmp_path,
                                                                   tied_model,
                                                                   default_model_dir):
    import shutil
    gone = make_tiny_model(tmp_path / "gone", "llama", default_model_dir, hidden_size=256,
                           intermediate_size=512)
    _load(gone)
    stale = _wait_for_file(cache)
    shutil.rmtree(gone)
    foreign = cache / "0123456789abcdef-0.panels"  # not ours: left alone
    foreign.write_bytes(b"not a panels' file")
    _load(tied_model)
    fresh = _wait_for_file(cache, old=[stale, str(foreign)])
    deadline = time.monotonic() + 10
    while stale in _files(cache):
        assert time.monotonic() < deadline, "the deleted folder's file stayed"
        time.sleep(0.05)
    assert _files(cache) == sorted([fresh, str(foreign)])


def test_auto_writes_no_file_for_small_panels_and_off_none_at_all(cache, tied_model,
                                                                  monkeypatch):
    for value in ("auto", "", "off", "0"):
        monkeypatch.setenv("PAGEDLM_PANEL_CACHE", value)
        llm = LLM(tied_model, dtype="bfloat16", kv_cache_memory_bytes=32 << 20)
        llm.llm_engine.shutdown()
    time.sleep(0.5)  # a thread would have written this small file by now
    assert _files(cache) == []
    # A file there is left unread when the cache is off.
    monkeypatch.setenv("PAGEDLM_PANEL_CACHE", "always")
    _load(tied_model)
    _wait_for_file(cache)
    monkeypatch.setenv("PAGEDLM_PANEL_CACHE", "off")
    assert not panel_cache.is_cached(tied_model, "bfloat16")
    assert not any(_load(tied_model)[2].values())


def test_a_wrong_setting_is_refused_naming_the_variable(cache, tied_model, monkeypatch):
    monkeypatch.setenv("PAGEDLM_PANEL_CACHE", "sometimes")
    with pytest.raises(ValueError, match="PAGEDLM_PANEL_CACHE='sometimes'"):
        LLM(tied_model, dtype="bfloat16", kv_cache_memory_bytes=32 << 20)
    assert not panel_cache.is_cached(tied_model, "bfloat16")  # serve's early look: no error


def test_float32_and_quantized_loads_write_no_file(cache, tied_model):
    for kwargs in ({"dtype": "float32"}, {"dtype": "bfloat16", "quantization": "int8"}):
        llm = LLM(tied_model, kv_cache_memory_bytes=32 << 20, **kwargs)
        llm.llm_engine.shutdown()
    time.sleep(0.5)
    assert _files(cache) == []


def test_serve_faults_no_memory_in_for_panels_it_will_map(cache, tied_model):
    argv = ["serve", tied_model, "--dtype", "bfloat16"]
    memory = cli._prefault(argv, min_bytes=0)
    assert memory is not None
    memory.finish()
    _load(tied_model)
    _wait_for_file(cache)
    assert cli._prefault(argv, min_bytes=0) is None
    memory = cli._prefault(["serve", tied_model, "--dtype", "half"], min_bytes=0)
    assert memory is not None  # float16 panels are another file
    memory.finish()


def _staging_files(cache) -> list[str]:
    return sorted(glob.glob(str(cache / ".*")))


def test_a_dead_writer_s_staging_file_goes_at_the_next_load(cache, tied_model):
    """What a writer killed mid-write leaves (its staging file, its lock free) is removed by
    the next load, one that maps the file and writes nothing; one whose writer holds the lock
    stays until it is free."""
    from pagedlm import staging
    _load(tied_model)
    entry = os.path.basename(_wait_for_file(cache))
    leftover = cache / f"{staging.staging_prefix(entry)}killed"
    leftover.write_bytes(b"\0" * 4096)
    with staging.try_build_lock(cache, panel_cache._lock_directory(), "other.panels") as mine:
        assert mine
        alive = cache / f"{staging.staging_prefix('other.panels')}writing"
        alive.write_bytes(b"\0" * 4096)
        assert all(_load(tied_model)[2].values())
        assert _staging_files(cache) == [str(alive)]
    _load(tied_model)
    assert _staging_files(cache) == []
    # The temporaries of writers before staging files: gone once an hour old.
    old, recent = cache / f"{entry}.123.456.tmp", cache / f"{entry}.124.457.tmp"
    for tmp in (old, recent):
        tmp.write_bytes(b"\0" * 4096)
    os.utime(old, (time.time() - 7200,) * 2)
    _load(tied_model)
    assert not old.exists() and recent.exists()


def test_a_write_another_process_holds_or_a_stop_abandons_leaves_nothing(cache, tied_model):
    from pagedlm import staging
    llm = LLM(tied_model, dtype="bfloat16", kv_cache_memory_bytes=32 << 20)
    try:
        model = llm.llm_engine.executor.worker.model
        layers = {name: m for name, m in model.named_modules()
                  if isinstance(getattr(m, "panel_weight", None), torch.Tensor)}
        _wait_for_file(cache)
        for f in _files(cache):
            os.unlink(f)
        path = panel_cache.cache_file(tied_model, "bfloat16")
        with staging.try_build_lock(cache, panel_cache._lock_directory(),
                                    os.path.basename(path)):
            assert not panel_cache.write_panels(path, tied_model, layers, {})
        stop = threading.Event()
        stop.set()
        assert not panel_cache.write_panels(path, tied_model, layers, {}, stop)
        assert _files(cache) == [] and _staging_files(cache) == []
        assert panel_cache.write_panels(path, tied_model, layers, {})
        assert _files(cache) == [path] and _staging_files(cache) == []
    finally:
        llm.llm_engine.shutdown()


def test_a_server_stopped_while_it_writes_leaves_no_staging_file(cache, tied_model, tmp_path):
    """The write stops at the process's exit (atexit) and removes its staging file: a
    process that exits mid-write, as a server stopped seconds after it started."""
    script = tmp_path / "exit_mid_write.py"
    script.write_text(
        "import sys, threading, time\n"
        "from pagedlm import LLM, panel_cache\n"
        "writing = threading.Event()\n"
        "def slow_piece(piece):  # each 4 KiB piece 20 ms: the write takes far longer\n"
        "    writing.set()\n"
        "    time.sleep(0.02)\n"
        "    return memoryview(piece)\n"
        "panel_cache._WRITE_PIECE = 4096\n"
        "panel_cache.memoryview = slow_piece  # the module's name, before the builtin\n"
        "LLM(sys.argv[1], dtype='bfloat16', kv_cache_memory_bytes=32 << 20)\n"
        "assert writing.wait(30)\n"
        "print('exiting mid-write', flush=True)\n")
    out = subprocess.run([sys.executable, str(script), tied_model], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "exiting mid-write" in out.stdout
    assert _files(cache) == [] and _staging_files(cache) == []
