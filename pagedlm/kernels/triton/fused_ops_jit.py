"""The Triton kernels behind fused_ops.py (imported by it on first use: this module needs
Triton). Module-level `@triton.jit` functions, because Triton's interpreter and compiler read
`tl` from the kernel's module globals."""
import triton
import triton.language as tl



@triton.jit
def rms_norm_kernel(x_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, x_stride, res_stride,
                    out_stride, n, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # residual = x + residual, rounded to the activations' dtype as PyTorch's add is;
        # the norm then reads the rounded sum.
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(res_out_ptr + row * out_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # The layer rounds the normalised row to the activations' dtype before the weight.
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

# positions is a view into the step's index buffer at an offset that changes with the batch:
# not specialised on its alignment (see attention_jit.py).
@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])
def rotary_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, q_stride_t, q_stride_h,
                  k_stride_t, k_stride_h, num_q_heads, num_k_heads,
                  HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # One program per (token, head) over q's heads then k's; rotates the first 2 * HALF
    # features in place (neox layout: pairs (i, i + HALF)); the rest pass through.
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    i = tl.arange(0, BLOCK_HALF)
    mask = i < HALF
    cos = tl.load(cos_ptr + pos * HALF + i, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + pos * HALF + i, mask=mask, other=0.0)
    if h < num_q_heads:
        base = q_ptr + t * q_stride_t + h * q_stride_h
    else:
        base = k_ptr + t * k_stride_t + (h - num_q_heads) * k_stride_h
    x1 = tl.load(base + i, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + i, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(base + i, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(base + HALF + i, (b * cos + a * sin).to(x1.dtype), mask=mask)

@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * x_stride + n + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    # silu rounds to the dtype before the multiply, as F.silu(gate) * up does.
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * out_stride + cols,
             (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)
