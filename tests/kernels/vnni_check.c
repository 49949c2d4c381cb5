/* Runs every 8-bit-activation quant kernel (quant_matmul.c's q4_1 and q8_0, quant_kquants.c's
 * K-quants and 32-weight types) on random valid blocks and ragged shapes, on 1 and 2 threads,
 * and prints one line per run with a hash of the output's bits. scripts/check_vnni.sh builds
 * it with and without VNNI (the VNNI build runs under qemu where the CPU lacks it) and
 * compares the lines: quant_common.h's dot_u8s8 promises the very same bits.
 *
 * Besides random bytes, weight rows 0..2 of every matrix hold the extreme integers (every
 * quant byte 0xff, 0x00 or 0x80: q8_0's -128, iq4_nl's -127, the largest nibbles and high
 * bits) and x row 0 alternates +-1, so its every q_x is +-127: the largest pair sums
 * vpmaddubsw could meet. x row 1 starts with an all-zero block (d_x = 0). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pagedlm_ops.h"

typedef void (*qmm_fn)(float *, const float *, const uint8_t *, int, int, int, int);

typedef struct {
    const char *name;
    qmm_fn fn;
    int block_w, block_b, nfp16, fp16[2]; /* the byte offsets of each block's fp16 fields */
} format_t;

static const format_t FORMATS[] = {
    {"q4_1", qmm_q4_1, 32, 20, 2, {0, 2}},    {"q8_0", qmm_q8_0, 32, 34, 1, {0}},
    {"q4_k", qmm_q4_k, 256, 144, 2, {0, 2}},  {"q5_k", qmm_q5_k, 256, 176, 2, {0, 2}},
    {"q6_k", qmm_q6_k, 256, 210, 1, {208}},   {"q3_k", qmm_q3_k, 256, 110, 1, {108}},
    {"q2_k", qmm_q2_k, 256, 84, 2, {80, 82}}, {"q5_0", qmm_q5_0, 32, 22, 1, {0}},
    {"q5_1", qmm_q5_1, 32, 24, 2, {0, 2}},    {"iq4_nl", qmm_iq4_nl, 32, 18, 1, {0}},
};

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t next_u64(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* A finite fp16 of either sign, 2^-10 .. 2^-3 in magnitude. */
static uint16_t random_fp16(void) {
    const uint64_t r = next_u64();
    return (uint16_t)(((r & 1) << 15) | ((5 + (r >> 1) % 8) << 10) | ((r >> 8) & 0x3ff));
}

static uint64_t fnv1a(const void *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * 0x100000001b3ull;
    return h;
}

static void run(const format_t *f, int N, int K, int M) {
    const int nb = K / f->block_w;
    const size_t row_bytes = (size_t)nb * f->block_b;
    uint8_t *w = malloc((size_t)N * row_bytes);
    float *x = malloc(sizeof(float) * M * K), *y = malloc(sizeof(float) * M * N);
    if (!w || !x || !y) {
        fprintf(stderr, "vnni_check: out of memory\n");
        exit(2);
    }
    for (size_t i = 0; i < (size_t)N * row_bytes; i++) w[i] = (uint8_t)next_u64();
    static const uint8_t extremes[3] = {0xff, 0x00, 0x80};
    for (int r = 0; r < 3 && r < N; r++) memset(w + r * row_bytes, extremes[r], row_bytes);
    for (int b = 0; b < N * nb; b++)
        for (int i = 0; i < f->nfp16; i++) {
            const uint16_t h = random_fp16();
            memcpy(w + (size_t)b * f->block_b + f->fp16[i], &h, 2);
        }
    for (int i = 0; i < M * K; i++) /* uniform in [-1, 1), one scale per row: 2^-6 .. 2^6 */
        x[i] = ((float)(next_u64() >> 40) / (float)(1 << 23) - 1.0f) *
               (float)(1u << (i / K % 13)) / 64.0f;
    for (int k = 0; k < K; k++) x[k] = k % 2 ? -1.0f : 1.0f;
    if (M > 1) memset(x + K, 0, 32 * sizeof(float));
    for (int threads = 1; threads <= 2; threads++) {
        f->fn(y, x, w, M, N, K, threads);
        printf("%-6s N=%-4d K=%-4d M=%d threads=%d %016llx\n", f->name, N, K, M, threads,
               (unsigned long long)fnv1a(y, sizeof(float) * M * N));
    }
    free(w);
    free(x);
    free(y);
}

int main(void) {
    /* Ragged N (partial groups of 4 rows), M odd and even (partial tiles of 2 x rows), and
     * matrices above PAR_MIN_WEIGHTS so that 2 threads split the rows. */
    static const int SHAPES[][3] = {{37, 1, 1}, {131, 2, 3}, {6, 3, 5}, {4, 1, 2}};
    for (size_t f = 0; f < sizeof FORMATS / sizeof FORMATS[0]; f++)
        for (size_t s = 0; s < sizeof SHAPES / sizeof SHAPES[0]; s++) {
            /* K: units of 256 weights, or of 9 blocks (288) for the 32-weight types */
            const int blocks = SHAPES[s][1] * (FORMATS[f].block_w == 32 ? 9 : 1);
            run(&FORMATS[f], SHAPES[s][0], blocks * FORMATS[f].block_w, SHAPES[s][2]);
        }
    return 0;
}
