"""The Triton kernels behind attention.py (imported by it on first use: this module needs Triton):
the KV-cache write, paged decode attention, and prefill over chunks with cached context.
Module-level `@triton.jit` functions, because Triton's compiler and interpreter read `tl` from
the kernel's module globals.

Caches are [num_blocks, block_size, num_kv_heads, head_dim]; a token at position p of a sequence
lives in block block_table[p // block_size], row p % block_size. Scores, the softmax and the
output accumulate in float32 whatever the cache holds (online softmax, one pass over the keys).

DOT_FP32: the products run in float32 (input_precision="ieee": Triton would otherwise use TF32
on the GPU, and float32 parity is tested with TF32 off). Otherwise the query and the cache share
a 16-bit dtype, and the tensor cores multiply them exactly into float32 accumulators; the
probabilities are then rounded to that dtype for the product with V, as flash attention does.

Loops over keys are `while` loops, not `for ... in range(...)`: under TRITON_INTERPRET (the CPU
tests), range() needs its bounds as Python ints, and Triton 3.6's interpreter holds a loaded
scalar as a one-element array, which NumPy >= 2.4 refuses to convert. The cost on the GPU is
Triton's software pipelining (it applies to `for` loops only); the many programs per SM of a
batch hide load latency instead.
"""
import triton
import triton.language as tl


# The step's index arrays (slots, lengths, block tables, chunk starts) are views into one buffer
# at offsets that change with the batch: not specialised on 16-byte alignment, or each change of
# parity compiles another variant in the middle of serving (the likely cause of an 865 ms stall
# between two tokens in an H200 serving run).
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                    k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                    c_stride_b, c_stride_s, c_stride_h,
                    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per token: its K and V rows (all KV heads) into the slot the mapping names,
    # cast to the cache's dtype. A negative slot (PAD_SLOT_ID: a CUDA-graph padding row) is
    # skipped.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    dst = ((slot // BLOCK_SIZE) * c_stride_b + (slot % BLOCK_SIZE) * c_stride_s
           + h[:, None] * c_stride_h + d[None, :])
    k = tl.load(key_ptr + t * k_stride_t + h[:, None] * k_stride_h + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * v_stride_t + h[:, None] * v_stride_h + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _soft_cap(s, cap):
    # cap * tanh(s / cap), with tanh from exp (1 - 2 / (e^2x + 1)): it saturates to +-1 for
    # large |x| instead of overflowing, and Triton's language has no portable tanh.
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * (s / cap)) + 1.0))


@triton.jit
def _scores(q, k, scale, soft_cap, HAS_SOFT_CAP: tl.constexpr, DOT_FP32: tl.constexpr):
    # q [M, D] . k [N, D]^T -> [M, N] float32, scaled (and soft-capped).
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    if HAS_SOFT_CAP:
        s = _soft_cap(s, soft_cap)
    return s


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, DOT_FP32: tl.constexpr):
    # One tile of keys into the running (max, denominator, numerator) of each query row. s is
    # -inf where a key is masked; a row with every key masked so far keeps max -inf, and the
    # shifts below use 0 for it so that no -inf - -inf (NaN) appears.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _load_group_q(q_ptr, row, kvh, q_stride_t, q_stride_h, GROUP: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                  DOT_FP32: tl.constexpr):
    # The GROUP query heads of KV head kvh in a decode row, as a [BLOCK_H, BLOCK_D] tile (rows
    # padded to BLOCK_H >= 16, the tensor cores' smallest tile, with zeros).
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    q_mask = (h[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + row * q_stride_t + (kvh * GROUP + h[:, None]) * q_stride_h + d[None, :],
                mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    return q


@triton.jit
def _attend_cached_keys(q, k_cache_ptr, v_cache_ptr, table, kvh, start, end, scale, soft_cap,
                        c_stride_b, c_stride_s, c_stride_h, HEAD_DIM: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                        HAS_SOFT_CAP: tl.constexpr, DOT_FP32: tl.constexpr):
    # The online softmax of q's rows over the cached keys [start, end) of one KV head, read
    # through the sequence's block table in tiles of BLOCK_N: (max, denominator, unnormalised
    # numerator), all float32. Empty range: (-inf, 0, 0).
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    n0 = (start // BLOCK_N) * BLOCK_N
    while n0 < end:  # not `for`: see the module's note on loops
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = (pos < end) & (pos >= start)
        blk = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        off = blk * c_stride_b + (pos % BLOCK_SIZE) * c_stride_s + kvh * c_stride_h
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = _scores(q, k, scale, soft_cap, HAS_SOFT_CAP, DOT_FP32)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_FP32)
        n0 += BLOCK_N
    return m_i, l_i, acc


# The block tables' width changes from step to step when run eagerly: not specialised on (a value
# of 1 or a multiple of 16 would otherwise compile another variant mid-run).
@triton.jit(do_not_specialize=["bt_stride"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
                        scale, soft_cap, window,
                        q_stride_t, q_stride_h, o_stride_t, o_stride_h,
                        c_stride_b, c_stride_s, c_stride_h, bt_stride,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                        HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
                        DOT_FP32: tl.constexpr):
    # One program per (decode row, KV head): the GROUP query heads sharing that KV head attend
    # together, so each K/V tile is read once for all of them (rows padded to BLOCK_H >= 16,
    # the tensor cores' smallest tile). The row attends to keys [max(0, L - window), L), L its
    # sequence length read here: the grid depends on shapes only, so the launch can be captured
    # in a CUDA graph whatever the lengths are. L = 0 (a padding row) writes zeros.
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + row)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    q_mask = (h[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = _load_group_q(q_ptr, row, kvh, q_stride_t, q_stride_h, GROUP, HEAD_DIM, BLOCK_H,
                      BLOCK_D, DOT_FP32)
    lo = tl.full([], 0, tl.int32)
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    table = block_tables_ptr + row.to(tl.int64) * bt_stride
    m_i, l_i, acc = _attend_cached_keys(q, k_cache_ptr, v_cache_ptr, table, kvh, lo, seq_len,
                                        scale, soft_cap, c_stride_b, c_stride_s, c_stride_h,
                                        HEAD_DIM, BLOCK_SIZE, BLOCK_H, BLOCK_D, BLOCK_N,
                                        HAS_SOFT_CAP, DOT_FP32)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = row * o_stride_t + (kvh * GROUP + h[:, None]) * o_stride_h + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)


# Split-KV ("flash-decoding") decode: paged_decode_kernel's work for one (row, KV head) cut along
# the keys into num_splits programs, for batches whose (rows x KV heads) grid would leave most
# SMs idle (attention.py decides). Two kernels: each split writes its partial softmax state, and
# paged_decode_combine_kernel merges a row's splits per query head. split_len, num_splits and
# the scratch's strides (which scale with num_splits) change with the block tables' width in
# eager steps: not specialised on, like bt_stride.
@triton.jit(do_not_specialize=["bt_stride", "split_len", "pa_stride_t", "pa_stride_h",
                               "pm_stride_t", "pm_stride_h"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def paged_decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                              part_acc_ptr, part_ml_ptr, scale, soft_cap, window, split_len,
                              q_stride_t, q_stride_h, c_stride_b, c_stride_s, c_stride_h,
                              bt_stride, pa_stride_t, pa_stride_h, pa_stride_s,
                              pm_stride_t, pm_stride_h, pm_stride_s,
                              GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                              BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                              HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
                              DOT_FP32: tl.constexpr):
    # One program per (decode row, KV head, split): the keys [split * split_len, (split + 1) *
    # split_len) that the row sees ([lo, L) as in paged_decode_kernel; split_len is a multiple
    # of BLOCK_N, so only lo starts a split off a tile's edge). It writes, for each of its GROUP
    # query heads, the running max m, the denominator l and the unnormalised numerator acc (all
    # float32) at index `split` of the scratch. A split with no key writes nothing: the combine
    # derives from L and the window which splits hold keys and reads only those, so the scratch
    # needs no initialising and padding rows (L = 0) read none.
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    lo = tl.full([], 0, tl.int32)
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    start = tl.maximum(split * split_len, lo)
    end = tl.minimum(split * split_len + split_len, seq_len)
    if start >= end:
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    q_mask = (h[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    heads = kvh * GROUP + h
    q = _load_group_q(q_ptr, row, kvh, q_stride_t, q_stride_h, GROUP, HEAD_DIM, BLOCK_H,
                      BLOCK_D, DOT_FP32)
    table = block_tables_ptr + row.to(tl.int64) * bt_stride
    m_i, l_i, acc = _attend_cached_keys(q, k_cache_ptr, v_cache_ptr, table, kvh, start, end,
                                        scale, soft_cap, c_stride_b, c_stride_s, c_stride_h,
                                        HEAD_DIM, BLOCK_SIZE, BLOCK_H, BLOCK_D, BLOCK_N,
                                        HAS_SOFT_CAP, DOT_FP32)
    pa = row * pa_stride_t + heads[:, None] * pa_stride_h + split * pa_stride_s + d[None, :]
    tl.store(part_acc_ptr + pa, acc, mask=q_mask)
    pm = part_ml_ptr + row * pm_stride_t + heads * pm_stride_h + split * pm_stride_s
    tl.store(pm, m_i, mask=h < GROUP)
    tl.store(pm + 1, l_i, mask=h < GROUP)


@triton.jit(do_not_specialize=["split_len", "num_splits", "pa_stride_t", "pa_stride_h",
                               "pm_stride_t", "pm_stride_h"],
            do_not_specialize_on_alignment=["seq_lens_ptr"])
def paged_decode_combine_kernel(part_acc_ptr, part_ml_ptr, seq_lens_ptr, out_ptr, window,
                                split_len, num_splits, o_stride_t, o_stride_h,
                                pa_stride_t, pa_stride_h, pa_stride_s,
                                pm_stride_t, pm_stride_h, pm_stride_s,
                                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                                BLOCK_S: tl.constexpr, HAS_WINDOW: tl.constexpr):
    # One program per (decode row, query head): merges the splits that hold keys of the row,
    # [lo // split_len, cdiv(L, split_len)) -- exactly those paged_decode_split_kernel wrote --
    # BLOCK_S at a time, rescaling each to the common max: out = sum_s e^(m_s - M) acc_s /
    # sum_s e^(m_s - M) l_s. A row with no keys (L = 0) merges nothing and writes zeros.
    row = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + row)
    lo = tl.full([], 0, tl.int32)
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    s_lo = lo // split_len
    # min(): the grid's splits cover the table's width, which covers L; lo < L: a window of
    # 0 keys (or L = 0) leaves split s_lo unwritten, so none is read.
    s_hi = tl.minimum(tl.cdiv(seq_len, split_len), num_splits)
    s_hi = tl.where(lo < seq_len, s_hi, s_lo)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    m_all = tl.full([], float("-inf"), tl.float32)
    l_all = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    s0 = s_lo
    while s0 < s_hi:  # not `for`: see the module's note on loops
        s = s0 + tl.arange(0, BLOCK_S)
        s_mask = s < s_hi
        pm = part_ml_ptr + row * pm_stride_t + head * pm_stride_h + s * pm_stride_s
        m = tl.load(pm, mask=s_mask, other=float("-inf"))
        lsum = tl.load(pm + 1, mask=s_mask, other=0.0)
        pa = row * pa_stride_t + head * pa_stride_h + s[:, None] * pa_stride_s + d[None, :]
        a = tl.load(part_acc_ptr + pa, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        # Every chunk holds a written split (finite m), so m_new is finite; the guard keeps
        # -inf - -inf (NaN) out all the same, as _online_softmax_step does.
        m_new = tl.maximum(m_all, tl.max(m, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp(m - m_safe)
        alpha = tl.exp(m_all - m_safe)
        l_all = l_all * alpha + tl.sum(w * lsum, 0)
        acc = acc * alpha + tl.sum(w[:, None] * a, 0)
        m_all = m_new
        s0 += BLOCK_S
    out = acc / tl.where(l_all == 0.0, 1.0, l_all)
    tl.store(out_ptr + row * o_stride_t + head * o_stride_h + d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit(do_not_specialize=["bt_stride"],
            do_not_specialize_on_alignment=["query_start_loc_ptr", "context_lens_ptr",
                                            "block_tables_ptr"])
def prefill_attention_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
                             query_start_loc_ptr, context_lens_ptr, block_tables_ptr,
                             scale, soft_cap, window,
                             q_stride_t, q_stride_h, k_stride_t, k_stride_h,
                             v_stride_t, v_stride_h, o_stride_t, o_stride_h,
                             c_stride_b, c_stride_s, c_stride_h, bt_stride,
                             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                             HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
                             DOT_FP32: tl.constexpr):
    # One program per (chunk, query head, tile of BLOCK_M query rows). Chunk c holds rows
    # [start[c], start[c + 1]) of the flat batch, at positions ctx .. ctx + n - 1 of its
    # sequence. Its keys: the ctx cached ones (read through its block table; all earlier than
    # every query row, so only the window masks them), then the chunk's own K/V, causal, read
    # from the step's key/value rounded to the cache's dtype as the cache holds them (a prompt
    # attends to the same K/V whether it is computed fresh or read back from the cache).
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    row0 = tl.load(query_start_loc_ptr + chunk)
    n = tl.load(query_start_loc_ptr + chunk + 1) - row0
    if m_start >= n:  # the grid covers the longest chunk
        return
    ctx = tl.load(context_lens_ptr + chunk)
    kvh = head // GROUP
    m = m_start + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    m_mask = m < n
    rows = (row0 + m).to(tl.int64)
    q_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + rows[:, None] * q_stride_t + head * q_stride_h + d[None, :],
                mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # The cached context, from the first key the tile's first row sees.
    lo = tl.full([], 0, tl.int32)
    if HAS_WINDOW:
        lo = tl.maximum(ctx + m_start - window + 1, 0)
    table = block_tables_ptr + chunk.to(tl.int64) * bt_stride
    n0 = (lo // BLOCK_N) * BLOCK_N
    while n0 < ctx:
        pos = n0 + tl.arange(0, BLOCK_N)
        in_ctx = pos < ctx
        blk = tl.load(table + pos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
        off = blk * c_stride_b + (pos % BLOCK_SIZE) * c_stride_s + kvh * c_stride_h
        kv_mask = in_ctx[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = _scores(q, k, scale, soft_cap, HAS_SOFT_CAP, DOT_FP32)
        valid = in_ctx[None, :]
        if HAS_WINDOW:
            valid = valid & (pos[None, :] > ctx + m[:, None] - window)
        s = tl.where(valid, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_FP32)
        n0 += BLOCK_N

    # The chunk's own keys, up to the tile's last row.
    j_lo = tl.full([], 0, tl.int32)
    if HAS_WINDOW:
        j_lo = tl.maximum(m_start - window + 1, 0)
    hi = tl.minimum(n, m_start + BLOCK_M)
    j0 = (j_lo // BLOCK_N) * BLOCK_N
    while j0 < hi:
        j = j0 + tl.arange(0, BLOCK_N)
        j_mask = j < hi
        kv_rows = (row0 + j).to(tl.int64)
        kv_mask = j_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_rows[:, None] * k_stride_t + kvh * k_stride_h + d[None, :],
                    mask=kv_mask, other=0.0).to(k_cache_ptr.dtype.element_ty)
        v = tl.load(v_ptr + kv_rows[:, None] * v_stride_t + kvh * v_stride_h + d[None, :],
                    mask=kv_mask, other=0.0).to(v_cache_ptr.dtype.element_ty)
        s = _scores(q, k, scale, soft_cap, HAS_SOFT_CAP, DOT_FP32)
        valid = j_mask[None, :] & (j[None, :] <= m[:, None])
        if HAS_WINDOW:
            valid = valid & (j[None, :] > m[:, None] - window)
        s = tl.where(valid, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_FP32)
        j0 += BLOCK_N

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + rows[:, None] * o_stride_t + head * o_stride_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)
