/* Paged attention over a block-structured KV cache, float32, CPU (OpenMP).
 *
 * Cache layout (both K and V): [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
 * query/out: [num_tokens, num_q_heads, head_dim], contiguous.
 * Token t reads block-table row token_seq[t] and attends to the positions
 * 0 .. token_ctx_len[t]-1 of that sequence; position p lives in slot p % block_size of block
 * block_tables[row * max_blocks_per_seq + p / block_size].
 *
 * One work item = one (token, kv head) pair. Its G = num_q_heads / num_kv_heads query heads
 * are processed together so every K/V row is read from memory once. Softmax is computed
 * online (streaming), one tile of whole blocks at a time. No -ffast-math: the only reordering
 * is the one `omp simd reduction` allows inside a dot product.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define TILE_KEYS 64 /* keys scored per online-softmax step (rounded to whole blocks) */

static void attend_one(float* out, const float* query, const float* k_cache,
                       const float* v_cache, const int32_t* blocks, int ctx_len, int kvh, int G,
                       int D, int num_kv_heads, int block_size, int blocks_per_tile, float scale,
                       float* q, float* acc, float* s, float* m, float* l) {
    const size_t row_stride = (size_t)num_kv_heads * D; /* between slots of a block */
    const size_t block_stride = (size_t)block_size * row_stride;
    const int tile = blocks_per_tile * block_size;

    for (int g = 0; g < G; g++) {
        for (int d = 0; d < D; d++) q[g * D + d] = query[(size_t)g * D + d] * scale;
        for (int d = 0; d < D; d++) acc[g * D + d] = 0.0f;
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int start = 0; start < ctx_len; start += tile) {
        const int n = ctx_len - start < tile ? ctx_len - start : tile;
        /* Scores s[g * tile + j] = q_g . k_{start + j}. */
        for (int j = 0; j < n; j++) {
            const int p = start + j;
            const float* k = k_cache + (size_t)blocks[p / block_size] * block_stride +
                             (size_t)(p % block_size) * row_stride + (size_t)kvh * D;
            for (int g = 0; g < G; g++) {
                const float* qg = q + g * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < D; d++) dot += qg[d] * k[d];
                s[g * tile + j] = dot;
            }
        }
        /* Online softmax: rescale the running sums to the new max, turn scores into weights. */
        for (int g = 0; g < G; g++) {
            float* sg = s + g * tile;
            float mx = m[g];
            for (int j = 0; j < n; j++) mx = sg[j] > mx ? sg[j] : mx;
            const float alpha = expf(m[g] - mx); /* exp(-inf) = 0 on the first tile */
            float sum = 0.0f;
            for (int j = 0; j < n; j++) {
                sg[j] = expf(sg[j] - mx);
                sum += sg[j];
            }
            l[g] = l[g] * alpha + sum;
            m[g] = mx;
            if (alpha != 1.0f) {
                float* ag = acc + g * D;
#pragma omp simd
                for (int d = 0; d < D; d++) ag[d] *= alpha;
            }
        }
        /* acc_g += sum_j w_gj * v_j, reading each V row once for all G heads. */
        for (int j = 0; j < n; j++) {
            const int p = start + j;
            const float* v = v_cache + (size_t)blocks[p / block_size] * block_stride +
                             (size_t)(p % block_size) * row_stride + (size_t)kvh * D;
            for (int g = 0; g < G; g++) {
                float* ag = acc + g * D;
                const float w = s[g * tile + j];
#pragma omp simd
                for (int d = 0; d < D; d++) ag[d] += w * v[d];
            }
        }
    }
    for (int g = 0; g < G; g++) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f; /* ctx_len == 0 -> zeros */
        for (int d = 0; d < D; d++) out[(size_t)g * D + d] = acc[g * D + d] * inv;
    }
}

void paged_attention_f32(float* out, const float* query, const float* k_cache,
                         const float* v_cache, const int32_t* block_tables,
                         const int32_t* token_seq, const int32_t* token_ctx_len, int num_tokens,
                         int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                         int max_blocks_per_seq, float scale, int num_threads) {
    const int G = num_q_heads / num_kv_heads;
    const int blocks_per_tile = block_size >= TILE_KEYS ? 1 : TILE_KEYS / block_size;
    const int tile = blocks_per_tile * block_size;
    const long num_items = (long)num_tokens * num_kv_heads;
    if (num_threads <= 0) num_threads = 1;

#pragma omp parallel num_threads(num_threads)
    {
        /* Per-thread scratch: scaled queries, accumulators, scores, running max and sum. */
        float buf[(size_t)G * (2 * head_dim + tile + 2)];
        float *q = buf, *acc = q + (size_t)G * head_dim, *s = acc + (size_t)G * head_dim;
        float *m = s + (size_t)G * tile, *l = m + G;
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < num_items; item++) {
            const int t = (int)(item / num_kv_heads), kvh = (int)(item % num_kv_heads);
            const size_t off = ((size_t)t * num_q_heads + (size_t)kvh * G) * head_dim;
            attend_one(out + off, query + off, k_cache, v_cache,
                       block_tables + (size_t)token_seq[t] * max_blocks_per_seq,
                       token_ctx_len[t], kvh, G, head_dim, num_kv_heads, block_size,
                       blocks_per_tile, scale, q, acc, s, m, l);
        }
    }
}
