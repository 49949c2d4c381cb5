/* Attention of prefill chunks over a bfloat16 KV cache on AMX's tile unit (tdpbf16ps).
 *
 * The same job, arguments and layout as prefill_attention_f32 (prefill_attention.c, whose header
 * gives the causal and context rules), for a bfloat16 cache: K and V are bfloat16 values
 * already (the cache's rows as they lie; the fresh float32 rows are rounded here as the cache
 * rounds them, to nearest even; a rounded row passes unchanged), so both products run on
 * tiles:
 *   - K of a (chunk, kv head) is packed once into B tiles for Q K^T: 16 keys a tile, row j =
 *     (K[c][2j], K[c][2j+1]) for the 16 keys c; V into B tiles for P V: 32 keys a tile, row j =
 *     (V[2j][d], V[2j+1][d]) for 16 columns d. Keys past the chunk's are zero.
 *   - An item is 32 query rows (two A tiles; as in the float32 kernel, row f is position f / G
 *     and query head h * G + f % G, so the G query heads of the kv head share the keys). Its Q
 *     rows are rounded to bfloat16 (to nearest even: vcvtne2ps2bf16, which reads a subnormal as
 *     zero, as tdpbf16ps does anyway); its scores go 32 x 32 keys a block (4 C tiles) to a float32
 *     scratch, over D in steps of 32 (head_dim must be a multiple of 32).
 *   - The softmax is the float32 kernel's, exact and two-pass, on the scaled scores (soft cap
 *     and window as there); the weights exp(s - max) are rounded to bfloat16 for P V and the
 *     row's sum is taken over the rounded weights, so the output is a convex combination of V's
 *     rows; it is scaled by 1 / sum as it is written out. P V goes 32 rows x 32 columns a pass.
 * So the errors against float attention are bfloat16's: Q rounded (relative 2^-9 an element)
 * and each weight rounded (relative 2^-9); the sums are float32 (tests/kernels/
 * test_prefill_attention_amx.py bounds both). A row's result depends only on its own query and
 * keys, not on the other rows of its item or the thread count; but it is not the float32
 * kernel's, so the deterministic mode (which does not call a prefill kernel at all: the paged
 * kernel takes every row there) keeps to that.
 *
 * Measured on the project's 2-vCPU Sapphire Rapids-class Xeon while other jobs kept it at a load
 * of 7-8 (so every figure is 2-4x below an idle machine's; ratios from interleaved rounds):
 * SmolLM2-135M's 9 query heads over 3 kv heads of 64, 8 fresh prompts of 96-464 tokens,
 * - benchmarks/attention.py --only prefill --kv-cache-dtype bfloat16 (30 layers, 2 threads,
 *   5 rounds): float32 kernel best 552 / median 625 ms, this one 345 / 436 ms (0.62x);
 * - one layer, 1 thread, 9 rounds of 5 calls: 14.5 ms median (13.4 best) against 7.5 (6.9).
 * perf (1 thread): the float32 softmax pass (scale, mask, exp, rounding) is about 40% of this
 * kernel, the two tile products about 15% each, rounding Q 8%, packing K/V 3% of the call: the
 * products were the float32 kernel's bulk, the softmax is now.
 * In the 128-request run with its outputs cut to 16-32 tokens (the same 33495 prompt tokens;
 * benchmarks/throughput.py --dtype bfloat16 --temperature 0 --op-times, 2 interleaved rounds,
 * load 6-10): "attention, steps with prefill rows" 38.2 / 54.2 s with the float32 kernel against
 * 33.0 / 25.3 s here, i.e. 0.98 / 1.16 of the same run's ">128 rows" linears' time against
 * 0.67 / 0.62. That figure includes the backend's rounding of the step's fresh K/V, which this
 * kernel does itself as it packs them (attention/backends/native.py).
 */
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "include/pagedlm_ops.h"

#if defined(__linux__) && defined(__x86_64__) && defined(__AMX_TILE__) \
    && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "include/vec_math.h"

#define RT 32 /* query rows per item: two A tiles */
#define KT 32 /* keys per score block and per P V step */

typedef struct {
    int32_t start, len, ctx; /* the chunk */
    uint16_t* kp; /* [kpad / 16][D / 2][16][2]: K's B tiles for Q K^T, 16 keys each */
    uint16_t* vp; /* [kpad / 32][16][D][2]: V's B tiles for P V, 32 keys each */
} Src;

/* Tiles 0-3: C (rows 0-15 x columns 0-15, 0-15 x 16-31, 16-31 x 0-15, 16-31 x 16-31);
 * 4, 5: A (rows 0-15, 16-31); 6, 7: B (columns 0-15, 16-31). All 16 rows of 64 bytes. */
static void load_tiles(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

/* n (a multiple of 32) floats to bfloat16, to nearest even. */
static inline void round_bf16(uint16_t* dst, const float* src, int n) {
    for (int d = 0; d < n; d += 32)
        _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + d + 16),
                                                                  _mm512_loadu_ps(src + d)));
}

/* Row p of a chunk's K (or V), bfloat16: in the cache before ctx, else the fresh row rounded
 * into buf. */
static const uint16_t* kv_row_bf16(uint16_t* buf, const float* fresh, int64_t kv_stride,
                                   const uint16_t* cache, const int32_t* blocks, int block_size,
                                   int Hkv, int D, int start, int ctx, int h, int p) {
    if (p < ctx) {
        const size_t slot = (size_t)blocks[p / block_size] * block_size + p % block_size;
        return cache + (slot * Hkv + h) * D;
    }
    round_bf16(buf, fresh + (size_t)(start + p - ctx) * kv_stride + (size_t)h * D, D);
    return buf;
}

/* Keys p0 .. p0+31 of a source into its K and V tiles (zero past `keys`). */
static void pack_keys(const Src* sc, int p0, int keys, const float* key, const float* value,
                      int64_t kv_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                      const int32_t* blocks, int block_size, int Hkv, int D, int h,
                      uint16_t* buf /* [2][KT + 1][D] */) {
    const uint16_t *k[KT], *v[KT];
    uint16_t* zero = buf + (size_t)2 * KT * D;
    memset(zero, 0, (size_t)D * sizeof *zero);
    for (int i = 0; i < KT; i++) {
        const int p = p0 + i;
        if (p >= keys) {
            k[i] = v[i] = zero;
            continue;
        }
        k[i] = kv_row_bf16(buf + (size_t)i * D, key, kv_stride, k_cache, blocks, block_size,
                           Hkv, D, sc->start, sc->ctx, h, p);
        v[i] = kv_row_bf16(buf + (size_t)(KT + i) * D, value, kv_stride, v_cache, blocks,
                           block_size, Hkv, D, sc->start, sc->ctx, h, p);
    }
    /* K: two tiles of 16 keys, pair row j of key c at [j][c][2]. */
    uint16_t* kp = sc->kp + (size_t)p0 * D;
    for (int half = 0; half < 2; half++, kp += (size_t)16 * D)
        for (int j = 0; j < D / 2; j++)
            for (int c = 0; c < 16; c++) {
                kp[(size_t)j * 32 + c * 2] = k[half * 16 + c][2 * j];
                kp[(size_t)j * 32 + c * 2 + 1] = k[half * 16 + c][2 * j + 1];
            }
    /* V: pair row j (keys 2j, 2j+1) at [j][d][2]. */
    uint16_t* vp = sc->vp + (size_t)p0 * D;
    for (int j = 0; j < KT / 2; j++)
        for (int d = 0; d < D; d++) {
            vp[((size_t)j * D + d) * 2] = v[2 * j][d];
            vp[((size_t)j * D + d) * 2 + 1] = v[2 * j + 1][d];
        }
}

__attribute__((noinline)) static void soft_cap_row(float* s, int n, float cap) {
    for (int i = 0; i < n; i++) s[i] = cap * tanhf(s[i] / cap);
}

/* Rows row0 .. row0+R-1 (R <= RT) of one (chunk, kv head). Scratch: qb [RT][D] bfloat16,
 * s [RT][s_stride] float, pb [RT][s_stride] bfloat16, ob [RT][D] float. */
static void amx_item(float* out, const float* query, int64_t q_stride, const Src* src, int row0,
                     int R, int h, int G, int D, int Hq, float scale, int window, float soft_cap,
                     uint16_t* qb, float* s, uint16_t* pb, float* ob, int s_stride) {
    int limit[RT], lo[RT];
    float* o[RT];
    float inv[RT];
    int kmin = INT_MAX, kmax = 0;
    for (int r = 0; r < RT; r++) {
        if (r >= R) { /* spare rows: zero queries, their results not written */
            memset(qb + (size_t)r * D, 0, (size_t)D * sizeof *qb);
            continue;
        }
        const int f = row0 + r;
        limit[r] = src->ctx + f / G + 1;
        lo[r] = window > 0 && limit[r] > window ? limit[r] - window : 0;
        kmin = lo[r] < kmin ? lo[r] : kmin;
        kmax = limit[r] > kmax ? limit[r] : kmax;
        const size_t t = (size_t)(src->start + f / G), head = (size_t)h * G + f % G;
        round_bf16(qb + (size_t)r * D, query + t * q_stride + head * D, D);
        o[r] = out + (t * Hq + head) * D;
    }
    kmin = kmin / KT * KT; /* whole key blocks of the packed tiles */
    const int nk = (kmax - kmin + KT - 1) / KT * KT;
    const size_t lda = (size_t)D * 2, lds = (size_t)s_stride * 4, ldp = (size_t)s_stride * 2;

    /* s = Q K^T for 32 rows x 32 keys a block, D in steps of 32. */
    for (int j0 = 0; j0 < nk; j0 += KT) {
        const uint16_t* kb = src->kp + (size_t)(kmin + j0) * D;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int k = 0; k < D; k += 32) {
            _tile_loadd(4, qb + k, lda);
            _tile_loadd(5, qb + (size_t)16 * D + k, lda);
            _tile_loadd(6, kb + (size_t)k * 16, 64);
            _tile_loadd(7, kb + (size_t)16 * D + (size_t)k * 16, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, s + j0, lds);
        _tile_stored(1, s + j0 + 16, lds);
        _tile_stored(2, s + (size_t)16 * s_stride + j0, lds);
        _tile_stored(3, s + (size_t)16 * s_stride + j0 + 16, lds);
    }

    /* Per row: scale, cap, mask to its keys, the exact softmax; weights to bfloat16. */
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 ninf = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale);
    for (int r = 0; r < RT; r++) {
        uint16_t* pr = pb + (size_t)r * s_stride;
        if (r >= R) {
            memset(pr, 0, (size_t)nk * sizeof *pr);
            continue;
        }
        float* sr = s + (size_t)r * s_stride;
        __m512 sc = vscale; /* the scale, applied in the exp pass unless capped first */
        if (soft_cap > 0.0f || !(scale > 0.0f)) {
            for (int j = 0; j < nk; j += 16)
                _mm512_storeu_ps(sr + j, _mm512_mul_ps(_mm512_loadu_ps(sr + j), vscale));
            if (soft_cap > 0.0f) soft_cap_row(sr, nk, soft_cap);
            sc = _mm512_set1_ps(1.0f);
        }
        const int a = lo[r] - kmin, b = limit[r] - kmin; /* valid keys a .. b-1 */
        const __m512i va = _mm512_set1_epi32(a), vb = _mm512_set1_epi32(b);
        /* The max of the raw scores, then one pass: (s * scale - max) in one rounding (the
         * scale is positive here, so the max of the scaled scores is the scaled max). A first
         * version stored the scaled, masked scores and read them back: 7.9 against 7.5 ms
         * median (one layer of benchmarks/attention.py's prompts, 1 thread, 11 interleaved
         * rounds at load 7), within the noise, but one pass over the row fewer. */
        __m512 mx = ninf;
        for (int j = 0; j < nk; j += 16) {
            const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(j));
            const __mmask16 v = _mm512_cmpge_epi32_mask(idx, va) & _mm512_cmplt_epi32_mask(idx, vb);
            mx = _mm512_mask_max_ps(mx, v, mx, _mm512_loadu_ps(sr + j));
        }
        const __m512 m = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(mx)), sc);
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < nk; j += 16) {
            const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(j));
            const __mmask16 v = _mm512_cmpge_epi32_mask(idx, va) & _mm512_cmplt_epi32_mask(idx, vb);
            /* Masked keys weigh exactly 0. */
            const __m512 e = _mm512_maskz_mov_ps(
                    v, exp_neg16(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), sc, m)));
            const __m256i eb = (__m256i)_mm512_cvtneps_pbh(e);
            _mm256_storeu_si256((__m256i*)(pr + j), eb);
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(eb), 16)));
        }
        inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
    }

    /* ob = P V, 32 rows x 32 columns a pass, keys 32 a step. */
    for (int d0 = 0; d0 < D; d0 += 32) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int j0 = 0; j0 < nk; j0 += KT) {
            const uint16_t* vb = src->vp + (size_t)(kmin + j0) * D + (size_t)d0 * 2;
            _tile_loadd(4, pb + j0, ldp);
            _tile_loadd(5, pb + (size_t)16 * s_stride + j0, ldp);
            _tile_loadd(6, vb, (size_t)D * 4);
            _tile_loadd(7, vb + 32, (size_t)D * 4);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, ob + d0, lda * 2);
        _tile_stored(1, ob + d0 + 16, lda * 2);
        _tile_stored(2, ob + (size_t)16 * D + d0, lda * 2);
        _tile_stored(3, ob + (size_t)16 * D + d0 + 16, lda * 2);
    }
    for (int r = 0; r < R; r++) {
        const __m512 sc = _mm512_set1_ps(inv[r]);
        for (int d = 0; d < D; d += 16)
            _mm512_storeu_ps(o[r] + d, _mm512_mul_ps(_mm512_loadu_ps(ob + (size_t)r * D + d), sc));
    }
}

/* Work item -> chunk, kv head and rows, as the float32 kernel orders them: each chunk's items
 * last to first (the later rows see the most keys), the kv heads of an item together. */
static void item_rows(long item, const int32_t* chunk_len, int G, int Hkv, int* c, int* h,
                      int* row0, int* R) {
    int tiles;
    for (*c = 0;; (*c)++) {
        tiles = (chunk_len[*c] * G + RT - 1) / RT;
        if (item < (long)tiles * Hkv) break;
        item -= (long)tiles * Hkv;
    }
    const int rows = chunk_len[*c] * G;
    *h = (int)(item % Hkv);
    *row0 = (tiles - 1 - (int)(item / Hkv)) * RT;
    *R = rows - *row0 < RT ? rows - *row0 : RT;
}

static void* alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

int prefill_attention_amx_runs(int head_dim) {
    return head_dim > 0 && head_dim % 32 == 0 && amx_bf16_available();
}

int prefill_attention_bf16_amx(float* out, const float* query, int64_t q_stride,
                               const float* key, const float* value, int64_t kv_stride,
                               const uint16_t* k_cache, const uint16_t* v_cache,
                               const int32_t* chunk_start, const int32_t* chunk_len,
                               const int32_t* chunk_ctx, const int32_t* block_tables,
                               int max_blocks, int num_chunks, int num_q_heads,
                               int num_kv_heads, int head_dim, int block_size, float scale,
                               int window, float soft_cap, int num_threads) {
    if (!prefill_attention_amx_runs(head_dim)) return -2;
    const int G = num_q_heads / num_kv_heads, D = head_dim, Hkv = num_kv_heads;
    const int num_src = num_chunks * Hkv;
    size_t pack_total = 0;
    long num_items = 0;
    int max_keys = KT;
    for (int c = 0; c < num_chunks; c++) {
        const int kpad = (chunk_ctx[c] + chunk_len[c] + KT - 1) / KT * KT;
        pack_total += (size_t)kpad * D * Hkv;
        num_items += (long)((chunk_len[c] * G + RT - 1) / RT) * Hkv;
        if (kpad > max_keys) max_keys = kpad;
    }
    Src* src = malloc(sizeof(Src) * (num_src > 0 ? num_src : 1));
    uint16_t* kp = alloc64(sizeof(uint16_t) * (pack_total > 0 ? pack_total : 1));
    uint16_t* vp = alloc64(sizeof(uint16_t) * (pack_total > 0 ? pack_total : 1));
    if (!src || !kp || !vp) {
        free(src), free(kp), free(vp);
        return -1;
    }
    {
        size_t off = 0;
        for (int c = 0; c < num_chunks; c++) {
            const int kpad = (chunk_ctx[c] + chunk_len[c] + KT - 1) / KT * KT;
            for (int h = 0; h < Hkv; h++, off += (size_t)kpad * D)
                src[c * Hkv + h] = (Src){chunk_start[c], chunk_len[c], chunk_ctx[c], kp + off,
                                         vp + off};
        }
    }
    if (num_threads > num_items) num_threads = (int)num_items;
    if (num_threads < 1) num_threads = 1;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        uint16_t* buf = malloc(sizeof(uint16_t) * (2 * KT + 1) * D);
        const size_t scratch = (size_t)RT * D * 2 + (size_t)RT * max_keys * 4
                               + (size_t)RT * max_keys * 2 + (size_t)RT * D * 4;
        char* sb = alloc64(scratch + 3 * 64);
        if (!buf || !sb) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int si = 0; si < num_src; si++) {
                const Src* sc = &src[si];
                const int c = si / Hkv, h = si % Hkv, keys = sc->ctx + sc->len;
                for (int p0 = 0; p0 < keys; p0 += KT)
                    pack_keys(sc, p0, keys, key, value, kv_stride, k_cache, v_cache,
                              block_tables + (size_t)c * max_blocks, block_size, Hkv, D, h, buf);
            }
            /* Each buffer on a 64-byte line of its own. */
            uint16_t* qb = (uint16_t*)sb;
            float* s = (float*)(sb + ((size_t)RT * D * 2 + 63) / 64 * 64);
            uint16_t* pb = (uint16_t*)((char*)s + ((size_t)RT * max_keys * 4 + 63) / 64 * 64);
            float* ob = (float*)((char*)pb + ((size_t)RT * max_keys * 2 + 63) / 64 * 64);
            load_tiles();
#pragma omp for schedule(dynamic, 1)
            for (long item = 0; item < num_items; item++) {
                int c, h, row0, R;
                item_rows(item, chunk_len, G, Hkv, &c, &h, &row0, &R);
                amx_item(out, query, q_stride, &src[c * Hkv + h], row0, R, h, G, D,
                         num_q_heads, scale, window, soft_cap, qb, s, pb, ob, max_keys);
            }
            /* An idle pool thread should not carry 8 KiB of tile state through switches. */
            _tile_release();
        }
        free(buf);
        free(sb);
    }
    free(src), free(kp), free(vp);
    return failed ? -1 : 0; /* -1: out of memory for the scratch, out is incomplete */
}
#else
int prefill_attention_amx_runs(int head_dim) {
    (void)head_dim;
    return 0;
}

int prefill_attention_bf16_amx(float* out, const float* query, int64_t q_stride,
                               const float* key, const float* value, int64_t kv_stride,
                               const uint16_t* k_cache, const uint16_t* v_cache,
                               const int32_t* chunk_start, const int32_t* chunk_len,
                               const int32_t* chunk_ctx, const int32_t* block_tables,
                               int max_blocks, int num_chunks, int num_q_heads,
                               int num_kv_heads, int head_dim, int block_size, float scale,
                               int window, float soft_cap, int num_threads) {
    (void)out, (void)query, (void)q_stride, (void)key, (void)value, (void)kv_stride;
    (void)k_cache, (void)v_cache, (void)chunk_start, (void)chunk_len, (void)chunk_ctx;
    (void)block_tables, (void)max_blocks, (void)num_chunks, (void)num_q_heads;
    (void)num_kv_heads, (void)head_dim, (void)block_size, (void)scale, (void)window;
    (void)soft_cap, (void)num_threads;
    return -2; /* no AMX in this build: callers take prefill_attention_f32 */
}
#endif
