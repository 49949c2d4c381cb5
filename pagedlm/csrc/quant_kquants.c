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
 * do (qmm_quantize_activations: d_x, q_x, s_x = d_x sum q_x; q6_k also the sums of q_x over
 * each 16, bs). For each 32-block b of a row it sums exactly in integers, in 8 lanes l of 4
 * weights each (lane l: weights 4l..4l+3), and adds one float FMA per lane:
 *     I_l = sum_j c_g u_j q_x_j         (quant_common.h: c = 1 dot_u8s8, else dot_u8s8_scaled)
 *     acc_l = fma(S_b, I_l, acc_l)
 *   q6_k:       u = q + 32 (0..63), c = sc_g, S_b = d * d_x
 *   q3_k:       u = q (signed: its sign moves onto x by vpsignb, as q8_0's), c = sc_g
 *   q2_k:       u = q, c = sc_g;  q5_0, iq4_nl: u = q (signed), c = 1;  q5_1: u = q, c = 1
 * and the offsets apart, 8 lanes per row summed the same way:
 *   q4_k, q5_k, q5_1:  summ_(b mod 8) = fma(dmin * mn_b, s_x, summ_(b mod 8))  (q5_1: -m)
 *   q6_k:              summ_(b mod 8) = fma(S_b, 32 (sc_2b bs_2b + sc_2b+1 bs_2b+1), ...)
 *   q2_k:              summ_l = fma(dmin * d_x, sum_j mn_g q_x_j, summ_l)
 * Then y = hsum256(acc) - hsum256(summ). No int16 pair can saturate (no u exceeds 128: see
 * dot_u8s8), and every integer converted to float is below 2^24.
 * q4_k and q5_k (u = q, unsigned; c = 1) sum a whole block in integers before its float
 * steps: the 128 bytes of nibbles are 4 chunks of 32 (chunk i: 32-block 2i in the low
 * nibbles, 2i + 1 in the high; q5_k's fifth bits, bits 2i and 2i + 1 of qh's byte of the same
 * weight, follow by a shuffle and a variable shift of qh's dwords), and a 4 x 4
 * dword transpose of the chunks (within each 128-bit lane: 8 unpacks) puts chunk l mod 4 in
 * lane l, so lane l of the low nibbles sums 32-block 2 (l mod 4) and of the high nibbles
 * 2 (l mod 4) + 1, 16 weights each over the 4 transposed vectors; x is stored in that order
 * (k4_order_x, once a call). Then per block and lane two FMAs:
 *     acc_l = fma(S_(2 (l mod 4)), I_lo_l, acc_l);  acc_l = fma(S_(2 (l mod 4) + 1), I_hi_l, acc_l)
 * with S_b = (d * sc_b) * d_x as before: 2 FMAs a block instead of 8, and no vpermps of S per
 * 32 weights. On the Zen 4 EPYC, M = 1, 2 threads, medians of 7 rounds alternating with the
 * build before in one process: from cache 35.5 -> 46.5 GB/s of blocks ([1, 2048] x [8192,
 * 2048]) and 37.4 -> 48.2 ([1, 8192] x [2048, 8192]); from memory, in a slow phase of the
 * host's memory (a plain sum read 34-36 GB/s), 33.3 -> 34.3 and 29.9 -> 32.1; q5_k from cache
 * 36.3 -> 42.1 and 37.3 -> 42.7, from memory 30.9 -> 35.8 and 33.1 -> 37.9.
 * Each weight row has its own chain of FMAs, so 4 rows go together (kq_group) to keep 4 chains
 * in flight.
 *
 * Two limbs (qmm16_<fmt>, under PAGEDLM_PRECISE_ACTIVATIONS): 8 bits of x flip a flat
 * distribution's near-ties against a float reference on the dequantized weights. So x row m
 * goes in as two quantized rows, x itself (q_hi, d_hi) and its residual r = fmaf(-d_hi, q_hi,
 * x) (|r| <= d_hi / 2, quantized in turn), the pair one tile of x rows: y = (W q_hi d_hi) +
 * (W q_lo d_lo), each sum as above. x is then held to about 1 / (127 * 254) of its block's
 * largest |x|. The weight bytes are read once for both limbs, but the dot products double
 * (kernels/quant.py's TWO_LIMB_FORMATS has the cost), hence not the default.
 *
 * Batch invariance: as in quant_matmul.c, each output is that fixed sequence over its row's
 * blocks in order, by one thread, from an x row quantized on its own: the same bits at any M,
 * tile position and thread count. The scalar build (no AVX2) unpacks every block into
 * iblock_t and runs the same lanes with fmaf: the very bits of the AVX2 build
 * (tests/kernels/test_kquant_kernels.py). Every type unpacks in AVX2 registers into the same
 * integers unpack() gives. q3_k and q2_k went through the scalar iblock_t until issue 33, 5x
 * q4_k's time per weight; unpacked in registers, on the AVX-512 Xeon at [1, 2048] x [2048, 2048]
 * from cache, one thread (medians): q3_k 712 -> 196 us (2.5 -> 9.2 GB/s of blocks), q2_k
 * 505 -> 176 us (2.7 -> 7.8 GB/s), q4_k 108-132 us (18-22 GB/s), so 1.3-1.8x q4_k's time per
 * weight; at M = 8 q3_k 2.9x and q2_k 1.7x faster than before; two threads the same ratios.
 * With VNNI the c = 1 dots take vpdpbusd, the same integers, so the same bits
 * (tests/kernels/test_quant_vnni.py).
 *
 * AVX-512 (F, BW, DQ, VL): q4_k, q5_k and q6_k put two weight rows in one zmm (kq_pair_block:
 * row r in lanes 0..7, row r + 1 in 8..15, the x block broadcast to both halves, each half's S
 * picked by vpermps), so every row keeps exactly the 256-bit lanes, integers and FMA chain
 * (tests/kernels/test_kquant_kernels.py: the build without AVX-512 gives the same bits); q4_k's
 * 6-bit scales of both rows unpack in one ymm (scalar, as k4_scales, they were 60 of the 140
 * instructions of a pair of blocks), q6_k's high bits merge by one shift and a vpternlog.
 * Intel runs 512-bit vector ops on 2 ports where 256-bit ones have 3 (Zen 4 splits them in
 * two), so the gain from cache is the fewer instructions, far from 2x. From memory one core
 * was the limit, not the arithmetic: q4_k read 8-9 GB/s of blocks where a plain float32 sum
 * streams 12 GB/s, as its 4 rows interleaved, prefetched into L1, kept few lines in flight; so
 * at M = 1 the pair path runs one pair of rows over all its blocks, then the next (2 streams),
 * and prefetches the next rows into L2. On the 2-core AVX-512 Xeon (load average 4-5 from
 * other work), one thread, thread CPU time, medians of 11 rounds interleaved with the 256-bit
 * build: from memory (> 100 MB of distinct weights), M = 1, q4_k [1, 2048] x [8192, 2048]
 * 1262 -> 1129 us (7.5 -> 8.4 GB/s of blocks), [1, 8192] x [2048, 8192] 1098 -> 977 us (8.6
 * -> 9.7), q6_k 1710 -> 1352 us (8.0 -> 10.2) and 1551 -> 1354 us (8.9 -> 10.2), the 2.4 MB
 * [2048, 2048] ones 0.99-1.02x; from cache, M = 1, 0.97-1.11x (q4_k [1, 8192] x [2048, 8192]
 * 524 -> 472 us, 18.0 -> 20.0 GB/s); M = 8 1.11-1.21x from cache and memory (but the 2.4 MB
 * q4_k from memory, 1.00x); q5_k [1, 8192] x [2048, 8192] 1.02-1.04x at M = 1, 1.15-1.18x at 8.
 * Tried and dropped: 4 rows (2 zmm chains) at M = 1, as the 256-bit code does (5-8% faster
 * from cache, 5-20% slower from memory), 8 rows (slower), q6_k by vpdpbusd and the scale as an
 * exact float product (no faster than vpmaddubsw + vpmaddwd), prefetching 2 groups or 8 KiB
 * ahead (within the noise). The other formats stay 256-bit, their prefetch into L1.
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
/* x rows a tile on the AVX-512 pair path (kq_pair_block): one pair's blocks unpacked once for
 * 4 x rows instead of 2 (12 of the 32 zmm registers hold their sums and S). On the Zen 4 EPYC,
 * 2 threads, [M, 2048] x [8192, 2048] and [M, 8192] x [2048, 8192] from cache, medians of 21
 * calls alternating with the XT = 2 build in one process, at M = 4..128: q4_k 1.11-1.13x
 * (6.53 -> 5.85 ms at M = 32), q5_k 1.16-1.18x, q6_k 1.16-1.24x (8.75 -> 7.18 ms), M = 1 and
 * 2 unchanged. 8 x rows: no faster for q4_k, slower for q6_k. Each output keeps its chain, so
 * the bits do not change. */
#define XTP 4
#define X_BLOCK_BYTES (128 * 1024)

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define KQ_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define KQ_AVX512 1
#endif
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

/* q4_k / q5_k: 8 six-bit scales and 8 mins from 12 bytes: bytes 0..3 hold scales 0..3 in
 * their low 6 bits, 4..7 mins 0..3; 8..11 the low 4 bits of scales 4..7 (low nibble) and mins
 * 4..7 (high nibble), whose top 2 bits are the top bits of bytes 0..3 and 4..7. Four bytes at a
 * time (little-endian). */
static inline void k4_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    const uint32_t s0 = (uint32_t)load_u32(s), s1 = (uint32_t)load_u32(s + 4);
    const uint32_t s2 = (uint32_t)load_u32(s + 8), lo6 = 0x3f3f3f3fu, lo4 = 0x0f0f0f0fu;
    const uint32_t v[4] = {s0 & lo6, (s2 & lo4) | (((s0 >> 6) & 0x03030303u) << 4), s1 & lo6,
                           ((s2 >> 4) & lo4) | (((s1 >> 6) & 0x03030303u) << 4)};
    memcpy(sc, v, 8);
    memcpy(mn, v + 2, 8);
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
        /* loops of constant trip counts and shifts, so that they vectorize */
        for (int i = 0; i < 4; i++)
            for (int l = 0; l < 32; l++) {
                const int v = qs[32 * i + l], h = fmt == F_Q5_K ? qh[l] >> (2 * i) : 0;
                u->q[64 * i + l] = (int8_t)((v & 0x0f) | (h & 1) << 4);
                u->q[64 * i + 32 + l] = (int8_t)((v >> 4) | (h & 2) << 3);
            }
        break;
    }
    case F_Q6_K:
        u->d = fp16_to_f32(load_u16(b + 208));
        memcpy(u->sc, b + 192, 16);
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const int l0 = b[64 * h + l], l1 = b[64 * h + 32 + l], hi = b[128 + 32 * h + l];
                int8_t *q = u->q + 128 * h + l;
                q[0] = (int8_t)(((l0 & 0x0f) | (hi & 3) << 4) - 32);
                q[32] = (int8_t)(((l1 & 0x0f) | (hi & 0x0c) << 2) - 32);
                q[64] = (int8_t)(((l0 >> 4) | (hi & 0x30)) - 32);
                q[96] = (int8_t)(((l1 >> 4) | (hi & 0xc0) >> 2) - 32);
            }
        break;
    case F_Q3_K:
        u->d = fp16_to_f32(load_u16(b + 108));
        for (int g = 0; g < 16; g++) {
            const int lo = (b[96 + g % 8] >> (4 * (g / 8))) & 0x0f;
            const int hi = (b[104 + g % 4] >> (2 * (g / 4))) & 3;
            u->sc[g] = (int8_t)((lo | (hi << 4)) - 32);
        }
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int l = 0; l < 32; l++)
                    u->q[128 * h + 32 * s + l] = (int8_t)(((b[32 + 32 * h + l] >> (2 * s)) & 3) -
                                                          4 + 4 * ((b[l] >> (4 * h + s)) & 1));
        break;
    case F_Q2_K:
        u->d = fp16_to_f32(load_u16(b + 80));
        u->dmin = fp16_to_f32(load_u16(b + 82));
        for (int g = 0; g < 16; g++) {
            u->sc[g] = (int8_t)(b[g] & 0x0f);
            u->mn[g] = (int8_t)(b[g] >> 4);
        }
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int l = 0; l < 32; l++)
                    u->q[128 * h + 32 * s + l] = (int8_t)((b[16 + 32 * h + l] >> (2 * s)) & 3);
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

/* x rows quantized for one pass: q [rows, K], d and s [rows, K/32], and (q6_k) the sums of
 * q over each 16, bs [rows, K/16]. */
typedef struct {
    const int8_t *q;
    const float *d, *s;
    const int16_t *bs;
    int K;
    /* AVX-512 builds, q4_k/q5_k/q6_k: q with each 32-byte chunk written twice, so that the
     * 512-bit pair kernels (two weight rows a zmm, one x chunk against both) read their x
     * operand with a plain load, which vpdpbusd takes from memory, instead of a vbroadcasti64x4
     * each: on the Zen 4 EPYC, 2 threads, 1 row, hot in L3, q4_k 41.3 -> 45.8 GB/s of blocks,
     * q5_k 38.6 -> 41.8, q6_k 41.4 -> 44.7, 2-8 rows 1.12-1.18x, the same bits. From memory
     * while the host's memory ran slow (about 30 GB/s) q4_k at 1 row read 0.96-0.98x on 8192 x
     * 2048 (a further prefetch distance or an L1 hint did not change that), 1.00-1.02x on 2048
     * x 8192, 1.10-1.16x at 2 rows (benchmarks/kquant_kernels.py). NULL elsewhere. */
    const int8_t *q2;
} qx_t;

/* bs [rows, K/16] = the sums of q [rows, K] over each 16 (at most 16 * 127: an int16). */
static void q_sums16(int16_t *bs, const int8_t *q, int rows, int K) {
    for (size_t i = 0; i < (size_t)rows * (K / 16); i++) {
        int sum = 0;
        for (int j = 0; j < 16; j++) sum += q[16 * i + j];
        bs[i] = (int16_t)sum;
    }
}

/* q4_k's and q5_k's x order (see the header): within each 256-block, dword 16 t + 8 h + l
 * takes x's dword 8 (2 (l mod 4) + h) + t + 4 (l / 4), weights 4 (t + 4 (l / 4)) .. +3 of
 * 32-block 2 (l mod 4) + h: what the nibbles in lane l of transposed vector t meet (low
 * nibbles h = 0, high h = 1). */
static inline int k4_x_dword(int t, int h, int l) {
    return 8 * (2 * (l & 3) + h) + t + 4 * (l >> 2);
}

static void k4_order_x(int8_t *q, int rows, int K) {
    uint32_t in[64], out[64];
    for (size_t b = 0; b < (size_t)rows * (K / QK_K); b++) {
        memcpy(in, q + b * QK_K, sizeof in);
        for (int t = 0; t < 4; t++)
            for (int h = 0; h < 2; h++)
                for (int l = 0; l < 8; l++) out[16 * t + 8 * h + l] = in[k4_x_dword(t, h, l)];
        memcpy(q + b * QK_K, out, sizeof out);
    }
}

#ifdef KQ_AVX2
/* *p on 8 lanes, read from memory: written as an intrinsic, GCC hoists the addresses of the
 * scale slots out of the loop and spills them, two loads per broadcast. */
static inline __m256 bcast(const float *p) {
    __m256 v;
    __asm__("vbroadcastss %1, %0" : "=x"(v) : "m"(*p));
    return v;
}

/* 32 weights w (int8; signed: -128..127 meeting x by vpsignb, else 0..127) with int16
 * multipliers *sc16 (the low 128 bits for weights 0..15, the high for 16..31; NULL: all 1,
 * which VNNI sums in one instruction) against x block gb of mt rows: acc[m] += S[8 m] * lanes.
 */
static inline __attribute__((always_inline)) void dot32(__m256 *acc, const int mt,
                                                        const qx_t *X, int xr, int gb,
                                                        const float *S, __m256i w,
                                                        const __m256i *sc16, const int sgn) {
    const __m256i wu = sgn ? _mm256_sign_epi8(w, w) : w;
    for (int m = 0; m < mt; m++) {
        __m256i x = _mm256_loadu_si256(
            (const __m256i *)(X->q + (size_t)(xr + m) * X->K + (size_t)gb * QK));
        if (sgn) x = _mm256_sign_epi8(x, w);
        const __m256i i = sc16 ? dot_u8s8_scaled(wu, x, *sc16) : dot_u8s8(wu, x);
        acc[m] = _mm256_fmadd_ps(bcast(S + 8 * m), _mm256_cvtepi32_ps(i), acc[m]);
    }
}

/* int16 lanes: the first 8 hold word a of each 128-bit half of v, the last 8 word b. */
static inline __m256i pick16(__m256i v, int a, int b) {
    return _mm256_shuffle_epi8(v, _mm256_set_m128i(_mm_set1_epi16((short)(0x0100 + 0x202 * b)),
                                                   _mm_set1_epi16((short)(0x0100 + 0x202 * a))));
}
#endif

#ifdef KQ_AVX2
/* Block b (the first of whose 32-blocks is gb0) of one weight row against x rows xr ..
 * xr+mt-1, into that row's sums: acc, summ [mt], sm1 [mt][8] (q5_1's mins). */
static inline __attribute__((always_inline)) void kq_block(
        __m256 *acc, __m256 *summ, float (*sm1)[8], float *S, const qx_t *X, int xr,
        const int mt, const uint8_t *b, int gb0, const int fmt) {
    const int K = X->K, nbx = K / QK, bw = BLOCK_W[fmt];
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    {
        const float d = fp16_to_f32(load_u16(b + (fmt == F_Q6_K ? 208 : fmt == F_Q3_K ? 108
                                                 : fmt == F_Q2_K ? 80 : 0)));
        if (fmt == F_Q4_K || fmt == F_Q5_K) {
            /* the sub-blocks' scales go into S below */
        } else if (bw == QK_K) {
            for (int m = 0; m < mt; m++)
                _mm256_store_ps(S + 8 * m, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(
                    X->d + (size_t)(xr + m) * nbx + gb0)));
        } else {
            for (int m = 0; m < mt; m++) S[8 * m] = d * X->d[(size_t)(xr + m) * nbx + gb0];
        }
        if (fmt == F_Q4_K || fmt == F_Q5_K) {
            uint8_t sc8[8], mn8[8];
            k4_scales(b + 4, sc8, mn8);
            const __m256 mins = _mm256_mul_ps(
                _mm256_set1_ps(fp16_to_f32(load_u16(b + 2))),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn8))));
            const __m256 dsc = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc8))));
            for (int m = 0; m < mt; m++) {
                const size_t xb = (size_t)(xr + m) * nbx + gb0;
                summ[m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(X->s + xb), summ[m]);
                _mm256_store_ps(S + 8 * m, _mm256_mul_ps(dsc, _mm256_loadu_ps(X->d + xb)));
            }
            const uint8_t *qs = b + (fmt == F_Q4_K ? 16 : 48);
            /* the header's lanes: a 4 x 4 dword transpose */
            const __m256i c0 = _mm256_loadu_si256((const __m256i *)qs);
            const __m256i c1 = _mm256_loadu_si256((const __m256i *)(qs + 32));
            const __m256i c2 = _mm256_loadu_si256((const __m256i *)(qs + 64));
            const __m256i c3 = _mm256_loadu_si256((const __m256i *)(qs + 96));
            const __m256i t0 = _mm256_unpacklo_epi32(c0, c1);
            const __m256i t1 = _mm256_unpackhi_epi32(c0, c1);
            const __m256i t2 = _mm256_unpacklo_epi32(c2, c3);
            const __m256i t3 = _mm256_unpackhi_epi32(c2, c3);
            const __m256i T[4] = {
                _mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
            const __m256i pick_lo = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
            const __m256i pick_hi = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
            __m256i L[4], H[4];
            for (int t = 0; t < 4; t++) {
                L[t] = _mm256_and_si256(T[t], low4);
                H[t] = _mm256_and_si256(_mm256_srli_epi16(T[t], 4), low4);
            }
            if (fmt == F_Q5_K) {  /* lane l's fifth bits: bits 2 (l mod 4), +1 of qh */
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
                const __m256i five = _mm256_set1_epi8(0x10);
                const __m256i sh = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
                /* lane l of vector t: qh's dword t + 4 (l / 4), as T[t]'s chunks */
                const __m256i dword = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
                for (int t = 0; t < 4; t++) {
                    const __m256i v = _mm256_srlv_epi32(_mm256_permutevar8x32_epi32(
                        qh, _mm256_add_epi32(dword, _mm256_set1_epi32(t))), sh);
                    L[t] = _mm256_or_si256(
                        L[t], _mm256_and_si256(_mm256_slli_epi32(v, 4), five));
                    H[t] = _mm256_or_si256(
                        H[t], _mm256_and_si256(_mm256_slli_epi32(v, 3), five));
                }
            }
            for (int m = 0; m < mt; m++) {
                const int8_t *xq = X->q + (size_t)(xr + m) * K + (size_t)gb0 * QK;
                __m256i lo_sum = _mm256_setzero_si256(), hi_sum = _mm256_setzero_si256();
                for (int t = 0; t < 4; t++) {
                    lo_sum = dot_u8s8_acc(lo_sum, L[t],
                                          _mm256_loadu_si256((const __m256i *)(xq + 64 * t)));
                    hi_sum = dot_u8s8_acc(hi_sum, H[t], _mm256_loadu_si256(
                        (const __m256i *)(xq + 64 * t + 32)));
                }
                const __m256 Sm = _mm256_load_ps(S + 8 * m);
                acc[m] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(Sm, pick_lo),
                                         _mm256_cvtepi32_ps(lo_sum), acc[m]);
                acc[m] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(Sm, pick_hi),
                                         _mm256_cvtepi32_ps(hi_sum), acc[m]);
            }
        } else if (fmt == F_Q6_K) {
            const __m256i scv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
            const __m256i three = _mm256_set1_epi8(3);
            for (int m = 0; m < mt; m++) {  /* lane s: 32 (sc_2s bs_2s + sc_2s+1 bs_2s+1) */
                const __m256i bs = _mm256_loadu_si256((const __m256i *)(
                    X->bs + (size_t)(xr + m) * (K / 16) + 2 * gb0));
                summ[m] = _mm256_fmadd_ps(_mm256_load_ps(S + 8 * m), _mm256_cvtepi32_ps(
                    _mm256_slli_epi32(_mm256_madd_epi16(scv, bs), 5)), summ[m]);
            }
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
                    const __m256i q = _mm256_or_si256(nib, _mm256_slli_epi16(hb, 4));
                    const __m256i sc16 = pick16(sch, 2 * s, 2 * s + 1);
                    dot32(acc, mt, X, xr, gb0 + 4 * h + s, S + 4 * h + s, q, &sc16, 0);
                }
            }
        } else if (fmt == F_Q3_K) {
            /* unpack()'s integers, 32 at a time: the 16 scales (6 bits - 32) as int16, lane g
             * scale g, from 4 words: low nibbles of bytes 0..7 (scales 0..7), their high
             * nibbles (8..15), each with 2 top bits from bytes 8..11 (scale g: byte 8 + g % 4,
             * bits 2 (g / 4)); q_j = (2 bits of qs) + 4 (bit of hmask) - 4 in -4..3. */
            const uint32_t a0 = (uint32_t)load_u32(b + 96), a1 = (uint32_t)load_u32(b + 100);
            const uint32_t a2 = (uint32_t)load_u32(b + 104), m2 = 0x03030303u, m4 = 0x0f0f0f0fu;
            const __m128i sc8 = _mm_sub_epi8(_mm_setr_epi32(
                (int)((a0 & m4) | (a2 & m2) << 4), (int)((a1 & m4) | ((a2 >> 2) & m2) << 4),
                (int)(((a0 >> 4) & m4) | ((a2 >> 4) & m2) << 4),
                (int)(((a1 >> 4) & m4) | ((a2 >> 6) & m2) << 4)), _mm_set1_epi8(32));
            const __m256i scv = _mm256_cvtepi8_epi16(sc8);
            /* the 16 scales' halves, each in both 128-bit lanes: an immediate in any loop */
            const __m256i sc_lo = _mm256_permute2x128_si256(scv, scv, 0x00);
            const __m256i sc_hi = _mm256_permute2x128_si256(scv, scv, 0x11);
            const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
            const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * h));
                const __m256i sch = h ? sc_hi : sc_lo;
#pragma GCC unroll 4
                for (int s = 0; s < 4; s++) {
                    /* 4 where bit k = 4h + s of the hmask byte is clear: the bit moved to bit 2
                     * (16-bit shifts: what crosses between a word's two bytes is masked off) */
                    const int k = 4 * h + s;
                    const __m256i hb = _mm256_andnot_si256(
                        k >= 2 ? _mm256_srli_epi16(hm, k - 2) : _mm256_slli_epi16(hm, 2 - k), four);
                    const __m256i q = _mm256_sub_epi8(
                        _mm256_and_si256(_mm256_srli_epi16(ql, 2 * s), three), hb);
                    const __m256i sc16 = pick16(sch, 2 * s, 2 * s + 1);
                    dot32(acc, mt, X, xr, gb0 + k, S + k, q, &sc16, 1);
                }
            }
        } else if (fmt == F_Q2_K) {
            /* 16 bytes of scale (low nibble) | min (high nibble); q_j 2 bits of qs, 0..3 */
            const __m128i sm = _mm_loadu_si128((const __m128i *)b), lo4 = _mm_set1_epi8(0x0f);
            const __m256i scv = _mm256_cvtepu8_epi16(_mm_and_si128(sm, lo4));
            const __m256i mnv = _mm256_broadcastsi128_si256(
                _mm_and_si128(_mm_srli_epi16(sm, 4), lo4));
            /* the 16 scales' halves, each in both 128-bit lanes: an immediate in any loop */
            const __m256i sc_lo = _mm256_permute2x128_si256(scv, scv, 0x00);
            const __m256i sc_hi = _mm256_permute2x128_si256(scv, scv, 0x11);
            const __m256i three = _mm256_set1_epi8(3);
            const __m256 dmin = _mm256_set1_ps(fp16_to_f32(load_u16(b + 82)));
            float Sm[XT * 8] __attribute__((aligned(32)));
            for (int m = 0; m < mt; m++)
                _mm256_store_ps(Sm + 8 * m, _mm256_mul_ps(
                    dmin, _mm256_loadu_ps(X->d + (size_t)(xr + m) * nbx + gb0)));
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * h));
                const __m256i sch = h ? sc_hi : sc_lo;
#pragma GCC unroll 4
                for (int s = 0; s < 4; s++) {
                    const int k = 4 * h + s;
                    const __m256i q = _mm256_and_si256(_mm256_srli_epi16(ql, 2 * s), three);
                    const __m256i sc16 = pick16(sch, 2 * s, 2 * s + 1);
                    /* bytes 0..15 min 2k, 16..31 min 2k + 1 */
                    const __m256i mn = _mm256_shuffle_epi8(mnv, _mm256_set_m128i(
                        _mm_set1_epi8((char)(2 * k + 1)), _mm_set1_epi8((char)(2 * k))));
                    dot32(acc, mt, X, xr, gb0 + k, S + k, q, &sc16, 0);
                    dot32(summ, mt, X, xr, gb0 + k, Sm + k, mn, NULL, 0);
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
            dot32(acc, mt, X, xr, gb0, S, q, NULL, fmt != F_Q5_1);
            if (fmt == F_Q5_1) {
                const float mterm = fp16_to_f32(load_u16(b + 2)) * -1.0f;
                for (int m = 0; m < mt; m++)
                    sm1[m][gb0 & 7] = fmaf(mterm, X->s[(size_t)(xr + m) * nbx + gb0],
                                           sm1[m][gb0 & 7]);
            }
        }
    }
}
#endif

#ifdef KQ_AVX512
/* Bit moves within each byte. With GFNI, one vgf2p8affineqb: output bit i is the parity of
 * the input byte AND the matrix's byte 7 - i, so a matrix with one bit a byte moves bits. It
 * replaces a shift and a mask in the pair kernels: on the Zen 4 EPYC, 2 threads, 8192 x 2048
 * hot in L3, 1 row, q4_k 51.4 -> 53.8 GB/s of blocks, q5_k 39.1 -> 40.8 (and its fifth bits
 * then 1.02-1.05x more), q6_k 42.9 -> 45.4 (benchmarks/kquant_kernels.py --hot), 2-8 rows
 * 0.99-1.03x, the same bits; level from memory, which bounds the kernels there. In qg_unpack
 * it was level (the GEMM's dot products bound it), so that keeps its shifts. */
#ifdef __GFNI__
static inline __m512i gf_move_bits(__m512i v, long long matrix) {
    return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(matrix), 0);
}
#endif

/* (v >> 4) & 0x0f in every byte */
static inline __m512i high_nibbles512(__m512i v) {
#ifdef __GFNI__
    return gf_move_bits(v, 0x1020408000000000LL);  /* bit i <- bit i + 4, i < 4 */
#else
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
#endif
}

/* Bits 2s and 2s + 1 of every byte at bits 4 and 5, the rest 0 (q6_k's high bits, s 0..3) */
static inline __m512i q6_high_bits512(__m512i qh, const int s) {
#ifdef __GFNI__
    if (s != 2)  /* bit 4 <- bit 2s (matrix byte 3), bit 5 <- bit 2s + 1 (byte 2) */
        return gf_move_bits(qh, ((1LL << (2 * s)) << 24) | ((1LL << (2 * s + 1)) << 16));
#endif
    return _mm512_and_si512(s < 2 ? _mm512_slli_epi16(qh, 4 - 2 * s)
                                  : s == 2 ? qh : _mm512_srli_epi16(qh, 2),
                            _mm512_set1_epi8(0x30));
}

/* 32 bytes at p (low half) and at p + row_bytes (high half) */
static inline __m512i pair256(const uint8_t *p, size_t row_bytes) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                              _mm256_loadu_si256((const __m256i *)(p + row_bytes)), 1);
}

/* dot32 for two rows (q6_k's): 32-block j of the block (first 32-block gb0) in w, int16
 * multipliers sc16 as dot32's per row, against x rows xr .. xr+mt-1: acc[m] += S_j * lanes,
 * S_j = d * d_x of x row xr + m's 32-block gb0 + j, d holding row r's d (lanes 0..7) and row
 * r + 1's (8..15): the very products a vpermps of the block's 8 S would pick, one multiply
 * with a broadcast operand instead of building the permute's index (GCC made it from general
 * registers, five instructions a 32-block) and running it. On the Zen 4 EPYC, 2 threads, from
 * cache ([M, 2048] x [1024, 2048], [M, 8192] x [256, 8192]; medians of 11-15 calls alternating
 * with the build before in one process, the same bits): 1.22-1.23x at M = 1, 1.06-1.25x at
 * M = 2..8; from memory within the noise (the memory bounds it there). */
static inline __attribute__((always_inline)) void dot32_pair(
        __m512 *acc, const int mt, const qx_t *X, int xr, int gb0, const __m512 d, int j,
        __m512i w, __m512i sc16) {
    const int nbx = X->K / QK;
    for (int m = 0; m < mt; m++) {
        const __m512i x = _mm512_loadu_si512(
            X->q2 + (size_t)(xr + m) * 2 * X->K + (size_t)(gb0 + j) * 2 * QK);
        const __m512i i = _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), sc16);
        const __m512 S = _mm512_mul_ps(d, _mm512_set1_ps(X->d[(size_t)(xr + m) * nbx + gb0 + j]));
        acc[m] = _mm512_fmadd_ps(S, _mm512_cvtepi32_ps(i), acc[m]);
    }
}

/* q4_k, q5_k on 512 bits: weight rows r (lanes 0..7) and r + 1 (lanes 8..15) in one zmm, each
 * half the very lanes of kq_block's 256-bit code (the x block broadcast to both halves, S per
 * half), so each row keeps its own chain of integer sums and FMAs in kq_block's order. Block
 * b0 of row r, b0 + row_bytes of row r + 1, against x rows xr .. xr+mt-1. */
static inline __attribute__((always_inline)) void kq_pair_block(
        __m512 *acc, __m512 *summ, const qx_t *X, int xr, const int mt, const uint8_t *b0,
        size_t row_bytes, int gb0, const int fmt) {
    const int nbx = X->K / QK;
    const uint8_t *b1 = b0 + row_bytes;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    /* bytes 0..15 of both blocks (row r's in the low 128 bits): d, dmin, then k4_scales'
     * words s0, s1, s2 (dwords 1..3), unpacked as there, both rows at once: dwords
     * (sc 0..3, sc 4..7, mn 0..3, mn 4..7) of each row */
    const __m256i hd = _mm256_inserti128_si256(_mm256_castsi128_si256(
        _mm_loadu_si128((const __m128i *)b0)), _mm_loadu_si128((const __m128i *)b1), 1);
    const __m256i sw = _mm256_srlv_epi32(_mm256_shuffle_epi32(hd, _MM_SHUFFLE(3, 2, 3, 1)),
                                         _mm256_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4));
    const __m256i su = _mm256_srli_epi32(_mm256_shuffle_epi32(hd, _MM_SHUFFLE(2, 2, 1, 1)), 2);
    const __m256i lo = _mm256_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f,
                                         0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f);
    const __m256i hi = _mm256_setr_epi32(0, 0x30303030, 0, 0x30303030,
                                         0, 0x30303030, 0, 0x30303030);
    /* qwords (sc row r, sc row r + 1, mn row r, mn row r + 1) */
    const __m256i scmn = _mm256_permute4x64_epi64(_mm256_or_si256(
        _mm256_and_si256(sw, lo), _mm256_and_si256(su, hi)), _MM_SHUFFLE(3, 1, 2, 0));
    /* (d, dmin) of row r, of row r + 1 */
    const __m512 dd = _mm512_castps128_ps512(_mm_cvtph_ps(_mm256_castsi256_si128(
        _mm256_permutevar8x32_epi32(hd, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)))));
    const __m512i half = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(2), 1);
    const __m512 d = _mm512_permutexvar_ps(half, dd);
    const __m512 dmin = _mm512_permutexvar_ps(_mm512_add_epi32(half, _mm512_set1_epi32(1)), dd);
    const __m512 dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm256_castsi256_si128(scmn))));
    const __m512 mins = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm256_extracti128_si256(scmn, 1))));
    __m512 S[XTP];
    for (int m = 0; m < mt; m++) {
        const size_t xb = (size_t)(xr + m) * nbx + gb0;
        summ[m] = _mm512_fmadd_ps(mins, _mm512_broadcast_f32x8(_mm256_loadu_ps(X->s + xb)),
                                  summ[m]);
        S[m] = _mm512_mul_ps(dsc, _mm512_broadcast_f32x8(_mm256_loadu_ps(X->d + xb)));
    }
    const int qo = fmt == F_Q4_K ? 16 : 48;
    /* kq_block's lanes, each half a row's */
    const __m512i c0 = pair256(b0 + qo, row_bytes), c1 = pair256(b0 + qo + 32, row_bytes);
    const __m512i c2 = pair256(b0 + qo + 64, row_bytes);
    const __m512i c3 = pair256(b0 + qo + 96, row_bytes);
    const __m512i t0 = _mm512_unpacklo_epi32(c0, c1), t1 = _mm512_unpackhi_epi32(c0, c1);
    const __m512i t2 = _mm512_unpacklo_epi32(c2, c3), t3 = _mm512_unpackhi_epi32(c2, c3);
    const __m512i T[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                          _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
    const __m512i pick_lo = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6,
                                              8, 10, 12, 14, 8, 10, 12, 14);
    const __m512i pick_hi = _mm512_add_epi32(pick_lo, _mm512_set1_epi32(1));
    __m512i L[4], H[4];
    for (int t = 0; t < 4; t++) {
        L[t] = _mm512_and_si512(T[t], low4);
        H[t] = high_nibbles512(T[t]);
    }
    if (fmt == F_Q5_K) {  /* as kq_block's */
        const __m512i qh = pair256(b0 + 16, row_bytes);
        const __m512i sh = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
        /* lane l of vector t: qh's dword t + 4 (l / 4), as T[t]'s chunks */
        const __m512i dword = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8,
                                                12, 12, 12, 12);
        for (int t = 0; t < 4; t++) {
            const __m512i v = _mm512_srlv_epi32(_mm512_permutexvar_epi32(
                _mm512_add_epi32(dword, _mm512_set1_epi32(t)), qh), sh);
#ifdef __GFNI__  /* bit 4 <- bit 0 (the low nibbles' fifth bits), <- bit 1 (the high's) */
            L[t] = _mm512_or_si512(L[t], gf_move_bits(v, 0x01000000LL));
            H[t] = _mm512_or_si512(H[t], gf_move_bits(v, 0x02000000LL));
#else
            const __m512i five = _mm512_set1_epi8(0x10);
            L[t] = _mm512_or_si512(L[t], _mm512_and_si512(_mm512_slli_epi32(v, 4), five));
            H[t] = _mm512_or_si512(H[t], _mm512_and_si512(_mm512_slli_epi32(v, 3), five));
#endif
        }
    }
    for (int m = 0; m < mt; m++) {
        const int8_t *xq2 = X->q2 + (size_t)(xr + m) * 2 * X->K + (size_t)gb0 * 2 * QK;
        __m512i lo_sum = _mm512_setzero_si512(), hi_sum = _mm512_setzero_si512();
        for (int t = 0; t < 4; t++) {
            lo_sum = dot_u8s8_512_acc(lo_sum, L[t], _mm512_loadu_si512(xq2 + 128 * t));
            hi_sum = dot_u8s8_512_acc(hi_sum, H[t], _mm512_loadu_si512(xq2 + 128 * t + 64));
        }
        acc[m] = _mm512_fmadd_ps(_mm512_permutexvar_ps(pick_lo, S[m]),
                                 _mm512_cvtepi32_ps(lo_sum), acc[m]);
        acc[m] = _mm512_fmadd_ps(_mm512_permutexvar_ps(pick_hi, S[m]),
                                 _mm512_cvtepi32_ps(hi_sum), acc[m]);
    }
}

/* q6_k as kq_block's, two rows at a time (see kq_pair_block). */
static inline __attribute__((always_inline)) void kq_pair_block_q6(
        __m512 *acc, __m512 *summ, const qx_t *X, int xr, const int mt, const uint8_t *b0,
        size_t row_bytes, int gb0) {
    const int K = X->K, nbx = K / QK;
    const uint8_t *b1 = b0 + row_bytes;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(fp16_to_f32(load_u16(b0 + 208))),
                                        _mm256_set1_ps(fp16_to_f32(load_u16(b1 + 208))), 1);
    /* int16 scales, 128-bit lanes: row r's 0..7, 8..15, row r + 1's 0..7, 8..15 */
    const __m512i scv = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(
        _mm_loadu_si128((const __m128i *)(b0 + 192))),
        _mm_loadu_si128((const __m128i *)(b1 + 192)), 1));
    for (int m = 0; m < mt; m++) {  /* lane s: 32 (sc_2s bs_2s + sc_2s+1 bs_2s+1) */
        const size_t xb = (size_t)(xr + m) * nbx + gb0;
        const __m512 S = _mm512_mul_ps(d, _mm512_broadcast_f32x8(_mm256_loadu_ps(X->d + xb)));
        const __m512i bs = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(
            X->bs + (size_t)(xr + m) * (K / 16) + 2 * gb0)));
        summ[m] = _mm512_fmadd_ps(S, _mm512_cvtepi32_ps(
            _mm512_slli_epi32(_mm512_madd_epi16(scv, bs), 5)), summ[m]);
    }
    for (int h = 0; h < 2; h++) {
        const __m512i ql0 = pair256(b0 + 64 * h, row_bytes);
        const __m512i ql1 = pair256(b0 + 64 * h + 32, row_bytes);
        const __m512i qh = pair256(b0 + 128 + 32 * h, row_bytes);
        /* each row's scales 8h .. 8h+7 in both of its 128-bit lanes */
        const __m512i sch = h ? _mm512_shuffle_i64x2(scv, scv, _MM_SHUFFLE(3, 3, 1, 1))
                              : _mm512_shuffle_i64x2(scv, scv, _MM_SHUFFLE(2, 2, 0, 0));
        for (int s = 0; s < 4; s++) {
            const int j = 4 * h + s;
            const __m512i lo = s & 1 ? ql1 : ql0;
            /* the nibble merged with the 2 high bits by vpternlog (A & B) | C */
            const __m512i q = _mm512_ternarylogic_epi32(s < 2 ? lo : _mm512_srli_epi16(lo, 4),
                                                        low4, q6_high_bits512(qh, s), 0xea);
            /* pick16 per row: weights 0..15 scale 2s of the 8, 16..31 scale 2s + 1 */
            const __m256i ab = _mm256_set_m128i(
                _mm_set1_epi16((short)(0x0100 + 0x202 * (2 * s + 1))),
                _mm_set1_epi16((short)(0x0100 + 0x202 * (2 * s))));
            const __m512i sc16 = _mm512_shuffle_epi8(
                sch, _mm512_inserti64x4(_mm512_castsi256_si512(ab), ab, 1));
            dot32_pair(acc, mt, X, xr, gb0, d, j, q, sc16);
        }
    }
}
#endif

#ifndef KQ_AVX2
/* The scalar build: weight row `wrow` against x rows xr .. xr+mt-1, into y[m * N], the AVX2
 * lanes emulated one by one. */
static void kq_row_scalar(float *y, const qx_t *X, int xr, const int mt, const uint8_t *wrow,
                          int N, const int fmt) {
    const int bw = BLOCK_W[fmt], bb = BLOCK_B[fmt], K = X->K, nb = K / bw, nbx = K / QK;
    /* q4_k, q5_k: the sub-block's scale in S; q6_k: q unsigned, 32 sc bs apart */
    const int sc_in_s = fmt == F_Q4_K || fmt == F_Q5_K, off = fmt == F_Q6_K ? 32 : 0;
    float acc[XT][8], summ[XT][8];
    memset(acc, 0, sizeof acc);
    memset(summ, 0, sizeof summ);
    iblock_t u;
    for (int bi = 0; bi < nb; bi++) {
        unpack(fmt, wrow + (size_t)bi * bb, &u);
        if (fmt == F_Q4_K || fmt == F_Q5_K) {  /* the header's lanes, emulated */
            for (int m = 0; m < mt; m++) {
                const size_t xb = (size_t)(xr + m) * nbx + bi * 8;
                const int8_t *xq = X->q + (size_t)(xr + m) * K + (size_t)bi * QK_K;
                for (int l = 0; l < 8; l++) {
                    int sums[2] = {0, 0};
                    for (int h = 0; h < 2; h++)
                        for (int t = 0; t < 4; t++)
                            for (int e = 0; e < 4; e++)  /* k4_x_dword(t, h, l)'s weights */
                                sums[h] += u.q[4 * k4_x_dword(t, h, l) + e] *
                                           xq[64 * t + 32 * h + 4 * l + e];
                    for (int h = 0; h < 2; h++) {
                        const int sb = 2 * (l & 3) + h;
                        acc[m][l] = fmaf((u.d * (float)u.sc[2 * sb]) * X->d[xb + sb],
                                         (float)sums[h], acc[m][l]);
                    }
                }
                for (int sb = 0; sb < 8; sb++)
                    summ[m][sb] = fmaf(u.dmin * (float)u.mn[2 * sb], X->s[xb + sb], summ[m][sb]);
            }
            continue;
        }
        for (int s = 0; s < bw / QK; s++) {
            const int gb = bi * (bw / QK) + s;
            const int8_t *wq = u.q + QK * s;
            for (int m = 0; m < mt; m++) {
                const size_t xb = (size_t)(xr + m) * nbx + gb;
                const int8_t *xq = X->q + (size_t)(xr + m) * K + (size_t)gb * QK;
                const float S = sc_in_s ? (u.d * (float)u.sc[2 * s]) * X->d[xb] : u.d * X->d[xb];
                for (int l = 0; l < 8; l++) {
                    int isum = 0, msum = 0;
                    for (int j = 4 * l; j < 4 * l + 4; j++) {
                        isum += (sc_in_s ? 1 : u.sc[2 * s + j / 16]) * (wq[j] + off) * xq[j];
                        msum += u.mn[2 * s + j / 16] * xq[j];
                    }
                    acc[m][l] = fmaf(S, (float)isum, acc[m][l]);
                    if (fmt == F_Q2_K)
                        summ[m][l] = fmaf(u.dmin * X->d[xb], (float)msum, summ[m][l]);
                }
                if (fmt == F_Q4_K || fmt == F_Q5_K || fmt == F_Q5_1)
                    summ[m][gb & 7] = fmaf(u.dmin * (float)u.mn[2 * s], X->s[xb], summ[m][gb & 7]);
                if (fmt == F_Q6_K) {
                    const int16_t *bs = X->bs + (size_t)(xr + m) * (K / 16) + 2 * gb;
                    const int corr = 32 * (u.sc[2 * s] * bs[0] + u.sc[2 * s + 1] * bs[1]);
                    summ[m][gb & 7] = fmaf(S, (float)corr, summ[m][gb & 7]);
                }
            }
        }
    }
    for (int m = 0; m < mt; m++)
        y[(size_t)m * N] = hsum8_scalar(acc[m]) - hsum8_scalar(summ[m]);
}
#endif

/* Weight rows n .. n+R-1 (`w0` the first, row_bytes apart) against x rows xr .. xr+mt-1:
 * y[m * N + n + r]. The R rows' blocks interleave, so R chains of FMAs are in flight. */
#define RMAX 4
static inline __attribute__((always_inline)) void kq_group(
        float *y, const qx_t *X, int xr, const int mt, const uint8_t *w0, size_t row_bytes,
        const int R, int N, int n, const int fmt, const uint8_t *prefetch) {
    const int bw = BLOCK_W[fmt], bb = BLOCK_B[fmt], nb = X->K / bw;
#ifdef KQ_AVX512
    if ((fmt == F_Q4_K || fmt == F_Q5_K || fmt == F_Q6_K) && R % 2 == 0) {
        __m512 acc[RMAX / 2][XTP], summ[RMAX / 2][XTP];
        for (int p = 0; p < R / 2; p++)
            for (int m = 0; m < mt; m++) acc[p][m] = summ[p][m] = _mm512_setzero_ps();
        for (int bi = 0; bi < nb; bi++) {
            if (prefetch) {  /* into L2: measured faster from memory than into L1 here */
                const uint8_t *p = prefetch + (size_t)bi * R * bb;
                for (int off = 0; off < R * bb; off += 64)
                    _mm_prefetch((const char *)p + off, _MM_HINT_T1);
            }
#pragma GCC unroll 2
            for (int p = 0; p < R / 2; p++)
                if (fmt == F_Q6_K)
                    kq_pair_block_q6(acc[p], summ[p], X, xr, mt,
                                     w0 + 2 * p * row_bytes + (size_t)bi * bb, row_bytes,
                                     bi * (bw / QK));
                else
                    kq_pair_block(acc[p], summ[p], X, xr, mt,
                                  w0 + 2 * p * row_bytes + (size_t)bi * bb, row_bytes,
                                  bi * (bw / QK), fmt);
        }
        for (int p = 0; p < R / 2; p++)
            for (int m = 0; m < mt; m++) {
                y[(size_t)m * N + n + 2 * p] = hsum256(_mm512_castps512_ps256(acc[p][m])) -
                                               hsum256(_mm512_castps512_ps256(summ[p][m]));
                y[(size_t)m * N + n + 2 * p + 1] =
                    hsum256(_mm512_extractf32x8_ps(acc[p][m], 1)) -
                    hsum256(_mm512_extractf32x8_ps(summ[p][m], 1));
            }
        return;
    }
#endif
#ifdef KQ_AVX2
    __m256 acc[RMAX][XT], summ[RMAX][XT];
    float sm1[RMAX][XT][8] __attribute__((aligned(32)));
    float S[RMAX][XT * 8] __attribute__((aligned(32)));
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mt; m++) {
            acc[r][m] = summ[r][m] = _mm256_setzero_ps();
            if (fmt == F_Q5_1) memset(sm1[r][m], 0, sizeof sm1[r][m]);
        }
    for (int bi = 0; bi < nb; bi++) {
        if (prefetch) {  /* the next group of rows, spread over this group's blocks */
            const uint8_t *p = prefetch + (size_t)bi * R * bb;
            for (int off = 0; off < R * bb; off += 64)
                _mm_prefetch((const char *)p + off, _MM_HINT_T0);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            kq_block(acc[r], summ[r], sm1[r], S[r], X, xr, mt,
                     w0 + r * row_bytes + (size_t)bi * bb, bi * (bw / QK), fmt);
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mt; m++) {
            if (fmt == F_Q5_1) summ[r][m] = _mm256_load_ps(sm1[r][m]);
            y[(size_t)m * N + n + r] = hsum256(acc[r][m]) - hsum256(summ[r][m]);
        }
#else
    (void)prefetch, (void)bb, (void)nb;
    for (int r = 0; r < R; r++) kq_row_scalar(y + n + r, X, xr, mt, w0 + r * row_bytes, N, fmt);
#endif
}

/* Weight rows [lo, hi) against all M rows of x, each thread quantizing x itself (see
 * quant_matmul.c's qrows_range). limbs 1: x at 8 bits, the sums written into y. limbs 2: x
 * at about 16 bits as two 8-bit limbs (see the header): quantized row 2m holds x row m, row
 * 2m + 1 its residual, whose sums land in ys [2 rows, hi - lo] and are added into y. Returns
 * -1 if scratch memory could not be had. */
static inline __attribute__((always_inline)) int kq_rows(float *y, const float *x,
                                                         const uint8_t *w, int M, int N, int K,
                                                         int lo, int hi, const int fmt,
                                                         const int limbs) {
    if (lo >= hi) return 0;
    const int nbx = K / QK, width = hi - lo;
    int mb = X_BLOCK_BYTES / (limbs * K);  /* x rows a chunk: their limbs' bytes stay in L2 */
    mb = limbs == 2 ? (mb < 1 ? 1 : mb) : (mb < XT ? XT : mb - mb % XT);
    const int xrows = M < mb ? M : mb, qrows = limbs * xrows;
    const size_t row_bytes = (size_t)(K / BLOCK_W[fmt]) * BLOCK_B[fmt];
    const size_t nbs = fmt == F_Q6_K ? (size_t)K / 16 : 0;
    const size_t floats = limbs == 2 ? (size_t)K + (size_t)qrows * width : 0;
    float *scales = (float *)malloc((size_t)qrows * (2 * nbx * sizeof(float) +
                                                     nbs * sizeof(int16_t) + K) +
                                    floats * sizeof(float));
    if (!scales) return -1;
    int16_t *bs = (int16_t *)(scales + (size_t)2 * qrows * nbx);
    int8_t *q = (int8_t *)(bs + (size_t)qrows * nbs);
    float *res = (float *)(q + (size_t)qrows * K);  /* K is a multiple of 32: aligned */
    int8_t *q2 = NULL;
#ifdef KQ_AVX512
    if (fmt == F_Q4_K || fmt == F_Q5_K || fmt == F_Q6_K) {
        q2 = (int8_t *)aligned_alloc(64, (size_t)qrows * 2 * K);  /* K: a multiple of 256 */
        if (!q2) {
            free(scales);
            return -1;
        }
    }
#endif
    float *const d = scales, *const sx = scales + (size_t)qrows * nbx;
    for (int m0 = 0; m0 < M; m0 += mb) {
        const int mt = M - m0 < mb ? M - m0 : mb, qt = limbs * mt;
        /* where the kernel's sums go: y itself, or the limbs' rows of ys */
        float *yb = limbs == 2 ? res + K : y + (size_t)m0 * N;
        const int ystride = limbs == 2 ? width : N, col0 = limbs == 2 ? lo : 0;
        if (limbs == 2) {
            for (int m = 0; m < mt; m++) {
                const float *xm = x + (size_t)(m0 + m) * K;
                int8_t *qh = q + (size_t)2 * m * K;
                const float *dh = d + (size_t)2 * m * nbx;
                qmm_quantize_activations(qh, d + (size_t)2 * m * nbx,
                                         sx + (size_t)2 * m * nbx, xm, 1, K);
                limb_residual(res, xm, qh, dh, K);
                qmm_quantize_activations(qh + K, d + (size_t)(2 * m + 1) * nbx,
                                         sx + (size_t)(2 * m + 1) * nbx, res, 1, K);
            }
        } else {
            qmm_quantize_activations(q, d, sx, x + (size_t)m0 * K, mt, K);
        }
        if (nbs) q_sums16(bs, q, qt, K);
        if (fmt == F_Q4_K || fmt == F_Q5_K) k4_order_x(q, qt, K);
        if (q2)
            for (size_t c = 0; c < (size_t)qt * K / 32; c++) {
                memcpy(q2 + 64 * c, q + 32 * c, 32);
                memcpy(q2 + 64 * c + 32, q + 32 * c, 32);
            }
        const qx_t X = {q, d, sx, bs, K, q2};
        int n = lo;
        /* Constant tile sizes let the compiler keep every sum in a register: 4 weight rows
         * against one x row, 2 against 2 (an x row's two limbs are such a pair). */
        for (; n + RMAX <= hi; n += RMAX) {
            const uint8_t *wg = w + (size_t)n * row_bytes;
            const uint8_t *next = n + 2 * RMAX <= hi ? wg + RMAX * row_bytes : NULL;
            const int c = n - col0;
            int r = 0;
#ifdef KQ_AVX512
            if (fmt == F_Q4_K || fmt == F_Q5_K || fmt == F_Q6_K)
                for (; r + XTP <= qt; r += XTP) {
                    const uint8_t *pf = r ? NULL : next;
                    float *yr = yb + (size_t)r * ystride;
                    kq_group(yr, &X, r, XTP, wg, row_bytes, 2, ystride, c, fmt, pf);
                    kq_group(yr, &X, r, XTP, wg + 2 * row_bytes, row_bytes, 2, ystride, c + 2,
                             fmt, pf ? pf + 2 * row_bytes : NULL);
                }
#endif
            for (; r + XT <= qt; r += XT) {
                const uint8_t *pf = r ? NULL : next;
                float *yr = yb + (size_t)r * ystride;
                kq_group(yr, &X, r, XT, wg, row_bytes, 2, ystride, c, fmt, pf);
                kq_group(yr, &X, r, XT, wg + 2 * row_bytes, row_bytes, 2, ystride, c + 2, fmt,
                         pf ? pf + 2 * row_bytes : NULL);
            }
            for (; r < qt; r++) {
                float *yr = yb + (size_t)r * ystride;
#ifdef KQ_AVX512
                /* one pair of rows, then the next: 2 streams from memory instead of 4
                 * interleaved (see the header) */
                if (fmt == F_Q4_K || fmt == F_Q5_K || fmt == F_Q6_K) {
                    const uint8_t *pf = r ? NULL : next;
                    kq_group(yr, &X, r, 1, wg, row_bytes, 2, ystride, c, fmt, pf);
                    kq_group(yr, &X, r, 1, wg + 2 * row_bytes, row_bytes, 2, ystride, c + 2,
                             fmt, pf ? pf + 2 * row_bytes : NULL);
                    continue;
                }
#endif
                kq_group(yr, &X, r, 1, wg, row_bytes, RMAX, ystride, c, fmt, r ? NULL : next);
            }
        }
        for (; n < hi; n++)
            for (int r = 0; r < qt; r++)
                kq_group(yb + (size_t)r * ystride, &X, r, 1, w + (size_t)n * row_bytes,
                         row_bytes, 1, ystride, n - col0, fmt, NULL);
        if (limbs == 2) add_limbs(y + (size_t)m0 * N + lo, N, yb, width, mt);
    }
    free(q2);
    free(scales);
    return 0;
}

static void kq_matmul(float *y, const float *x, const uint8_t *w, int M, int N, int K,
                      int nthreads, const rows_fn rows) {
    run_quant_rows("quant_kquants", y, x, w, M, N, K, nthreads, 4, rows);
}

/* One entry point per format and x precision (qmm<prefix>_<name>, limbs 1 or 2), its passes
 * compiled on their own for M == 1 (decode), with the tile loop resolved, and for any M. */
#define KQ_MATMUL(prefix, name, fmt, limbs)                                                   \
    static int rows##prefix##_##name##_1(float *y, const float *x, const uint8_t *w, int M,   \
                                         int N, int K, int lo, int hi) {                      \
        (void)M;                                                                              \
        return kq_rows(y, x, w, 1, N, K, lo, hi, fmt, limbs);                                 \
    }                                                                                         \
    static int rows##prefix##_##name(float *y, const float *x, const uint8_t *w, int M,       \
                                     int N, int K, int lo, int hi) {                          \
        return kq_rows(y, x, w, M, N, K, lo, hi, fmt, limbs);                                 \
    }                                                                                         \
    void qmm##prefix##_##name(float *y, const float *x, const uint8_t *w, int M, int N,       \
                              int K, int nthreads) {                                          \
        kq_matmul(y, x, w, M, N, K, nthreads,                                                 \
                  M == 1 ? rows##prefix##_##name##_1 : rows##prefix##_##name);                \
    }

#define KQ_FORMAT(name, fmt)                                                                  \
    KQ_MATMUL(, name, fmt, 1)                                                                 \
    KQ_MATMUL(16, name, fmt, 2)                                                               \
    void dequant_##name(float *out, const uint8_t *w, int N, int K, int nthreads) {           \
        dequant(fmt, out, w, N, K, nthreads);                                                 \
    }                                                                                         \
    void dequant_panels_##name(uint16_t *panels, const uint8_t *w, int N, int K,              \
                               int nthreads) {                                                \
        dequant_bf16_panels(dequant_##name, panels, w,                                        \
                            (size_t)(K / BLOCK_W[fmt]) * BLOCK_B[fmt], N, K, nthreads);       \
    }
KQ_FORMAT(q4_k, F_Q4_K)
KQ_FORMAT(q5_k, F_Q5_K)
KQ_FORMAT(q6_k, F_Q6_K)
KQ_FORMAT(q3_k, F_Q3_K)
KQ_FORMAT(q2_k, F_Q2_K)
KQ_FORMAT(q5_0, F_Q5_0)
KQ_FORMAT(q5_1, F_Q5_1)
KQ_FORMAT(iq4_nl, F_IQ4_NL)

#if defined(KQ_AVX512) && defined(__AVX512VNNI__)
#define KQ_GEMM 1
/* The many-row GEMM of q4_k, q5_k and q6_k (qgemm_<fmt>; AVX512-VNNI builds, outside the
 * deterministic mode): kq_rows spends, per x row and 32 weights of a pair of rows, a vpdpbusd
 * and then three float operations (the scale's vpermps, a convert, an FMA), since each
 * vpdpbusd lane holds 4 weights of one 32-block whose scale it must meet at once. Here each
 * lane is one weight row instead: 16 rows' blocks are unpacked and transposed (transpose16)
 * so that one zmm holds 4 consecutive weights of each of the 16 rows, and the vpdpbusd of a
 * scale's weights sum exactly in int32 before its one convert and FMA: per 512 products 8
 * integer instructions and 4-6 float ones instead of 8 and 24. Each output is then its own
 * chain over its row's blocks in order, I the exact integer sums:
 *   q4_k, q5_k, per 32-block b:  acc = fma((d sc_b) d_x, I_b, acc),
 *                                summ = fma(dmin mn_b, s_x, summ),  y = acc - summ
 *   q6_k, per 16 weights g of 32-block b (u = q + 32 in 0..63, bs_g the sum of x's q over g):
 *                          acc = fma((d sc_g) d_x, I_g - 32 bs_g, acc),  y = acc
 * other bits than kq_rows' 8 lanes (so not the deterministic mode's kernel), the same at any
 * M, tile and thread count. Rows past the last whole 16 take kq_rows. */
#define GR 16
#define QG_X_BYTES (512 * 1024)

/* r[i] (16 dwords each) -> r[c] = dword c of r[0..15]. */
static inline __attribute__((always_inline)) void transpose16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* r[4g + e], 128-bit lane l: rows 4g..4g+3, dword 4l+e */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int e = 0; e < 4; e++) {  /* the 4 x 4 transpose of 128-bit lanes */
        const __m512i v0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x88);
        const __m512i v1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xdd);
        const __m512i w0 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x88);
        const __m512i w1 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xdd);
        t[e] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        t[4 + e] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        t[8 + e] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
        t[12 + e] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

static inline __m512i bcast4(const int8_t *p) {
    return _mm512_set1_epi32(load_u32((const uint8_t *)p));
}

/* Row r's 64 weights of chunk c of its block b (32-blocks 2c and 2c + 1), as bytes 0..63. */
static inline __attribute__((always_inline)) __m512i qg_unpack(const uint8_t *b, int c,
                                                                const int fmt) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    if (fmt == F_Q4_K || fmt == F_Q5_K) {
        /* the low nibbles of 32 bytes (32-block 2c), then their high ones; q5_k's fifth bits
         * from qh: bit 2c of byte l for weight l of 32-block 2c, bit 2c + 1 for 2c + 1 */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(
            b + (fmt == F_Q4_K ? 16 : 48) + 32 * c));
        const __m512i vv = _mm512_inserti64x4(_mm512_castsi256_si512(v), v, 1);
        const __m512i q = _mm512_and_si512(
            _mm512_mask_srli_epi16(vv, (__mmask32)0xffff0000u, vv, 4), low4);
        if (fmt == F_Q4_K) return q;
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)));
        const __m512i sh = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c)),
                                              _mm256_set1_epi16((short)(2 * c + 1)), 1);
        return _mm512_or_si512(q, _mm512_slli_epi16(_mm512_and_si512(
            _mm512_srlv_epi16(qh, sh), _mm512_set1_epi8(1)), 4));
    }
    /* q6_k: 32-blocks 4h + s and 4h + s + 1 (h = c / 2, s = 2 (c % 2)) from ql's 64 bytes of
     * half h (nibble s / 2) and qh's 32 (bits 2s, 2s + 2 for the two) */
    const int h = c / 2, s = 2 * (c % 2);
    __m512i v = _mm512_loadu_si512((const void *)(b + 64 * h));
    if (s) v = _mm512_srli_epi16(v, 4);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(
        b + 128 + 32 * h)));
    const __m512i sh = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * s)),
                                          _mm256_set1_epi16((short)(2 * s + 2)), 1);
    const __m512i hb = _mm512_and_si512(_mm512_srlv_epi16(qh, sh), _mm512_set1_epi8(3));
    return _mm512_or_si512(_mm512_and_si512(v, low4), _mm512_slli_epi16(hb, 4));
}

/* Chunk c (32-blocks gb = 8 bi + 2c and gb + 1) of 16 rows, transposed in W, against x rows
 * m0 .. m0+mt-1, into acc / summ [m][16]. sc: q4_k's d sc_b and dmin mn_b ([8][16] each),
 * q6_k's d sc_g ([16][16]). */
static inline __attribute__((always_inline)) void qg_chunk(
        float *acc, float *summ, const qx_t *X, int m0, const int mt,
        const __m512i *W, int gb, int c, const float *sc, const int fmt) {
    const int nbx = X->K / QK;
    for (int m = m0; m < m0 + mt; m++) {
        const int8_t *xq = X->q + (size_t)m * X->K + (size_t)gb * QK;
        const float *dx = X->d + (size_t)m * nbx + gb;
        float *am = acc + (size_t)m * GR;
        __m512 a = _mm512_load_ps(am);
        if (fmt != F_Q6_K) {
            /* 4 chains: integer sums are exact in any order */
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, b0 = a0, b1 = a0;
            for (int t = 0; t < 8; t += 2) {
                a0 = _mm512_dpbusd_epi32(a0, W[t], bcast4(xq + 4 * t));
                a1 = _mm512_dpbusd_epi32(a1, W[t + 1], bcast4(xq + 4 * t + 4));
                b0 = _mm512_dpbusd_epi32(b0, W[8 + t], bcast4(xq + 32 + 4 * t));
                b1 = _mm512_dpbusd_epi32(b1, W[9 + t], bcast4(xq + 36 + 4 * t));
            }
            const float *dsc = sc + 2 * c * GR, *mns = sc + 8 * GR + 2 * c * GR;
            const float *sx = X->s + (size_t)m * nbx + gb;
            float *sm = summ + (size_t)m * GR;
            __m512 s = _mm512_load_ps(sm);
            a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_load_ps(dsc), _mm512_set1_ps(dx[0])),
                                _mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)), a);
            a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_load_ps(dsc + GR), _mm512_set1_ps(dx[1])),
                                _mm512_cvtepi32_ps(_mm512_add_epi32(b0, b1)), a);
            s = _mm512_fmadd_ps(_mm512_load_ps(mns), _mm512_set1_ps(sx[0]), s);
            s = _mm512_fmadd_ps(_mm512_load_ps(mns + GR), _mm512_set1_ps(sx[1]), s);
            _mm512_store_ps(sm, s);
        } else {  /* q6_k: a chain per 16 weights */
            __m512i g[4];
            for (int u = 0; u < 4; u++) {
                g[u] = _mm512_setzero_si512();
                for (int t = 0; t < 4; t++)
                    g[u] = _mm512_dpbusd_epi32(g[u], W[4 * u + t], bcast4(xq + 16 * u + 4 * t));
            }
            const int16_t *bm = X->bs + (size_t)m * (X->K / 16) + 2 * gb;
            const float *dsc = sc + 4 * c * GR;
            for (int u = 0; u < 4; u++) {
                const __m512i i = _mm512_sub_epi32(g[u], _mm512_set1_epi32(32 * bm[u]));
                a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_load_ps(dsc + u * GR),
                                                  _mm512_set1_ps(dx[u / 2])),
                                    _mm512_cvtepi32_ps(i), a);
            }
        }
        _mm512_store_ps(am, a);
    }
}

static inline __attribute__((always_inline)) int qg_rows(
        float *y, const float *x, const uint8_t *w, int M, int N, int K, int lo, int hi,
        const int fmt, const rows_fn tail) {
    if (lo >= hi) return 0;
    const int nbx = K / QK, nb = K / QK_K, whole = lo + (hi - lo) / GR * GR;
    const int bb = BLOCK_B[fmt];
    const size_t row_bytes = (size_t)nb * bb;
    if (whole > lo) {
        int mb = QG_X_BYTES / K;  /* x rows a chunk: their bytes stay in L2 */
        mb = mb < 2 ? 2 : mb;
        const int xrows = M < mb ? M : mb;
        /* acc and summ [xrows][16], the scales [16][16], x's d, s, bs (int16 per 16), q */
        const size_t floats = (size_t)(2 * xrows + 16) * GR + (size_t)2 * xrows * nbx +
                              (size_t)xrows * (K / 16) / 2 + (size_t)xrows * K / 4;
        float *buf = (float *)aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        if (!buf) return -1;
        float *acc = buf, *summ = acc + (size_t)xrows * GR, *sc = summ + (size_t)xrows * GR;
        float *d = sc + 16 * GR, *sx = d + (size_t)xrows * nbx;
        int16_t *bs = (int16_t *)(sx + (size_t)xrows * nbx);
        int8_t *q = (int8_t *)(bs + (size_t)xrows * (K / 16));
        for (int m0 = 0; m0 < M; m0 += mb) {
            const int mt = M - m0 < mb ? M - m0 : mb;
            qmm_quantize_activations(q, d, sx, x + (size_t)m0 * K, mt, K);
            if (fmt == F_Q6_K) q_sums16(bs, q, mt, K);
            const qx_t X = {q, d, sx, bs, K, NULL};
            for (int n0 = lo; n0 < whole; n0 += GR) {
                memset(acc, 0, (size_t)2 * xrows * GR * sizeof(float));
                const uint8_t *w0 = w + (size_t)n0 * row_bytes;
                for (int bi = 0; bi < nb; bi++) {
                    for (int r = 0; r < GR; r++) {
                        const uint8_t *b = w0 + (size_t)r * row_bytes + (size_t)bi * bb;
                        if (fmt != F_Q6_K) {
                            uint8_t sc8[8], mn8[8];
                            k4_scales(b + 4, sc8, mn8);
                            const float dd = fp16_to_f32(load_u16(b));
                            const float dm = fp16_to_f32(load_u16(b + 2));
                            for (int j = 0; j < 8; j++) {
                                sc[j * GR + r] = dd * (float)sc8[j];
                                sc[(8 + j) * GR + r] = dm * (float)mn8[j];
                            }
                        } else {
                            const float dd = fp16_to_f32(load_u16(b + 208));
                            for (int g = 0; g < 16; g++)
                                sc[g * GR + r] = dd * (float)(int8_t)b[192 + g];
                        }
                    }
                    for (int c = 0; c < 4; c++) {
                        __m512i W[16];
                        for (int r = 0; r < GR; r++)
                            W[r] = qg_unpack(w0 + (size_t)r * row_bytes + (size_t)bi * bb, c,
                                             fmt);
                        transpose16(W);
                        const int gb = bi * 8 + 2 * c;
                        int m = 0;
                        for (; m + 2 <= mt; m += 2)
                            qg_chunk(acc, summ, &X, m, 2, W, gb, c, sc, fmt);
                        if (m < mt) qg_chunk(acc, summ, &X, m, 1, W, gb, c, sc, fmt);
                    }
                }
                for (int m = 0; m < mt; m++) {
                    __m512 v = _mm512_load_ps(acc + (size_t)m * GR);
                    if (fmt != F_Q6_K) v = _mm512_sub_ps(v, _mm512_load_ps(summ + (size_t)m * GR));
                    _mm512_storeu_ps(y + (size_t)(m0 + m) * N + n0, v);
                }
            }
        }
        free(buf);
    }
    return whole < hi ? tail(y, x, w, M, N, K, whole, hi) : 0;
}

static int qg_rows_q4_k(float *y, const float *x, const uint8_t *w, int M, int N, int K,
                        int lo, int hi) {
    return qg_rows(y, x, w, M, N, K, lo, hi, F_Q4_K, rows_q4_k);
}

static int qg_rows_q5_k(float *y, const float *x, const uint8_t *w, int M, int N, int K,
                        int lo, int hi) {
    return qg_rows(y, x, w, M, N, K, lo, hi, F_Q5_K, rows_q5_k);
}

static int qg_rows_q6_k(float *y, const float *x, const uint8_t *w, int M, int N, int K,
                        int lo, int hi) {
    return qg_rows(y, x, w, M, N, K, lo, hi, F_Q6_K, rows_q6_k);
}
#endif

/* The many-row GEMM where the build has AVX512-VNNI (qgemm_available() says), its own bits
 * (see qg_rows); elsewhere it is not called. */
int qgemm_available(void) {
#ifdef KQ_GEMM
    return 1;
#else
    return 0;
#endif
}

#ifdef KQ_GEMM
#define QGEMM(name)                                                                           \
    void qgemm_##name(float *y, const float *x, const uint8_t *w, int M, int N, int K,        \
                      int nthreads) {                                                         \
        run_quant_rows("quant_kquants", y, x, w, M, N, K, nthreads, GR, qg_rows_##name);      \
    }
#else
#define QGEMM(name)                                                                           \
    void qgemm_##name(float *y, const float *x, const uint8_t *w, int M, int N, int K,        \
                      int nthreads) {                                                         \
        qmm_##name(y, x, w, M, N, K, nthreads);                                               \
    }
#endif
QGEMM(q4_k)
QGEMM(q5_k)
QGEMM(q6_k)
