/* Weight-only quantized matmul for CPU: y[M, N] = x[M, K] @ W^T, W kept quantized.
 *
 * Formats (W is [N, K], blocks run along K, each row starts a new block):
 *   q4_1: 32 weights per 20-byte block {fp16 d, fp16 m, 16 bytes of nibbles}; w = d*q + m,
 *         q in 0..15; byte j holds weight j (low nibble) and weight j+16 (high nibble).
 *         This is ggml's Q4_1 block byte for byte (Q4_0 converts to it exactly: m = -8d).
 *   q8_0: 32 weights per 34-byte block {fp16 d, 32 x int8}; w = d*q. ggml's Q8_0 block.
 *   i8:   one int8 row per output channel and one float scale per row; w = s*q. Any K.
 *
 * Decode (M of 1..few) is bound by reading W, so each weight row is unpacked once and used
 * for a tile of up to 4 input rows; rows of W are split across threads. For large M the
 * caller dequantizes into a float scratch buffer and runs a float GEMM instead.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QK 32
#define Q4_1_BYTES 20
#define Q8_0_BYTES 34
#define MTILE 4

static inline float fp16_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

#ifdef __AVX2__
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* Parallelising a tiny matmul costs more in thread wake-ups than it saves. */
#define PAR_MIN_WEIGHTS (1 << 15)

/* ---------------------------------------------------------------- q4_1 */

static void q4_1_row(float *y, const float *x, const float *xsum, const uint8_t *w,
                     int mt, int N, int K, int n) {
    const int nb = K / QK;
    float acc_s[MTILE] = {0};
#ifdef __AVX2__
    __m256 acc[MTILE];
    for (int r = 0; r < mt; r++) acc[r] = _mm256_setzero_ps();
    const __m128i m4 = _mm_set1_epi8(0x0f);
#endif
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)b * Q4_1_BYTES;
        const float d = fp16_to_f32(load_u16(blk)), m = fp16_to_f32(load_u16(blk + 2));
        const uint8_t *qs = blk + 4;
        for (int r = 0; r < mt; r++) acc_s[r] += m * xsum[(size_t)r * nb + b];
#ifdef __AVX2__
        const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
        const __m128i lo = _mm_and_si128(raw, m4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        const __m256 vd = _mm256_set1_ps(d);
        for (int r = 0; r < mt; r++) {
            const float *xb = x + (size_t)r * K + (size_t)b * QK;
            __m256 t = _mm256_mul_ps(q0, _mm256_loadu_ps(xb));
            t = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xb + 8), t);
            t = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xb + 16), t);
            t = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xb + 24), t);
            acc[r] = _mm256_fmadd_ps(vd, t, acc[r]);
        }
#else
        for (int r = 0; r < mt; r++) {
            const float *xb = x + (size_t)r * K + (size_t)b * QK;
            float t = 0.f;
            for (int j = 0; j < 16; j++)
                t += (float)(qs[j] & 0x0f) * xb[j] + (float)(qs[j] >> 4) * xb[j + 16];
            acc_s[r] += d * t;
        }
#endif
    }
    for (int r = 0; r < mt; r++) {
#ifdef __AVX2__
        acc_s[r] += hsum256(acc[r]);
#endif
        y[(size_t)r * N + n] = acc_s[r];
    }
}

void qmm_q4_1(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads) {
    const int nb = K / QK;
    const size_t row_bytes = (size_t)nb * Q4_1_BYTES;
    /* Per-block sums of x carry the "+ m" term: sum(x * (d*q + m)) = d*sum(x*q) + m*sum(x). */
    float *xsum = (float *)malloc(sizeof(float) * (size_t)M * nb + 1);
    for (int r = 0; r < M; r++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)r * K + (size_t)b * QK;
            float s = 0.f;
            for (int j = 0; j < QK; j++) s += xb[j];
            xsum[(size_t)r * nb + b] = s;
        }
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if ((long)N * K >= PAR_MIN_WEIGHTS && nthreads > 1)
    for (int n = 0; n < N; n++) {
        const uint8_t *wr = w + (size_t)n * row_bytes;
        for (int r0 = 0; r0 < M; r0 += MTILE) {
            const int mt = M - r0 < MTILE ? M - r0 : MTILE;
            q4_1_row(y + (size_t)r0 * N, x + (size_t)r0 * K, xsum + (size_t)r0 * nb, wr, mt,
                     N, K, n);
        }
    }
    free(xsum);
}

void dequant_q4_1(float *out, const uint8_t *w, int N, int K, int nthreads) {
    const int nb = K / QK;
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if ((long)N * K >= PAR_MIN_WEIGHTS && nthreads > 1)
    for (int n = 0; n < N; n++) {
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = w + ((size_t)n * nb + b) * Q4_1_BYTES;
            const float d = fp16_to_f32(load_u16(blk)), m = fp16_to_f32(load_u16(blk + 2));
            float *o = out + (size_t)n * K + (size_t)b * QK;
            for (int j = 0; j < 16; j++) {
                o[j] = d * (float)(blk[4 + j] & 0x0f) + m;
                o[j + 16] = d * (float)(blk[4 + j] >> 4) + m;
            }
        }
    }
}

/* ---------------------------------------------------------------- q8_0 */

static void q8_0_row(float *y, const float *x, const uint8_t *w, int mt, int N, int K, int n) {
    const int nb = K / QK;
    float acc_s[MTILE] = {0};
#ifdef __AVX2__
    __m256 acc[MTILE];
    for (int r = 0; r < mt; r++) acc[r] = _mm256_setzero_ps();
#endif
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)b * Q8_0_BYTES;
        const float d = fp16_to_f32(load_u16(blk));
        const int8_t *qs = (const int8_t *)(blk + 2);
#ifdef __AVX2__
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)qs)));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8))));
        const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 16))));
        const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 24))));
        const __m256 vd = _mm256_set1_ps(d);
        for (int r = 0; r < mt; r++) {
            const float *xb = x + (size_t)r * K + (size_t)b * QK;
            __m256 t = _mm256_mul_ps(q0, _mm256_loadu_ps(xb));
            t = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xb + 8), t);
            t = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xb + 16), t);
            t = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xb + 24), t);
            acc[r] = _mm256_fmadd_ps(vd, t, acc[r]);
        }
#else
        for (int r = 0; r < mt; r++) {
            const float *xb = x + (size_t)r * K + (size_t)b * QK;
            float t = 0.f;
            for (int j = 0; j < QK; j++) t += (float)qs[j] * xb[j];
            acc_s[r] += d * t;
        }
#endif
    }
    for (int r = 0; r < mt; r++) {
#ifdef __AVX2__
        acc_s[r] += hsum256(acc[r]);
#endif
        y[(size_t)r * N + n] = acc_s[r];
    }
}

void qmm_q8_0(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads) {
    const size_t row_bytes = (size_t)(K / QK) * Q8_0_BYTES;
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if ((long)N * K >= PAR_MIN_WEIGHTS && nthreads > 1)
    for (int n = 0; n < N; n++)
        for (int r0 = 0; r0 < M; r0 += MTILE) {
            const int mt = M - r0 < MTILE ? M - r0 : MTILE;
            q8_0_row(y + (size_t)r0 * N, x + (size_t)r0 * K, w + (size_t)n * row_bytes, mt, N, K,
                     n);
        }
}

void dequant_q8_0(float *out, const uint8_t *w, int N, int K, int nthreads) {
    const int nb = K / QK;
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if ((long)N * K >= PAR_MIN_WEIGHTS && nthreads > 1)
    for (int n = 0; n < N; n++)
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = w + ((size_t)n * nb + b) * Q8_0_BYTES;
            const float d = fp16_to_f32(load_u16(blk));
            const int8_t *qs = (const int8_t *)(blk + 2);
            float *o = out + (size_t)n * K + (size_t)b * QK;
            for (int j = 0; j < QK; j++) o[j] = d * (float)qs[j];
        }
}

/* ---------------------------------------------------------------- i8 (per output channel) */

static void i8_row(float *y, const float *x, const int8_t *w, float s, int mt, int N, int K,
                   int n) {
    float acc_s[MTILE] = {0};
    int k = 0;
#ifdef __AVX2__
    __m256 acc[MTILE];
    for (int r = 0; r < mt; r++) acc[r] = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + k))));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + k + 8))));
        for (int r = 0; r < mt; r++) {
            const float *xr = x + (size_t)r * K + k;
            acc[r] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(xr), acc[r]);
            acc[r] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xr + 8), acc[r]);
        }
    }
    for (int r = 0; r < mt; r++) acc_s[r] = hsum256(acc[r]);
#endif
    for (; k < K; k++)
        for (int r = 0; r < mt; r++) acc_s[r] += (float)w[k] * x[(size_t)r * K + k];
    for (int r = 0; r < mt; r++) y[(size_t)r * N + n] = s * acc_s[r];
}

void qmm_i8(float *y, const float *x, const int8_t *w, const float *scale, int M, int N, int K,
            int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if ((long)N * K >= PAR_MIN_WEIGHTS && nthreads > 1)
    for (int n = 0; n < N; n++)
        for (int r0 = 0; r0 < M; r0 += MTILE) {
            const int mt = M - r0 < MTILE ? M - r0 : MTILE;
            i8_row(y + (size_t)r0 * N, x + (size_t)r0 * K, w + (size_t)n * K, scale[n], mt, N, K,
                   n);
        }
}

void dequant_i8(float *out, const int8_t *w, const float *scale, int N, int K, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if ((long)N * K >= PAR_MIN_WEIGHTS && nthreads > 1)
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) out[(size_t)n * K + k] = scale[n] * (float)w[(size_t)n * K + k];
}
