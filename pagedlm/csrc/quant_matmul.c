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
 * of input rows; rows of W are split across threads. q4_1 and q8_0 run on 8-bit activations
 * with integer dot products (see qmm below); i8 multiplies float x by its int8 weights. For
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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "include/pagedlm_ops.h"
#include "include/parallel.h"
#include "include/quant_common.h"
#include "include/vec_math.h"

#define QK 32
#define Q4_1_BYTES 20
#define Q8_0_BYTES 34
#define MTILE 4

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
 * Integer dot products on 8-bit activations, the scheme of llama.cpp's CPU backend (its Q8_0 /
 * Q8_1 activation blocks). Each thread quantizes the x rows it needs per 32-block,
 *     d_x = amax / 127,  q_x = round-half-even(x * (127 / amax)) as int8 (|q_x| <= 127),
 *     s_x = d_x * sum(q_x)  (for q4_1's offset),
 * and a weight block meets an x block as exact integer sums:
 *     q4_1: sum_j (d_w q_j + m_w) d_x q_x_j = (d_w d_x) sum_j q_j q_x_j + m_w s_x
 *     q8_0: (d_w d_x) sum_j q_j q_x_j
 * The 32 weight bytes meet the 32 x bytes in dot_u8s8 (quant_common.h: unsigned x signed,
 * quads to int32 exactly; vpdpbusd with VNNI, else vpmaddubsw and vpmaddwd, which never
 * saturate here): q4_1's nibbles are unsigned already, q8_0 moves the weights' signs onto x
 * (vpsignb). Lane l of the 8 int32 sums covers weights 4l..4l+3; one FMA per block adds
 * (d_w d_x) * lane into 8 float lanes, q4_1's m_w s_x goes into one scalar by FMA, and
 * y = hsum256(lanes) + scalar.
 *
 * Why: the float kernel this replaces decoded every weight block to 32 floats (4 conversions
 * and 4 FMAs with AVX2) for each tile of x rows; those instructions, not memory, bounded one
 * gguf stream (13.6 GB/s of the ~31 the float32 decode reads at). The activations lose
 * precision to 8 bits, as in llama.cpp: on SmolLM2's Q4_1 file the perplexity stays within
 * 0.1% of float32's (x0.9994, tests/models/test_quantization.py; benchmarks/quality.py's text
 * is long enough to take the dequantize + GEMM path, so its figure does not see this kernel).
 *
 * Batch invariance: an x row's quantization depends on that row alone, the integer sums are
 * exact and every output's float operations are the fixed sequence above over its blocks in
 * order, by one thread: the same bits at any M, tile position and thread count. The scalar
 * build (no AVX2) emulates the 8 lanes and hsum256's tree with fmaf, so it gives the very bits
 * of the AVX2 build (tests/kernels/test_quant_dot.py builds both); a VNNI build sums the very
 * integers of the AVX2 one, so it gives those bits too (tests/kernels/test_quant_vnni.py).
 * The kernel is 256-bit code on purpose: AVX-512 builds (the Xeons of the fleet) run it too,
 * with VNNI's vpdpbusd on 256 bits where they have it.
 */
#define QROWS 4
#define QXTILE 2

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

/* K/32 blocks of one x row as 8-bit blocks: q [K] int8, d [K/32] and, if s is not NULL,
 * s [K/32] = d * sum(q). */
static void quantize_row_q8(int8_t *q, float *d, float *s, const float *x, int K) {
    for (int b = 0; b < K / QK; b++) {
        const float *xb = x + (size_t)b * QK;
        int8_t *qb = q + (size_t)b * QK;
        float amax;
        int nonfinite;
#ifdef __AVX2__
        __m256 v[4], mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]);
            mx = _mm256_max_ps(mx, a);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ));
        }
        nonfinite = _mm256_movemask_ps(bad);
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
        amax = 0.0f;
        nonfinite = 0;
        for (int j = 0; j < QK; j++) {
            amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
            nonfinite |= !(fabsf(xb[j]) < INFINITY);
        }
#endif
        if (nonfinite) {
            /* A NaN or an infinity in the block: the row's outputs are NaN (the float product
             * gives NaN or an infinity). Quantized as the others, a NaN was dropped or kept by
             * its lane in the max, converted to INT_MIN (q = -128), and 127 / inf made x * 0 a
             * NaN: finite garbage came out, up to 1e7 with q4_1's offset term. */
            memset(qb, 0, QK);
            d[b] = NAN;
            if (s) s[b] = NAN;
            continue;
        }
        /* Below 2^-120, 127 / amax overflowed to inf and every q became -128 (the block's
         * sign and size wrong); such a block is 0 to 8 bits anyway. */
        const float dx = amax / 127.0f, id = amax >= 0x1p-120f ? 127.0f / amax : 0.0f;
        int sum = 0;
#ifdef __AVX2__
        __m256i i[4];
        for (int k = 0; k < 4; k++)
            i[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], _mm256_set1_ps(id)),
                                                      _MM_FROUND_TO_NEAREST_INT |
                                                      _MM_FROUND_NO_EXC));
        if (s) {
            const __m256i t = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]),
                                               _mm256_add_epi32(i[2], i[3]));
            __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            u = _mm_add_epi32(u, _mm_unpackhi_epi64(u, u));
            sum = _mm_cvtsi128_si32(_mm_add_epi32(u, _mm_shuffle_epi32(u, 1)));
        }
        /* packs interleave the 128-bit halves; the permute puts the 4-byte groups in order */
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]),
                                             _mm256_packs_epi32(i[2], i[3]));
        _mm256_storeu_si256((__m256i *)qb, _mm256_permutevar8x32_epi32(
            p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
        for (int j = 0; j < QK; j++) {
            qb[j] = (int8_t)nearbyintf(xb[j] * id);  /* ties to even, as _mm256_round_ps */
            sum += qb[j];
        }
#endif
        d[b] = dx;
        if (s) s[b] = dx * (float)sum;
    }
}

/* quantize_row_q8 on M rows (s for all of them), as the kernels do it: for the tests. */
void qmm_quantize_activations(int8_t *q, float *d, float *s, const float *x, int M, int K) {
    for (int m = 0; m < M; m++)
        quantize_row_q8(q + (size_t)m * K, d + (size_t)m * (K / QK), s + (size_t)m * (K / QK),
                        x + (size_t)m * K, K);
}

/* Rows of x quantized for one pass: q [rows, K], d and s [rows, K/32]. */
typedef struct {
    const int8_t *q;
    const float *d, *s;
} qx_t;

/* Weight j of a block as an integer: q4_1's nibble (0..15) or q8_0's int8. */
static inline int block_q(const uint8_t *blk, int j, const int fmt) {
    if (fmt == FMT_Q4_1) return j < 16 ? blk[4 + j] & 0x0f : blk[4 + j - 16] >> 4;
    return ((const int8_t *)(blk + 2))[j];
}

/* mt x rows (from row xr of X) against weight rows n .. n+rows-1 (rows <= QROWS). */
static inline __attribute__((always_inline)) void qgroup(
        float *y, const qx_t *X, int xr, const uint8_t *w, const int mt, const int rows, int N,
        int K, int n, const int fmt, const uint8_t *prefetch) {
    const int nb = K / QK, bytes = fmt == FMT_Q4_1 ? Q4_1_BYTES : Q8_0_BYTES;
    const size_t row_bytes = (size_t)nb * bytes;
    const uint8_t *wg = w + (size_t)n * row_bytes;
    float out[QXTILE][QROWS], summ[QXTILE][QROWS];
    for (int m = 0; m < mt; m++)
        for (int r = 0; r < rows; r++) summ[m][r] = 0.0f;
#if defined(__AVX2__) && defined(__F16C__)
    /* A q4_1 block's 16 nibble bytes, loaded into both halves, shifted by 4 in the high half
     * only (32-bit shifts: what crosses from the next byte lands in the masked-off nibble). */
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    __m256 acc[QXTILE][QROWS], summ8[QXTILE];
    for (int m = 0; m < mt; m++) {
        summ8[m] = _mm256_setzero_ps();
        for (int r = 0; r < rows; r++) acc[m][r] = _mm256_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        if (prefetch) {  /* the next group, spread over this group's blocks */
            const uint8_t *p = prefetch + (size_t)b * QROWS * bytes;
            _mm_prefetch((const char *)p, _MM_HINT_T0);
            _mm_prefetch((const char *)p + 64, _MM_HINT_T0);
        }
        /* The first 4 bytes of each row's block, as fp16 pairs by one vcvtph2ps: lane 2r is
         * row r's d, lane 2r+1 its m (q4_1; q8_0's is junk, never used). Times d_x, through
         * a stack slot: broadcasts from memory are loads, from a register shuffles. */
        __m128i h = _mm_cvtsi32_si128(load_u32(wg + (size_t)b * bytes));
        if (rows > 1) h = _mm_insert_epi32(h, load_u32(wg + row_bytes + (size_t)b * bytes), 1);
        if (rows > 2)
            h = _mm_insert_epi32(h, load_u32(wg + 2 * row_bytes + (size_t)b * bytes), 2);
        if (rows > 3)
            h = _mm_insert_epi32(h, load_u32(wg + 3 * row_bytes + (size_t)b * bytes), 3);
        const __m256 dm = _mm256_cvtph_ps(h);
        float sc[QXTILE][8] __attribute__((aligned(32)));
        __m256i xq[QXTILE];
        for (int m = 0; m < mt; m++) {
            const size_t xb = (size_t)(xr + m) * nb + b;
            xq[m] = _mm256_loadu_si256((const __m256i *)(X->q + (size_t)(xr + m) * K + b * QK));
            _mm256_store_ps(sc[m], _mm256_mul_ps(dm, _mm256_set1_ps(X->d[xb])));
            if (fmt == FMT_Q4_1)  /* lane 2r+1: m_r s_x (the even lanes are never read) */
                summ8[m] = _mm256_fmadd_ps(dm, _mm256_set1_ps(X->s[xb]), summ8[m]);
        }
        __asm__("" : "+m"(sc));  /* so the broadcasts read the slot rather than a register */
        for (int r = 0; r < rows; r++) {
            const uint8_t *blk = wg + r * row_bytes + (size_t)b * bytes;
            __m256i wq, wu;
            if (fmt == FMT_Q4_1) {
                wq = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 4)));
                wu = _mm256_and_si256(_mm256_srlv_epi32(wq, shift), low);
            } else {
                wq = _mm256_loadu_si256((const __m256i *)(blk + 2));
                wu = _mm256_sign_epi8(wq, wq);
            }
            for (int m = 0; m < mt; m++) {
                const __m256i xs = fmt == FMT_Q4_1 ? xq[m] : _mm256_sign_epi8(xq[m], wq);
                const __m256i isum = dot_u8s8(wu, xs);
                acc[m][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&sc[m][2 * r]),
                                            _mm256_cvtepi32_ps(isum), acc[m][r]);
            }
        }
    }
    for (int m = 0; m < mt; m++) {
        float sm[8] __attribute__((aligned(32)));
        _mm256_store_ps(sm, summ8[m]);
        for (int r = 0; r < rows; r++) {
            out[m][r] = hsum256(acc[m][r]);
            summ[m][r] = sm[2 * r + 1];
        }
    }
#else
    for (int m = 0; m < mt; m++)
        for (int r = 0; r < rows; r++) {
            float lane[8] = {0};
            const int8_t *xq = X->q + (size_t)(xr + m) * K;
            for (int b = 0; b < nb; b++) {
                const uint8_t *blk = wg + r * row_bytes + (size_t)b * bytes;
                const size_t xb = (size_t)(xr + m) * nb + b;
                const float scale = fp16_to_f32(load_u16(blk)) * X->d[xb];
                for (int l = 0; l < 8; l++) {
                    int isum = 0;
                    for (int j = 4 * l; j < 4 * l + 4; j++)
                        isum += block_q(blk, j, fmt) * xq[b * QK + j];
                    lane[l] = fmaf(scale, (float)isum, lane[l]);
                }
                if (fmt == FMT_Q4_1)
                    summ[m][r] = fmaf(fp16_to_f32(load_u16(blk + 2)), X->s[xb], summ[m][r]);
            }
            out[m][r] = hsum8_scalar(lane);
        }
#endif
    for (int m = 0; m < mt; m++)
        for (int r = 0; r < rows; r++)
            y[(size_t)m * N + n + r] = fmt == FMT_Q4_1 ? out[m][r] + summ[m][r] : out[m][r];
}

static inline __attribute__((always_inline)) void qtile(
        float *y, const qx_t *X, const uint8_t *w, int M, int N, int K, int n, const int rows,
        const int fmt, const uint8_t *next) {
    for (int m0 = 0; m0 < M; m0 += QXTILE) {
        float *ym = y + (size_t)m0 * N;
        const uint8_t *pf = m0 ? NULL : next;
        /* Constant tile heights let the compiler keep every sum in a register. */
        if (M - m0 >= QXTILE) qgroup(ym, X, m0, w, QXTILE, rows, N, K, n, fmt, pf);
        else qgroup(ym, X, m0, w, 1, rows, N, K, n, fmt, pf);
    }
}

/* x rows per pass over a thread's weight rows: each output is one call of qgroup whatever the
 * pass, so the blocking changes which rows share a pass, not any output's sum order. */
static inline int x_block_rows(int K) {
    const int rows = X_BLOCK_BYTES / K;  /* int8 rows */
    return rows < QXTILE ? QXTILE : rows - rows % QXTILE;
}

/* Weight rows [lo, hi) against all M rows of x. Each thread quantizes x itself: a row's
 * quantization is a small fraction of its dot products with hundreds of weight rows, and no
 * thread waits for another at a barrier. limbs 2: x in two 8-bit limbs as quant_kquants.c's
 * kq_rows takes it (its header): quantized rows 2m (x row m) and 2m + 1 (its residual) sum into
 * ys [2 rows, hi - lo], added into y. Returns -1 if scratch memory could not be had. */
static inline __attribute__((always_inline)) int qrows_range(
        float *y, const float *x, const uint8_t *w, int M, int N, int K, int lo, int hi,
        const int fmt, const int limbs) {
    if (lo >= hi) return 0;
    const int nb = K / QK, width = hi - lo;
    int mb = x_block_rows(K);
    if (limbs == 2) mb = mb / 2 < 1 ? 1 : mb / 2;  /* both limbs' bytes in the same L2 share */
    const int xrows = M < mb ? M : mb, qrows = limbs * xrows;
    const size_t group_bytes = (size_t)nb * (fmt == FMT_Q4_1 ? Q4_1_BYTES : Q8_0_BYTES) * QROWS;
    const size_t floats = limbs == 2 ? (size_t)K + (size_t)qrows * width : 0;
    float *scales = (float *)malloc((size_t)qrows * (2 * nb * sizeof(float) + K) +
                                    floats * sizeof(float));
    if (!scales) return -1;
    int8_t *q = (int8_t *)(scales + (size_t)2 * qrows * nb);
    float *res = (float *)(q + (size_t)qrows * K);  /* K is a multiple of 32: aligned */
    const qx_t X = {q, scales, scales + (size_t)qrows * nb};
    for (int m0 = 0; m0 < M; m0 += mb) {
        const int mt = M - m0 < mb ? M - m0 : mb, qt = limbs * mt;
        for (int m = 0; m < mt; m++) {
            const float *xm = x + (size_t)(m0 + m) * K;
            const int r = limbs * m;
            float *d = scales + (size_t)r * nb;
            quantize_row_q8(q + (size_t)r * K, d,
                            fmt == FMT_Q4_1 ? scales + (size_t)(qrows + r) * nb : NULL, xm, K);
            if (limbs == 2) {
                limb_residual(res, xm, q + (size_t)r * K, d, K);
                quantize_row_q8(q + (size_t)(r + 1) * K, d + nb,
                                fmt == FMT_Q4_1 ? scales + (size_t)(qrows + r + 1) * nb : NULL,
                                res, K);
            }
        }
        /* Where the sums go: y itself, or the limbs' rows of ys, whose column c is weight row
         * lo + c (qgroup indexes both by its n: the weights are then counted from row lo). */
        float *yb = limbs == 2 ? res + K : y + (size_t)m0 * N;
        const int ystride = limbs == 2 ? width : N, col0 = limbs == 2 ? lo : 0;
        const uint8_t *wb = w + (size_t)col0 * (group_bytes / QROWS);
        int n = lo;
        for (; n + QROWS <= hi; n += QROWS) {
            const uint8_t *next = n + 2 * QROWS <= hi
                                  ? w + (size_t)(n / QROWS + 1) * group_bytes : NULL;
            qtile(yb, &X, wb, qt, ystride, K, n - col0, QROWS, fmt, next);
        }
        for (; n < hi; n++) qtile(yb, &X, wb, qt, ystride, K, n - col0, 1, fmt, NULL);
        if (limbs == 2) add_limbs(y + (size_t)m0 * N + lo, N, yb, width, mt);
    }
    free(scales);
    return 0;
}

/* qrows_range compiled for each format and x precision, and on its own for M == 1 (decode),
 * with the tile loops resolved at compile time (an OpenMP region is outlined once, whatever is
 * inlined around it, so the choice is made before it). */
#define ROWS_FN(name, m, fmt, limbs)                                                          \
    static int name(float *y, const float *x, const uint8_t *w, int M, int N, int K, int lo, \
                    int hi) {                                                                 \
        (void)M;                                                                              \
        return qrows_range(y, x, w, m, N, K, lo, hi, fmt, limbs);                             \
    }
ROWS_FN(rows_q4_1_1, 1, FMT_Q4_1, 1)
ROWS_FN(rows_q4_1, M, FMT_Q4_1, 1)
ROWS_FN(rows_q8_0_1, 1, FMT_Q8_0, 1)
ROWS_FN(rows_q8_0, M, FMT_Q8_0, 1)
ROWS_FN(rows16_q4_1_1, 1, FMT_Q4_1, 2)
ROWS_FN(rows16_q4_1, M, FMT_Q4_1, 2)
ROWS_FN(rows16_q8_0_1, 1, FMT_Q8_0, 2)
ROWS_FN(rows16_q8_0, M, FMT_Q8_0, 2)

static void qmm(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads,
                const rows_fn rows) {
    run_quant_rows("quant_matmul", y, x, w, M, N, K, nthreads, QROWS, rows);
}

void qmm_q4_1(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads) {
    qmm(y, x, w, M, N, K, nthreads, M == 1 ? rows_q4_1_1 : rows_q4_1);
}

void qmm_q8_0(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads) {
    qmm(y, x, w, M, N, K, nthreads, M == 1 ? rows_q8_0_1 : rows_q8_0);
}

void qmm16_q4_1(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads) {
    qmm(y, x, w, M, N, K, nthreads, M == 1 ? rows16_q4_1_1 : rows16_q4_1);
}

void qmm16_q8_0(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads) {
    qmm(y, x, w, M, N, K, nthreads, M == 1 ? rows16_q8_0_1 : rows16_q8_0);
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
