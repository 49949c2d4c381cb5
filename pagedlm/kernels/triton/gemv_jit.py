"""The Triton kernels behind gemv.py (imported by it on first use: this module needs Triton).
Module-level `@triton.jit` functions, because Triton's compiler and interpreter read `tl` from
the kernel's module globals.

y[M, N] = x[M, K] @ W[N, K]^T (+ b) for M <= 8: each program owns BLOCK_N output features for
every row. Its tile is 2-D, [BLOCK_M * BLOCK_N, BLOCK_K]: tile row r is output (r // BLOCK_N,
r % BLOCK_N), and holds W's row for that feature and x's row for that batch row, so one
blocked layout serves both loads and the product (no layout conversion inside the loop; a 3-D
[BLOCK_M, BLOCK_N, BLOCK_K] product needed one, through shared memory, for each load of each
step, in the sm_90 code Triton 3.6 generates). The feature's W row is thus loaded BLOCK_M times
and x's row BLOCK_N times, all but the first from L1: memory reads each byte once. Products
accumulate elementwise in float32 and are summed over K once, after the loop.

No tl.dot: it would pad the rows to 16 and need BLOCK_N >= 16, which leaves too few programs
for N = 576; and Triton's interpreter multiplies 16-bit dot operands as their raw bits (see
attention.py's _dot_fp32).

The loop over K is unrolled (tl.static_range over K_STEPS, a constexpr): every step's loads can
be in flight at once (a GEMV this small is bound by memory latency, not bandwidth), and
TRITON_INTERPRET (the CPU tests) takes it, where range() over an int argument fails (the
interpreter holds int arguments as one-element arrays, which NumPy >= 2.4 refuses to convert;
see attention_jit.py). K_STEPS follows from the weight's shape, so it adds no variant per call.
"""
import triton
import triton.language as tl


@triton.jit
def gemv_tile(m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program pid_n's tile rows: (batch row rm, feature rn, valid) of each of its
    BLOCK_M * BLOCK_N outputs (see the module docstring's layout). Shared with
    fused_gemv_jit's kernels, whose tiles must be this one."""
    r = tl.arange(0, BLOCK_M * BLOCK_N)
    rm = r // BLOCK_N
    rn = tl.program_id(0) * BLOCK_N + r % BLOCK_N
    return rm, rn, (rm < m) & (rn < n)


@triton.jit
def gemv_store(out, b_ptr, y_ptr, rm, rn, row_mask, stride_ym, HAS_BIAS: tl.constexpr):
    """y[rm, rn] = the tile's float32 sums (+ b), rounded once to y's dtype."""
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rm * stride_ym + rn, out.to(y_ptr.dtype.element_ty), mask=row_mask)


# m, the batch's row count, is not specialised on: its bucket BLOCK_M is the constexpr that
# shapes the tiles, and a bucket sees only counts above the next smaller one (bucket 1 only
# m = 1), so no row count compiles a variant that warm-up (CUDA-graph capture at 1, 2, 4 and 8
# rows) did not. Pointers keep Triton's 16-byte alignment specialisation, which gives 16-byte
# vector loads (without it, x's loads were 2-byte ones): the layers' inputs are whole tensors
# from the caching allocator, so their alignment does not change from step to step.
@triton.jit(do_not_specialize=["m"])
def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, m, n, k,
                stride_xm, stride_xk, stride_wn, stride_ym, stride_ys,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                K_STEPS: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    # Program (pid_n, pid_s): features [pid_n * BLOCK_N, +BLOCK_N) over the K range
    # [pid_s * K_STEPS * BLOCK_K, +K_STEPS * BLOCK_K) (its tail past k masked). PARTIAL
    # (split-K): the float32 sums go to y[pid_s, m, n] (stride_ys apart) for
    # splitk_reduce_kernel; otherwise y = sum + b, rounded once to y's dtype.
    pid_s = tl.program_id(1)
    rm, rn, row_mask = gemv_tile(m, n, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # int64 row offsets: N * K may pass 2^31 for a large matrix.
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm[:, None] * stride_xm
    k_base = pid_s * (K_STEPS * BLOCK_K)
    acc = tl.zeros([BLOCK_M * BLOCK_N, BLOCK_K], dtype=tl.float32)
    for step in tl.static_range(K_STEPS):
        kk = k_base + step * BLOCK_K + rk
        mask = row_mask[:, None] & (kk < k)[None, :]
        xt = tl.load(x_rows + kk[None, :] * stride_xk, mask=mask, other=0.0)
        wt = tl.load(w_rows + kk[None, :], mask=mask, other=0.0)
        acc += xt.to(tl.float32) * wt.to(tl.float32)
    out = tl.sum(acc, axis=1)
    if PARTIAL:
        tl.store(y_ptr + pid_s * stride_ys + rm * stride_ym + rn, out, mask=row_mask)
    else:
        gemv_store(out, b_ptr, y_ptr, rm, rn, row_mask, stride_ym, HAS_BIAS)


@triton.jit(do_not_specialize=["m"])
def splitk_reduce_kernel(p_ptr, b_ptr, y_ptr, m, n, stride_ps, stride_pm, stride_ym,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                         HAS_BIAS: tl.constexpr):
    # The split-K sums p[SPLIT_K, m, n] (float32) added in split order (the same order on
    # every call), plus b, rounded once to y's dtype.
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < m)[:, None] & (rn < n)[None, :]
    off = rm[:, None] * stride_pm + rn[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(p_ptr + s * stride_ps + off, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask)
