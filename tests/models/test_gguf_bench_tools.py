"""The issue-33 benchmark tools without the model or llama.cpp: gguf_models.py's system names,
weight bytes per token (the roofline's numerator) from tiny GGUF and safetensors files, the
roofline arithmetic, process-tree memory, make_gguf_model.py's atomic steps,
gguf_fidelity.py's position-by-position comparison, and kquant_kernels.py's random blocks."""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import needs_kernels

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    """The scripts imported as `python benchmarks/X.py` imports them; removed afterwards."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield {name: importlib.import_module(name)
               for name in ("gguf_models", "make_gguf_model", "gguf_fidelity", "lib.roofline",
                            "kquant_kernels")}
    finally:
        sys.path.remove(str(BENCHMARKS))
        for name in [m for m in sys.modules if m in ("compare", "lib", "gguf_models",
                                                       "make_gguf_model", "make_random_model",
                                                       "gguf_fidelity", "kquant_kernels")
                     or m.startswith("lib.")]:
            sys.modules.pop(name)


def test_system_names(bench, tmp_path):
    gm = bench["gguf_models"]
    s = gm.parse_system("pagedlm-q4_k_m:gguf=--quantization gguf")
    assert (s.name, s.base, s.fmt, s.extra_args) == (
        "pagedlm-q4_k_m:gguf", "pagedlm", "Q4_K_M", ("--quantization", "gguf"))
    assert s.model_path(tmp_path) == tmp_path / "model-Q4_K_M.gguf"
    assert gm.parse_system("pagedlm-bf16").model_path(tmp_path) == tmp_path / "bf16"
    assert gm.parse_system("llamacpp-f16").fmt == "F16"
    for bad in ("pagedlm", "vllm-bf16", "llamacpp-bf16", "pagedlm-bf16=--dtype bfloat16",
                "pagedlm-bf16:x"):
        with pytest.raises(ValueError, match="--systems entry"):
            gm.parse_system(bad)


def test_warm_page_cache_reads_files_and_folders(bench, tmp_path):
    gm = bench["gguf_models"]
    folder = tmp_path / "bf16"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.safetensors").write_bytes(b"x" * 5000)
    (folder / "config.json").write_bytes(b"{}")
    (folder / "sub" / "skipped").write_bytes(b"y" * 7)  # a folder's folders are not models
    (tmp_path / "model.gguf").write_bytes(b"z" * 40000)
    # Chunks smaller than the files: every byte is read, the last chunk short.
    assert gm.warm_page_cache([folder, tmp_path / "model.gguf"], chunk=4096) == 45002
    assert gm.warm_page_cache([]) == 0
    assert gm.parse_args(["--model-dir", str(tmp_path)]).cold_files is False
    assert gm.parse_args(["--model-dir", str(tmp_path), "--cold-files"]).cold_files is True


def write_gguf(path: Path, tensors: dict[str, np.ndarray]) -> None:
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_bytes_per_token(bench, tmp_path):
    rl = bench["lib.roofline"]
    emb = np.zeros((64, 32), np.float16)  # 4096 bytes
    layer = np.zeros((32, 32), np.float32)  # 4096 bytes
    # Tied: the embedding is the LM head, read whole every step.
    write_gguf(tmp_path / "tied.gguf", {"token_embd.weight": emb, "blk.0.w.weight": layer})
    assert rl.gguf_bytes_per_token(tmp_path / "tied.gguf") == 8192
    # Untied: the embedding is only looked up; output.weight is read.
    write_gguf(tmp_path / "untied.gguf", {"token_embd.weight": emb, "blk.0.w.weight": layer,
                                          "output.weight": emb})
    assert rl.bytes_per_token(tmp_path / "untied.gguf") == 8192


def test_safetensors_bytes_per_token(bench, tmp_path):
    from safetensors.torch import save_file
    rl = bench["lib.roofline"]
    emb = torch.zeros(64, 32, dtype=torch.bfloat16)  # 4096 bytes
    save_file({"model.embed_tokens.weight": emb, "model.layers.0.w": torch.zeros(8, 8)},
              str(tmp_path / "model.safetensors"))
    assert rl.bytes_per_token(tmp_path) == 4096 + 256
    save_file({"lm_head.weight": emb}, str(tmp_path / "model-2.safetensors"))
    assert rl.safetensors_bytes_per_token(tmp_path) == 4096 + 256


def test_roofline_and_summary(bench):
    gm = bench["gguf_models"]
    r = bench["lib.roofline"].roofline(weight_bytes=10**9, bandwidth=40e9, decode_tokens_per_s=30.0)
    assert r["roofline_tokens_per_s"] == pytest.approx(40.0)
    assert r["share_of_roofline"] == pytest.approx(0.75)
    assert r["implied_read_bytes_per_s"] == pytest.approx(30e9)
    runs = [{"load_s": x, "memory": {"vmhwm_sum_bytes": 2e9, "sampled_rss_peak_bytes": 1e9},
             "tokens_per_s": 10 * x, "decode_tokens_per_s": 11 * x, "ttft_ms": 5.0}
            for x in (1.0, 3.0, 2.0)]
    s = gm.summary(runs, "single")
    assert s["load_s"] == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": 3}
    assert s["peak_rss_gb"]["median"] == 2.0 and s["tokens_per_s"]["median"] == 20.0
    assert "peak_rss_gb" in gm.render({"single": {"x": s}}, {"y": "boom\nmore"})


def test_tree_memory_reads_this_process(bench):
    gm = bench["gguf_models"]
    with gm.TreeMemory(os.getpid(), interval=0.01) as memory:
        pass
    m = memory.read()
    assert m["processes"] >= 1
    # Read after the samples: the high-water mark covers them (this process only grows here,
    # unless a page is freed in between: 1% of slack).
    assert 0 < m["sampled_rss_peak_bytes"] <= 1.01 * m["vmhwm_sum_bytes"]
    assert gm.status_kib(2**22 + 12345, "VmHWM") == 0  # no such process


def test_make_steps_are_atomic_and_skipped_when_done(bench, tmp_path):
    mk = bench["make_gguf_model"]
    target = tmp_path / "model-X.gguf"

    def fails(partial: Path) -> None:
        partial.write_bytes(b"half")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        mk.step("X", target, 0, fails)
    assert list(tmp_path.iterdir()) == []  # neither the target nor the partial file
    mk.step("X", target, 0, lambda partial: partial.write_bytes(b"done"))
    mk.step("X", target, 0, fails)  # exists: not redone
    assert target.read_bytes() == b"done" and list(tmp_path.iterdir()) == [target]
    with pytest.raises(SystemExit, match="GB free"):
        mk.step("Y", tmp_path / "y", 1e18, fails)


def test_fidelity_comparison(bench):
    compare_positions = bench["gguf_fidelity"].compare_positions
    ref = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0], [2.0, 1.99, 0.0],
                                          [0.0, 0.0, 5.0]]), dim=-1)
    same = compare_positions(ref, [1, 0, 2], [float(ref[0, 1]), float(ref[1, 0]) + 0.01,
                                              float(ref[2, 2])], near_tie=0.05)
    assert same["identical"] and same["only_near_ties"]
    assert same["max_logprob_diff"] == pytest.approx(0.01, abs=1e-6)
    assert same["top2_margins"] == pytest.approx([2.0, 0.01, 5.0], abs=1e-5)
    # Position 1 picks the runner-up of a near-tie (gap 0.01); position 2 a clear loser.
    tie = compare_positions(ref, [1, 1, 2], [0.0] * 3, near_tie=0.05)
    assert not tie["identical"] and tie["only_near_ties"]
    assert [d["position"] for d in tie["differences"]] == [1]
    assert tie["differences"][0]["gap"] == pytest.approx(0.01, abs=1e-6)
    wrong = compare_positions(ref, [1, 0, 0], [0.0] * 3, near_tie=0.05)
    assert not wrong["only_near_ties"] and wrong["differences"][0]["gap"] == pytest.approx(5.0)


@needs_kernels
def test_kquant_kernels_blocks_are_valid(bench):
    """The A/B script's random blocks are blocks of the format it names: the library's kernel
    multiplies them as gguf-py's dequantization does, within what 8-bit activations cost (a
    block of the wrong size or scales at the wrong offset would miss by far more)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from pagedlm.kernels import loader
    kk = bench["kquant_kernels"]
    lib = loader.load_library()
    assert lib is not None, "the native kernels failed to build"
    rng = np.random.default_rng(1)
    n, k, rows = 32, 512, 3
    for fmt in sorted(kk.FORMATS):
        w = kk.random_blocks(fmt, n, k, rng)
        assert w.shape == (n, k // 256, kk.FORMATS[fmt][0])
        dense = dequantize(w.reshape(n, -1), GGMLQuantizationType[fmt.upper()])
        assert dense.shape == (n, k) and np.isfinite(dense).all()
        x = rng.standard_normal((rows, k)).astype(np.float32)
        y = np.zeros((rows, n), np.float32)
        kk.kernel(lib, fmt)(y.ctypes.data, x.ctypes.data, w.ctypes.data, rows, n, k, 1)
        ref = x.astype(np.float64) @ dense.T.astype(np.float64)
        scale = np.abs(x).astype(np.float64) @ np.abs(dense).T.astype(np.float64)
        assert (np.abs(y - ref) <= 0.005 * scale).all(), fmt  # measured: at most 0.0018
