"""The Triton kernels behind fused_gemv.py (imported by it on first use: this module needs
Triton). Module-level `@triton.jit` functions, because Triton's compiler and interpreter read
`tl` from the kernel's module globals.

Both are gemv_jit.gemv_kernel (split_k = 1) with a prologue that forms the GEMV's input from
the layer's previous op inside the K loop, instead of reading it from memory where another
launch wrote it:
- rms_norm_gemv_kernel: the input is rmsnorm(x + residual) (fused_ops_jit.rms_norm_kernel);
- silu_mul_gemv_kernel: the input is silu(gate) * up of the gate_up output
  (fused_ops_jit.silu_and_mul_kernel).
The tile, its layout and the K order are gemv_kernel's, and the prologue rounds where those
kernels round (to the activations' dtype), so on the same configuration the result is the
two launches' bit for bit (tests/kernels/test_triton_fused_gemv.py checks it under the
interpreter). Keep the three in step: a change to one's K loop must be made to all.

The prologue is recomputed by every program for its BLOCK_N features (the tile holds each
batch row once per feature): a few FLOPs an element of x, from L1, against a launch and a
round trip through memory saved.
"""
import triton
import triton.language as tl

from pagedlm.kernels.triton.gemv_jit import gemv_store, gemv_tile


# m is not specialised on (gemv_jit.gemv_kernel: its bucket BLOCK_M is the constexpr).
@triton.jit(do_not_specialize=["m"])
def rms_norm_gemv_kernel(x_ptr, res_ptr, res_out_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, m, n, k, eps,
                         stride_xm, stride_rm, stride_om, stride_wn, stride_ym,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_H: tl.constexpr, K_STEPS: tl.constexpr,
                         HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr):
    # y[m, n] = W @ rmsnorm(h) (+ b) with h = x + residual (HAS_RESIDUAL; else h = x); h is
    # written to res_out by the programs of the first feature block only (each row once).
    # Rows of x, residual and res_out are contiguous (stride 1 along K); BLOCK_H >= k.
    rm, rn, row_mask = gemv_tile(m, n, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)

    # Each row's 1 / rms, as rms_norm_kernel computes it: the whole row (BLOCK_H wide) in one
    # reduction, from h rounded to the activations' dtype.
    cols = tl.arange(0, BLOCK_H)
    rstd = tl.zeros([BLOCK_M * BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(BLOCK_M):
        hmask = (cols < k) & (j < m)
        h = tl.load(x_ptr + j * stride_xm + cols, mask=hmask, other=0.0)
        if HAS_RESIDUAL:
            rr = tl.load(res_ptr + j * stride_rm + cols, mask=hmask, other=0.0)
            h = (h.to(tl.float32) + rr.to(tl.float32)).to(rr.dtype)
            tl.store(res_out_ptr + j * stride_om + cols, h, mask=hmask & (tl.program_id(0) == 0))
        hf = h.to(tl.float32)
        rstd_j = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / k + eps)
        rstd = tl.where(rm == j, rstd_j, rstd)

    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm[:, None] * stride_xm
    r_rows = res_ptr + rm[:, None] * stride_rm
    acc = tl.zeros([BLOCK_M * BLOCK_N, BLOCK_K], dtype=tl.float32)
    for step in tl.static_range(K_STEPS):
        kk = step * BLOCK_K + rk
        kmask = kk < k
        mask = row_mask[:, None] & kmask[None, :]
        xt = tl.load(x_rows + kk[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            rt = tl.load(r_rows + kk[None, :], mask=mask, other=0.0)
            xt = (xt.to(tl.float32) + rt.to(tl.float32)).to(rt.dtype)
        # rms_norm_kernel's roundings: the normalised row, then the product with the weight.
        nw = tl.load(nw_ptr + kk, mask=kmask, other=0.0)
        at = (xt.to(tl.float32) * rstd[:, None]).to(xt.dtype).to(tl.float32)
        at = (at * nw.to(tl.float32)[None, :]).to(x_ptr.dtype.element_ty)
        wt = tl.load(w_rows + kk[None, :], mask=mask, other=0.0)
        acc += at.to(tl.float32) * wt.to(tl.float32)
    gemv_store(tl.sum(acc, axis=1), b_ptr, y_ptr, rm, rn, row_mask, stride_ym, HAS_BIAS)


@triton.jit(do_not_specialize=["m"])
def silu_mul_gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, m, n, k, stride_xm, stride_wn, stride_ym,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         K_STEPS: tl.constexpr, HAS_BIAS: tl.constexpr):
    # y[m, n] = W @ (silu(x[:, :k]) * x[:, k:2k]) (+ b); x's rows contiguous.
    rm, rn, row_mask = gemv_tile(m, n, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M * BLOCK_N, BLOCK_K], dtype=tl.float32)
    for step in tl.static_range(K_STEPS):
        kk = step * BLOCK_K + rk
        mask = row_mask[:, None] & (kk < k)[None, :]
        g = tl.load(x_rows + kk[None, :], mask=mask, other=0.0)
        u = tl.load(x_rows + k + kk[None, :], mask=mask, other=0.0)
        # silu_and_mul_kernel's roundings: silu(gate), then its product with up.
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        at = (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
        wt = tl.load(w_rows + kk[None, :], mask=mask, other=0.0)
        acc += at.to(tl.float32) * wt.to(tl.float32)
    gemv_store(tl.sum(acc, axis=1), b_ptr, y_ptr, rm, rn, row_mask, stride_ym, HAS_BIAS)
