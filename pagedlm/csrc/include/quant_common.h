/* What the quantized-weight kernels (quant_matmul.c, quant_kquants.c) share: reading ggml's
 * fp16 fields, their u8 x s8 integer dot product (where VNNI is chosen), the 8-lane
 * horizontal sum their scalar builds emulate bit for bit, and the split of W's rows across
 * threads. */
#ifndef PAGEDLM_QUANT_COMMON_H
#define PAGEDLM_QUANT_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

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
static inline int load_u32(const uint8_t *p) { int v; memcpy(&v, p, 4); return v; }

#ifdef __AVX2__
/* The 8-bit-activation kernels' integer dot product, and the one place its instructions are
 * chosen (at compile time, by the -march=native macros): 32 unsigned bytes u against 32 signed
 * bytes s, lane l of the 8 int32 lanes = u_4l s_4l + ... + u_4l+3 s_4l+3.
 *   AVX-VNNI (Sapphire Rapids and later Xeons):   one VEX vpdpbusd
 *   AVX512-VNNI with AVX512VL (Ice Lake, Zen 4):  one EVEX vpdpbusd on 256 bits
 *   AVX2:  vpmaddubsw (pairs to int16, saturating), then vpmaddwd by ones (pairs to int32)
 * All give the same integers, so the kernels give the same bits in every build, and the
 * deterministic mode's promise (one sum order, whatever the row count) holds unchanged:
 * vpdpbusd sums the 4 products exactly (at most 4 * 128 * 128 = 2^16 in magnitude), and
 * vpmaddubsw never saturates in these kernels because no u byte exceeds 128:
 *     q4_1, q4_k 15; q5_k, q5_1 31; q6_k 63 (q + 32); q2_k 3, its mins 15;
 *     q3_k 4, q5_0 16, q8_0 128, iq4_nl 127 (|q|, the signs moved onto x by vpsignb;
 *     q8_0's q = -128 gives the byte 0x80, read as 128)
 * so a pair is within 2 * 128 * [-128, 127] = [-32768, 32512], inside int16, whatever the s
 * bytes hold (the activations' |q_x| <= 127 is not even needed). */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* acc + dot_u8s8(u, s): one vpdpbusd with VNNI */
static inline __m256i dot_u8s8_acc(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, dot_u8s8(u, s));
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* dot_u8s8 on 64 bytes (16 lanes): AVX512-VNNI's vpdpbusd, else vpmaddubsw and vpmaddwd; the
 * same integers (the bound above). */
static inline __m512i dot_u8s8_512(__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

/* acc + dot_u8s8_512(u, s): one vpdpbusd with VNNI */
static inline __m512i dot_u8s8_512_acc(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, dot_u8s8_512(u, s));
#endif
}
#endif

/* dot_u8s8 with the pair sums of bytes 0..15 times the int16 sc16 lanes of the low half, of
 * 16..31 those of the high half (a K-quant's sub-block scales; each int32 lane's two pairs
 * share one). AVX2's form in every build: VNNI would take vpdpbusd and then vpmulld by the
 * scales, the same integers (|sc| <= 128, so every product stays far inside int32), but
 * vpmulld is 2 uops of 10 cycles' latency on Intel: 3 uops against 2, and no fewer on Zen 4.
 * The saturation bound is dot_u8s8's. */
static inline __m256i dot_u8s8_scaled(__m256i u, __m256i s, __m256i sc16) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc16);
}
#endif

/* Two 8-bit limbs of x (the qmm16_ kernels; quant_kquants.c's header): the residual of x's K
 * values against its first limb (q, with one scale d per 32-block), rounded once as fmaf
 * does, for the second limb to quantize. */
static inline void limb_residual(float *res, const float *x, const int8_t *q, const float *d,
                                 int K) {
    for (int j = 0; j < K; j++) res[j] = fmaf(-d[j / 32], (float)q[j], x[j]);
}

/* y's rows 0..mt-1 (N apart), columns 0..width-1, from the limbs' sums: row m's two limbs are
 * rows 2m and 2m + 1 of ys (width apart). */
static inline void add_limbs(float *y, int N, const float *ys, int width, int mt) {
    for (int m = 0; m < mt; m++) {
        const float *hi = ys + (size_t)2 * m * width, *lo = hi + width;
        float *ym = y + (size_t)m * N;
        for (int c = 0; c < width; c++) ym[c] = hi[c] + lo[c];
    }
}

/* hsum256's order on 8 lanes held in memory: the halves, then pairs, then the last two. */
static inline float hsum8_scalar(const float *lane) {
    const float h0 = lane[0] + lane[4], h1 = lane[1] + lane[5];
    const float h2 = lane[2] + lane[6], h3 = lane[3] + lane[7];
    return (h0 + h2) + (h1 + h3);
}

/* Parallelising a tiny matmul costs more in thread wake-ups than it saves. */
#define PAR_MIN_WEIGHTS (1 << 15)

/* A kernel's pass over W's rows [lo, hi) for all M rows of x; nonzero when it could not
 * allocate its activation scratch. */
typedef int (*rows_fn)(float *, const float *, const uint8_t *, int, int, int, int, int);

/* y[M, N] = x @ W^T by `rows`, W's rows split across the threads in whole groups of `group`
 * (the rows a kernel keeps in flight). The caller picks `rows` (M == 1 or not) before this
 * OpenMP region, which is outlined once whatever is inlined around it. */
static inline void run_quant_rows(const char *who, float *y, const float *x, const uint8_t *w,
                                  int M, int N, int K, int nthreads, int group,
                                  const rows_fn rows) {
    int failed = 0;
    if ((long)N * K < PAR_MIN_WEIGHTS || nthreads < 2) {
        failed = rows(y, x, w, M, N, K, 0, N);
    } else {
#pragma omp parallel num_threads(nthreads) reduction(|: failed)
        {
            int lo, hi;
            omp_thread_rows(N, group, &lo, &hi);
            failed |= rows(y, x, w, M, N, K, lo, hi);
        }
    }
    if (failed) {  /* no error channel in this ABI, and a wrong y must never pass silently */
        fprintf(stderr, "pagedlm %s: out of memory for %d x %d activations\n", who, M, K);
        abort();
    }
}

/* float -> bfloat16 rounded to nearest even, as torch's .bfloat16() does (a NaN stays one). */
static inline uint16_t f32_to_bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* A float dequantizer of N rows from their blocks (dequant_<fmt>'s signature). */
typedef void (*dequant_fn)(float *, const uint8_t *, int, int, int);

/* W [N, K] (K even) from its blocks, rounded to bfloat16, as the k-pair panels the AMX GEMM
 * reads (gemv.pack_panels: [ceil(N / 32), K / 2, 32, 2], element [p, j, c, e] = W[32 p + c]
 * [2 j + e], zero past N): the same bits as pack_panels(dequant(W).bfloat16()), in one pass
 * that keeps each 32-row panel's floats in a thread's L2 instead of writing the float matrix
 * out and reading it back twice. For many-row steps of GGUF layers on AMX
 * (model_executor/layers/quantization/kernels.py says what it saves). */
static inline void dequant_bf16_panels(dequant_fn dq, uint16_t *panels, const uint8_t *w,
                                       size_t row_bytes, int N, int K, int nthreads) {
    const int P = (N + 31) / 32, pairs = K / 2;
    int failed = 0;
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if ((long)N * K >= PAR_MIN_WEIGHTS && nthreads > 1) reduction(|: failed)
    for (int p = 0; p < P; p++) {
        const int rows = N - 32 * p < 32 ? N - 32 * p : 32;
        float *buf = (float *)malloc((size_t)32 * K * sizeof(float) +
                                     (size_t)32 * pairs * sizeof(uint32_t));
        if (!buf) {
            failed = 1;
            continue;
        }
        uint32_t *kp = (uint32_t *)(buf + (size_t)32 * K);  /* [32 rows, pairs] */
        dq(buf, w + (size_t)32 * p * row_bytes, rows, K, 1);
        if (rows < 32) memset(buf + (size_t)rows * K, 0, (size_t)(32 - rows) * K * sizeof(float));
        /* Rounded row by row along K, where the loop vectorizes, then the 32 rows' pairs
         * transposed 16 pairs at a time: rounding while reading down the columns (K floats
         * apart) made the panels of the 1B model's 8192 x 2048 q4_k matrix take 14.7 ms on the
         * Zen 4 EPYC, 3x the float dequantizing. */
        for (size_t i = 0; i < (size_t)32 * pairs; i++)
            kp[i] = (uint32_t)f32_to_bf16_rne(buf[2 * i]) |
                    (uint32_t)f32_to_bf16_rne(buf[2 * i + 1]) << 16;
        uint32_t *o = (uint32_t *)panels + (size_t)p * pairs * 32;
        for (int j0 = 0; j0 < pairs; j0 += 16) {
            const int jn = pairs - j0 < 16 ? pairs - j0 : 16;
            for (int c = 0; c < 32; c++)
                for (int j = 0; j < jn; j++)
                    o[(size_t)(j0 + j) * 32 + c] = kp[(size_t)c * pairs + j0 + j];
        }
        free(buf);
    }
    if (failed) {  /* no error channel in this ABI, and unset panels must never pass silently */
        fprintf(stderr, "pagedlm dequant_bf16_panels: out of memory for %d x %d floats\n", 32, K);
        abort();
    }
}

#endif
