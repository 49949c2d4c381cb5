/* Matmul and dequantization for ggml's K-quants and the 32-weight types llama-quantize falls
 * back to: y[M, N] = x[M, K] @ W^T with W kept in its GGUF blocks (W is [N, K], blocks run
 * along K, each row starts a new block).
 *
 *   q4_k (144 B / 256 w)  {fp16 d, fp16 dmin, 12 B of 6-bit scales and mins, 128 B nibbles}
 *   q5_k (176 B / 256 w)  q4_k plus 32 B of fifth bits
 *   q6_k (210 B / 256 w)  {128 B low nibbles, 64 B high 2 bits, 16 int8 scales, fp16 d}
 *   q3_k (110 B / 256 w)  {32 B high-bit mask, 64 B 2-bit, 12 B of 6-bit scales, fp16 d}
 *   q2_k  (84 B / 256 w)  {16 B of 4-bit scale|min, 64 B 2-bit, fp16 d, fp16 dmin}
 *   q5_0  (22 B / 32 w)   {fp16 d, 32 fifth bits, 16 B nibbles}: w = d (q - 16)
 *   q5_1  (24 B / 32 w)   {fp16 d, fp16 m, 32 fifth bits, 16 B nibbles}: w = d q + m
 *   iq4_nl (18 B / 32 w)  {fp16 d, 16 B nibbles}: w = d kvalues[q]
 *
 * Every one of them reads as small integers: per 16 weights g an integer multiplier sc_g and
 * an integer min mn_g, per block floats d and dmin (iblock_t), and
 *     w_j = (d * sc_g) * q_j - dmin * mn_g
 * which is what gguf-py's dequantize computes, step for step in float32: every product but
 * q6_k's last is exact (an fp16 times integers of at most 11 bits together), so the one
 * rounding per step is the same in any evaluation order and with or without FMA contraction,
 * in the scalar and the vector builds alike.
 *
 * The matmul quantizes x per 32-block to 8 bits exactly as quant_matmul.c's q4_1/q8_0 kernels
 * do (qmm_quantize_activations: d_x, q_x, s_x = d_x sum q_x), and for each 32-block b of a row
 * sums exactly in integers, in 8 lanes l of 4 weights each (lane l: weights 4l..4l+3):
 *     I_l = sum_j sc_g q_j q_x_j                        (vpmaddubsw, vpmaddwd by sc_g)
 *     acc_l = fma(d * d_x, I_l, acc_l)
 * and the mins: per 32-block mins (q4_k, q5_k; q5_1 as mn = -1, dmin = m) as
 *     summ_(b mod 8) = fma(dmin * mn_b, s_x, summ_(b mod 8)),
 * per 16 (q2_k) as an integer sum J_l = sum_j mn_g q_x_j, summ_l = fma(dmin * d_x, J_l, summ_l).
 * Then y = hsum256(acc) - hsum256(summ). Signed weights (q6_k, q3_k, q5_0, iq4_nl) meet x with
 * the sign moved onto x (vpsignb), as q8_0 does; no int16 pair can saturate (largest:
 * iq4_nl's 2 * 127 * 127).
 *
 * Batch invariance: as in quant_matmul.c, each output is that fixed sequence over its row's
 * blocks in order, by one thread, from an x row quantized on its own: the same bits at any M,
 * tile position and thread count. The scalar build (no AVX2) unpacks every block into
 * iblock_t and runs the same lanes with fmaf: the very bits of the AVX2 build
 * (tests/kernels/test_kquant_kernels.py). q4_k, q5_k, q6_k and the 32-weight types unpack in
 * AVX2 registers; q3_k and q2_k unpack through the scalar iblock_t, then dot in AVX2.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "include/pagedlm_ops.h"
#include "include/parallel.h"
#include "include/quant_common.h"
#include "include/vec_math.h"

#define QK 32
#define QK_K 256
#define XT 2
/* as in quant_matmul.c */
#define PAR_MIN_WEIGHTS (1 << 15)
#define X_BLOCK_BYTES (128 * 1024)

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define KQ_AVX2 1
#endif

enum { F_Q4_K, F_Q5_K, F_Q6_K, F_Q3_K, F_Q2_K, F_Q5_0, F_Q5_1, F_IQ4_NL };
static const int BLOCK_W[] = {256, 256, 256, 256, 256, 32, 32, 32};
static const int BLOCK_B[] = {144, 176, 210, 110, 84, 22, 24, 18};
static const int8_t IQ4NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                        1,    13,   25,  38,  53,  69,  89,  113};

/* One block as integers: w_j = (d * sc[j / 16]) * q_j - dmin * mn[j / 16]. */
typedef struct {
    int8_t q[QK_K];
    int8_t sc[QK_K / 16], mn[QK_K / 16];
    float d, dmin;
} iblock_t;

/* q4_k / q5_k: 8 six-bit scales and mins from 12 bytes (ggml's get_scale_min_k4). */
static inline void k4_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

static void unpack(const int fmt, const uint8_t *b, iblock_t *u) {
    uint8_t sc8[8], mn8[8];
    u->dmin = 0.0f;
    memset(u->mn, 0, sizeof u->mn);
    memset(u->sc, 1, sizeof u->sc);
    switch (fmt) {
    case F_Q4_K:
    case F_Q5_K: {
        const uint8_t *qs = b + (fmt == F_Q4_K ? 16 : 48), *qh = b + 16;
        u->d = fp16_to_f32(load_u16(b));
        u->dmin = fp16_to_f32(load_u16(b + 2));
        k4_scales(b + 4, sc8, mn8);
        for (int g = 0; g < 16; g++) {
            u->sc[g] = (int8_t)sc8[g / 2];
            u->mn[g] = (int8_t)mn8[g / 2];
        }
        for (int s = 0; s < 8; s++)
            for (int l = 0; l < 32; l++) {
                int q = (qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0f;
                if (fmt == F_Q5_K) q |= ((qh[l] >> s) & 1) << 4;
                u->q[32 * s + l] = (int8_t)q;
            }
        break;
    }
    case F_Q6_K:
        u->d = fp16_to_f32(load_u16(b + 208));
        memcpy(u->sc, b + 192, 16);
        for (int j = 0; j < QK_K; j++) {
            const int h = j / 128, s = (j % 128) / 32, l = j % 32;
            const int lo = (b[64 * h + 32 * (s % 2) + l] >> (4 * (s / 2))) & 0x0f;
            const int hi = (b[128 + 32 * h + l] >> (2 * s)) & 3;
            u->q[j] = (int8_t)((lo | (hi << 4)) - 32);
        }
        break;
    case F_Q3_K:
        u->d = fp16_to_f32(load_u16(b + 108));
        for (int g = 0; g < 16; g++) {
            const int lo = (b[96 + g % 8] >> (4 * (g / 8))) & 0x0f;
            const int hi = (b[104 + g % 4] >> (2 * (g / 4))) & 3;
            u->sc[g] = (int8_t)((lo | (hi << 4)) - 32);
        }
        for (int j = 0; j < QK_K; j++) {
            const int h = j / 128, s = (j % 128) / 32, l = j % 32;
            const int lo = (b[32 + 32 * h + l] >> (2 * s)) & 3;
            u->q[j] = (int8_t)(lo - (((b[l] >> (j / 32)) & 1) ? 0 : 4));
        }
        break;
    case F_Q2_K:
        u->d = fp16_to_f32(load_u16(b + 80));
        u->dmin = fp16_to_f32(load_u16(b + 82));
        for (int g = 0; g < 16; g++) {
            u->sc[g] = (int8_t)(b[g] & 0x0f);
            u->mn[g] = (int8_t)(b[g] >> 4);
        }
        for (int j = 0; j < QK_K; j++)
            u->q[j] = (int8_t)((b[16 + 32 * (j / 128) + j % 32] >> (2 * ((j % 128) / 32))) & 3);
        break;
    default: { /* the 32-weight types */
        const uint8_t *qs = b + (fmt == F_Q5_0 ? 6 : fmt == F_Q5_1 ? 8 : 2);
        const uint32_t qh = fmt == F_IQ4_NL ? 0 : (uint32_t)load_u32(b + (fmt == F_Q5_0 ? 2 : 4));
        u->d = fp16_to_f32(load_u16(b));
        if (fmt == F_Q5_1) {
            u->dmin = fp16_to_f32(load_u16(b + 2));
            u->mn[0] = u->mn[1] = -1;
        }
        for (int j = 0; j < QK; j++) {
            const int lo = j < 16 ? qs[j] & 0x0f : qs[j - 16] >> 4;
            const int q = lo | (int)((qh >> j) & 1) << 4;
            u->q[j] = (int8_t)(fmt == F_IQ4_NL ? IQ4NL_VALUES[lo] : fmt == F_Q5_0 ? q - 16 : q);
        }
    }
    }
}

/* ---------------------------------------------------------------- dequantize */

static void dequant(const int fmt, float *out, const uint8_t *w, int N, int K, int nthreads) {
    const int bw = BLOCK_W[fmt], nb = K / bw;
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if ((long)N * K >= PAR_MIN_WEIGHTS && nthreads > 1)
    for (int n = 0; n < N; n++) {
        iblock_t u;
        for (int b = 0; b < nb; b++) {
            unpack(fmt, w + ((size_t)n * nb + b) * BLOCK_B[fmt], &u);
            float *o = out + (size_t)n * K + (size_t)b * bw;
            for (int g = 0; g < bw / 16; g++) {
                const float dl = u.d * (float)u.sc[g], ml = u.dmin * (float)u.mn[g];
                for (int j = 16 * g; j < 16 * g + 16; j++) o[j] = dl * (float)u.q[j] - ml;
            }
        }
    }
}

/* ---------------------------------------------------------------- matmul */

/* x rows quantized for one pass: q [rows, K], d and s [rows, K/32]. */
typedef struct {
    const int8_t *q;
    const float *d, *s;
    int K;
} qx_t;

#ifdef KQ_AVX2
/* 32 weights w (int8; signed: -128..127 meeting x by vpsignb, else 0..127) with int16
 * multipliers sc16 (the low 128 bits for weights 0..15, the high for 16..31) against x block
 * gb of mt rows: acc[m] += S[8 m] * lanes. */
static inline __attribute__((always_inline)) void dot32(__m256 *acc, const int mt,
                                                        const qx_t *X, int xr, int gb,
                                                        const float *S, __m256i w, __m256i sc16,
                                                        const int sgn) {
    const __m256i wu = sgn ? _mm256_sign_epi8(w, w) : w;
    for (int m = 0; m < mt; m++) {
        __m256i x = _mm256_loadu_si256(
            (const __m256i *)(X->q + (size_t)(xr + m) * X->K + (size_t)gb * QK));
        if (sgn) x = _mm256_sign_epi8(x, w);
        const __m256i i = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, x), sc16);
        acc[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(S + 8 * m), _mm256_cvtepi32_ps(i), acc[m]);
    }
}

/* int16 lanes: the first 8 hold word a of each 128-bit half of v, the last 8 word b. */
static inline __m256i pick16(__m256i v, int a, int b) {
    return _mm256_shuffle_epi8(v, _mm256_set_m128i(_mm_set1_epi16((short)(0x0100 + 0x202 * b)),
                                                   _mm_set1_epi16((short)(0x0100 + 0x202 * a))));
}
#endif

/* Weight row `wrow` against x rows xr .. xr+mt-1: y[m * N + n]. */
static inline __attribute__((always_inline)) void kq_row(float *y, const qx_t *X, int xr,
                                                         const int mt, const uint8_t *wrow,
                                                         int N, int n, const int fmt) {
    const int bw = BLOCK_W[fmt], bb = BLOCK_B[fmt], K = X->K, nb = K / bw, nbx = K / QK;
#ifdef KQ_AVX2
    __m256 acc[XT], summ[XT];
    float sm1[XT][8] __attribute__((aligned(32)));  /* q5_1's mins, lane b mod 8 */
    for (int m = 0; m < mt; m++) {
        acc[m] = summ[m] = _mm256_setzero_ps();
        if (fmt == F_Q5_1) memset(sm1[m], 0, sizeof sm1[m]);
    }
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int bi = 0; bi < nb; bi++) {
        const uint8_t *b = wrow + (size_t)bi * bb;
        const int gb0 = bi * (bw / QK);
        float S[XT * 8] __attribute__((aligned(32)));
        if (bw == QK_K) {
            const float d = fp16_to_f32(load_u16(b + (fmt == F_Q6_K ? 208 : fmt == F_Q3_K ? 108
                                                     : fmt == F_Q2_K ? 80 : 0)));
            for (int m = 0; m < mt; m++)
                _mm256_store_ps(S + 8 * m, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(
                    X->d + (size_t)(xr + m) * nbx + gb0)));
        } else {
            const float d = fp16_to_f32(load_u16(b));
            for (int m = 0; m < mt; m++) S[8 * m] = d * X->d[(size_t)(xr + m) * nbx + gb0];
        }
        __asm__("" : "+m"(S));  /* so the broadcasts read the slot rather than a register */
        if (fmt == F_Q4_K || fmt == F_Q5_K) {
            uint8_t sc8[16] __attribute__((aligned(16))), mn8[8];
            k4_scales(b + 4, sc8, mn8);
            const __m256 mins = _mm256_mul_ps(
                _mm256_set1_ps(fp16_to_f32(load_u16(b + 2))),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn8))));
            for (int m = 0; m < mt; m++)
                summ[m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(X->s + (size_t)(xr + m) * nbx
                                                                + gb0), summ[m]);
            const __m256i scv = _mm256_broadcastsi128_si256(
                _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc8)));
            const uint8_t *qs = b + (fmt == F_Q4_K ? 16 : 48);
            const __m256i qh = fmt == F_Q5_K ? _mm256_loadu_si256((const __m256i *)(b + 16))
                                             : _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
                __m256i q0 = _mm256_and_si256(v, low4);
                __m256i q1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                if (fmt == F_Q5_K) {
                    const __m256i one8 = _mm256_set1_epi8(1);
                    q0 = _mm256_or_si256(q0, _mm256_slli_epi16(
                        _mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), one8), 4));
                    q1 = _mm256_or_si256(q1, _mm256_slli_epi16(
                        _mm256_and_si256(_mm256_srli_epi16(qh, 2 * i + 1), one8), 4));
                }
                dot32(acc, mt, X, xr, gb0 + 2 * i, S + 2 * i, q0,
                      pick16(scv, 2 * i, 2 * i), 0);
                dot32(acc, mt, X, xr, gb0 + 2 * i + 1, S + 2 * i + 1, q1,
                      pick16(scv, 2 * i + 1, 2 * i + 1), 0);
            }
        } else if (fmt == F_Q6_K) {
            const __m256i scv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
            const __m256i three = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
            for (int h = 0; h < 2; h++) {
                const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
                const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                const __m256i sch = _mm256_permute2x128_si256(scv, scv, h ? 0x11 : 0x00);
                for (int s = 0; s < 4; s++) {
                    const __m256i lo = s & 1 ? ql1 : ql0;
                    const __m256i nib = s < 2 ? _mm256_and_si256(lo, low4)
                                              : _mm256_and_si256(_mm256_srli_epi16(lo, 4), low4);
                    const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), three);
                    const __m256i q = _mm256_sub_epi8(
                        _mm256_or_si256(nib, _mm256_slli_epi16(hb, 4)), off);
                    dot32(acc, mt, X, xr, gb0 + 4 * h + s, S + 4 * h + s, q,
                          pick16(sch, 2 * s, 2 * s + 1), 1);
                }
            }
        } else if (fmt == F_Q3_K || fmt == F_Q2_K) {
            iblock_t u;
            unpack(fmt, b, &u);
            float Sm[XT * 8] __attribute__((aligned(32)));
            if (fmt == F_Q2_K)
                for (int m = 0; m < mt; m++)
                    _mm256_store_ps(Sm + 8 * m, _mm256_mul_ps(
                        _mm256_set1_ps(u.dmin),
                        _mm256_loadu_ps(X->d + (size_t)(xr + m) * nbx + gb0)));
            for (int s = 0; s < 8; s++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(u.q + 32 * s));
                const __m256i sc16 = _mm256_set_m128i(_mm_set1_epi16(u.sc[2 * s + 1]),
                                                      _mm_set1_epi16(u.sc[2 * s]));
                dot32(acc, mt, X, xr, gb0 + s, S + s, q, sc16, fmt == F_Q3_K);
                if (fmt == F_Q2_K) {
                    const __m256i mn = _mm256_set_m128i(_mm_set1_epi8(u.mn[2 * s + 1]),
                                                        _mm_set1_epi8(u.mn[2 * s]));
                    dot32(summ, mt, X, xr, gb0 + s, Sm + s, mn, ones, 0);
                }
            }
        } else { /* the 32-weight types */
            const uint8_t *qs = b + (fmt == F_Q5_0 ? 6 : fmt == F_Q5_1 ? 8 : 2);
            const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
            __m256i q = _mm256_and_si256(
                _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), low4);
            if (fmt == F_IQ4_NL) {
                q = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(
                    _mm_loadu_si128((const __m128i *)IQ4NL_VALUES)), q);
            } else { /* byte j gets 16 where bit j of qh is set */
                const __m256i bytes = _mm256_shuffle_epi8(
                    _mm256_set1_epi32(load_u32(b + (fmt == F_Q5_0 ? 2 : 4))),
                    _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                       0x0303030303030303LL));
                const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
                const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
                q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
                if (fmt == F_Q5_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
            }
            dot32(acc, mt, X, xr, gb0, S, q, ones, fmt != F_Q5_1);
            if (fmt == F_Q5_1) {
                const float mterm = fp16_to_f32(load_u16(b + 2)) * -1.0f;
                for (int m = 0; m < mt; m++)
                    sm1[m][gb0 & 7] = fmaf(mterm, X->s[(size_t)(xr + m) * nbx + gb0],
                                           sm1[m][gb0 & 7]);
            }
        }
    }
    for (int m = 0; m < mt; m++) {
        if (fmt == F_Q5_1) summ[m] = _mm256_load_ps(sm1[m]);
        y[(size_t)m * N + n] = hsum256(acc[m]) - hsum256(summ[m]);
    }
#else
    float acc[XT][8], summ[XT][8];
    memset(acc, 0, sizeof acc);
    memset(summ, 0, sizeof summ);
    iblock_t u;
    for (int bi = 0; bi < nb; bi++) {
        unpack(fmt, wrow + (size_t)bi * bb, &u);
        for (int s = 0; s < bw / QK; s++) {
            const int gb = bi * (bw / QK) + s;
            const int8_t *wq = u.q + QK * s;
            for (int m = 0; m < mt; m++) {
                const size_t xb = (size_t)(xr + m) * nbx + gb;
                const int8_t *xq = X->q + (size_t)(xr + m) * K + (size_t)gb * QK;
                const float S = u.d * X->d[xb];
                for (int l = 0; l < 8; l++) {
                    int isum = 0, msum = 0;
                    for (int j = 4 * l; j < 4 * l + 4; j++) {
                        isum += u.sc[2 * s + j / 16] * wq[j] * xq[j];
                        msum += u.mn[2 * s + j / 16] * xq[j];
                    }
                    acc[m][l] = fmaf(S, (float)isum, acc[m][l]);
                    if (fmt == F_Q2_K)
                        summ[m][l] = fmaf(u.dmin * X->d[xb], (float)msum, summ[m][l]);
                }
                if (fmt == F_Q4_K || fmt == F_Q5_K || fmt == F_Q5_1)
                    summ[m][gb & 7] = fmaf(u.dmin * (float)u.mn[2 * s], X->s[xb], summ[m][gb & 7]);
            }
        }
    }
    for (int m = 0; m < mt; m++)
        y[(size_t)m * N + n] = hsum8_scalar(acc[m]) - hsum8_scalar(summ[m]);
#endif
}

/* Weight rows [lo, hi) against all M rows of x, each thread quantizing x itself (see
 * quant_matmul.c's qrows_range). Returns -1 if scratch memory could not be had. */
static inline __attribute__((always_inline)) int kq_rows(float *y, const float *x,
                                                         const uint8_t *w, int M, int N, int K,
                                                         int lo, int hi, const int fmt) {
    if (lo >= hi) return 0;
    const int nbx = K / QK;
    int mb = X_BLOCK_BYTES / K;
    mb = mb < XT ? XT : mb - mb % XT;
    const int xrows = M < mb ? M : mb;
    const size_t row_bytes = (size_t)(K / BLOCK_W[fmt]) * BLOCK_B[fmt];
    float *scales = (float *)malloc((size_t)xrows * (2 * nbx * sizeof(float) + K));
    if (!scales) return -1;
    int8_t *q = (int8_t *)(scales + (size_t)2 * xrows * nbx);
    for (int m0 = 0; m0 < M; m0 += mb) {
        const int mt = M - m0 < mb ? M - m0 : mb;
        qmm_quantize_activations(q, scales, scales + (size_t)xrows * nbx, x + (size_t)m0 * K,
                                 mt, K);
        const qx_t X = {q, scales, scales + (size_t)xrows * nbx, K};
        float *ym = y + (size_t)m0 * N;
        for (int n = lo; n < hi; n++) {
            const uint8_t *wrow = w + (size_t)n * row_bytes;
            int r = 0;
            /* Constant tile heights let the compiler keep every sum in a register. */
            for (; r + XT <= mt; r += XT) kq_row(ym + (size_t)r * N, &X, r, XT, wrow, N, n, fmt);
            for (; r < mt; r++) kq_row(ym + (size_t)r * N, &X, r, 1, wrow, N, n, fmt);
        }
    }
    free(scales);
    return 0;
}

typedef int (*rows_fn)(float *, const float *, const uint8_t *, int, int, int, int, int);

static void kq_matmul(float *y, const float *x, const uint8_t *w, int M, int N, int K,
                      int nthreads, const rows_fn rows) {
    int failed = 0;
    if ((long)N * K < PAR_MIN_WEIGHTS || nthreads < 2) {
        failed = rows(y, x, w, M, N, K, 0, N);
    } else {
#pragma omp parallel num_threads(nthreads) reduction(|: failed)
        {
            int lo, hi;
            omp_thread_rows(N, 4, &lo, &hi);
            failed |= rows(y, x, w, M, N, K, lo, hi);
        }
    }
    if (failed) {  /* no error channel in this ABI, and a wrong y must never pass silently */
        fprintf(stderr, "pagedlm quant_kquants: out of memory for %d x %d activations\n", M, K);
        abort();
    }
}

/* Each format compiled on its own, and for M == 1 (decode) with the tile loop resolved. */
#define KQ_FORMAT(name, fmt)                                                                  \
    static int rows_##name##_1(float *y, const float *x, const uint8_t *w, int M, int N,      \
                               int K, int lo, int hi) {                                       \
        (void)M;                                                                              \
        return kq_rows(y, x, w, 1, N, K, lo, hi, fmt);                                        \
    }                                                                                         \
    static int rows_##name(float *y, const float *x, const uint8_t *w, int M, int N, int K,   \
                           int lo, int hi) {                                                  \
        return kq_rows(y, x, w, M, N, K, lo, hi, fmt);                                        \
    }                                                                                         \
    void qmm_##name(float *y, const float *x, const uint8_t *w, int M, int N, int K,          \
                    int nthreads) {                                                           \
        kq_matmul(y, x, w, M, N, K, nthreads, M == 1 ? rows_##name##_1 : rows_##name);        \
    }                                                                                         \
    void dequant_##name(float *out, const uint8_t *w, int N, int K, int nthreads) {           \
        dequant(fmt, out, w, N, K, nthreads);                                                 \
    }
KQ_FORMAT(q4_k, F_Q4_K)
KQ_FORMAT(q5_k, F_Q5_K)
KQ_FORMAT(q6_k, F_Q6_K)
KQ_FORMAT(q3_k, F_Q3_K)
KQ_FORMAT(q2_k, F_Q2_K)
KQ_FORMAT(q5_0, F_Q5_0)
KQ_FORMAT(q5_1, F_Q5_1)
KQ_FORMAT(iq4_nl, F_IQ4_NL)
