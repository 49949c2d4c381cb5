"""The fused GEMVs (kernels/triton/fused_gemv.py) against the two launches they replace:
fused_ops.rms_norm then gemv.gemv, and fused_ops.silu_and_mul then gemv.gemv, at the same GEMV
configuration. Under Triton's interpreter (CPU tensors: tests/conftest.py) the results are the
same bits: the same roundings, the same float32 sums in the same K order. On a GPU, where the
norm's sum of squares may be reduced in another order (another layout), within one unit of the
last place of the output and nearly all exact.

Shapes are small (the interpreter is slow) and ragged: N = 90 is a multiple of none of the
BLOCK_Ns past 2, K = 80 / 2I = 2 x 72 end inside a BLOCK_K of 64 (the tail masked) and inside
the norm's BLOCK_H of 128."""
from __future__ import annotations

import pytest
import torch

from pagedlm.kernels.triton import fused_gemv, fused_ops
from pagedlm.kernels.triton import gemv as tg
from tests.kernels.sm90 import sm90_report

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N = 90
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -22}


def _rand(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if DEVICE == "cpu":  # the interpreter: the two-launch path's bits
        assert torch.equal(got, want), f"max diff {(got.float() - want.float()).abs().max()}"
        return
    if got.dtype == torch.float32:  # no rounding absorbs 1/rms's last bit: every value moves
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    err = (got.float() - want.float()).abs()
    assert bool((err <= ULP[got.dtype] * want.float().abs() + 1e-3).all()), err.max()
    assert (got == want).float().mean().item() >= 0.98


CONFIGS = [None,  # default_config's pick
           tg.GemvConfig(block_n=4, block_k=64, num_warps=1),
           tg.GemvConfig(block_n=16, block_k=32, num_warps=4)]


def _cases(rows):
    """bfloat16 at every configuration, float32 at the default one. On a GPU each case is a
    compile (gpu_check.sh's test_triton stage has 90 s for all the Triton tests): there only
    the default configuration, which the layers run."""
    configs = CONFIGS if DEVICE == "cpu" else [None]
    return ([(m, torch.bfloat16, c) for m in rows for c in configs]
            + [(m, torch.float32, None) for m in rows])


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("m,dtype,config", _cases([1, 2, 3, 8]))
def test_rms_norm_gemv_is_norm_then_gemv(m, dtype, residual, config):
    gen = torch.Generator().manual_seed(m)
    k = 80
    x, res = _rand(gen, m, k, dtype=dtype), _rand(gen, m, k, dtype=dtype)
    norm_w, w = _rand(gen, k, dtype=dtype), _rand(gen, N, k, dtype=dtype)
    bias = _rand(gen, N, dtype=dtype) if config is None else None
    x_before, res_before = x.clone(), res.clone()
    got, got_res = fused_gemv.rms_norm_gemv(x, res if residual else None, norm_w, 1e-5, w,
                                            bias, config)
    if residual:
        normed, want_res = fused_ops.rms_norm(x, norm_w, 1e-5, res)
        assert torch.equal(got_res, want_res)  # each row written once, by the first block
    else:
        normed, want_res = fused_ops.rms_norm(x, norm_w, 1e-5), x
        assert got_res is x  # the first layer's form: x is the residual
    _same(got, tg.gemv(normed, w, bias, config))
    assert torch.equal(x, x_before) and torch.equal(res, res_before)  # inputs left alone


@pytest.mark.parametrize("m,dtype,config", _cases([1, 2, 5, 8]))
def test_silu_mul_gemv_is_act_then_gemv(m, dtype, config):
    gen = torch.Generator().manual_seed(10 + m)
    inter = 72
    x = _rand(gen, m, 2 * inter, dtype=dtype) * 3  # past silu's near-linear range
    w = _rand(gen, N, inter, dtype=dtype)
    bias = _rand(gen, N, dtype=dtype) if config is None else None
    got = fused_gemv.silu_mul_gemv(x, w, bias, config)
    _same(got, tg.gemv(fused_ops.silu_and_mul(x), w, bias, config))


@pytest.mark.parametrize("m", [1, 2])
def test_the_model_shapes_tuned_configs(m):
    # SmolLM2-135M's K: hidden 576 (QKV and gate_up: BLOCK_H 1024) and intermediate 1536
    # (down), at the configurations TUNED gives its shapes (here N is cut to 48: the
    # interpreter is slow); one and two rows, as the layers send (TRITON_GEMV_MAX_ROWS).
    gen = torch.Generator().manual_seed(7)
    x, res = _rand(gen, m, 576, dtype=torch.bfloat16), _rand(gen, m, 576, dtype=torch.bfloat16)
    norm_w, w = _rand(gen, 576, dtype=torch.bfloat16), _rand(gen, 48, 576, dtype=torch.bfloat16)
    for cfg in (tg.TUNED[(m, 960, 576)], tg.TUNED[(m, 3072, 576)]):
        got, got_res = fused_gemv.rms_norm_gemv(x, res, norm_w, 1e-5, w, config=cfg)
        normed, want_res = fused_ops.rms_norm(x, norm_w, 1e-5, res)
        assert torch.equal(got_res, want_res)
        _same(got, tg.gemv(normed, w, config=cfg))
    gu = _rand(gen, m, 2 * 1536, dtype=torch.bfloat16)
    wd = _rand(gen, 48, 1536, dtype=torch.bfloat16)
    cfg = tg.TUNED[(m, 576, 1536)]
    _same(fused_gemv.silu_mul_gemv(gu, wd, config=cfg),
          tg.gemv(fused_ops.silu_and_mul(gu), wd, config=cfg))


def test_bad_inputs_are_refused():
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(N, 64, dtype=torch.bfloat16, device=DEVICE)
    nw = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="at most 8 rows"):
        fused_gemv.rms_norm_gemv(torch.zeros(9, 64, dtype=torch.bfloat16, device=DEVICE),
                                 None, nw, 1e-5, w)
    with pytest.raises(ValueError, match="norm weight"):
        fused_gemv.rms_norm_gemv(x, None, nw[:32], 1e-5, w)
    with pytest.raises(ValueError, match="residual"):
        fused_gemv.rms_norm_gemv(x, x[:1], nw, 1e-5, w)
    with pytest.raises(ValueError, match="split K"):
        fused_gemv.rms_norm_gemv(x, None, nw, 1e-5, w, config=tg.GemvConfig(8, 64, 2))
    with pytest.raises(ValueError, match="2I"):
        fused_gemv.silu_mul_gemv(x[:, :63], w)
    with pytest.raises(ValueError, match="inputs"):
        fused_gemv.silu_mul_gemv(x, w)  # I = 32, the weight takes 64
    with pytest.raises(ValueError, match="contiguous"):
        fused_gemv.silu_mul_gemv(torch.zeros(64, 2, dtype=torch.bfloat16, device=DEVICE).T,
                                 w[:, :32])


# Compiles the fused kernels for an H100/H200 (sm_90) without one, in a child process (the
# tests' own has Triton in interpreter mode), and reads ptxas's report, as test_triton_gemv.py
# does for the plain GEMV. One line a variant: "<kernel> <bucket> <N> <K> <residual>
# <registers> <spill bytes> <16-byte loads> <2-byte loads>".
_SM90_SCRIPT = r"""
import os, re, subprocess, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedlm.kernels.triton import fused_gemv, gemv as tg, fused_gemv_jit as jit

ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def report(fn, ptrs, divisible, consts, num_warps):
    names = fn.arg_names
    sig = {a: "i32" for a in names}
    sig.update({p: "*bf16" for p in ptrs})
    sig.update({"eps": "fp32"} if "eps" in names else {})
    sig.update({c: "constexpr" for c in consts})
    # What a launch specialises on: 16-byte aligned pointers, N, K and strides multiples of 16.
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ptrs + divisible}
    kern = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})
    ptx = kern.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        open(path, "w").write(ptx)
        rep = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", path, "-o", path + ".o"],
                             capture_output=True, text=True, check=True).stderr
    return (re.search(r"Used (\d+) registers", rep).group(1),
            re.search(r"(\d+) bytes spill stores", rep).group(1),
            ptx.count("ld.global.v4.b32"), ptx.count("ld.global.b16"))


cpu = torch.device("cpu")
for bm in (1, 2):  # the rows the layers send (linear_method.TRITON_GEMV_MAX_ROWS)
    for n, res in ((960, False), (960, True), (3072, True)):  # QKV, gate_up; K = 576
        cfg = tg.default_config(bm, n, 576, cpu)
        consts = {"BLOCK_M": bm, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                  "BLOCK_H": 1024, "K_STEPS": -(-576 // cfg.block_k), "HAS_RESIDUAL": res,
                  "HAS_BIAS": False}
        out = report(jit.rms_norm_gemv_kernel, ["x_ptr", "res_ptr", "res_out_ptr", "nw_ptr",
                                                "w_ptr", "b_ptr", "y_ptr"],
                     ["n", "k", "stride_xm", "stride_rm", "stride_om", "stride_wn",
                      "stride_ym"], consts, cfg.num_warps)
        print("norm", bm, n, 576, int(res), *out)
for bm in (1, 2, 8):  # down; 8: SILU_CONFIGS' entry
    cfg = fused_gemv.SILU_CONFIGS.get((bm, 576, 1536)) or tg.default_config(bm, 576, 1536, cpu)
    consts = {"BLOCK_M": bm, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
              "K_STEPS": -(-1536 // cfg.block_k), "HAS_BIAS": False}
    out = report(jit.silu_mul_gemv_kernel, ["x_ptr", "w_ptr", "b_ptr", "y_ptr"],
                 ["n", "k", "stride_xm", "stride_wn", "stride_ym"], consts, cfg.num_warps)
    print("silu", bm, 576, 1536, 0, *out)
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the tests above compile them for real")
def test_compiles_for_sm90_without_spills():
    # The GPU code Triton generates, checked where there is no GPU: SmolLM2-135M's fused
    # shapes at the configurations the layers' rows get compile for sm_90, keep their tiles in
    # registers (TUNED's 8-row pick for the down GEMV spilled with the SiLU prologue:
    # SILU_CONFIGS), and read x and W with 16-byte loads.
    lines = sm90_report(_SM90_SCRIPT)
    assert len(lines) == 9, lines
    for line in lines:
        *_, regs, spill, wide, narrow = line.split()
        assert spill == "0" and int(regs) <= 255 and int(wide) > 0 and narrow == "0", line
