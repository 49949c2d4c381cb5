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
    err = (got.float() - want.float()).abs()
    assert bool((err <= ULP[got.dtype] * want.float().abs() + 1e-3).all()), err.max()
    assert (got == want).float().mean().item() >= 0.98


CONFIGS = [None,  # default_config's pick
           tg.GemvConfig(block_n=4, block_k=64, num_warps=1),
           tg.GemvConfig(block_n=16, block_k=32, num_warps=4)]


def _cases(rows):
    """bfloat16 at every configuration, float32 at the default one: each case is a compile on
    a GPU (gpu_check.sh's test_triton stage has 90 s for all the Triton tests)."""
    return ([(m, torch.bfloat16, c) for m in rows for c in CONFIGS]
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
