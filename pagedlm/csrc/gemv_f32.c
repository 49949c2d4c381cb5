/* Float32 y[M, N] = x[M, K] @ W[N, K]^T for the few rows of a decode step.
 *
 * At one to a few rows a linear layer does 2 flops per weight it reads, so its speed is how
 * fast W streams from memory:
 *   - each thread reads one contiguous run of W's rows, each row front to back: its loads are
 *     a single sequential stream, which the hardware prefetcher follows best;
 *   - each loaded W vector is used for every x row of a tile, so x stays in L1 and W is read
 *     from memory once (more x rows than a tile re-read the same W row from L1).
 * Measured (every matrix of SmolLM2-135M once, 2 threads): on an AVX2-only EPYC this kernel's
 * first version (four W rows at a time) took 30 ms at 1 row and 63 at 8 where oneDNN's packed
 * GEMM took 43 and 69. On an AVX-512 EPYC (Zen 4) reading one row at a time instead of four
 * interleaved ones went from 28 to 31-33 GB/s at 1 row, 25 to 28 at 4 and 17 to 19 at 8 (the
 * same source built for AVX2 only: 28 -> 34, 22 -> 30, 16 -> 19); at 8 rows oneDNN (W packed so
 * that N runs along the lanes, no horizontal sums) is still faster, 24 ms against 29.
 * The sum runs over K in 8 or 16 lanes (and UNROLL partial sums) per W row, added at the end,
 * so results differ from a sequential dot product only by float32 rounding.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "include/pagedlm_ops.h"
#include "include/parallel.h"
#include "include/vec_math.h"

/* x rows sharing one pass over a W row: their XTILE x UNROLL sums and the loaded vectors must
 * stay in registers, 16 of them with AVX2, 32 with AVX-512. */
#ifdef __AVX512F__
#define XTILE 4
#define LANES 16
typedef __m512 vec;
#define VLOAD _mm512_loadu_ps
#define VFMA _mm512_fmadd_ps
#define VADD _mm512_add_ps
#define VZERO _mm512_setzero_ps
#define VSUM _mm512_reduce_add_ps
#elif defined(__AVX2__)
#define XTILE 2
#define LANES 8
typedef __m256 vec;
#define VLOAD _mm256_loadu_ps
#define VFMA _mm256_fmadd_ps
#define VADD _mm256_add_ps
#define VZERO _mm256_setzero_ps
#define VSUM hsum256
#else
#define XTILE 2
#endif
/* Below this many weights one thread finishes before a second one would have woken. */
#define PAR_MIN_WEIGHTS (1L << 16)

/* One W row against mt x rows (1..XTILE). UNROLL independent sums per x row over K hide the
 * FMA latency; the row is read front to back, so a thread's loads form one sequential stream. */
#define UNROLL 4
static inline __attribute__((always_inline)) void wrow(
        float *y, const float *x, const float *wr, const int mt, int N, int K, int n) {
    int k = 0;
    float acc_s[XTILE] = {0};
#ifdef __AVX2__
    vec acc[XTILE][UNROLL];
    for (int m = 0; m < mt; m++)
        for (int u = 0; u < UNROLL; u++) acc[m][u] = VZERO();
    for (; k + UNROLL * LANES <= K; k += UNROLL * LANES)
        for (int u = 0; u < UNROLL; u++) {
            const vec wv = VLOAD(wr + k + u * LANES);
            for (int m = 0; m < mt; m++)
                acc[m][u] = VFMA(wv, VLOAD(x + (size_t)m * K + k + u * LANES), acc[m][u]);
        }
    for (; k + LANES <= K; k += LANES) {
        const vec wv = VLOAD(wr + k);
        for (int m = 0; m < mt; m++)
            acc[m][0] = VFMA(wv, VLOAD(x + (size_t)m * K + k), acc[m][0]);
    }
    for (int m = 0; m < mt; m++) {
        vec s = acc[m][0];
        for (int u = 1; u < UNROLL; u++) s = VADD(s, acc[m][u]);
        acc_s[m] = VSUM(s);
    }
#endif
    for (; k < K; k++)
        for (int m = 0; m < mt; m++) acc_s[m] += wr[k] * x[(size_t)m * K + k];
    for (int m = 0; m < mt; m++) y[(size_t)m * N + n] = acc_s[m];
}

static void rows_range(float *y, const float *x, const float *w, int M, int N, int K,
                       int lo, int hi) {
    for (int n = lo; n < hi; n++) {
        const float *wr = w + (size_t)n * K;
        for (int m0 = 0; m0 < M; m0 += XTILE) {
            float *ym = y + (size_t)m0 * N;
            const float *xm = x + (size_t)m0 * K;
            /* Constant tile heights let the compiler keep every sum in a register. */
            switch (M - m0 >= XTILE ? XTILE : M - m0) {
                case 1: wrow(ym, xm, wr, 1, N, K, n); break;
#if XTILE > 2
                case 2: wrow(ym, xm, wr, 2, N, K, n); break;
                case 3: wrow(ym, xm, wr, 3, N, K, n); break;
#endif
                default: wrow(ym, xm, wr, XTILE, N, K, n);
            }
        }
    }
}

void gemv_f32(float *y, const float *x, const float *w, int M, int N, int K, int nthreads) {
    if ((long)N * K < PAR_MIN_WEIGHTS || nthreads < 2) {
        rows_range(y, x, w, M, N, K, 0, N);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    {
        int lo, hi;
        omp_thread_rows(N, 1, &lo, &hi);
        rows_range(y, x, w, M, N, K, lo, hi);
    }
}

/* Float32 y[M, N] = x[M, K] @ W^T past a few rows, over W packed in panels of PANEL output
 * columns: wp[p][k][0..PANEL) = W[p * PANEL + 0..PANEL)[k] (zeros past N).
 *
 * With the columns along the lanes there are no horizontal sums: each k adds x[m][k] times a
 * panel row into MR x 2 vector sums held in registers, a tile of MR rows by PANEL columns. A
 * thread takes a run of whole panels, which are contiguous, so its W reads are one sequential
 * stream; a panel stays in L2 for the row tiles after the first. Rows go MBLOCK at a time, so
 * the x rows a panel meets stay in L2 too.
 *
 * Each output is one chain of FMAs, c = fma(x[m][k], W[n][k], c) for k = 0..K-1 from c = 0:
 * its bits do not depend on M, the tile height, the row's position in x, the panel width or
 * the thread split, so a row gives the same output whatever batch it is part of, with AVX2 and
 * with AVX-512 alike.
 * Measured on a 2-vCPU Sapphire Rapids-class Xeon (AVX-512), the four matrices of a SmolLM2-135M
 * layer, 30 layers' weights (read from memory), ms a layer against oneDNN's packed GEMM: 0.56 vs
 * 0.87 at 9 rows, 0.95 vs 1.29 at 32, 1.47 vs 2.01 at 64, 2.48 vs 3.03 at 128, 4.59 vs 5.00 at
 * 256, 34.4 vs 35.2 at 2048.
 *
 * gemm_panels_bf16 runs the same tiles over bfloat16 panels: a bfloat16 is the top half of a
 * float32, so each panel element is widened exactly (bits << 16) and then meets the same FMA
 * chain. Its outputs are bit for bit gemm_panels_f32's on the widened weight, at any M, tile
 * position or thread count, and it reads half the bytes. Without AVX512-BF16 the panels have
 * the float32 layout (2-byte elements). With it (BF16_PAIRS; gemm_panels_bf16_layout() says
 * 2 and gemv.pack_panels packs for it) they are k-pairs, wp[p][j][c][e] = W[p * PANEL + c]
 * [2j + e] (an odd K's last pair padded with a zero): the layout vdpbf16ps reads, and AMX's
 * B tiles (16 pair rows at a 128-byte stride, columns 0-15 at +0, 16-31 at +64). A pair row's
 * dword d holds k = 2j in its low half and 2j + 1 in its high one, so d << 16 and
 * d & 0xffff0000 are both rows widened, met in k order: the same chain, the same bits.
 * Measured, 1 thread, 32 SmolLM2-135M-shaped matrices (56.6 MB of bfloat16, from memory),
 * ms median (least) of 30 repeats rotating the kernels, two runs, on the 2-vCPU Sapphire
 * Rapids-class Xeon while other jobs ran (2 threads and benchmarks/gemv.py were too disturbed
 * to compare), the plain panels' kernel before this (a copy of its .so) / the k-pairs widened:
 * 1 row 2.95 (2.60) / 2.56 (2.35) and 3.56 (2.95) / 2.72 (2.52); 8 rows 4.50 (3.91) / 2.92
 * (2.73) and 5.17 (4.14) / 3.20 (2.86); 32 rows 12.47 (12.26) / 12.02 (10.45) and 12.69
 * (12.48) / 12.06 (11.74); 128 rows 51.34 (50.60) / 47.84 (46.93) and 52.09 (51.40) / 48.17
 * (47.66): one load and two ALU ops widen 32 weights, where the plain panels took a
 * vpmovzxwd and a shift for 16.
 * Opt-in (gemm_panels_bf16_set_dpbf16(1), PAGEDLM_BF16_DPBF16=1): the k-pair tiles on
 * vdpbf16ps. x's rows are rounded to bfloat16 once per call (vcvtne2ps2bf16: to nearest even,
 * a subnormal read as zero), each x pair is broadcast as one dword, and two vdpbf16ps a tile
 * row take a pair row. Per Intel's SDM pseudo-code vdpbf16ps does, per lane, c = fma(odd
 * pair's product) then c = fma(even), each rounded to nearest even, subnormal inputs read as
 * zero and subnormal results flushed (MXCSR neither read nor written); this CPU follows it bit
 * for bit (tests/kernels/test_gemm_2byte.py holds it to a torch emulation; "even first"
 * differs). So an output is c = 0, then for j = 0..ceil(K/2)-1: c += x[2j+1] w[2j+1],
 * c += x[2j] w[2j] (a product of two bfloat16s is exact in float32): one order whatever M,
 * the tile, the row's position or the thread split, the same path at every M, so a row's bits
 * do not depend on its batch, on one CPU; they are not the widened kernel's (x is rounded),
 * nor a CPU's without AVX512-BF16. Not the default because it is slower here: in a register
 * loop of 24 independent sums vdpbf16ps zmm took 0.80 ns an instruction against 0.20 for
 * vfmadd231ps (latency 3.2 ns against 1.57: about 8 cycles against 4), so its 32 products an
 * instruction come at half the FMAs' rate. Same runs, vdpbf16ps: 1 row 2.53 (2.42) and 2.66
 * (2.51); 8 rows 4.08 (4.02) and 4.14 (4.03); 32 rows 16.55 (16.11) and 16.62 (16.34); 128
 * rows 71.31 (70.94) and 72.05 (71.27) ms: as fast at 1 row (memory-bound), 1.4-1.5x slower
 * from 8.
 * gemm_panels_f16 does the same over float16 panels (a GGUF file's F16 matrices, or
 * dtype=float16): vcvtph2ps widens a float16 exactly (subnormals included, whatever MXCSR's
 * DAZ says), so its outputs are gemm_panels_f32's bits on the widened weight too.
 */
#if defined(__AVX512F__) || defined(__AVX2__)
#define MBLOCK 192
/* Bytes of panel rows to prefetch ahead of the loads, whatever the element size. The hardware
 * streamer alone runs too few lines ahead of loads this far apart: on the AVX-512 Xeon 9 rows
 * took 0.83 ms a layer without, 0.56 with (64 float32 rows of 128 bytes ahead). For bfloat16
 * panels on the AVX2 EPYC, 4, 16 and 32 KiB ahead measured the same as 8 within the noise. */
#define PREFETCH_BYTES 8192
/* Tiles of fewer rows go without it. A tile of 1 or 2 rows spends too little time on a panel
 * row for the streamer to fall behind, and the prefetches, 8 KiB ahead, cost it bandwidth: on
 * the Zen 4 EPYC, 2 threads, bfloat16 k-pair panels on huge pages (2048- and 8192-wide),
 * GB/s from memory without / with: 1 row 56-63 / 43-45, 2 rows 53-56 / 43-46; 4 rows 40-42 /
 * 48-50 and from 8 rows the prefetch wins by more (a session's microbenchmark, best of 5, in
 * the phases where the host's memory read above 50 GB/s; in those below 35 GB/s, all within
 * the noise). The 1B model's bfloat16 matrices at 1 row, this build against the one before
 * (benchmarks/gemv.py --bf16-baseline; calls of the two alternating): 1.05-1.06x in slow
 * phases, 1.22x in a fast one; 3 and 4 rows level. Not measured on a Xeon. */
#ifdef __AVX512F__
#define PREFETCH_MIN_ROWS 3
#else
#define PREFETCH_MIN_ROWS 1
#endif

/* The panels' element type; 2-byte ones are widened exactly to float32 as they are read (the
 * bfloat16 k-pair panels too), but for PANEL_BF16_PAIRS, multiplied by vdpbf16ps (see above). */
enum { PANEL_F32 = 0, PANEL_BF16 = 1, PANEL_F16 = 2, PANEL_BF16_PAIRS = 3,
       PANEL_BF16_PAIRS_WIDE = 4 };
#define IS_PAIRS(elt) ((elt) == PANEL_BF16_PAIRS || (elt) == PANEL_BF16_PAIRS_WIDE)
/* Bytes of one step's panel row: a float32, a 2-byte value, or a pair of bfloat16s. */
#define ELT_BYTES(elt) ((elt) == PANEL_F32 || IS_PAIRS(elt) ? 4 : 2)
/* Steps over K: one per k, or one per k-pair (an odd K's last pair padded with a zero). */
#define STEPS(elt, K) (IS_PAIRS(elt) ? ((K) + 1) / 2 : (K))
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define BF16_PAIRS 1
#endif

#ifdef __AVX512F__
#define PANEL 32
#define MR 12 /* rows of a tile: 24 sums + 2 panel vectors + 1 broadcast of the 32 registers */
typedef __m512 pvec;
#define PZERO _mm512_setzero_ps
#define PFMA _mm512_fmadd_ps
#define PBROADCAST(p) _mm512_set1_ps(*(p))

/* Panel row k as two vectors of 16 floats, widened exactly from elt's type. */
static inline __attribute__((always_inline)) void panel_row(
        const void *wp, const int elt, const int k, pvec *w0, pvec *w1) {
    if (elt == PANEL_BF16) {
        const uint16_t *r = (const uint16_t *)wp + (size_t)k * PANEL;
        *w0 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)r)), 16));
        *w1 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r + 16))), 16));
    } else if (elt == PANEL_F16) {
        const uint16_t *r = (const uint16_t *)wp + (size_t)k * PANEL;
        *w0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)r));
        *w1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + 16)));
    } else {
        const float *r = (const float *)wp + (size_t)k * PANEL;
        *w0 = _mm512_loadu_ps(r);
        *w1 = _mm512_loadu_ps(r + 16);
    }
}

static inline __attribute__((always_inline)) void tile_store(
        float *y, const pvec *c0, const pvec *c1, const int mr, int N, int cols) {
    const __mmask16 k0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
    const __mmask16 k1 = cols >= 32 ? 0xffff
                       : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    for (int m = 0; m < mr; m++) {
        _mm512_mask_storeu_ps(y + (size_t)m * N, k0, c0[m]);
        _mm512_mask_storeu_ps(y + (size_t)m * N + 16, k1, c1[m]);
    }
}
#else
#define PANEL 16
#define MR 6 /* rows of a tile: 12 sums + 2 panel vectors + 1 broadcast of the 16 registers */
typedef __m256 pvec;
#define PZERO _mm256_setzero_ps
#define PFMA _mm256_fmadd_ps
#define PBROADCAST(p) _mm256_broadcast_ss(p)

/* 8 float16s as float32s: vcvtph2ps (F16C, which every AVX2 CPU has had so far), else the
 * compiler's _Float16 conversion; both exact. */
static inline __attribute__((always_inline)) __m256 f16x8(const uint16_t *r) {
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)r));
#else
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = (float)((const _Float16 *)r)[i];
    return _mm256_loadu_ps(f);
#endif
}

/* Panel row k as two vectors of 8 floats, widened exactly from elt's type. */
static inline __attribute__((always_inline)) void panel_row(
        const void *wp, const int elt, const int k, pvec *w0, pvec *w1) {
    if (elt == PANEL_BF16) {
        const uint16_t *r = (const uint16_t *)wp + (size_t)k * PANEL;
        *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)r)), 16));
        *w1 = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(r + 8))), 16));
    } else if (elt == PANEL_F16) {
        const uint16_t *r = (const uint16_t *)wp + (size_t)k * PANEL;
        *w0 = f16x8(r);
        *w1 = f16x8(r + 8);
    } else {
        const float *r = (const float *)wp + (size_t)k * PANEL;
        *w0 = _mm256_loadu_ps(r);
        *w1 = _mm256_loadu_ps(r + 8);
    }
}

static inline __attribute__((always_inline)) void tile_store(
        float *y, const pvec *c0, const pvec *c1, const int mr, int N, int cols) {
    if (cols == PANEL) {
        for (int m = 0; m < mr; m++) {
            _mm256_storeu_ps(y + (size_t)m * N, c0[m]);
            _mm256_storeu_ps(y + (size_t)m * N + 8, c1[m]);
        }
        return;
    }
    /* The last panel of a ragged N: lanes at or past `cols` lie in the next row of y. */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i k0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane);
    const __m256i k1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane);
    for (int m = 0; m < mr; m++) {
        _mm256_maskstore_ps(y + (size_t)m * N, k0, c0[m]);
        _mm256_maskstore_ps(y + (size_t)m * N + 8, k1, c1[m]);
    }
}
#endif

/* mr rows of x (ldx 4-byte elements apart) against one panel of elt's type (a constant after
 * inlining, so each element type gets its own loop). For PANEL_BF16_PAIRS x holds bfloat16
 * pairs (gemm_panels_bf16's rounded copy), one 4-byte pair a step. */
static inline __attribute__((always_inline)) void panel_tile(
        float *y, const float *x, const void *wp, const int elt, const int mr, int N, int K,
        int ldx, int cols) {
    /* A panel row is 128 bytes (AVX-512 float32 or bfloat16 pairs), 64 or 32 (AVX2 bfloat16:
     * each line is prefetched twice, which measured 5-15% faster at 1 and 8 rows than
     * skipping odd k). */
    const int row_bytes = PANEL * ELT_BYTES(elt), prefetch = mr >= PREFETCH_MIN_ROWS;
    pvec c0[MR], c1[MR];
    for (int m = 0; m < mr; m++) c0[m] = PZERO(), c1[m] = PZERO();
#ifdef BF16_PAIRS
    if (elt == PANEL_BF16_PAIRS_WIDE) {
        /* k-pair panels widened: a dword holds k = 2j in its low half and 2j + 1 in its high
         * one, so (d << 16) and (d & 0xffff0000) are the two rows' float32s, met in k order:
         * the same FMA chain, so the same bits, as the float32 kernel on the widened weight. */
        const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
        for (int j = 0; j < STEPS(elt, K); j++) {
            const char *r = (const char *)wp + (size_t)j * row_bytes;
            if (prefetch) {
                _mm_prefetch(r + PREFETCH_BYTES, _MM_HINT_T1);
                _mm_prefetch(r + PREFETCH_BYTES + 64, _MM_HINT_T1);
            }
            const __m512i d0 = _mm512_loadu_si512(r), d1 = _mm512_loadu_si512(r + 64);
            const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(d0, 16));
            const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(d1, 16));
            for (int m = 0; m < mr; m++) {
                const __m512 xv = _mm512_set1_ps(x[(size_t)m * ldx + 2 * j]);
                c0[m] = _mm512_fmadd_ps(xv, e0, c0[m]);
                c1[m] = _mm512_fmadd_ps(xv, e1, c1[m]);
            }
            if (2 * j + 1 == K) break; /* an odd K's padding */
            const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(d0, high));
            const __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(d1, high));
            for (int m = 0; m < mr; m++) {
                const __m512 xv = _mm512_set1_ps(x[(size_t)m * ldx + 2 * j + 1]);
                c0[m] = _mm512_fmadd_ps(xv, o0, c0[m]);
                c1[m] = _mm512_fmadd_ps(xv, o1, c1[m]);
            }
        }
        tile_store(y, c0, c1, mr, N, cols);
        return;
    }
#endif
    for (int k = 0; k < STEPS(elt, K); k++) {
        const char *ahead = (const char *)wp + (size_t)k * row_bytes + PREFETCH_BYTES;
        if (prefetch) {
            _mm_prefetch(ahead, _MM_HINT_T1);
            if (row_bytes == 128) _mm_prefetch(ahead + 64, _MM_HINT_T1);
        }
#ifdef BF16_PAIRS
        if (elt == PANEL_BF16_PAIRS) {
            /* Columns 0-15's pairs, then 16-31's; each x pair is broadcast as one dword. */
            const char *r = (const char *)wp + (size_t)k * row_bytes;
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(r);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(r + 64);
            for (int m = 0; m < mr; m++) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(
                        ((const int32_t *)x)[(size_t)m * ldx + k]);
                c0[m] = _mm512_dpbf16_ps(c0[m], w0, xv);
                c1[m] = _mm512_dpbf16_ps(c1[m], w1, xv);
            }
            continue;
        }
#endif
        pvec w0, w1;
        panel_row(wp, elt, k, &w0, &w1);
        for (int m = 0; m < mr; m++) {
            const pvec xv = PBROADCAST(x + (size_t)m * ldx + k);
            c0[m] = PFMA(xv, w0, c0[m]);
            c1[m] = PFMA(xv, w1, c1[m]);
        }
    }
    tile_store(y, c0, c1, mr, N, cols);
}

/* Rows 0..M-1 (at most MBLOCK) of panels lo..hi-1. */
static inline __attribute__((always_inline)) void panels_range(
        float *y, const float *x, const void *wp, const int elt, int M, int N, int K, int ldx,
        int lo, int hi) {
    for (int p = lo; p < hi; p++) {
        const char *w = (const char *)wp + (size_t)p * STEPS(elt, K) * PANEL * ELT_BYTES(elt);
        const int n0 = p * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
        for (int m0 = 0; m0 < M; m0 += MR) {
            float *ym = y + (size_t)m0 * N + n0;
            const float *xm = x + (size_t)m0 * ldx;
            /* Constant tile heights let the compiler keep every sum in a register. */
            switch (M - m0 >= MR ? MR : M - m0) {
#define TILE_CASE(r) case r: panel_tile(ym, xm, w, elt, r, N, K, ldx, cols); break;
                TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5)
#if MR > 6
                TILE_CASE(6) TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11)
#endif
                default: panel_tile(ym, xm, w, elt, MR, N, K, ldx, cols);
#undef TILE_CASE
            }
        }
    }
}

/* x's rows are ldx 4-byte elements apart: K floats, or STEPS(PANEL_BF16_PAIRS, K) pairs. */
static void panels_rows(float *y, const float *x, const void *wp, int elt, int M, int N, int K,
                        int ldx, int lo, int hi) {
    for (int m0 = 0; m0 < M; m0 += MBLOCK) {
        float *ym = y + (size_t)m0 * N;
        const float *xm = x + (size_t)m0 * ldx;
        const int mb = M - m0 < MBLOCK ? M - m0 : MBLOCK;
        if (elt == PANEL_BF16)
            panels_range(ym, xm, wp, PANEL_BF16, mb, N, K, ldx, lo, hi);
        else if (elt == PANEL_F16)
            panels_range(ym, xm, wp, PANEL_F16, mb, N, K, ldx, lo, hi);
#ifdef BF16_PAIRS
        else if (elt == PANEL_BF16_PAIRS)
            panels_range(ym, xm, wp, PANEL_BF16_PAIRS, mb, N, K, ldx, lo, hi);
        else if (elt == PANEL_BF16_PAIRS_WIDE)
            panels_range(ym, xm, wp, PANEL_BF16_PAIRS_WIDE, mb, N, K, ldx, lo, hi);
#endif
        else
            panels_range(ym, xm, wp, PANEL_F32, mb, N, K, ldx, lo, hi);
    }
}

static void gemm_panels(float *y, const float *x, const void *wp, int elt, int M, int N, int K,
                        int ldx, int nthreads) {
    const int P = (N + PANEL - 1) / PANEL;
    if ((long)M * N * K < PAR_MIN_WEIGHTS || nthreads < 2 || P < 2) {
        panels_rows(y, x, wp, elt, M, N, K, ldx, 0, P);
        return;
    }
#pragma omp parallel num_threads(nthreads < P ? nthreads : P)
    {
        int t, nt;
        omp_team(&t, &nt);
        panels_rows(y, x, wp, elt, M, N, K, ldx, (int)((long)P * t / nt),
                    (int)((long)P * (t + 1) / nt));
    }
}

/* The panel width the packing must use; 0 where this build has no panel kernel (no AVX2). */
int gemm_panel_width(void) { return PANEL; }

void gemm_panels_f32(float *y, const float *x, const float *wp, int M, int N, int K,
                     int nthreads) {
    gemm_panels(y, x, wp, PANEL_F32, M, N, K, K, nthreads);
}

/* Whether gemm_panels_bf16 multiplies k-pair panels with vdpbf16ps (1) or widens them to the
 * float32 chain (0, the default), process-wide. */
static int bf16_dpbf16 = 0;

#ifdef BF16_PAIRS
/* x's rows rounded to bfloat16 once, in k-pairs: xb[m][j] = bf16(x[m][2j]) | bf16(x[m][2j+1])
 * << 16, the pair an odd K lacks zero. vcvtne2ps2bf16 rounds to nearest even and reads a
 * subnormal as a zero of its sign (Intel SDM, convert_fp32_to_bfloat16), whatever MXCSR says. */
static void round_x_pairs(uint32_t *xb, const float *x, int M, int K) {
    const int K2 = STEPS(PANEL_BF16_PAIRS, K);
    for (int m = 0; m < M; m++) {
        const float *xr = x + (size_t)m * K;
        uint32_t *out = xb + (size_t)m * K2;
        for (int k = 0; k < K; k += 32) {
            const int n = K - k < 32 ? K - k : 32;
            const __mmask16 lo = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
            const __mmask16 hi = n >= 32 ? 0xffff
                               : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1);
            const int pairs = (n + 1) / 2;
            const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, xr + k + 16),
                                                   _mm512_maskz_loadu_ps(lo, xr + k));
            _mm512_mask_storeu_epi32(out + k / 2,
                                     pairs >= 16 ? 0xffff : (__mmask16)((1u << pairs) - 1),
                                     (__m512i)b);
        }
    }
}

static void gemm_panels_bf16_pairs(float *y, const float *x, const uint16_t *wp, int M, int N,
                                   int K, int nthreads) {
    const int K2 = STEPS(PANEL_BF16_PAIRS, K);
    uint32_t stack[4096];
    uint32_t *xb = (size_t)M * K2 <= 4096 ? stack : malloc((size_t)M * K2 * sizeof(uint32_t));
    if (xb == NULL) abort();
    round_x_pairs(xb, x, M, K);
    gemm_panels(y, (const float *)xb, wp, PANEL_BF16_PAIRS, M, N, K, K2, nthreads);
    if (xb != stack) free(xb);
}
#endif

void gemm_panels_bf16(float *y, const float *x, const uint16_t *wp, int M, int N, int K,
                      int nthreads) {
#ifdef BF16_PAIRS
    if (bf16_dpbf16)
        gemm_panels_bf16_pairs(y, x, wp, M, N, K, nthreads);
    else
        gemm_panels(y, x, wp, PANEL_BF16_PAIRS_WIDE, M, N, K, K, nthreads);
#else
    gemm_panels(y, x, wp, PANEL_BF16, M, N, K, K, nthreads);
#endif
}

/* gemm_panels_bf16 on vdpbf16ps whatever set_dpbf16 says (its caller checked
 * gemm_panels_bf16_layout() == 2): the K-quant layers' many-row branch on panels dequantized
 * for one call, where rounding x to bfloat16 is that branch's promise anyway. */
void gemm_panels_bf16_dot(float *y, const float *x, const uint16_t *wp, int M, int N, int K,
                          int nthreads) {
#ifdef BF16_PAIRS
    gemm_panels_bf16_pairs(y, x, wp, M, N, K, nthreads);
#else
    (void)y, (void)x, (void)wp, (void)M, (void)N, (void)K, (void)nthreads;
    abort();
#endif
}

void gemm_panels_f16(float *y, const float *x, const uint16_t *wp, int M, int N, int K,
                     int nthreads) {
    gemm_panels(y, x, wp, PANEL_F16, M, N, K, K, nthreads);
}
#else
int gemm_panel_width(void) { return 0; }

static const int bf16_dpbf16 = 0;

void gemm_panels_f32(float *y, const float *x, const float *wp, int M, int N, int K,
                     int nthreads) {
    (void)y, (void)x, (void)wp, (void)M, (void)N, (void)K, (void)nthreads;
}

void gemm_panels_bf16(float *y, const float *x, const uint16_t *wp, int M, int N, int K,
                      int nthreads) {
    (void)y, (void)x, (void)wp, (void)M, (void)N, (void)K, (void)nthreads;
}

void gemm_panels_bf16_dot(float *y, const float *x, const uint16_t *wp, int M, int N, int K,
                          int nthreads) {
    (void)y, (void)x, (void)wp, (void)M, (void)N, (void)K, (void)nthreads;
    abort();
}

void gemm_panels_f16(float *y, const float *x, const uint16_t *wp, int M, int N, int K,
                     int nthreads) {
    (void)y, (void)x, (void)wp, (void)M, (void)N, (void)K, (void)nthreads;
}
#endif

#ifdef BF16_PAIRS
int gemm_panels_bf16_layout(void) { return 2; }
#else
int gemm_panels_bf16_layout(void) { return 1; }
#endif

int gemm_panels_bf16_dpbf16(void) { return bf16_dpbf16; }

int gemm_panels_bf16_set_dpbf16(int on) {
#ifdef BF16_PAIRS
    bf16_dpbf16 = on != 0;
#else
    (void)on;
#endif
    return bf16_dpbf16;
}

/* Rows first .. first + rows - 1 of a matrix of 4-byte elements (a float32 one, or a bfloat16
 * one's k-pairs) into panels of `width` columns, [P][kk][width]: element j of row g lands at
 * panel g / width, line j, column g % width; src is [rows][kk]. gemv.put_panel_rows' transposing
 * copy, in 16 x 16 tiles that each read 16 source lines and write 16 panel lines: torch's
 * strided copy moved the 1B Llama's 1.95 GB of bfloat16 matrices at 3.5 GB/s (0.55 s of its
 * load, Zen 4 EPYC, 2 threads). */
#ifdef __AVX512F__
/* dst[j * ldd + c] = src[c * lds + j] for a 16 x 16 tile of 4-byte elements. */
static inline void tile16_transpose(uint32_t *dst, int ldd, const uint32_t *src, int lds) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src + (size_t)i * lds);
    for (int i = 0; i < 16; i += 2) {  /* pairs of rows: 32-bit interleave */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* 64-bit interleave */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* r[4q + s] holds, in each 128-bit lane L, column 4L + s' of rows 4q..4q+3 (s' the
     * column order unpack leaves: 0, 1, 2, 3 for s = 0, 1, 2, 3) */
    for (int s = 0; s < 4; s++) {
        const __m512i a = _mm512_shuffle_i32x4(r[s], r[4 + s], 0x88);      /* lanes 0,2 | 0,2 */
        const __m512i b = _mm512_shuffle_i32x4(r[s], r[4 + s], 0xdd);      /* lanes 1,3 | 1,3 */
        const __m512i c = _mm512_shuffle_i32x4(r[8 + s], r[12 + s], 0x88);
        const __m512i d = _mm512_shuffle_i32x4(r[8 + s], r[12 + s], 0xdd);
        t[s] = _mm512_shuffle_i32x4(a, c, 0x88);       /* column s:      lanes 0 of all */
        t[8 + s] = _mm512_shuffle_i32x4(a, c, 0xdd);   /* column 8 + s:  lanes 2 */
        t[4 + s] = _mm512_shuffle_i32x4(b, d, 0x88);   /* column 4 + s:  lanes 1 */
        t[12 + s] = _mm512_shuffle_i32x4(b, d, 0xdd);  /* column 12 + s: lanes 3 */
    }
    for (int j = 0; j < 16; j++) _mm512_storeu_si512(dst + (size_t)j * ldd, t[j]);
}
#endif

void pack_panel_rows32(uint32_t *panels, const uint32_t *src, int first, int rows, int kk,
                       int width, int nthreads) {
    const int p0 = first / width, p1 = (first + rows - 1) / width;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && rows > 64)
    for (int p = p0; p <= p1; p++) {
        const int g0 = p * width > first ? p * width : first;
        const int g1 = (p + 1) * width < first + rows ? (p + 1) * width : first + rows;
        uint32_t *panel = panels + (size_t)p * kk * width;
        for (int j0 = 0; j0 < kk; j0 += 16) {
            const int j1 = j0 + 16 < kk ? j0 + 16 : kk;
            for (int c0 = g0; c0 < g1; c0 += 16) {
                const int c1 = c0 + 16 < g1 ? c0 + 16 : g1;
#ifdef __AVX512F__
                if (c1 - c0 == 16 && j1 - j0 == 16) {
                    tile16_transpose(panel + (size_t)j0 * width + (c0 - p * width), width,
                                     src + (size_t)(c0 - first) * kk + j0, kk);
                    continue;
                }
#endif
                for (int j = j0; j < j1; j++) {
                    uint32_t *line = panel + (size_t)j * width;
                    for (int g = c0; g < c1; g++)
                        line[g - p * width] = src[(size_t)(g - first) * kk + j];
                }
            }
        }
    }
}
