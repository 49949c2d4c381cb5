/* Paged attention over a block-structured KV cache, float32 queries, CPU (OpenMP).
 *
 * The cache holds float32, bfloat16 or float16 elements (kv_type, see kv_types.h); all
 * arithmetic is float32 whatever the storage. The AVX-512 path reads narrow rows in place and
 * widens them in registers (exactly); the portable path widens them into a per-tile copy first.
 * Reading in place took the step measured below from 112 to 91 ms with a bfloat16 cache and
 * from 529 to 95 ms with a float16 one (139 ms with float32): the copy had cost more
 * than half of what the halved reads saved.
 *
 * Cache layout (both K and V): [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
 * query/out: [num_tokens, num_q_heads, head_dim], contiguous.
 * Token t reads block-table row token_seq[t] and attends to the positions
 * 0 .. token_ctx_len[t]-1 of that sequence; position p lives in slot p % block_size of block
 * block_tables[row * max_blocks_per_seq + p / block_size].
 * window > 0 (sliding-window attention) keeps only the last `window` of those positions: the
 * keys before them are never read, so their blocks need not even be valid. soft_cap > 0 maps
 * each scaled score s to soft_cap * tanh(s / soft_cap) before the softmax (Gemma 2).
 *
 * One work item = a token with all its kv heads (or, with fewer tokens than 2 per thread, one
 * kv head of a token). The G = num_q_heads / num_kv_heads query heads of a kv head are
 * processed together so every K/V row is read from memory once, and in the AVX-512 loops in
 * groups of up to 4 so that each 16-element chunk of a row is loaded and widened into a
 * register once per group, not once per head (below). Softmax is computed online
 * (streaming), one tile of whole blocks at a time, while the next tile is prefetched.
 *
 * Measured on a 2-vCPU Sapphire Rapids-class Xeon (128 decode tokens, 300-700 keys, 3 kv heads
 * of 3 query heads, 30 layers' float32 caches in interleaved blocks): with the heads of a token
 * advancing tile by tile together and an AVX-512 softmax (its exp ran scalar before), 176 ->
 * 154 ms a step; the same data held in L2 takes 42-48 ms, so the rest is waiting on memory
 * (plain reads of scattered 12 KiB blocks peak at about 21 GB/s here, against 30 sequential).
 * Issuing the next tile's prefetches a few at a time from inside the arithmetic, rather than
 * in one burst per head, took the same step from 164 to 144 ms: a burst of hundreds of
 * prefetches waits on the core's few line-fill buffers and stalls the arithmetic behind it.
 * Widening a narrow row's chunks once per query head (G times) made the kernel compute-bound:
 * with all blocks held in L2 a bfloat16 step took 80 ms on two threads against 45 for
 * float32. Widening once per group of up to 4 heads, one thread, blocks in L2 (CPU time a
 * step): 9 query / 3 kv heads of 64, bfloat16 160 -> 110 ms, float16 148 -> 101, float32
 * 161 -> 121 (fewer loads per FMA); 32 / 8 heads (G = 4) 561 -> 340, of 128 1041 -> 579;
 * 14 / 2 heads (G = 7: groups of 4 and 3) 216 -> 137. Blocks spread over DRAM, bfloat16:
 * 384 -> 327 ms (noisy, shared machine). TILE_KEYS 16 or 64 and issuing the prefetches in
 * the first half of the arithmetic measured no better. Every dot product and accumulator
 * keeps its FMA chain and reduction, so the results are bitwise those of one head at a time.
 *
 * Per-tile bookkeeping, next: the loops take one array of row byte offsets per tile (filled a
 * block at a time: a block's rows lie at a fixed stride) plus each head's K or V base, instead
 * of per-head pointer arrays rebuilt key by key for every head; the prefetch list holds one
 * offset per line pair (K and V lie at the same offsets), built from contiguous ranges (a
 * block's rows, all kv heads read, are one range). And every thread claims its next work
 * item before starting the current one, so the current item's last tile prefetches the next
 * item's first, which had always been read cold. Interleaved A/B against the previous build
 * (the same shapes; medians of 5-7 rounds of per-round ratios, shared machine at load 1.7-2.9):
 * blocks in L2, one thread (CPU time): bfloat16 0.87-0.90x (110 -> 96 ms), float32 0.87x;
 * two threads (wall) bfloat16 0.77x. Blocks over DRAM, bfloat16: one thread 0.91x (216 ->
 * 199 ms), two threads 0.90x (110 -> 99 ms); float32 one thread 0.97x. The row-pointer and
 * list changes alone gave 0.98x over DRAM; the next-item prefetch the rest. Measured no
 * better over DRAM: prefetching 2 tiles ahead (0.96x against 0.91x), into L1 (prefetcht0,
 * 0.96x), and one prefetch per 128 or 256 bytes leaving the rest of a block to the hardware
 * prefetchers (worse than the previous build: the streamer does not fill a scattered 6 KiB
 * block in time). With the cache on 2 MiB pages (pagedlm/huge_pages.py) the gain holds: one
 * thread 171 -> 155 ms (0.91x; 198 -> 181 on 4 KiB pages in the same minutes), two threads
 * 0.88x; there 2 tiles ahead measured 1.04x slower than 1 and prefetcht0 the same as t1.
 * Over DRAM a one-thread step still reads ~1.5 GB of K/V in ~155-200 ms, 7.5-9.5 GB/s: the
 * core's outstanding misses (and, on 4 KiB pages, the page walks), not the arithmetic (96 ms
 * of the step with the blocks in L2), bound it.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "include/kv_types.h"
#include "include/pagedlm_ops.h"
#include "include/vec_math.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define TILE_KEYS 32 /* keys scored per online-softmax step (rounded to whole blocks) */
/* K/V rows (x kv heads) below which another thread costs more than it saves. With the
 * workers spinning between regions (the fused decode stack) a second thread pays off early:
 * one SmolLM2 stream (3 kv heads, 32-288 keys) spent 0.94 ms a token in attention at 2048
 * (one thread throughout), 0.71 ms at 256. */
#define ROWS_PER_THREAD 256

/* gcc's -march=native tuning keeps auto-vectorised loops to 256 bits on Intel cores; 512-bit
 * ones measured faster for the portable V accumulation (128 decode tokens, 48-768 keys: 3.75 ->
 * 3.38 ms with a float32 cache on a Sapphire Rapids-class Xeon). */
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#define WIDE __attribute__((target("prefer-vector-width=512")))
#else
#define WIDE
#endif

/* How many tiles ahead the prefetches run, and their locality hint (2: prefetcht1, into L2;
 * the header says what else was measured). -D on the compiler line overrides, for A/B runs. */
#ifndef PF_AHEAD
#define PF_AHEAD 1
#endif
#ifndef PF_HINT
#define PF_HINT 2
#endif
/* A later tile's K/V cache lines, issued `per` pairs at a time from the inner loops: off[i]
 * is a line's byte offset in the K cache, and the V line at the same offset of the V cache
 * goes with it (both caches have one layout). */
typedef struct {
    const char *k, *v;
    const size_t* off;
    int pos, end, per;
} Prefetch;

static inline void prefetch_some(Prefetch* pf) {
    for (int i = 0; i < pf->per && pf->pos < pf->end; i++, pf->pos++) {
        __builtin_prefetch(pf->k + pf->off[pf->pos], 0, PF_HINT);
        __builtin_prefetch(pf->v + pf->off[pf->pos], 0, PF_HINT);
    }
}

/* Byte offsets of the rows (all kv heads) of positions start .. start+n-1; returns n, the
 * tile's length. One division per tile and one block-table read per block, not per key: a
 * block's rows lie at a fixed stride. */
static int tile_rows(size_t* rows, const int32_t* blocks, int start, int ctx_len, int tile,
                     int block_size, size_t row_bytes) {
    const int n = ctx_len - start < tile ? ctx_len - start : tile;
    int b = start / block_size, o = start % block_size;
    for (int j = 0; j < n; b++, o = 0) {
        const size_t base = (size_t)blocks[b] * block_size * row_bytes;
        for (; o < block_size && j < n; o++, j++) rows[j] = base + (size_t)o * row_bytes;
    }
    return n > 0 ? n : 0;
}

/* The cache lines of bytes [lo + rows[j], lo + rows[j] + len) for the n rows, as offsets from
 * base (64-byte lines of the absolute addresses); rows that continue the
 * previous one (a block's rows when all kv heads are read) form one range. Returns the count. */
static int tile_lines(size_t* off, const char* base, const size_t* rows, int n, size_t lo,
                      size_t len) {
    int c = 0;
    for (int j = 0; j < n;) {
        const size_t from = rows[j] + lo;
        size_t to = from + len;
        for (j++; j < n && rows[j] + lo == to; j++) to += len;
        const size_t a = (size_t)(((uintptr_t)(base + from) & ~(uintptr_t)63) - (uintptr_t)base);
        for (size_t o = a; o < to; o += 64) off[c++] = o;
    }
    return c;
}

/* s = cap * tanh(s / cap) over G rows of n scores. Out of line, so the uncapped path's code
 * is laid out as without it. */
__attribute__((noinline)) static void soft_cap_scores(float* s, int G, int n, int tile,
                                                      float cap) {
    for (int g = 0; g < G; g++)
        for (int j = 0; j < n; j++) s[g * tile + j] = cap * tanhf(s[g * tile + j] / cap);
}

#ifdef __AVX512F__
/* The four horizontal sums of a0..a3 as one 4-lane vector: pairs are folded together before
 * the last cross-lane adds, about a third of the work of four separate reductions. */
static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 v = _mm256_add_ps(_mm512_castps512_ps256(u), _mm256_castpd_ps(
                                       _mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}

/* 16 K/V elements of a row of kv_type as float32, widened in registers (exactly: a shift for
 * bfloat16, vcvtph2ps for float16), so a narrow cache is read without a widened copy. */
static inline __attribute__((always_inline)) __m512 load16(const void* row, int d,
                                                            const int kv_type) {
    if (kv_type == KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)row + d))),
            16));
    if (kv_type == KV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)row + d)));
    return _mm512_loadu_ps((const float*)row + d);
}

/* The query heads of a kv head go through the AVX-512 loops in groups of at most 4 (G x 4
 * accumulators must stay in registers), as evenly sized as possible: group i of ng. The
 * loops over a group's heads carry `#pragma GCC unroll 4`: without it gcc kept one copy's
 * accumulator array on the stack. */
static inline int group_size(int G, int ng, int i) { return G / ng + (i < G % ng); }

/* s[g * tile + j] = q_g . k_j for n keys and GG query heads (q_g at q + g * D), four keys at a
 * time (D a multiple of 16): one reduction per four dot products instead of one each, which
 * dominated the scoring. Each 16-element chunk of the four K rows (of kv_type) is widened once
 * for all GG heads; every dot product is the same FMA chain over d as for one head alone. */
static inline __attribute__((always_inline)) void scores_avx512(
        float* s, const float* q, const char* kb, const size_t* rows, int n, int D, int tile,
        Prefetch* pf, const int GG, const int kv_type) {
    for (int j = 0; j < n; j += 4) {
        const int r = n - j < 4 ? n - j : 4;
        const void *k0 = kb + rows[j], *k1 = kb + rows[j + (r > 1)],
                   *k2 = kb + rows[j + (r > 2 ? 2 : 0)], *k3 = kb + rows[j + (r > 3 ? 3 : 0)];
        prefetch_some(pf);
        __m512 a[4][4];
#pragma GCC unroll 4
        for (int g = 0; g < GG; g++)
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) a[g][i] = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 16) {
            const __m512 c0 = load16(k0, d, kv_type), c1 = load16(k1, d, kv_type),
                         c2 = load16(k2, d, kv_type), c3 = load16(k3, d, kv_type);
#pragma GCC unroll 4
            for (int g = 0; g < GG; g++) {
                const __m512 qv = _mm512_loadu_ps(q + (size_t)g * D + d);
                a[g][0] = _mm512_fmadd_ps(qv, c0, a[g][0]);
                a[g][1] = _mm512_fmadd_ps(qv, c1, a[g][1]);
                a[g][2] = _mm512_fmadd_ps(qv, c2, a[g][2]);
                a[g][3] = _mm512_fmadd_ps(qv, c3, a[g][3]);
            }
        }
#pragma GCC unroll 4
        for (int g = 0; g < GG; g++) {
            float out[4];
            _mm_storeu_ps(out, sum4(a[g][0], a[g][1], a[g][2], a[g][3]));
            for (int i = 0; i < r; i++) s[g * tile + j + i] = out[i];
        }
    }
}

/* Online softmax over one tile for G query heads: rescale the running sums to the new max and
 * turn the scores into weights. */
static void softmax_avx512(float* s, float* m, float* l, float* acc, int n, int G, int D,
                           int tile) {
    for (int g = 0; g < G; g++) {
        float* sg = s + (size_t)g * tile;
        __m512 vmx = _mm512_set1_ps(m[g]);
        for (int j = 0; j < n; j += 16) {
            const __mmask16 k = tail_mask(n - j);
            vmx = _mm512_mask_max_ps(vmx, k, vmx, _mm512_maskz_loadu_ps(k, sg + j));
        }
        const float mx = _mm512_reduce_max_ps(vmx);
        const __m512 vm = _mm512_set1_ps(mx);
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < n; j += 16) {
            const __mmask16 k = tail_mask(n - j);
            const __m512 w = exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + j), vm));
            _mm512_mask_storeu_ps(sg + j, k, w);
            sum = _mm512_mask_add_ps(sum, k, sum, w);
        }
        const float alpha = exp_neg(m[g] - mx); /* ~0 on the first tile */
        l[g] = l[g] * alpha + _mm512_reduce_add_ps(sum);
        m[g] = mx;
        const __m512 va = _mm512_set1_ps(alpha);
        for (int d = 0; d < D; d += 16)
            _mm512_storeu_ps(acc + (size_t)g * D + d,
                             _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)g * D + d), va));
    }
}

/* acc_g += sum_j w_gj v_j for GG query heads (acc_g at acc + g * D, w_gj at s[g * tile + j]):
 * 64 columns of each head's acc stay in registers over the tile's keys, and each chunk of a V
 * row is widened once for all GG heads. Every accumulator adds the keys in order, as for one
 * head alone. */
static inline __attribute__((always_inline)) void accumulate_avx512(
        float* acc, const float* s, const char* vb, const size_t* rows, int n, int D, int tile,
        Prefetch* pf, const int GG, const int kv_type) {
    int d = 0;
    for (; d + 64 <= D; d += 64) {
        __m512 a[4][4];
#pragma GCC unroll 4
        for (int g = 0; g < GG; g++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) a[g][c] = _mm512_loadu_ps(acc + (size_t)g * D + d + 16 * c);
        for (int j = 0; j < n; j++) {
            prefetch_some(pf);
            const char* vr = vb + rows[j];
            const __m512 v0 = load16(vr, d, kv_type), v1 = load16(vr, d + 16, kv_type),
                         v2 = load16(vr, d + 32, kv_type), v3 = load16(vr, d + 48, kv_type);
#pragma GCC unroll 4
            for (int g = 0; g < GG; g++) {
                const __m512 w = _mm512_set1_ps(s[g * tile + j]);
                a[g][0] = _mm512_fmadd_ps(w, v0, a[g][0]);
                a[g][1] = _mm512_fmadd_ps(w, v1, a[g][1]);
                a[g][2] = _mm512_fmadd_ps(w, v2, a[g][2]);
                a[g][3] = _mm512_fmadd_ps(w, v3, a[g][3]);
            }
        }
#pragma GCC unroll 4
        for (int g = 0; g < GG; g++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + (size_t)g * D + d + 16 * c, a[g][c]);
    }
    for (; d < D; d += 16) {
        __m512 a[4];
#pragma GCC unroll 4
        for (int g = 0; g < GG; g++) a[g] = _mm512_loadu_ps(acc + (size_t)g * D + d);
        for (int j = 0; j < n; j++) {
            prefetch_some(pf);
            const __m512 v = load16(vb + rows[j], d, kv_type);
#pragma GCC unroll 4
            for (int g = 0; g < GG; g++)
                a[g] = _mm512_fmadd_ps(_mm512_set1_ps(s[g * tile + j]), v, a[g]);
        }
#pragma GCC unroll 4
        for (int g = 0; g < GG; g++) _mm512_storeu_ps(acc + (size_t)g * D + d, a[g]);
    }
}

/* One kv head's scores (phase 0) or accumulation (phase 1) over a tile, in groups of query
 * heads: each group size and cache type gets its own copy of the loops (constants). */
static inline __attribute__((always_inline)) void group_avx512(
        int phase, float* acc, float* s, const float* q, const char* base, const size_t* rows,
        int n, int G, int D, int tile, Prefetch* pf, const int kv_type) {
    const int ng = (G + 3) / 4;
    for (int i = 0, g0 = 0; i < ng; g0 += group_size(G, ng, i), i++) {
        const int gg = group_size(G, ng, i);
        const float* qg = q + (size_t)g0 * D;
        float *ag = acc + (size_t)g0 * D, *sg = s + (size_t)g0 * tile;
#define PA_GROUP(GG)                                                              \
        if (phase == 0) scores_avx512(sg, qg, base, rows, n, D, tile, pf, GG, kv_type); \
        else accumulate_avx512(ag, sg, base, rows, n, D, tile, pf, GG, kv_type);        \
        break;
        switch (gg) {
            case 1: PA_GROUP(1)
            case 2: PA_GROUP(2)
            case 3: PA_GROUP(3)
            default: PA_GROUP(4)
        }
#undef PA_GROUP
    }
}

/* group_avx512 with kv_type made a constant. */
static void phase_avx512(int phase, float* acc, float* s, const float* q, const char* base,
                         const size_t* rows, int n, int G, int D, int tile, Prefetch* pf,
                         int kv_type) {
    if (kv_type == KV_BF16)
        group_avx512(phase, acc, s, q, base, rows, n, G, D, tile, pf, KV_BF16);
    else if (kv_type == KV_F16)
        group_avx512(phase, acc, s, q, base, rows, n, G, D, tile, pf, KV_F16);
    else
        group_avx512(phase, acc, s, q, base, rows, n, G, D, tile, pf, KV_F32);
}
#endif

/* The portable versions of the three steps above (any D; no AVX-512). */
REASSOC static void scores_portable(float* s, const float* q, const float** kp, int n, int G,
                                    int D, int tile) {
    for (int j = 0; j < n; j++) {
        const float* k = kp[j];
        for (int g = 0; g < G; g++) {
            const float* qg = q + g * D;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; d++) dot += qg[d] * k[d];
            s[g * tile + j] = dot;
        }
    }
}

REASSOC static void softmax_portable(float* s, float* m, float* l, float* acc, int n, int G,
                                     int D, int tile) {
    for (int g = 0; g < G; g++) {
        float *sg = s + g * tile, mx = m[g], sum = 0.0f;
        for (int j = 0; j < n; j++) mx = sg[j] > mx ? sg[j] : mx;
        const float alpha = exp_neg(m[g] - mx); /* ~0 on the first tile */
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < n; j++) {
            sg[j] = exp_neg(sg[j] - mx);
            sum += sg[j];
        }
        l[g] = l[g] * alpha + sum;
        m[g] = mx;
        for (int d = 0; d < D; d++) acc[g * D + d] *= alpha;
    }
}

REASSOC static void accumulate_portable(float* acc, const float* s, const float** vp, int n,
                                        int G, int D, int tile) {
    for (int j = 0; j < n; j += 4) { /* four V rows per pass over the accumulators */
        const int r = n - j < 4 ? n - j : 4;
        const float* v[4];
        for (int i = 0; i < 4; i++) v[i] = vp[j + (i < r ? i : 0)];
        for (int g = 0; g < G; g++) {
            float w[4], *ag = acc + g * D;
            for (int i = 0; i < 4; i++) w[i] = i < r ? s[g * tile + j + i] : 0.0f;
#pragma omp simd
            for (int d = 0; d < D; d++)
                ag[d] += (w[0] * v[0][d] + w[1] * v[1][d]) + (w[2] * v[2][d] + w[3] * v[3][d]);
        }
    }
}

/* Per-thread scratch of attend(), for nh kv heads of G query heads each. */
typedef struct {
    float *q, *acc, *m, *l; /* [nh * G * D], [nh * G * D], [nh * G], [nh * G] */
    float* s;               /* [G * tile] */
    size_t* rows;           /* [2 * tile]: byte offsets of this tile's rows and a later one's */
    float *kbuf, *vbuf;     /* [tile * D] each, lower-precision caches only */
    const float **kp, **vp; /* [tile]: float32 rows (portable loops) */
    size_t* lines;          /* [tile * (lines per row + 1)], a later tile's prefetches */
} Scratch;

/* Where the thread's next work item starts reading (its first tile is prefetched during this
 * item's last one): its block-table row, first key, keys and first kv head. blocks == NULL:
 * none. */
typedef struct {
    const int32_t* blocks;
    int first, ctx_len, h0;
} Next;

/* The first key a token reads: keys outside the window are skipped, not masked. */
static inline int first_key(int ctx_len, int window) {
    return window > 0 && ctx_len > window ? ctx_len - window : 0;
}

/* kv heads h0 .. h0+nh-1 of one token: out[h][g] = softmax(scale * q[h][g] K_h^T) V_h.
 * query/out point at head h0's first query head. The heads advance together, one tile at a
 * time: they share each K/V row's cache lines, and the next tile's prefetches are spread over
 * all of their arithmetic, so the memory stays busy while they compute. */
WIDE static void attend(float* out, const float* query, const void* k_cache,
                        const void* v_cache, int kv_type, const int32_t* blocks, int ctx_len,
                        int h0, int nh, int G, int D, int num_kv_heads, int block_size, int tile,
                        float scale, int window, float soft_cap, const Scratch* w,
                        const Next* nx) {
    const size_t elem = kv_elem_size(kv_type);
    const char *kc = (const char*)k_cache, *vc = (const char*)v_cache;
    const size_t row_stride = (size_t)num_kv_heads * D;
    const int HG = nh * G;
    for (int i = 0; i < HG * D; i++) w->q[i] = query[i] * scale, w->acc[i] = 0.0f;
    for (int g = 0; g < HG; g++) w->m[g] = -INFINITY, w->l[g] = 0.0f;
#ifdef __AVX512F__
    const int fast = D % 16 == 0;
#endif

    const int first = first_key(ctx_len, window); /* the first tile starts at the window */
    const size_t row_bytes = row_stride * elem, pf_bytes = (size_t)nh * D * elem;
    const size_t head0 = (size_t)h0 * D * elem;
    size_t *cur = w->rows, *ahead = w->rows + tile; /* row offsets of this tile and a later */
    for (int start = first; start < ctx_len; start += tile) {
        const int n = tile_rows(cur, blocks, start, ctx_len, tile, block_size, row_bytes);
        int n_ahead = tile_rows(ahead, blocks, start + PF_AHEAD * tile, ctx_len, tile,
                                block_size, row_bytes);
        size_t ahead0 = head0;
        if (start + tile >= ctx_len && nx->blocks) { /* the last tile: the next item's first */
            n_ahead = tile_rows(ahead, nx->blocks, nx->first, nx->ctx_len, tile, block_size,
                                row_bytes);
            ahead0 = (size_t)nx->h0 * D * elem;
        }
        /* Every line of a later tile's rows (all nh heads' slices), shared out evenly over
         * the inner-loop steps of this tile's arithmetic: for each head and group of query
         * heads, one per 4 keys scored and one per key and block of 64 (or 16) columns
         * accumulated. */
        Prefetch pf = {kc, vc, w->lines, 0, 0, 0};
        pf.end = tile_lines(w->lines, kc, ahead, n_ahead, ahead0, pf_bytes);
        const int steps = nh * ((G + 3) / 4) * ((n + 3) / 4 + n * (D / 64 + D % 64 / 16));
        pf.per = (pf.end + steps - 1) / steps;
        for (int hh = 0; hh < nh; hh++) {
            const size_t head_off = (size_t)(h0 + hh) * D * elem;
#ifdef __AVX512F__
            if (fast) { /* rows in place: the AVX-512 loops widen narrow rows themselves */
                float *q = w->q + (size_t)hh * G * D, *acc = w->acc + (size_t)hh * G * D;
                float *m = w->m + hh * G, *l = w->l + hh * G;
                phase_avx512(0, acc, w->s, q, kc + head_off, cur, n, G, D, tile, &pf, kv_type);
                if (soft_cap > 0.0f) soft_cap_scores(w->s, G, n, tile, soft_cap);
                softmax_avx512(w->s, m, l, acc, n, G, D, tile);
                phase_avx512(1, acc, w->s, q, vc + head_off, cur, n, G, D, tile, &pf, kv_type);
                continue;
            }
#endif
            /* This tile's K/V rows of head h as float32 for the portable loops: in place for a
             * float32 cache, else widened into the tile's copy. */
            for (int j = 0; j < n; j++) {
                const char *kr = kc + cur[j] + head_off, *vr = vc + cur[j] + head_off;
                if (kv_type == KV_F32) {
                    w->kp[j] = (const float*)kr;
                    w->vp[j] = (const float*)vr;
                } else {
                    kv_load_row(w->kbuf + (size_t)j * D, kr, D, kv_type);
                    kv_load_row(w->vbuf + (size_t)j * D, vr, D, kv_type);
                    w->kp[j] = w->kbuf + (size_t)j * D;
                    w->vp[j] = w->vbuf + (size_t)j * D;
                }
            }
            float *q = w->q + (size_t)hh * G * D, *acc = w->acc + (size_t)hh * G * D;
            float *m = w->m + hh * G, *l = w->l + hh * G;
            if (hh == 0) { /* the portable steps take no prefetch cursor: all of it up front */
                pf.per = pf.end;
                prefetch_some(&pf);
            }
            scores_portable(w->s, q, w->kp, n, G, D, tile);
            if (soft_cap > 0.0f) soft_cap_scores(w->s, G, n, tile, soft_cap);
            softmax_portable(w->s, m, l, acc, n, G, D, tile);
            accumulate_portable(acc, w->s, w->vp, n, G, D, tile);
        }
        pf.per = pf.end; /* any left over by rounding */
        prefetch_some(&pf);
    }
    for (int g = 0; g < HG; g++) {
        const float inv = w->l[g] > 0.0f ? 1.0f / w->l[g] : 0.0f; /* ctx_len == 0 -> zeros */
        for (int d = 0; d < D; d++) out[g * D + d] = w->acc[g * D + d] * inv;
    }
}

void paged_attention_f32(float* out, const float* query, const void* k_cache,
                         const void* v_cache, int kv_type, const int32_t* block_tables,
                         const int32_t* token_seq, const int32_t* token_ctx_len, int num_tokens,
                         int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                         int max_blocks_per_seq, float scale, int window, float soft_cap,
                         int num_threads) {
    const int G = num_q_heads / num_kv_heads, D = head_dim;
    const int tile = block_size >= TILE_KEYS ? block_size : TILE_KEYS / block_size * block_size;
    long work = 0; /* K/V rows to read, to keep small calls on few threads */
    for (int t = 0; t < num_tokens; t++)
        work += window > 0 && token_ctx_len[t] > window ? window : token_ctx_len[t];
    work *= num_kv_heads;
    if ((long)num_threads * ROWS_PER_THREAD > work) num_threads = (int)(work / ROWS_PER_THREAD);
    if (num_threads < 1) num_threads = 1;
    /* With tokens to spare, a work item is a token with all its kv heads (they share each K/V
     * row's cache lines); with few tokens, one kv head of a token, so every thread has work. */
    const int nh = num_tokens >= 2 * num_threads ? num_kv_heads : 1;
    const long num_items = (long)num_tokens * (num_kv_heads / nh);
    if (num_threads > num_items) num_threads = (int)num_items;

    long claimed = 0; /* work items handed out */
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        float buf[(size_t)nh * G * (2 * D + 2) + (size_t)G * tile]; /* per-thread scratch */
        size_t rows[2 * tile];
        const float *kp[tile], *vp[tile];
        size_t lines[(size_t)tile * (((size_t)nh * D * kv_elem_size(kv_type) + 63) / 64 + 1)];
        float kvbuf[kv_type == KV_F32 ? 1 : 2 * (size_t)tile * D];
        Scratch w = {.q = buf, .acc = buf + (size_t)nh * G * D,
                     .m = buf + (size_t)2 * nh * G * D, .l = buf + (size_t)2 * nh * G * D + nh * G,
                     .s = buf + (size_t)nh * G * (2 * D + 2), .rows = rows, .kbuf = kvbuf,
                     .vbuf = kv_type == KV_F32 ? kvbuf : kvbuf + (size_t)tile * D, .kp = kp,
                     .vp = vp, .lines = lines};
        /* Items are taken one at a time (dynamic), but each thread claims its next item
         * before working on the current one, so that it can prefetch the next one's first
         * tile. */
        long item = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (item < num_items) {
            const long after = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            const int t = (int)(item / (num_kv_heads / nh));
            const int h0 = (int)(item % (num_kv_heads / nh)) * nh;
            const size_t off = ((size_t)t * num_q_heads + (size_t)h0 * G) * D;
            Next nx = {NULL, 0, 0, 0};
            if (after < num_items) {
                const int t2 = (int)(after / (num_kv_heads / nh));
                nx.blocks = block_tables + (size_t)token_seq[t2] * max_blocks_per_seq;
                nx.ctx_len = token_ctx_len[t2];
                nx.first = first_key(nx.ctx_len, window);
                nx.h0 = (int)(after % (num_kv_heads / nh)) * nh;
            }
            attend(out + off, query + off, k_cache, v_cache, kv_type,
                   block_tables + (size_t)token_seq[t] * max_blocks_per_seq, token_ctx_len[t],
                   h0, nh, G, D, num_kv_heads, block_size, tile, scale, window, soft_cap, &w,
                   &nx);
            item = after;
        }
    }
}
