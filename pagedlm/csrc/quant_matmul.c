/* Weight-only quantized matmul for CPU: y[M, N] = x[M, K] @ W^T, W kept quantized.
 *
 * Formats (W is [N, K], blocks run along K, each row starts a new block):
 *   q4_1: 32 weights per 20-byte block {fp16 d, fp16 m, 16 bytes of nibbles}; w = d*q + m,
 *         q in 0..15; byte j holds weight j (low nibble) and weight j+16 (high nibble).
 *         This is ggml's Q4_1 block byte for byte (Q4_0 converts to it exactly: m = -8d).
 *   q8_0: 32 weights per 34-byte block {fp16 d, 32 x int8}; w = d*q. ggml's Q8_0 block.
 *   i8:   one int8 row per output channel and one float scale per row; w = s*q. Any K.
 *
 * Decode (M of 1..few) is bound by reading W, so each weight block is unpacked once per tile
 * of input rows (see qmm below for q4_1 and q8_0); rows of W are split across threads. For
 * large M the caller dequantizes into a float scratch buffer and runs a float GEMM instead,
 * except under deterministic=True.
 *
 * Batch invariance (what deterministic=True relies on): every output y[m][n] is one sum of x
 * row m against W row n, in a fixed order over K (lane-wise vector FMAs over the blocks, then
 * one horizontal sum), computed whole by one thread. Which x rows share a tile, which x block
 * a pass takes and which thread owns W row n change what is computed together, never that
 * order: the same bits at any M, any place in the batch and any thread count
 * (tests/kernels/test_quant_kernels.py checks it).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "include/pagedlm_ops.h"
#include "include/parallel.h"
#include "include/vec_math.h"

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

/* Parallelising a tiny matmul costs more in thread wake-ups than it saves. */
#define PAR_MIN_WEIGHTS (1 << 15)
/* Past this many bytes of x, the rows of x a weight row meets no longer stay in L2 (3 MB at 512
 * rows of K = 1536): a pass over the weights takes this much of x at a time. Measured on a
 * Xeon (AVX-512), 2 threads, at 512 rows, SmolLM2's gate_up (3072 x 576) and down (576 x 1536)
 * in ms, one pass against blocks: q4_1 24.1 -> 20.2 and 10.8 -> 9.4, q8_0 23.3 -> 18.9 and
 * 10.6 -> 8.4, i8 49.4 -> 34.6 and 30.4 -> 15.2; no slower at 32 rows. */
#define X_BLOCK_BYTES (128 * 1024)

/* ---------------------------------------------------------------- q4_1 */

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

/* ---------------------------------------------------------------- q4_1 and q8_0
 *
 * Each weight block is decoded to floats in registers (w = d*q + m, or d*q: the values
 * dequantize_reference gives, up to one rounding of the fma) and used for every x row of a
 * tile. The work is laid out as in gemv_f32.c: groups of QROWS weight rows, one
 * contiguous run of groups per thread (a group's blocks are adjacent in memory, so each thread
 * reads one stream) and the next group prefetched explicitly. Against the earlier kernel (one
 * row at a time, a static OpenMP loop over rows, x * q summed before scaling by d), on
 * SmolLM2's Q4_1 layers and Q8_0 head, 2 threads, AVX-512 EPYC: 7.6 -> 4.9 ms at 1 row (12.6
 * -> 19.6 GB/s), 12.3 -> 7.5 at 4, 24.3 -> 14.5 at 8. Built for AVX2 only (16 registers, so
 * tiles of 2 x rows): 7.4 -> 5.5 ms at 1 row, 8.9 -> 6.6 at 2, about the same at 4 to 8.
 */
#define QROWS 4
#ifdef __AVX512F__
#define QXTILE 4
#define QLANES 16
typedef __m512 qvec;
#define QLOAD _mm512_loadu_ps
#define QFMA _mm512_fmadd_ps
#define QZERO _mm512_setzero_ps
#define QSET1 _mm512_set1_ps
#define QSUM _mm512_reduce_add_ps
#elif defined(__AVX2__)
#define QXTILE 2
#define QLANES 8
typedef __m256 qvec;
#define QLOAD _mm256_loadu_ps
#define QFMA _mm256_fmadd_ps
#define QZERO _mm256_setzero_ps
#define QSET1 _mm256_set1_ps
#define QSUM hsum256
#else
#define QXTILE 2
#endif
#define QV (QK / QLANES)  /* vectors per block */

enum { FMT_Q4_1, FMT_Q8_0 };

/* Which build of the kernels this is: Python picks the row count from which dequantizing the
 * matrix and a float GEMM is faster by it. */
int qmm_vector_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 0;
#endif
}

#ifdef __AVX2__
/* Block `blk` of format fmt as QV float vectors, in weight order. */
static inline __attribute__((always_inline)) void decode_block(qvec *w, const uint8_t *blk,
                                                               const int fmt) {
    /* The block's fp16 scale (and q4_1 minimum) widened together by one vcvtph2ps and
     * broadcast from a stack slot (a load) rather than from a register (a shuffle, on the port
     * the nibble unpacking also needs): SmolLM2's Q4_1 layers and Q8_0 head at 1 row, 2
     * threads, 7.87 -> 7.36 ms against one scalar conversion and register broadcast each. */
    float dm[4] __attribute__((aligned(16)));
#ifdef __F16C__
    _mm_store_ps(dm, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)blk)));
    __asm__("" : "+m"(dm));  /* so the broadcasts read the slot rather than the register */
#else
    dm[0] = fp16_to_f32(load_u16(blk));
    dm[1] = fp16_to_f32(load_u16(blk + 2));
#endif
    const qvec d = QSET1(dm[0]);
    if (fmt == FMT_Q4_1) {
        const qvec m = QSET1(dm[1]);
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4));
#ifdef __AVX512F__
        const __m512i b = _mm512_cvtepu8_epi32(raw), f = _mm512_set1_epi32(0x0f);
        w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, f)), d, m);
        w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), d, m);
#else
        const __m256i f = _mm256_set1_epi32(0x0f);
        const __m256i b0 = _mm256_cvtepu8_epi32(raw);
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8));
        w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, f)), d, m);
        w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, f)), d, m);
        w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), d, m);
        w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), d, m);
#endif
    } else {
        const int8_t *qs = (const int8_t *)(blk + 2);
#ifdef __AVX512F__
        const __m128i q0 = _mm_loadu_si128((const __m128i *)qs);
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(qs + 16));
        w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d);
        w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d);
#else
        for (int v = 0; v < 4; v++)
            w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(qs + 8 * v)))), d);
#endif
    }
}
#endif

/* Scalar weight j of a block (the tail of no vector build, and the reference for it). */
static inline float block_weight(const uint8_t *blk, int j, const int fmt) {
    const float d = fp16_to_f32(load_u16(blk));
    if (fmt == FMT_Q4_1) {
        const uint8_t q = blk[4 + (j & 15)];
        return d * (float)(j < 16 ? q & 0x0f : q >> 4) + fp16_to_f32(load_u16(blk + 2));
    }
    return d * (float)((const int8_t *)(blk + 2))[j];
}

/* mt x rows against weight rows n .. n+rows-1 (rows <= QROWS). */
static inline __attribute__((always_inline)) void qgroup(
        float *y, const float *x, const uint8_t *w, const int mt, const int rows, int N, int K,
        int n, const int fmt, const uint8_t *prefetch) {
    const int nb = K / QK, bytes = fmt == FMT_Q4_1 ? Q4_1_BYTES : Q8_0_BYTES;
    const size_t row_bytes = (size_t)nb * bytes;
    const uint8_t *wg = w + (size_t)n * row_bytes;
    float acc_s[QXTILE][QROWS] = {{0}};
#ifdef __AVX2__
    qvec acc[QXTILE][QROWS];
    for (int m = 0; m < mt; m++)
        for (int r = 0; r < rows; r++) acc[m][r] = QZERO();
    for (int b = 0; b < nb; b++) {
        if (prefetch) {  /* the next group, spread over this group's blocks */
            const uint8_t *p = prefetch + (size_t)b * QROWS * bytes;
            _mm_prefetch((const char *)p, _MM_HINT_T0);
            _mm_prefetch((const char *)p + 64, _MM_HINT_T0);
        }
        for (int r = 0; r < rows; r++) {
            qvec wv[QV];
            decode_block(wv, wg + r * row_bytes + (size_t)b * bytes, fmt);
            for (int m = 0; m < mt; m++) {
                const float *xb = x + (size_t)m * K + (size_t)b * QK;
                for (int v = 0; v < QV; v++)
                    acc[m][r] = QFMA(wv[v], QLOAD(xb + v * QLANES), acc[m][r]);
            }
        }
    }
    for (int m = 0; m < mt; m++)
        for (int r = 0; r < rows; r++) acc_s[m][r] = QSUM(acc[m][r]);
#else
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++)
            for (int j = 0; j < QK; j++) {
                const float wj = block_weight(wg + r * row_bytes + (size_t)b * bytes, j, fmt);
                for (int m = 0; m < mt; m++) acc_s[m][r] += wj * x[(size_t)m * K + b * QK + j];
            }
#endif
    for (int m = 0; m < mt; m++)
        for (int r = 0; r < rows; r++) y[(size_t)m * N + n + r] = acc_s[m][r];
}

static inline __attribute__((always_inline)) void qtile(
        float *y, const float *x, const uint8_t *w, int M, int N, int K, int n, const int rows,
        const int fmt, const uint8_t *next) {
    for (int m0 = 0; m0 < M; m0 += QXTILE) {
        float *ym = y + (size_t)m0 * N;
        const float *xm = x + (size_t)m0 * K;
        const uint8_t *pf = m0 ? NULL : next;
        /* Constant tile heights let the compiler keep every sum in a register. */
        switch (M - m0 >= QXTILE ? QXTILE : M - m0) {
            case 1: qgroup(ym, xm, w, 1, rows, N, K, n, fmt, pf); break;
#if QXTILE > 2
            case 2: qgroup(ym, xm, w, 2, rows, N, K, n, fmt, pf); break;
            case 3: qgroup(ym, xm, w, 3, rows, N, K, n, fmt, pf); break;
#endif
            default: qgroup(ym, xm, w, QXTILE, rows, N, K, n, fmt, pf);
        }
    }
}

/* x rows per pass over a thread's weight rows: each output is one call of qgroup whatever the
 * pass, so the blocking changes which rows share a pass, not any output's sum order. */
static inline int x_block_rows(int K) {
    const int rows = X_BLOCK_BYTES / (K * (int)sizeof(float));
    return rows < QXTILE ? QXTILE : rows - rows % QXTILE;
}

static void qrows_range(float *y, const float *x, const uint8_t *w, int M, int N, int K,
                        int lo, int hi, const int fmt) {
    const size_t group_bytes = (size_t)(K / QK) * (fmt == FMT_Q4_1 ? Q4_1_BYTES : Q8_0_BYTES)
                               * QROWS;
    const int mb = x_block_rows(K);
    for (int m0 = 0; m0 < M; m0 += mb) {
        const int mt = M - m0 < mb ? M - m0 : mb;
        float *ym = y + (size_t)m0 * N;
        const float *xm = x + (size_t)m0 * K;
        int n = lo;
        for (; n + QROWS <= hi; n += QROWS) {
            const uint8_t *next = n + 2 * QROWS <= hi
                                  ? w + (size_t)(n / QROWS + 1) * group_bytes : NULL;
            qtile(ym, xm, w, mt, N, K, n, QROWS, fmt, next);
        }
        for (; n < hi; n++) qtile(ym, xm, w, mt, N, K, n, 1, fmt, NULL);
    }
}

static void qmm(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads,
                const int fmt) {
    if ((long)N * K < PAR_MIN_WEIGHTS || nthreads < 2) {
        qrows_range(y, x, w, M, N, K, 0, N, fmt);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    {
        int lo, hi;
        omp_thread_rows(N, QROWS, &lo, &hi); /* whole groups per thread */
        qrows_range(y, x, w, M, N, K, lo, hi, fmt);
    }
}

void qmm_q4_1(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads) {
    if (M == 1) qmm(y, x, w, 1, N, K, nthreads, FMT_Q4_1);
    else qmm(y, x, w, M, N, K, nthreads, FMT_Q4_1);
}

void qmm_q8_0(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads) {
    if (M == 1) qmm(y, x, w, 1, N, K, nthreads, FMT_Q8_0);
    else qmm(y, x, w, M, N, K, nthreads, FMT_Q8_0);
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
        const __m128i b0 = _mm_loadl_epi64((const __m128i *)(w + k));
        const __m128i b1 = _mm_loadl_epi64((const __m128i *)(w + k + 8));
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1));
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
    int mb = X_BLOCK_BYTES / (K * (int)sizeof(float));
    mb = mb < MTILE ? MTILE : mb - mb % MTILE;
    #pragma omp parallel num_threads(nthreads) \
        if ((long)N * K >= PAR_MIN_WEIGHTS && nthreads > 1)
    for (int m0 = 0; m0 < M; m0 += mb) {  /* as in qrows_range */
        const int m1 = M - m0 < mb ? M : m0 + mb;
        #pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n++)
            for (int r0 = m0; r0 < m1; r0 += MTILE) {
                const int mt = m1 - r0 < MTILE ? m1 - r0 : MTILE;
                i8_row(y + (size_t)r0 * N, x + (size_t)r0 * K, w + (size_t)n * K, scale[n], mt,
                       N, K, n);
            }
    }
}

void dequant_i8(float *out, const int8_t *w, const float *scale, int N, int K, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if ((long)N * K >= PAR_MIN_WEIGHTS && nthreads > 1)
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) out[(size_t)n * K + k] = scale[n] * (float)w[(size_t)n * K + k];
}
