/* The Llama decoder stack for a decode step of a few sequences, in one call.
 *
 * At one token per sequence a layer's arithmetic besides its four matmuls is a few
 * microseconds, but run as separate torch ops and kernel calls from Python it is about
 * twenty dispatches, ~0.6 ms a layer here (18 ms of a 62 ms token, measured with the GEMV
 * kernel in place). This runs the same kernels, in the same order and on the same buffers'
 * values, as the layer-by-layer path, so both give bit-identical hidden states:
 *
 *   residual += x; x = rmsnorm(residual)          (layer 0: residual = x)
 *   qkv = x Wqkv^T (+ b); rotate q, k; write k, v to the cache
 *   x = paged_attention(q) Wo^T (+ b)
 *   residual += x; x = rmsnorm(residual)
 *   x = silu(gate) * up of x Wgu^T;  x = x Wdown^T (+ b)
 *
 * The final norm, the LM head and everything about which rows are decodes stay in Python.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "include/pagedlm_ops.h"

/* x16: the block formats in two limbs (qmm16_), as the layers take x under
 * PAGEDLM_PRECISE_ACTIVATIONS. */
static void segment(const segment_t *l, float *y, const float *x, int M, int N, int K, int nt,
                    int x16) {
    const uint8_t *q = (const uint8_t *)l->weight;
    switch (l->fmt) {
    case W_F32: gemv_f32(y, x, (const float *)l->weight, M, N, K, nt); break;
    case W_F32_PANELS: gemm_panels_f32(y, x, (const float *)l->weight, M, N, K, nt); break;
    case W_BF16_PANELS: gemm_panels_bf16(y, x, (const uint16_t *)l->weight, M, N, K, nt); break;
    case W_F16_PANELS: gemm_panels_f16(y, x, (const uint16_t *)l->weight, M, N, K, nt); break;
    case W_Q4_1: (x16 ? qmm16_q4_1 : qmm_q4_1)(y, x, q, M, N, K, nt); break;
    case W_Q8_0: (x16 ? qmm16_q8_0 : qmm_q8_0)(y, x, q, M, N, K, nt); break;
    case W_Q4_K: (x16 ? qmm16_q4_k : qmm_q4_k)(y, x, q, M, N, K, nt); break;
    case W_Q5_K: (x16 ? qmm16_q5_k : qmm_q5_k)(y, x, q, M, N, K, nt); break;
    case W_Q6_K: (x16 ? qmm16_q6_k : qmm_q6_k)(y, x, q, M, N, K, nt); break;
    case W_Q3_K: (x16 ? qmm16_q3_k : qmm_q3_k)(y, x, q, M, N, K, nt); break;
    case W_Q2_K: (x16 ? qmm16_q2_k : qmm_q2_k)(y, x, q, M, N, K, nt); break;
    case W_Q5_0: (x16 ? qmm16_q5_0 : qmm_q5_0)(y, x, q, M, N, K, nt); break;
    case W_Q5_1: (x16 ? qmm16_q5_1 : qmm_q5_1)(y, x, q, M, N, K, nt); break;
    case W_IQ4_NL: (x16 ? qmm16_iq4_nl : qmm_iq4_nl)(y, x, q, M, N, K, nt); break;
    default: qmm_i8(y, x, (const int8_t *)l->weight, l->scale, M, N, K, nt); break;
    }
}

/* scratch: M * (the largest segment's rows) floats, used when there are several segments
 * and rows (a segment's rows of one token are contiguous in y only at M = 1). */
static void linear(const linear_t *l, float *y, const float *x, int M, int N, int K, int nt,
                   float *scratch, int x16) {
    if (l->nseg == 1) {
        segment(&l->seg[0], y, x, M, N, K, nt, x16);
    } else {
        int64_t off = 0;
        for (int64_t s = 0; s < l->nseg; s++) {
            const int rows = (int)l->seg[s].rows;
            if (M == 1) {
                segment(&l->seg[s], y + off, x, 1, rows, K, nt, x16);
            } else {
                segment(&l->seg[s], scratch, x, M, rows, K, nt, x16);
                for (int m = 0; m < M; m++)
                    memcpy(y + (size_t)m * N + off, scratch + (size_t)m * rows,
                           (size_t)rows * sizeof(float));
            }
            off += rows;
        }
    }
    if (l->bias)
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) y[(size_t)m * N + n] += l->bias[n];
}

/* x [M, H]: the layers' input (the embeddings, or the previous stage's hidden states), and
 * on return the last layer's output; residual [M, H]: its residual stream (ignored and
 * written when has_residual is 0). Sequence t's block table is row t of block_tables; it
 * attends to ctx_lens[t] keys. Returns 0, or -1 if scratch memory could not be had. */
int llama_decode_f32(const dims_t *d, const layer_t *layers, float *x, float *residual,
                     int has_residual, int M, const int64_t *positions, const int64_t *slots,
                     const int32_t *block_tables, int max_blocks, const int32_t *ctx_lens,
                     int nthreads) {
    const int H = (int)d->hidden, D = (int)d->head_dim, I = (int)d->intermediate;
    const int Hq = (int)d->num_heads, Hk = (int)d->num_kv_heads;
    const int qn = Hq * D, kvn = Hk * D, qkvn = qn + 2 * kvn, x16 = M <= d->x16_rows;
    /* seg: a segmented linear's scratch (linear()); no segment outgrows its layer. */
    size_t segn = (size_t)(qkvn > 2 * I ? qkvn : 2 * I);
    if (segn < (size_t)H) segn = (size_t)H;
    const size_t floats = (size_t)M * (H + H + qkvn + qn + qn + 2 * (size_t)I + I + segn);
    float *buf = (float *)malloc(floats * sizeof(float) + (size_t)M * sizeof(int32_t));
    if (!buf) return -1;
    float *h = buf, *tmp = h + (size_t)M * H, *qkv = tmp + (size_t)M * H;
    float *q = qkv + (size_t)M * qkvn, *att = q + (size_t)M * qn, *gu = att + (size_t)M * qn;
    float *act = gu + (size_t)M * 2 * I;
    float *seg = act + (size_t)M * I;
    int32_t *token_seq = (int32_t *)(seg + (size_t)M * segn);
    for (int t = 0; t < M; t++) token_seq[t] = t;

    for (int64_t i = 0; i < d->num_layers; i++) {
        const layer_t *L = layers + i;
        if (!has_residual) {
            memcpy(residual, x, (size_t)M * H * sizeof(float));
            rms_norm_f32(h, NULL, x, H, NULL, 0, L->input_norm, M, H, d->eps);
            has_residual = 1;
        } else {
            rms_norm_f32(h, tmp, x, H, residual, H, L->input_norm, M, H, d->eps);
            memcpy(residual, tmp, (size_t)M * H * sizeof(float));
        }
        linear(&L->qkv, qkv, h, M, qkvn, H, nthreads, seg, x16);
        /* (positions from the engine's own decode rows, below max_model_len: unchecked) */
        rotary_f32(qkv, qkvn, Hq, qkv + qn, qkvn, Hk, positions, d->cos, d->sin, M, D,
                   (int)d->rotary_half, INT64_MAX);
        write_kv_f32(L->k_cache, L->v_cache, (int)d->kv_type, qkv + qn, qkvn, qkv + qn + kvn,
                     qkvn, slots, M, kvn);
        for (int t = 0; t < M; t++)
            memcpy(q + (size_t)t * qn, qkv + (size_t)t * qkvn, (size_t)qn * sizeof(float));
        paged_attention_f32(att, q, L->k_cache, L->v_cache, (int)d->kv_type, block_tables,
                            token_seq, ctx_lens, M, Hq, Hk, D, (int)d->block_size, max_blocks,
                            d->scale, (int)L->window, 0.0f, nthreads);
        linear(&L->o, x, att, M, H, qn, nthreads, seg, x16);
        rms_norm_f32(h, tmp, x, H, residual, H, L->post_norm, M, H, d->eps);
        memcpy(residual, tmp, (size_t)M * H * sizeof(float));
        linear(&L->gate_up, gu, h, M, 2 * I, H, nthreads, seg, x16);
        silu_and_mul_f32(act, gu, 2 * I, M, I);
        linear(&L->down, x, act, M, H, I, nthreads, seg, x16);
    }
    free(buf);
    return 0;
}
