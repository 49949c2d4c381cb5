"""The Triton GEMV for decode-sized batches (kernels/triton/gemv.py) against torch's float32
matmul of the same 16-bit inputs, and the linear layers' hook (PAGEDLM_TRITON_GEMV, on unless
0). On a GPU when there is one, else on CPU tensors under Triton's interpreter
(tests/conftest.py), which is slow: the shapes are small (N = 96 is not a multiple of the
wider BLOCK_Ns, so the last program's features are masked)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.kernels.triton import gemv as tg
from pagedlm.model_executor.layers import linear_method
from pagedlm.model_executor.layers.linear import ReplicatedLinear
from tests.kernels.sm90 import sm90_report

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N = 96
# One unit in the last place, relative: the kernel rounds its float32 sum once (half a unit),
# and a sum order other than torch's may land a value near a rounding boundary on the other
# side (one unit).
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def _inputs(m, k, dtype, bias, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = torch.randn(N, k, generator=g).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if bias else None
    return x, w, b


def _check(y, x, w, b):
    """y against the float32 matmul of the same inputs: within one unit in the last place, and
    nearly every output exactly the float32 result rounded to nearest (a kernel that truncated
    instead, as Triton's interpreter does by default, would match about half)."""
    # On the CPU: a GPU's float32 matmul may run in TF32 where a caller allowed it.
    x, w, y = x.cpu(), w.cpu(), y.cpu()
    b = b.cpu() if b is not None else None
    want = x.float() @ w.float().T + (b.float() if b is not None else 0.0)
    assert y.dtype == x.dtype and y.shape == want.shape
    err = (y.float() - want).abs()
    # The float32 sums themselves differ by order: far below the bound, but not zero.
    bound = ULP[x.dtype] * want.abs() + 1e-5 * (x.float().abs() @ w.float().abs().T)
    assert bool((err <= bound).all()), f"max error {err.max().item()}"
    exact = (y == want.to(x.dtype)).float().mean().item()
    assert exact >= 0.9, f"only {exact:.3f} of the outputs rounded to nearest"


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [64, 192])
@pytest.mark.parametrize("m", range(1, 9))
def test_gemv_matches_float32_matmul_bf16(m, k, bias):
    # Every row count of the four row buckets (1, 2, 4, 8; rows past m masked), default config.
    x, w, b = _inputs(m, k, torch.bfloat16, bias)
    _check(tg.gemv(x, w, b), x, w, b)


@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_matches_float32_matmul_fp16(m):
    x, w, b = _inputs(m, 192, torch.float16, True, seed=1)
    _check(tg.gemv(x, w, b), x, w, b)


@pytest.mark.parametrize("config", [
    tg.GemvConfig(block_n=4, block_k=64),
    tg.GemvConfig(block_n=32, block_k=128),  # the last program has 96 - 64 = 32 features
    tg.GemvConfig(block_n=16, block_k=64, split_k=2),
    # K = 192 in steps of 64 over 4 splits: 64 each, the last split entirely past K (zeros).
    tg.GemvConfig(block_n=8, block_k=64, split_k=4),
    tg.GemvConfig(block_n=16, block_k=64, split_k=3, num_warps=2),  # 3 splits of 64
])
@pytest.mark.parametrize("m", [1, 5])
def test_gemv_configs_and_split_k(config, m):
    # What benchmarks/gpu_gemv.py sweeps: every tile shape and split computes the same product.
    x, w, b = _inputs(m, 192, torch.bfloat16, True, seed=2)
    _check(tg.gemv(x, w, b, config), x, w, b)
    _check(tg.gemv(x, w, None, config), x, w, None)


def test_gemv_takes_strided_x():
    # A column slice (rows further apart than K) and a transposed view (K not contiguous).
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 300, generator=g).to(DEVICE, torch.bfloat16)
    _, w, b = _inputs(4, 192, torch.bfloat16, True)
    x = wide[:, 50:242]
    _check(tg.gemv(x, w, b), x, w, b)
    xt = torch.randn(192, 3, generator=g).to(DEVICE, torch.bfloat16).T
    _check(tg.gemv(xt, w, b), xt, w, b)


def test_gemv_empty_batch_and_bad_shapes():
    x, w, b = _inputs(1, 64, torch.bfloat16, True)
    y = tg.gemv(x[:0], w, b)
    assert y.shape == (0, N) and y.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="at most 8 rows"):
        tg.gemv(torch.zeros(9, 64, dtype=torch.bfloat16, device=DEVICE), w)
    with pytest.raises(ValueError, match="weight"):
        tg.gemv(x, w[:, :32])
    with pytest.raises(ValueError, match="rows contiguous"):
        tg.gemv(x, w.T.contiguous().T)
    with pytest.raises(ValueError, match="bias"):
        tg.gemv(x, w, b[:10])


def test_row_buckets():
    # At most 4 variants per weight shape: the buckets CUDA-graph capture runs (1, 2, 4, 8).
    assert [tg.row_bucket(m) for m in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]


def _layer(dtype, bias, k=64, device=DEVICE):
    layer = ReplicatedLinear(k, N, bias=bias)
    x, w, b = _inputs(2, k, dtype, bias, seed=4, device=device)
    layer.weight = nn.Parameter(w, requires_grad=False)
    if bias:
        layer.bias = nn.Parameter(b, requires_grad=False)
    return layer, x


def _spy(monkeypatch):
    calls = []
    real = tg.gemv

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(tg, "gemv", spy)
    return calls


def test_hook_leaves_cpu_tensors_alone(monkeypatch):
    # The hook is for CUDA tensors only: a CPU bfloat16 layer keeps its path with the variable
    # set (without a plain weight's panels here: F.linear).
    monkeypatch.setenv("PAGEDLM_TRITON_GEMV", "1")
    layer, x = _layer(torch.bfloat16, True, device="cpu")
    calls = _spy(monkeypatch)
    y = layer(x)
    assert not calls
    assert torch.equal(y, F.linear(x, layer.weight, layer.bias))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the hook runs on CUDA tensors only")
def test_hook_routes_small_16_bit_batches_unless_turned_off(monkeypatch):
    layer, x = _layer(torch.bfloat16, True)
    calls = _spy(monkeypatch)
    monkeypatch.setenv("PAGEDLM_TRITON_GEMV", "0")
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias)) and not calls
    monkeypatch.delenv("PAGEDLM_TRITON_GEMV")  # the default: on
    assert torch.equal(layer(x), tg.gemv(x, layer.weight, layer.bias))
    assert calls == [x.shape, x.shape]  # the layer's call, then the reference's
    calls.clear()
    big = torch.randn(linear_method.TRITON_GEMV_MAX_ROWS + 1, 64, device=DEVICE).to(torch.bfloat16)
    layer(big)  # more rows than the layers send it: cuBLAS
    layer32, x32 = _layer(torch.float32, False)
    layer32(x32)  # float32: cuBLAS
    assert not calls


# Compiles the kernel for an H100/H200 (sm_90) without one, in a child process (the tests' own
# has Triton in interpreter mode), and reads ptxas's report. Prints one line a variant:
# "<bucket> <N> <K> <config> <bias> <registers> <spill bytes> <16-byte loads> <2-byte loads>".
_SM90_SCRIPT = r"""
import os, re, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedlm.kernels.triton import gemv as tg, gemv_jit as jit

ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
names = jit.gemv_kernel.arg_names
div16 = [["tt.divisibility", 16]]
# What the launch specialises on here: 16-byte aligned pointers, N, K and strides multiples
# of 16, x's K stride 1.
attrs = {(names.index(a),): div16 for a in ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "n", "k",
                                            "stride_xm", "stride_wn", "stride_ym")}
cases = [(bm, n, k, tg.default_config(bm, n, k, torch.device("cpu")))
         for bm in (1, 2, 4, 8) for n, k in ((960, 576), (3072, 576), (576, 1536))]
cases.append((8, 576, 1536, tg.GemvConfig(16, 64, split_k=2)))
for i, (bm, n, k, cfg) in enumerate(cases):
    bias = i % 2 == 1  # half the variants with the bias's epilogue
    partial = cfg.split_k > 1
    sig = {a: "i32" for a in names}
    sig.update({"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16",
                "y_ptr": "*fp32" if partial else "*bf16", "stride_xk": "constexpr"})
    consts = {"stride_xk": 1, "BLOCK_M": bm, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
              "K_STEPS": -(-(-(-k // cfg.split_k)) // cfg.block_k), "HAS_BIAS": bias,
              "PARTIAL": partial}
    sig.update({c: "constexpr" for c in consts})
    kern = triton.compile(ASTSource(jit.gemv_kernel, sig, consts, attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps})
    ptx = kern.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        open(path, "w").write(ptx)
        rep = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", path, "-o", path + ".o"],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", rep).group(1)
    spill = re.search(r"(\d+) bytes spill stores", rep).group(1)
    print(bm, n, k, f"{cfg.block_n}/{cfg.block_k}/{cfg.split_k}/{cfg.num_warps}", int(bias),
          regs, spill, ptx.count("ld.global.v4.b32"), ptx.count("ld.global.b16"))
"""


def test_compiles_for_sm90_without_spills():
    # The GPU code Triton generates, checked where there is no GPU: every row bucket of the
    # default configurations of SmolLM2-135M's shapes (and a split-K pass) compiles for sm_90,
    # keeps its tile in registers (a spill would put the accumulators in local memory: 16 x
    # 128 tiles at 8 rows spilled), and reads x and W with 16-byte loads (scalar 2-byte loads,
    # as when x's alignment was not specialised on, issue 8x the load instructions).
    lines = sm90_report(_SM90_SCRIPT)
    assert len(lines) == 13, lines
    for line in lines:
        *_, bias, regs, spill, wide, narrow = line.split()
        # 2-byte loads only for the bias (an element per output feature), never for x or W.
        assert spill == "0" and int(regs) <= 255 and int(wide) > 0, line
        assert bias == "1" or narrow == "0", line
