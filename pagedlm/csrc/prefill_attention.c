/* Attention of prefill chunks, float32, CPU (OpenMP): each query row of a chunk (a position and
 * query head) attends causally to the chunk's own keys and to the context the cache already
 * holds for its sequence.
 *
 * The decode kernel (paged_attention.c) scores one query token at a time with dot products. A
 * prompt's rows share their keys, so here the rows are taken MR at a time (the G query heads of
 * one kv head at consecutive positions) and scored as a small matrix product, the way the panel
 * GEMM (gemv_f32.c) multiplies: the keys of a (chunk, kv head) are first transposed once, in
 * blocks of KW keys, so that 32 keys lie along two vectors; each query element is broadcast
 * against them, and an MR x 32 block of scores stays in registers. The
 * weighted sum of V then broadcasts each weight against V's rows as they lie in memory. The
 * softmax is exact: two passes over a tile's row of scores (at most ctx + n keys).
 *
 * out: [T, Hq, D] contiguous, rows of the flat batch. query, key, value: token t's heads
 * contiguous at query + t * q_stride, key + t * kv_stride, value + t * kv_stride (views of a
 * fused QKV projection's output qualify). A chunk covers batch rows start ..
 * start+len-1 at positions ctx .. ctx+len-1; the keys before ctx are read from the caches
 * ([num_blocks, block_size, Hkv, D] of kv_type, see kv_types.h; narrow rows are widened as they
 * are copied) through the chunk's block-table row.
 *
 * Measured on a 2-vCPU Sapphire Rapids-class Xeon (benchmarks/attention.py: SmolLM2-135M's 9
 * query heads over 3 kv heads of 64, 30 layers of 8 fresh prompts of 69-496 tokens): 150 ms
 * here (188 GFLOP/s) against 294 ms through PyTorch's SDPA, one call per prompt. A first version
 * with the rows along the lanes (keys broadcast, no transposed copy) ran at about 150 GFLOP/s:
 * transposing each tile's queries cost it a tenth of its time. Copying V into rows of its own,
 * like the keys, measured slower (171 against 177-184 GFLOP/s). In the 128-request run
 * (benchmarks/throughput.py, in one process) the prompts' attention took 2.2 s against 4.3-4.5
 * through SDPA.
 * A bfloat16 cache goes to prefill_attention_amx.c instead where the CPU has AMX (the products
 * on tiles, Q and the softmax weights rounded to bfloat16); this kernel keeps every other case.
 */
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "include/kv_types.h"
#include "include/pagedlm_ops.h"
#include "include/vec_math.h"

#ifdef __AVX512F__
#define MR 12 /* query rows per tile: 24 sums + 2 key vectors + 1 broadcast of 32 registers */
#define KW 32 /* keys per score block: two vectors */
#define PV_ROWS 6 /* rows per pass of the weighted V sum: 6 x 64 columns = 24 sums */

typedef struct {
    int32_t start, len, ctx; /* the chunk */
    float* kt;        /* [keys padded to KW / KW][D][KW]: this chunk's keys of head h, transposed */
    const float** vp; /* [keys]: its V rows of head h, where they lie (or widened copies) */
    float* vwide;     /* [ctx][D]: those copies, for a cache narrower than float32 */
} Source;

/* Row p of a chunk's K (or V) as float32: in the fresh rows from ctx on; before that in the
 * cache, in place for a float32 one, else widened into buf. */
static const float* kv_row(float* buf, const float* fresh, int64_t kv_stride, const void* cache,
                           int kv_type, const int32_t* blocks, int block_size, int Hkv, int D,
                           int start, int ctx, int h, int p) {
    if (p >= ctx) return fresh + (size_t)(start + p - ctx) * kv_stride + (size_t)h * D;
    const size_t slot = (size_t)blocks[p / block_size] * block_size + p % block_size;
    const size_t off = (slot * Hkv + h) * D;
    if (kv_type == KV_F32) return (const float*)cache + off;
    kv_load_row(buf, (const char*)cache + off * kv_elem_size(kv_type), D, kv_type);
    return buf;
}

__attribute__((noinline)) static void soft_cap_row(float* s, int n, float cap) {
    for (int i = 0; i < n; i++) s[i] = cap * tanhf(s[i] / cap);
}

/* acc[r][0..16*DV) += sum_j s[r][j] v_j[d0..], for PV_ROWS rows, written to out rows. */
static inline __attribute__((always_inline)) void weighted_v(
        float* const* o, const float* s, int s_stride, const float* inv, const float** vp,
        int kmin, int nk, int d0, const int DV) {
    __m512 a[PV_ROWS][4];
    for (int r = 0; r < PV_ROWS; r++)
        for (int v = 0; v < DV; v++) a[r][v] = _mm512_setzero_ps();
    for (int j = 0; j < nk; j++) {
        const float* vr = vp[kmin + j] + d0;
        __m512 vv[4];
        for (int v = 0; v < DV; v++) vv[v] = _mm512_loadu_ps(vr + 16 * v);
        for (int r = 0; r < PV_ROWS; r++) {
            const __m512 w = _mm512_set1_ps(s[(size_t)r * s_stride + j]);
            for (int v = 0; v < DV; v++) a[r][v] = _mm512_fmadd_ps(w, vv[v], a[r][v]);
        }
    }
    for (int r = 0; r < PV_ROWS; r++) {
        if (!o[r]) continue;
        const __m512 sc = _mm512_set1_ps(inv[r]);
        for (int v = 0; v < DV; v++)
            _mm512_storeu_ps(o[r] + d0 + 16 * v, _mm512_mul_ps(a[r][v], sc));
    }
}

/* Rows row0 .. row0+R-1 of one (chunk, kv head): row f is position f / G, query head
 * h * G + f % G. */
static void prefill_tile(float* out, const float* query, int64_t q_stride, const Source* src,
                         int row0, int R,
                         int h, int G, int D, int Hq, float scale, int window, float soft_cap,
                         float* qs, float* s, int s_stride) {
    int limit[MR], lo[MR];
    float* o[MR];
    int kmin = INT_MAX, kmax = 0;
    for (int r = 0; r < MR; r++) {
        const int f = row0 + (r < R ? r : R - 1); /* spare rows repeat the last one */
        limit[r] = src->ctx + f / G + 1;
        lo[r] = window > 0 && limit[r] > window ? limit[r] - window : 0;
        kmin = lo[r] < kmin ? lo[r] : kmin;
        kmax = limit[r] > kmax ? limit[r] : kmax;
        const size_t t = (size_t)(src->start + f / G), head = (size_t)h * G + f % G;
        const float* q = query + t * q_stride + head * D;
        /* The rows, scaled, side by side: one base pointer for the scoring loop's broadcasts. */
        for (int d = 0; d < D; d++) qs[r * D + d] = q[d] * scale;
        o[r] = r < R ? out + (t * Hq + head) * D : NULL;
    }
    kmin = kmin / KW * KW; /* whole key blocks of the transposed keys */
    const int nk = kmax - kmin;

    /* s[r][j] = scale * q_r . k_(kmin+j), MR rows by KW keys in registers. */
    for (int j0 = 0; j0 < nk; j0 += KW) {
        __m512 a0[MR], a1[MR];
        for (int r = 0; r < MR; r++) a0[r] = _mm512_setzero_ps(), a1[r] = a0[r];
        const float* kt = src->kt + (size_t)(kmin + j0) * D;
        for (int d = 0; d < D; d++) {
            const __m512 k0 = _mm512_loadu_ps(kt + d * KW);
            const __m512 k1 = _mm512_loadu_ps(kt + d * KW + 16);
            for (int r = 0; r < MR; r++) {
                const __m512 qv = _mm512_set1_ps(qs[r * D + d]);
                a0[r] = _mm512_fmadd_ps(qv, k0, a0[r]);
                a1[r] = _mm512_fmadd_ps(qv, k1, a1[r]);
            }
        }
        for (int r = 0; r < MR; r++) {
            _mm512_storeu_ps(s + (size_t)r * s_stride + j0, a0[r]);
            _mm512_storeu_ps(s + (size_t)r * s_stride + j0 + 16, a1[r]);
        }
    }

    /* Per row: mask to its keys, then the exact softmax along them. */
    float inv[MR];
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < MR; r++) {
        float* sr = s + (size_t)r * s_stride;
        if (soft_cap > 0.0f) soft_cap_row(sr, nk, soft_cap);
        const int a = lo[r] - kmin, b = limit[r] - kmin; /* valid keys a .. b-1 */
        __m512 mx = ninf;
        for (int j = 0; j < nk; j += 16) {
            const __m512i idx = _mm512_add_epi32(lane, _mm512_set1_epi32(j));
            const __mmask16 v = _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(a)) &
                                _mm512_cmplt_epi32_mask(idx, _mm512_set1_epi32(b));
            const __m512 x = _mm512_mask_loadu_ps(ninf, v, sr + j);
            _mm512_storeu_ps(sr + j, x);
            mx = _mm512_max_ps(mx, x);
        }
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < nk; j += 16) {
            const __m512 x = _mm512_loadu_ps(sr + j);
            /* Masked keys weigh exactly 0 (exp_neg16 floors at e^-87). */
            const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ),
                                                 exp_neg16(_mm512_sub_ps(x, m)));
            _mm512_storeu_ps(sr + j, e);
            sum = _mm512_add_ps(sum, e);
        }
        inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
    }

    /* out_r = inv_r * sum_j s[r][j] v_j, PV_ROWS rows by up to 64 columns in registers. */
    for (int r0 = 0; r0 < MR; r0 += PV_ROWS) {
        const float* sr = s + (size_t)r0 * s_stride;
        for (int d0 = 0; d0 < D; d0 += 64) {
            switch ((D - d0) / 16 < 4 ? (D - d0) / 16 : 4) {
                case 4: weighted_v(o + r0, sr, s_stride, inv + r0, src->vp, kmin, nk, d0, 4); break;
                case 3: weighted_v(o + r0, sr, s_stride, inv + r0, src->vp, kmin, nk, d0, 3); break;
                case 2: weighted_v(o + r0, sr, s_stride, inv + r0, src->vp, kmin, nk, d0, 2); break;
                default: weighted_v(o + r0, sr, s_stride, inv + r0, src->vp, kmin, nk, d0, 1);
            }
        }
    }
}

/* Work item -> chunk, kv head and rows: each chunk's tiles last to first (the later rows see
 * the most keys, so the largest items go first and the dynamic schedule evens out the tail),
 * the kv heads of a tile together. */
static void item_rows(long item, const int32_t* chunk_len, int G, int Hkv, int* c, int* h,
                      int* row0, int* R) {
    int tiles;
    for (*c = 0;; (*c)++) {
        tiles = (chunk_len[*c] * G + MR - 1) / MR;
        if (item < (long)tiles * Hkv) break;
        item -= (long)tiles * Hkv;
    }
    const int rows = chunk_len[*c] * G;
    *h = (int)(item % Hkv);
    *row0 = (tiles - 1 - (int)(item / Hkv)) * MR;
    *R = rows - *row0 < MR ? rows - *row0 : MR;
}

#endif

int prefill_attention_runs(int head_dim) {
#ifdef __AVX512F__
    return head_dim > 0 && head_dim % 16 == 0;
#else
    (void)head_dim;
    return 0;
#endif
}

int prefill_attention_f32(float* out, const float* query, int64_t q_stride, const float* key,
                          const float* value, int64_t kv_stride, const void* k_cache,
                          const void* v_cache, int kv_type, const int32_t* chunk_start,
                          const int32_t* chunk_len, const int32_t* chunk_ctx,
                          const int32_t* block_tables, int max_blocks, int num_chunks,
                          int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                          float scale, int window, float soft_cap, int num_threads) {
#ifdef __AVX512F__
    const int G = num_q_heads / num_kv_heads, D = head_dim, Hkv = num_kv_heads;
    const int num_src = num_chunks * Hkv;
    /* Transposed keys and V row pointers of every (chunk, kv head), then the row tiles. */
    size_t kt_total = 0, vp_total = 0, wide_total = 0;
    long num_items = 0;
    int max_keys = KW;
    for (int c = 0; c < num_chunks; c++) {
        const int keys = chunk_ctx[c] + chunk_len[c], kpad = (keys + KW - 1) / KW * KW;
        kt_total += (size_t)kpad * D * Hkv;
        vp_total += (size_t)keys * Hkv;
        if (kv_type != KV_F32) wide_total += (size_t)chunk_ctx[c] * D * Hkv;
        num_items += (long)((chunk_len[c] * G + MR - 1) / MR) * Hkv;
        if (kpad > max_keys) max_keys = kpad;
    }
    Source* src = malloc(sizeof(Source) * (num_src > 0 ? num_src : 1));
    float* kt = malloc(sizeof(float) * (kt_total > 0 ? kt_total : 1));
    const float** vp = malloc(sizeof(float*) * (vp_total > 0 ? vp_total : 1));
    float* wide = malloc(sizeof(float) * (wide_total > 0 ? wide_total : 1));
    if (!src || !kt || !vp || !wide) {
        free(src), free(kt), free(vp), free(wide);
        return -1;
    }
    {
        size_t kt_off = 0, vp_off = 0, wide_off = 0;
        for (int c = 0; c < num_chunks; c++) {
            const int keys = chunk_ctx[c] + chunk_len[c], kpad = (keys + KW - 1) / KW * KW;
            for (int h = 0; h < Hkv; h++) {
                src[c * Hkv + h] = (Source){chunk_start[c], chunk_len[c], chunk_ctx[c],
                                            kt + kt_off, vp + vp_off, wide + wide_off};
                kt_off += (size_t)kpad * D;
                vp_off += keys;
                if (kv_type != KV_F32) wide_off += (size_t)chunk_ctx[c] * D;
            }
        }
    }
    if (num_threads > num_items) num_threads = (int)num_items;
    if (num_threads < 1) num_threads = 1;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int si = 0; si < num_src; si++) {
            const Source* sc = &src[si];
            const int c = si / Hkv, h = si % Hkv, keys = sc->ctx + sc->len;
            const int kpad = (keys + KW - 1) / KW * KW;
            const int32_t* blocks = block_tables + (size_t)c * max_blocks;
            /* KW keys at a time, so each write fills a whole line of kt. */
            for (int p0 = 0; p0 < kpad; p0 += KW) {
                const float* k[KW];
                float kw[kv_type == KV_F32 ? 1 : KW * D]; /* widened K rows */
                for (int i = 0; i < KW; i++) {
                    const int p = p0 + i;
                    if (p >= keys) {
                        k[i] = NULL;
                        continue;
                    }
                    k[i] = kv_row(kw + (kv_type == KV_F32 ? 0 : i * D), key, kv_stride, k_cache,
                                  kv_type, blocks, block_size, Hkv, D, sc->start, sc->ctx, h, p);
                    sc->vp[p] = kv_row(sc->vwide + (p < sc->ctx ? (size_t)p * D : 0), value,
                                       kv_stride, v_cache, kv_type, blocks, block_size, Hkv, D,
                                       sc->start, sc->ctx, h, p);
                }
                for (int d = 0; d < D; d++)
                    for (int i = 0; i < KW; i++)
                        sc->kt[(size_t)p0 * D + d * KW + i] = k[i] ? k[i][d] : 0.0f;
            }
        }

        float* s = malloc(sizeof(float) * ((size_t)MR * max_keys + (size_t)MR * D));
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < num_items; item++) {
            int c, h, row0, R;
            item_rows(item, chunk_len, G, Hkv, &c, &h, &row0, &R);
            if (!s) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            prefill_tile(out, query, q_stride, &src[c * Hkv + h], row0, R, h, G, D,
                         num_q_heads, scale, window, soft_cap, s + (size_t)MR * max_keys, s,
                         max_keys);
        }
        free(s);
    }
    free(src), free(kt), free(vp), free(wide);
    return failed ? -1 : 0; /* -1: out of memory for the scratch, out is incomplete */
#else
    (void)out, (void)query, (void)q_stride, (void)key, (void)value, (void)kv_stride, (void)k_cache;
    (void)v_cache, (void)kv_type, (void)chunk_start, (void)chunk_len, (void)chunk_ctx;
    (void)block_tables, (void)max_blocks, (void)num_chunks, (void)num_q_heads,
        (void)num_kv_heads, (void)head_dim;
    (void)block_size, (void)scale, (void)window, (void)soft_cap, (void)num_threads;
    return -1; /* no AVX-512 in this build: callers keep SDPA */
#endif
}
