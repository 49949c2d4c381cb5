"""The GPU path's small Triton ops against the PyTorch forms of their layers: on a GPU when
there is one, else on CPU tensors under Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from pagedlm.kernels.triton import fused_ops
from pagedlm.model_executor.layers.activation import SiluAndMul
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.rotary_embedding import _rotate, _rotate_partial

# Triton is part of the gpu extra, which setup.sh installs: missing, this fails (no skip).
# Without a GPU, tests/conftest.py has put Triton in interpreter mode.

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bfloat16 results may differ from PyTorch's by one rounding of the last bit.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _torch_norm(norm: RMSNorm, x, residual=None):
    norm.native = False  # the PyTorch form
    return norm(x, residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96])  # 96: the block is wider than the row
def test_rms_norm_matches_the_layer(dtype, hidden):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden, generator=g)
    norm = norm.to(DEVICE, dtype)
    x = torch.randn(5, hidden, generator=g).to(DEVICE, dtype)
    res = torch.randn(5, hidden, generator=g).to(DEVICE, dtype)
    torch.testing.assert_close(fused_ops.rms_norm(x, norm.weight, 1e-5),
                               _torch_norm(norm, x), **TOL[dtype])
    want_out, want_res = _torch_norm(norm, x, res.clone())
    mine = res.clone()
    out, new_res = fused_ops.rms_norm(x, norm.weight, 1e-5, mine)
    assert torch.equal(mine, res)  # the inputs are left alone, as the PyTorch form does
    torch.testing.assert_close(new_res, want_res, **TOL[dtype])
    torch.testing.assert_close(out, want_out, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [16, 8])  # 8: partial rotary, the rest untouched
def test_rotary_in_place_matches_the_layer(dtype, rotary_dim):
    g = torch.Generator().manual_seed(1)
    t, hq, hk, d = 4, 4, 2, 16
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(DEVICE, dtype)
    q = qkv[:, :hq * d].view(t, hq, d)  # strided views of one projection, as models pass them
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    positions = torch.tensor([0, 3, 7, 30], device=DEVICE)
    freqs = torch.outer(torch.arange(32.0), torch.rand(rotary_dim // 2, generator=g))
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    rot = _rotate if rotary_dim == d else _rotate_partial
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    want_q, want_k = rot(q.clone(), c, s), rot(k.clone(), c, s)
    v_before = qkv[:, (hq + hk) * d:].clone()
    fused_ops.rotary_(positions, q, k, cos, sin)
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])
    assert torch.equal(qkv[:, (hq + hk) * d:], v_before)  # v is not touched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_the_layer(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2 * 40, generator=g).to(DEVICE, dtype)
    layer = SiluAndMul()
    layer.native = False
    torch.testing.assert_close(fused_ops.silu_and_mul(x), layer(x), **TOL[dtype])


def test_empty_batches_launch_nothing():
    x = torch.empty(0, 8, device=DEVICE)
    assert fused_ops.rms_norm(x, torch.ones(8, device=DEVICE), 1e-6).shape == (0, 8)
    assert fused_ops.silu_and_mul(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)
