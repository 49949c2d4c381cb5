/* The small per-layer float32 ops of a decoder layer, each one call instead of several torch
 * ops: at batch 1 a layer's elementwise work is a few microseconds of arithmetic but a dozen
 * torch dispatches (about 5-10 us each), so the dispatches, not the arithmetic, cost the time.
 *
 * Rows are independent; large batches (prefill) are split over OpenMP threads, small ones run
 * on the calling thread, where waking a team would cost more than the work.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "include/kv_types.h"
#include "include/pagedlm_ops.h"
#include "include/vec_math.h"

#define PAR_MIN_ELEMS 65536 /* elements below which one thread does the whole call */

/* residual_out = x + residual (when residual is given), then
 * out = weight * (h / sqrt(mean(h^2) + eps)) with h = residual_out (or x). Row strides in
 * elements; out and residual_out are contiguous [T, H]. */
REASSOC void rms_norm_f32(float* out, float* residual_out, const float* x, int64_t x_stride,
                          const float* residual, int64_t res_stride, const float* weight,
                          int T, int H, float eps) {
#pragma omp parallel for if ((int64_t)T * H >= PAR_MIN_ELEMS) schedule(static)
    for (int t = 0; t < T; t++) {
        const float* xr = x + (size_t)t * x_stride;
        const float* h = xr;
        if (residual) {
            float* ro = residual_out + (size_t)t * H;
            const float* rr = residual + (size_t)t * res_stride;
            for (int i = 0; i < H; i++) ro[i] = xr[i] + rr[i];
            h = ro;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < H; i++) ss += h[i] * h[i];
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        float* o = out + (size_t)t * H;
        for (int i = 0; i < H; i++) o[i] = weight[i] * (h[i] * inv);
    }
}

/* out[t, i] = silu(x[t, i]) * x[t, I + i]; x row stride in elements, out contiguous [T, I]. */
REASSOC void silu_and_mul_f32(float* out, const float* x, int64_t x_stride, int T, int I) {
#pragma omp parallel for if ((int64_t)T * I >= PAR_MIN_ELEMS) schedule(static)
    for (int t = 0; t < T; t++) {
        const float* g = x + (size_t)t * x_stride;
        const float* u = g + I;
        float* o = out + (size_t)t * I;
#pragma omp simd
        for (int i = 0; i < I; i++) {
            /* sigmoid through exp of a non-positive number only: no overflow either side. */
            const float e = exp_neg(-fabsf(g[i]));
            const float sig = (g[i] >= 0.0f ? 1.0f : e) / (1.0f + e);
            o[i] = g[i] * sig * u[i];
        }
    }
}

/* Rotate-half rotary embedding, in place, on the first 2 * half features of each head of q
 * [T, Hq, D] and k [T, Hk, D] (row strides q_stride / k_stride, heads contiguous at stride D).
 * cos/sin: [max_position, half] tables, looked up by positions[t]. Returns 0, or 1 + the
 * first token whose position is outside the tables, before anything is rotated (the tables
 * were read past their ends). */
int rotary_f32(float* q, int64_t q_stride, int Hq, float* k, int64_t k_stride, int Hk,
               const int64_t* positions, const float* cos_table, const float* sin_table, int T,
               int D, int half, int64_t max_position) {
    for (int t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return t + 1;
#pragma omp parallel for if ((int64_t)T * (Hq + Hk) * D >= PAR_MIN_ELEMS) schedule(static)
    for (int t = 0; t < T; t++) {
        const float* c = cos_table + (size_t)positions[t] * half;
        const float* s = sin_table + (size_t)positions[t] * half;
        for (int h = 0; h < Hq + Hk; h++) {
            float* x = h < Hq ? q + (size_t)t * q_stride + (size_t)h * D
                              : k + (size_t)t * k_stride + (size_t)(h - Hq) * D;
            for (int i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[half + i];
                x[i] = x1 * c[i] - x2 * s[i];
                x[half + i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
    return 0;
}

/* Write each token's K and V rows ([T, Hk * D] at row strides k_stride / v_stride) into cache
 * slot slots[t] ([num_slots, Hk * D] caches of kv_type), converting from float32. */
void write_kv_f32(void* k_cache, void* v_cache, int kv_type, const float* k, int64_t k_stride,
                  const float* v, int64_t v_stride, const int64_t* slots, int T, int row) {
    const size_t bytes = (size_t)row * kv_elem_size(kv_type);
    for (int t = 0; t < T; t++) {
        kv_store_row((char*)k_cache + (size_t)slots[t] * bytes, k + (size_t)t * k_stride, row,
                     kv_type);
        kv_store_row((char*)v_cache + (size_t)slots[t] * bytes, v + (size_t)t * v_stride, row,
                     kv_type);
    }
}

/* The largest element of r[0:V] (NaNs skipped) and whether r has a NaN. */
static inline float row_max(const float* r, int V, int* has_nan) {
#ifdef __AVX512F__
    /* Four accumulators: one vmaxps chain would wait on its 4-cycle latency every 16 floats. */
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    __mmask16 nan = 0;
    int i = 0;
    for (; i + 64 <= V; i += 64) {
        const __m512 a = _mm512_loadu_ps(r + i), b = _mm512_loadu_ps(r + i + 16);
        const __m512 c = _mm512_loadu_ps(r + i + 32), d = _mm512_loadu_ps(r + i + 48);
        /* vmaxps returns its second operand when either is NaN: the accumulator, so a NaN
         * is skipped here and caught by the unordered compares. */
        m0 = _mm512_max_ps(a, m0);
        m1 = _mm512_max_ps(b, m1);
        m2 = _mm512_max_ps(c, m2);
        m3 = _mm512_max_ps(d, m3);
        nan |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(c, d, _CMP_UNORD_Q);
    }
    for (; i < V; i += 16) {
        const __mmask16 k = tail_mask(V - i);
        const __m512 a = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, r + i);
        m0 = _mm512_max_ps(a, m0);
        nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    }
    *has_nan = nan != 0;
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
#else
    float m = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int i = 0; i < V; i++) {
        m = r[i] > m ? r[i] : m;
        nan |= r[i] != r[i];
    }
    *has_nan = nan;
    return m;
#endif
}

/* The first i in [0, V) with r[i] == m (or, with nan, the first NaN); 0 if there is none. */
static inline int64_t first_equal(const float* r, int V, float m, int nan) {
    int i = 0;
#ifdef __AVX512F__
    /* NaN compares unordered with everything: (x unord m) finds NaNs whatever m is. */
    const __m512 mv = _mm512_set1_ps(m);
    for (; i + 64 <= V; i += 64) {
        __mmask16 k0, k1, k2, k3;
        if (nan) {
            k0 = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + i), mv, _CMP_UNORD_Q);
            k1 = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + i + 16), mv, _CMP_UNORD_Q);
            k2 = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + i + 32), mv, _CMP_UNORD_Q);
            k3 = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + i + 48), mv, _CMP_UNORD_Q);
        } else {
            k0 = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + i), mv, _CMP_EQ_OQ);
            k1 = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + i + 16), mv, _CMP_EQ_OQ);
            k2 = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + i + 32), mv, _CMP_EQ_OQ);
            k3 = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + i + 48), mv, _CMP_EQ_OQ);
        }
        const uint64_t k = (uint64_t)k0 | (uint64_t)k1 << 16 | (uint64_t)k2 << 32 |
                           (uint64_t)k3 << 48;
        if (k) return i + __builtin_ctzll(k);
    }
#endif
    for (; i < V; i++)
        if (nan ? r[i] != r[i] : r[i] == m) return i;
    return 0; /* all -inf without a NaN cannot get here (m == -inf matches); V == 0 can */
}

/* out[t] = the index of the largest x[t, :V] (row stride x_stride), the first one on ties, and
 * the first NaN where a row has one: torch.argmax's answer. Greedy sampling's only op.
 *
 * Two passes a row: the max (with a NaN flag), then a search for the first element equal to
 * it, which reads the row again from L2 (a 49k-vocabulary row is 192 KiB). torch.argmax
 * (binary_kernel_reduce_lastdim) carries an index through every compare: measured on the
 * 2-core Xeon at 128 rows x 49152, one thread, 8 ms (6 GB/s; 4 ms on two threads) against
 * 1.2 ms (20 GB/s, about what a plain read of the logits takes) here.
 */
void argmax_rows_f32(int64_t* out, const float* x, int64_t x_stride, int T, int V) {
#pragma omp parallel for if ((int64_t)T * V >= PAR_MIN_ELEMS) schedule(static)
    for (int t = 0; t < T; t++) {
        const float* r = x + (size_t)t * x_stride;
        int nan;
        const float m = row_max(r, V, &nan);
        out[t] = first_equal(r, V, m, nan);
    }
}
