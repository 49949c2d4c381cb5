/* What the quantized-weight kernels (quant_matmul.c, quant_kquants.c) share: reading ggml's
 * fp16 fields, the 8-lane horizontal sum their scalar builds emulate bit for bit, and the
 * split of W's rows across threads. */
#ifndef PAGEDLM_QUANT_COMMON_H
#define PAGEDLM_QUANT_COMMON_H

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

#endif
