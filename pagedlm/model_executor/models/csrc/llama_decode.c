/* The Llama decoder stack for a decode step of a few sequences, in one call.
 *
 * At one token per sequence a layer's arithmetic besides its four matmuls is a few
 * microseconds, but run as separate torch ops and kernel calls from Python it is about
 * twenty dispatches, ~0.6 ms a layer here (18 ms of a 62 ms token, measured with the GEMV
 * kernel in place). This runs the same kernels, in the same order and on the same buffers'
 * values, as the layer-by-layer path (llama.py), so both give bit-identical hidden states:
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

/* The kernels it strings together (attention/csrc, layers/csrc, quantization/csrc). */
void gemv_f32(float *y, const float *x, const float *w, int M, int N, int K, int nthreads);
void gemm_panels_f32(float *y, const float *x, const float *wp, int M, int N, int K,
                     int nthreads);
void qmm_q4_1(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads);
void qmm_q8_0(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads);
void qmm_i8(float *y, const float *x, const int8_t *w, const float *scale, int M, int N, int K,
            int nthreads);
void rms_norm_f32(float *out, float *residual_out, const float *x, int64_t x_stride,
                  const float *residual, int64_t res_stride, const float *weight, int T, int H,
                  float eps);
void silu_and_mul_f32(float *out, const float *x, int64_t x_stride, int T, int I);
void rotary_f32(float *q, int64_t q_stride, int Hq, float *k, int64_t k_stride, int Hk,
                const int64_t *positions, const float *cos_table, const float *sin_table, int T,
                int D, int half);
void write_kv_f32(void *k_cache, void *v_cache, int kv_type, const float *k, int64_t k_stride,
                  const float *v, int64_t v_stride, const int64_t *slots, int T, int row);
void paged_attention_f32(float *out, const float *query, const void *k_cache,
                         const void *v_cache, int kv_type, const int32_t *block_tables,
                         const int32_t *token_seq, const int32_t *token_ctx_len, int num_tokens,
                         int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                         int max_blocks_per_seq, float scale, int window, float soft_cap,
                         int num_threads);

/* Weight formats; must match llama.py's _FUSED_FORMATS. */
enum { W_F32 = 0, W_Q4_1 = 1, W_Q8_0 = 2, W_I8 = 3, W_F32_PANELS = 4 };

typedef struct {
    int64_t fmt;
    const void *weight;
    const float *scale; /* W_I8: one per output row */
    const float *bias;  /* NULL: none */
} linear_t;

typedef struct {
    const float *input_norm, *post_norm;
    linear_t qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    int64_t window; /* sliding window in keys, 0: none */
} layer_t;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t kv_type, block_size, rotary_half;
    const float *cos, *sin;
    float eps, scale;
} dims_t;

static void linear(const linear_t *l, float *y, const float *x, int M, int N, int K, int nt) {
    switch (l->fmt) {
    case W_F32: gemv_f32(y, x, (const float *)l->weight, M, N, K, nt); break;
    case W_F32_PANELS: gemm_panels_f32(y, x, (const float *)l->weight, M, N, K, nt); break;
    case W_Q4_1: qmm_q4_1(y, x, (const uint8_t *)l->weight, M, N, K, nt); break;
    case W_Q8_0: qmm_q8_0(y, x, (const uint8_t *)l->weight, M, N, K, nt); break;
    default: qmm_i8(y, x, (const int8_t *)l->weight, l->scale, M, N, K, nt); break;
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
    const int qn = Hq * D, kvn = Hk * D, qkvn = qn + 2 * kvn;
    const size_t floats = (size_t)M * (H + H + qkvn + qn + qn + 2 * (size_t)I + I);
    float *buf = (float *)malloc(floats * sizeof(float) + (size_t)M * sizeof(int32_t));
    if (!buf) return -1;
    float *h = buf, *tmp = h + (size_t)M * H, *qkv = tmp + (size_t)M * H;
    float *q = qkv + (size_t)M * qkvn, *att = q + (size_t)M * qn, *gu = att + (size_t)M * qn;
    float *act = gu + (size_t)M * 2 * I;
    int32_t *token_seq = (int32_t *)(act + (size_t)M * I);
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
        linear(&L->qkv, qkv, h, M, qkvn, H, nthreads);
        rotary_f32(qkv, qkvn, Hq, qkv + qn, qkvn, Hk, positions, d->cos, d->sin, M, D,
                   (int)d->rotary_half);
        write_kv_f32(L->k_cache, L->v_cache, (int)d->kv_type, qkv + qn, qkvn, qkv + qn + kvn,
                     qkvn, slots, M, kvn);
        for (int t = 0; t < M; t++)
            memcpy(q + (size_t)t * qn, qkv + (size_t)t * qkvn, (size_t)qn * sizeof(float));
        paged_attention_f32(att, q, L->k_cache, L->v_cache, (int)d->kv_type, block_tables,
                            token_seq, ctx_lens, M, Hq, Hk, D, (int)d->block_size, max_blocks,
                            d->scale, (int)L->window, 0.0f, nthreads);
        linear(&L->o, x, att, M, H, qn, nthreads);
        rms_norm_f32(h, tmp, x, H, residual, H, L->post_norm, M, H, d->eps);
        memcpy(residual, tmp, (size_t)M * H * sizeof(float));
        linear(&L->gate_up, gu, h, M, 2 * I, H, nthreads);
        silu_and_mul_f32(act, gu, 2 * I, M, I);
        linear(&L->down, x, act, M, H, I, nthreads);
    }
    free(buf);
    return 0;
}
