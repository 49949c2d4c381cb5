"""The small per-layer float32 ops of a decoder layer, one native call each
(csrc/fused_ops.c): RMSNorm with the residual add, SiLU-and-mul, rotary embedding, the KV-cache
write; the greedy argmax over the logits."""
from __future__ import annotations

import ctypes

import torch

from pagedlm.kernels.kv_types import KV_TYPE_CODES
from pagedlm.kernels.loader import typed_library

_p, _i, _f, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
library = typed_library({
    "rms_norm_f32": ([_p, _p, _p, _i64, _p, _i64, _p, _i, _i, _f], None),
    "silu_and_mul_f32": ([_p, _p, _i64, _i, _i], None),
    "rotary_f32": ([_p, _i64, _i, _p, _i64, _i, _p, _p, _p, _i, _i, _i, _i64], _i),
    "write_kv_f32": ([_p, _p, _i, _p, _i64, _p, _i64, _p, _i, _i], None),
    "argmax_rows_f32": ([_p, _p, _i64, _i, _i], None),
})

# Callers (the layers) decide once whether a tensor qualifies (pagedlm.kernels.available(),
# float32, CPU); these wrappers then only check what is cheap to check, since they run a few
# times per layer per step and a check costs as much as the op at batch 1.
#
# Why C through ctypes rather than torch.compile's CPU code generation (vLLM's CPU route):
# measured here on add + RMSNorm at batch 1 (hidden 576, one thread, load average ~13 from
# other jobs, so absolute figures are inflated), the compiled function cost 920 us a call
# against 457 us eager (its guards and wrapper outweigh the fused loop at this size) after a
# 154 s compile, while the C call cost 503 us against 708 us eager in a later run; rotary
# q+k 239 vs 1994 us, the KV write 74 vs 315 us. A model-wide compile with graph capture might
# do better, but it would not pass through the paged attention call, whose metadata changes
# every step.


def _rows(t: torch.Tensor) -> int:
    """Row stride of a [T, N] tensor whose rows are contiguous (a view into a wider one)."""
    if t.stride(-1) != 1:
        raise ValueError(f"rows must be contiguous, got strides {t.stride()}")
    return t.stride(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """float32 RMSNorm of x [T, H] (rows contiguous); with residual, of x + residual, returned
    with that sum (new tensors; the inputs are not modified)."""
    num_tokens, hidden = x.shape
    # (A shorter weight or a smaller residual was read past its end.)
    if weight.shape != (hidden,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} needs a weight of ({hidden},) and a "
                         f"residual of x's shape, got {tuple(weight.shape)} and "
                         f"{None if residual is None else tuple(residual.shape)}")
    out = torch.empty((num_tokens, hidden), dtype=torch.float32)
    fn = library().rms_norm_f32
    if residual is None:
        fn(out.data_ptr(), None, x.data_ptr(), _rows(x), None, 0, weight.data_ptr(),
           num_tokens, hidden, eps)
        return out
    res_out = torch.empty((num_tokens, hidden), dtype=torch.float32)
    fn(out.data_ptr(), res_out.data_ptr(), x.data_ptr(), _rows(x), residual.data_ptr(),
       _rows(residual), weight.data_ptr(), num_tokens, hidden, eps)
    return out, res_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] float32 (rows contiguous) -> silu(x[:, :I]) * x[:, I:], [T, I]."""
    num_tokens, width = x.shape
    if width % 2:  # (its last column was dropped)
        raise ValueError(f"silu_and_mul: x's width must be even (gate and up), got {width}")
    out = torch.empty((num_tokens, width // 2), dtype=torch.float32)
    library().silu_and_mul_f32(out.data_ptr(), x.data_ptr(), _rows(x), num_tokens,
                               width // 2)
    return out


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> None:
    """Rotate-half rotary embedding, in place, of q [T, Hq, D] and k [T, Hk, D] float32 (each
    token's heads contiguous; rows may be views into a wider tensor) by the [max_pos, half]
    cos/sin tables at positions [T] int64; features from 2 * half on are left alone."""
    num_tokens, num_q_heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim or k.stride(2) != 1 or k.stride(1) != head_dim:
        raise ValueError(f"q/k heads must be contiguous, got strides {q.stride()} / "
                         f"{k.stride()}")
    # (k with fewer tokens, or fewer positions, was read and written past its end.)
    if (k.shape[0] != num_tokens or k.shape[2] != head_dim or positions.shape != (num_tokens,)
            or sin.shape != cos.shape or 2 * cos.shape[1] > head_dim):
        raise ValueError(f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)} and positions "
                         f"{tuple(positions.shape)} must agree, with cos/sin of [max_position, "
                         f"<= D/2], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    bad = library().rotary_f32(q.data_ptr(), q.stride(0), num_q_heads, k.data_ptr(),
                               k.stride(0), k.shape[1], positions.data_ptr(), cos.data_ptr(),
                               sin.data_ptr(), num_tokens, head_dim, cos.shape[1],
                               cos.shape[0])
    if bad:  # checked in C before anything is rotated: a reduction here costs more
        raise ValueError(f"rotary: position {positions[bad - 1].item()} is outside the "
                         f"tables' [0, {cos.shape[0]})")


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hk, D] float32 -> cache slots slot_mapping [T] int64 of
    [num_blocks, block_size, Hk, D] caches of a KERNEL_KV_DTYPES dtype (rounded to nearest even
    on the way down, as torch's casts)."""
    num_tokens = key.shape[0]
    row = k_cache.shape[-2] * k_cache.shape[-1]
    library().write_kv_f32(k_cache.data_ptr(), v_cache.data_ptr(), KV_TYPE_CODES[k_cache.dtype],
                           key.data_ptr(), key.stride(0), value.data_ptr(),
                           value.stride(0), slot_mapping.data_ptr(), num_tokens, row)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) of float32 [T, V] logits (rows contiguous): int64 [T], the
    first index of each row's maximum (of its first NaN if it has one)."""
    num_rows, vocab = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64)
    library().argmax_rows_f32(out.data_ptr(), logits.data_ptr(), _rows(logits), num_rows, vocab)
    return out
