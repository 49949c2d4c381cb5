/* Float32 y[M, N] = x[M, K] @ W[N, K]^T for the few rows of a decode step.
 *
 * At one to a few rows a linear layer does 2 flops per weight it reads, so its speed is how
 * fast W streams from memory:
 *   - each thread reads one contiguous run of W's rows (the hardware prefetcher sees a single
 *     stream per thread) and the rows of the next group are prefetched explicitly;
 *   - four W rows are read together and each loaded vector is used for every x row of the
 *     tile, so x stays in L1 and W is read from memory once (more x rows than a tile re-read
 *     the same four W rows from L1).
 * Measured (every matrix of SmolLM2-135M once, 2 threads, benchmarks/gemv.py): on an AVX2-only
 * EPYC this kernel took 30 ms at 1 row and 63 at 8 where oneDNN's packed GEMM took 43 and 69;
 * on an AVX-512 EPYC both stream ~22 GB/s at 1 to 4 rows, and at 8 rows oneDNN (W packed so
 * that N runs along the lanes, no horizontal sums) is faster, 24 ms against 34.
 * The sum runs over K in 8 or 16 lanes per W row, added across lanes at the end, so results
 * differ from a sequential dot product only by float32 rounding.
 */
#include <stddef.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define ROWS 4    /* W rows per group */
/* x rows sharing one pass over a group: the sums (XTILE x ROWS) and ROWS loaded vectors must
 * stay in registers, 16 of them with AVX2, 32 with AVX-512. */
#ifdef __AVX512F__
#define XTILE 4
#define LANES 16
typedef __m512 vec;
#define VLOAD _mm512_loadu_ps
#define VFMA _mm512_fmadd_ps
#define VZERO _mm512_setzero_ps
#define VSUM _mm512_reduce_add_ps
#elif defined(__AVX2__)
#define XTILE 2
#define LANES 8
typedef __m256 vec;
#define VLOAD _mm256_loadu_ps
#define VFMA _mm256_fmadd_ps
#define VZERO _mm256_setzero_ps
#define VSUM hsum256
#else
#define XTILE 2
#endif
/* Below this many weights one thread finishes before a second one would have woken. */
#define PAR_MIN_WEIGHTS (1L << 16)

#ifdef __AVX2__
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* mt x rows (1..XTILE) against W rows n .. n+ROWS-1; prefetch: the next group's first row. */
static inline __attribute__((always_inline)) void group(
        float *y, const float *x, const float *w, const int mt, int N, int K, int n,
        const float *prefetch) {
    const float *wr = w + (size_t)n * K;
    int k = 0;
    float acc_s[XTILE][ROWS] = {{0}};
#ifdef __AVX2__
    vec acc[XTILE][ROWS];
    for (int m = 0; m < mt; m++)
        for (int r = 0; r < ROWS; r++) acc[m][r] = VZERO();
    for (; k + LANES <= K; k += LANES) {
        vec wv[ROWS];
        /* One prefetch per 64-byte line of each next row. */
        if (prefetch && (k & 15) == 0)
            for (int r = 0; r < ROWS; r++)
                _mm_prefetch((const char *)(prefetch + (size_t)r * K + k), _MM_HINT_T0);
        for (int r = 0; r < ROWS; r++) wv[r] = VLOAD(wr + (size_t)r * K + k);
        for (int m = 0; m < mt; m++) {
            const vec xv = VLOAD(x + (size_t)m * K + k);
            for (int r = 0; r < ROWS; r++) acc[m][r] = VFMA(wv[r], xv, acc[m][r]);
        }
    }
    for (int m = 0; m < mt; m++)
        for (int r = 0; r < ROWS; r++) acc_s[m][r] = VSUM(acc[m][r]);
#endif
    for (; k < K; k++)
        for (int m = 0; m < mt; m++)
            for (int r = 0; r < ROWS; r++) acc_s[m][r] += wr[(size_t)r * K + k] * x[(size_t)m * K + k];
    for (int m = 0; m < mt; m++)
        for (int r = 0; r < ROWS; r++) y[(size_t)m * N + n + r] = acc_s[m][r];
}

/* One W row (the N % ROWS left over), plain. */
static void single_row(float *y, const float *x, const float *w, int M, int N, int K, int n) {
    const float *wr = w + (size_t)n * K;
    for (int m = 0; m < M; m++) {
        float s = 0.f;
        for (int k = 0; k < K; k++) s += wr[k] * x[(size_t)m * K + k];
        y[(size_t)m * N + n] = s;
    }
}

static void rows_range(float *y, const float *x, const float *w, int M, int N, int K,
                       int lo, int hi) {
    int n = lo;
    for (; n + ROWS <= hi; n += ROWS) {
        const float *next = n + 2 * ROWS <= hi ? w + (size_t)(n + ROWS) * K : NULL;
        for (int m0 = 0; m0 < M; m0 += XTILE) {
            float *ym = y + (size_t)m0 * N;
            const float *xm = x + (size_t)m0 * K;
            /* Constant tile heights let the compiler keep every sum in a register. */
            const float *pf = m0 ? NULL : next;
            switch (M - m0 >= XTILE ? XTILE : M - m0) {
                case 1: group(ym, xm, w, 1, N, K, n, pf); break;
#if XTILE > 2
                case 2: group(ym, xm, w, 2, N, K, n, pf); break;
                case 3: group(ym, xm, w, 3, N, K, n, pf); break;
#endif
                default: group(ym, xm, w, XTILE, N, K, n, pf);
            }
        }
    }
    for (; n < hi; n++) single_row(y, x, w, M, N, K, n);
}

void gemv_f32(float *y, const float *x, const float *w, int M, int N, int K, int nthreads) {
    if ((long)N * K < PAR_MIN_WEIGHTS || nthreads < 2) {
        rows_range(y, x, w, M, N, K, 0, N);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        /* Whole groups per thread, so only the last thread has a ragged end. */
        const int groups = (N + ROWS - 1) / ROWS, per = (groups + nt - 1) / nt;
        const int lo = t * per * ROWS < N ? t * per * ROWS : N;
        const int hi = lo + per * ROWS < N ? lo + per * ROWS : N;
        rows_range(y, x, w, M, N, K, lo, hi);
    }
}
