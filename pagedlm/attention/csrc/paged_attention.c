/* Paged attention over a block-structured KV cache, float32 queries, CPU (OpenMP).
 *
 * The cache holds float32, bfloat16 or float16 elements (kv_type, see kv_types.h); rows of a
 * lower-precision cache are widened to float32 as a tile is loaded, so all arithmetic is
 * float32 whatever the storage.
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
 * One work item = one (token, kv head) pair. Its G = num_q_heads / num_kv_heads query heads
 * are processed together so every K/V row is read from memory once. Softmax is computed
 * online (streaming), one tile of whole blocks at a time, while the next tile is prefetched.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kv_types.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define TILE_KEYS 32 /* keys scored per online-softmax step (rounded to whole blocks) */
/* K/V rows (x kv heads) below which another thread costs more than it saves. With the
 * workers spinning between regions (the fused decode stack) a second thread pays off early:
 * one SmolLM2 stream (3 kv heads, 32-288 keys) spent 0.94 ms a token in attention at 2048
 * (one thread throughout), 0.71 ms at 256. */
#define ROWS_PER_THREAD 256

/* Allow reassociation only, so dot products and sums use vector (tree) reductions. Not
 * -ffast-math: no finite-math, flush-to-zero or approximate-reciprocal assumptions. */
#if defined(__GNUC__) && !defined(__clang__)
#define REASSOC __attribute__((optimize("associative-math", "no-signed-zeros", "no-trapping-math")))
#else
#define REASSOC
#endif
/* gcc's -march=native tuning keeps auto-vectorised loops to 256 bits on Intel cores; here the
 * 512-bit V accumulation measured faster (128 decode tokens, 48-768 keys: 3.75 -> 3.38 ms with a
 * float32 cache on a Sapphire Rapids-class Xeon). */
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#define WIDE __attribute__((target("prefer-vector-width=512")))
#else
#define WIDE
#endif

/* exp(x) for x <= 0 that vectorizes (Cephes polynomial, relative error < 1e-7); inputs below
 * -87 (including -inf) give ~1.6e-38 instead of 0, which is harmless here. */
REASSOC static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504f + 0.5f); /* x = n ln2 + r, |r| <= ln2 / 2 */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n */
    float pow2n;
    memcpy(&pow2n, &bits, sizeof pow2n);
    return p * pow2n;
}

/* Offsets of the K/V rows of the tile starting at position `start`; returns how many. */
static int tile_rows(size_t* rows, const int32_t* blocks, int start, int ctx_len, int tile,
                     int block_size, size_t row_stride, size_t head_off) {
    const int n = ctx_len - start < tile ? ctx_len - start : tile;
    for (int j = 0; j < n; j++)
        rows[j] = ((size_t)blocks[(start + j) / block_size] * block_size +
                   (start + j) % block_size) * row_stride + head_off;
    return n > 0 ? n : 0;
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

/* s[g * tile + j] = q_g . k_j for n keys, four keys at a time (D a multiple of 16): one
 * reduction per four dot products instead of one each, which dominated the scoring. */
static void scores_avx512(float* s, const float* q, const float** kp, int n, int G, int D,
                          int tile) {
    for (int j = 0; j < n; j += 4) {
        const int r = n - j < 4 ? n - j : 4;
        const float *k0 = kp[j], *k1 = kp[j + (r > 1)], *k2 = kp[j + (r > 2 ? 2 : 0)],
                    *k3 = kp[j + (r > 3 ? 3 : 0)];
        for (int g = 0; g < G; g++) {
            const float* qg = q + (size_t)g * D;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int d = 0; d < D; d += 16) {
                const __m512 qv = _mm512_loadu_ps(qg + d);
                a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + d), a0);
                a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k1 + d), a1);
                a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k2 + d), a2);
                a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k3 + d), a3);
            }
            float out[4];
            _mm_storeu_ps(out, sum4(a0, a1, a2, a3));
            for (int i = 0; i < r; i++) s[g * tile + j + i] = out[i];
        }
    }
}
#endif

/* One (token, kv head): out[g] = softmax(scale * q[g] K^T) V for its G query heads.
 * Scratch: q, acc [G * D]; s [G * tile]; m, l [G]; rows [2 * tile]. */
REASSOC WIDE static void attend_one(float* out, const float* query, const void* k_cache,
                               const void* v_cache, int kv_type, const int32_t* blocks,
                               int ctx_len, int kvh, int G, int D, int num_kv_heads,
                               int block_size, int tile, float scale, int window,
                               float soft_cap, float* q, float* acc, float* s, float* m,
                               float* l, size_t* rows, float* kbuf, float* vbuf,
                               const float** kp, const float** vp, int prefetch_heads) {
    const size_t elem = kv_elem_size(kv_type);
    const char *kc = (const char*)k_cache, *vc = (const char*)v_cache;
    const size_t row_stride = (size_t)num_kv_heads * D, head_off = (size_t)kvh * D;
    for (int i = 0; i < G * D; i++) q[i] = query[i] * scale;
    for (int i = 0; i < G * D; i++) acc[i] = 0.0f;
    for (int g = 0; g < G; g++) m[g] = -INFINITY, l[g] = 0.0f;

    /* Keys outside the window are skipped, not masked: the first tile starts at the window. */
    const int first = window > 0 && ctx_len > window ? ctx_len - window : 0;
    size_t *cur = rows, *next = rows + tile; /* row offsets of this tile and the next */
    tile_rows(cur, blocks, first, ctx_len, tile, block_size, row_stride, head_off);
    for (int start = first; start < ctx_len; start += tile) {
        const int n = ctx_len - start < tile ? ctx_len - start : tile;
        const int n_next = tile_rows(next, blocks, start + tile, ctx_len, tile, block_size,
                                     row_stride, head_off);
        /* One prefetch per 64-byte line, into L2 (L1 is slower); with prefetch_heads, from
         * this head's slice to the row's end, so the same thread's later heads find it there. */
        const size_t pf_bytes = (size_t)D * elem * (prefetch_heads ? num_kv_heads - kvh : 1);
        for (int j = 0; j < n_next; j++)
            for (size_t b = 0; b < pf_bytes; b += 64) {
                __builtin_prefetch(kc + next[j] * elem + b, 0, 2);
                __builtin_prefetch(vc + next[j] * elem + b, 0, 2);
            }
        /* This tile's K/V rows as float32: in place for a float32 cache, else widened. */
        for (int j = 0; j < n; j++) {
            if (kv_type == KV_F32) {
                kp[j] = (const float*)k_cache + cur[j];
                vp[j] = (const float*)v_cache + cur[j];
            } else {
                kv_load_row(kbuf + (size_t)j * D, kc + cur[j] * elem, D, kv_type);
                kv_load_row(vbuf + (size_t)j * D, vc + cur[j] * elem, D, kv_type);
                kp[j] = kbuf + (size_t)j * D;
                vp[j] = vbuf + (size_t)j * D;
            }
        }
        /* Scores s[g * tile + j] = q_g . k_j (scale already in q). */
#ifdef __AVX512F__
        if (D % 16 == 0) scores_avx512(s, q, kp, n, G, D, tile);
        else
#endif
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
        if (soft_cap > 0.0f) soft_cap_scores(s, G, n, tile, soft_cap);
        /* Online softmax: rescale the running sums to the new max, turn scores into weights. */
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
        /* acc_g += sum_j w_gj v_j, four V rows per pass over the accumulators. */
        for (int j = 0; j < n; j += 4) {
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
        size_t* t = cur; /* the next tile's offsets become current */
        cur = next;
        next = t;
    }
    for (int g = 0; g < G; g++) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f; /* ctx_len == 0 -> zeros */
        for (int d = 0; d < D; d++) out[g * D + d] = acc[g * D + d] * inv;
    }
}

void paged_attention_f32(float* out, const float* query, const void* k_cache,
                         const void* v_cache, int kv_type, const int32_t* block_tables,
                         const int32_t* token_seq, const int32_t* token_ctx_len, int num_tokens,
                         int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                         int max_blocks_per_seq, float scale, int window, float soft_cap,
                         int num_threads) {
    const int G = num_q_heads / num_kv_heads;
    const int tile = block_size >= TILE_KEYS ? block_size : TILE_KEYS / block_size * block_size;
    const long num_items = (long)num_tokens * num_kv_heads;
    long work = 0; /* K/V rows to read, to keep small calls on few threads */
    for (int t = 0; t < num_tokens; t++)
        work += window > 0 && token_ctx_len[t] > window ? window : token_ctx_len[t];
    work *= num_kv_heads;
    if ((long)num_threads * ROWS_PER_THREAD > work) num_threads = (int)(work / ROWS_PER_THREAD);
    if (num_threads > num_items) num_threads = (int)num_items;
    /* With tokens to spare, one thread takes every kv head of a token: the heads share each
     * K/V row's cache lines, so the first head's pass brings the whole rows into that core's
     * L2 and the rest read them from there instead of from memory. */
    const int whole_rows = num_tokens >= 2 * (num_threads > 0 ? num_threads : 1);
    const int chunk = whole_rows ? num_kv_heads : 1;

#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        float buf[(size_t)G * (2 * head_dim + tile + 2)]; /* per-thread scratch */
        size_t rows[2 * tile];
        const float *kp[tile], *vp[tile];
        /* Widened K/V rows of one tile (lower-precision caches only). */
        float kvbuf[kv_type == KV_F32 ? 1 : 2 * (size_t)tile * head_dim];
        float *q = buf, *acc = q + (size_t)G * head_dim, *s = acc + (size_t)G * head_dim;
        float *m = s + (size_t)G * tile, *l = m + G;
#pragma omp for schedule(dynamic, chunk)
        for (long item = 0; item < num_items; item++) {
            const int t = (int)(item / num_kv_heads), kvh = (int)(item % num_kv_heads);
            const size_t off = ((size_t)t * num_q_heads + (size_t)kvh * G) * head_dim;
            attend_one(out + off, query + off, k_cache, v_cache, kv_type,
                       block_tables + (size_t)token_seq[t] * max_blocks_per_seq,
                       token_ctx_len[t], kvh, G, head_dim, num_kv_heads, block_size, tile,
                       scale, window, soft_cap, q, acc, s, m, l, rows, kvbuf,
                       kv_type == KV_F32 ? kvbuf : kvbuf + (size_t)tile * head_dim, kp, vp,
                       whole_rows && kvh == 0);
        }
    }
}
