/* Every function the kernel library exports, declared once.
 *
 * Each .c that defines or calls one includes this header, so the compiler checks every
 * definition and call against the same prototype. The ctypes argtypes that mirror them sit
 * next to each op's Python wrapper in pagedlm/kernels/ (one module per family, named after
 * the .c file); a change here needs the matching change there.
 */
#ifndef PAGEDLM_OPS_H
#define PAGEDLM_OPS_H

#include <stdint.h>

/* ---------------------------------------------------------------- paged_attention.c */

void paged_attention_f32(float *out, const float *query, const void *k_cache,
                         const void *v_cache, int kv_type, const int32_t *block_tables,
                         const int32_t *token_seq, const int32_t *token_ctx_len, int num_tokens,
                         int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                         int max_blocks_per_seq, float scale, int window, float soft_cap,
                         int num_threads);

/* ---------------------------------------------------------------- prefill_attention.c */

int prefill_attention_runs(int head_dim);
int prefill_attention_f32(float *out, const float *query, int64_t q_stride, const float *key,
                          const float *value, int64_t kv_stride, const void *k_cache,
                          const void *v_cache, int kv_type, const int32_t *chunk_start,
                          const int32_t *chunk_len, const int32_t *chunk_ctx,
                          const int32_t *block_tables, int max_blocks, int num_chunks,
                          int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                          float scale, int window, float soft_cap, int num_threads);

/* ---------------------------------------------------------------- prefill_attention_amx.c */

/* 1 where the AMX kernel takes this head size: AMX-BF16 available, head_dim a multiple of 32. */
int prefill_attention_amx_runs(int head_dim);
/* prefill_attention_f32's job over bfloat16 caches on AMX tiles (Q and the softmax weights
 * rounded to bfloat16); -2 where it does not run (prefill_attention_amx_runs), -1 out of
 * memory. */
int prefill_attention_bf16_amx(float *out, const float *query, int64_t q_stride,
                               const float *key, const float *value, int64_t kv_stride,
                               const uint16_t *k_cache, const uint16_t *v_cache,
                               const int32_t *chunk_start, const int32_t *chunk_len,
                               const int32_t *chunk_ctx, const int32_t *block_tables,
                               int max_blocks, int num_chunks, int num_q_heads,
                               int num_kv_heads, int head_dim, int block_size, float scale,
                               int window, float soft_cap, int num_threads);

/* ---------------------------------------------------------------- fused_ops.c */

void rms_norm_f32(float *out, float *residual_out, const float *x, int64_t x_stride,
                  const float *residual, int64_t res_stride, const float *weight, int T, int H,
                  float eps);
void silu_and_mul_f32(float *out, const float *x, int64_t x_stride, int T, int I);
int rotary_f32(float *q, int64_t q_stride, int Hq, float *k, int64_t k_stride, int Hk,
               const int64_t *positions, const float *cos_table, const float *sin_table, int T,
               int D, int half, int64_t max_position);
void write_kv_f32(void *k_cache, void *v_cache, int kv_type, const float *k, int64_t k_stride,
                  const float *v, int64_t v_stride, const int64_t *slots, int T, int row);
void argmax_rows_f32(int64_t *out, const float *x, int64_t x_stride, int T, int V);

/* ---------------------------------------------------------------- gemv_f32.c */

void gemv_f32(float *y, const float *x, const float *w, int M, int N, int K, int nthreads);
int gemm_panel_width(void);
void pack_panel_rows32(uint32_t *panels, const uint32_t *src, int first, int rows, int kk,
                       int width, int nthreads);
void gemm_panels_f32(float *y, const float *x, const float *wp, int M, int N, int K,
                     int nthreads);
/* The bfloat16 panels gemm_panels_bf16 reads: 2, k-pairs [ceil(N / W), ceil(K / 2), W, 2]
 * (AVX512-BF16 builds), else 1, plain [ceil(N / W), K, W] as the float32 ones. On k-pairs it
 * widens them to the float32 chain, or, once set_dpbf16(1) (process-wide; returns the setting
 * in force, 0 where not built), multiplies them with vdpbf16ps, x rounded to bfloat16. */
int gemm_panels_bf16_layout(void);
int gemm_panels_bf16_dpbf16(void);
int gemm_panels_bf16_set_dpbf16(int on);
void gemm_panels_bf16(float *y, const float *x, const uint16_t *wp, int M, int N, int K,
                      int nthreads);
/* gemm_panels_bf16 on k-pairs multiplied with vdpbf16ps whatever the setting (layout 2 only) */
void gemm_panels_bf16_dot(float *y, const float *x, const uint16_t *wp, int M, int N, int K,
                          int nthreads);
void gemm_panels_f16(float *y, const float *x, const uint16_t *wp, int M, int N, int K,
                     int nthreads);

/* ---------------------------------------------------------------- amx_bf16.c */

/* 1 where the build has AMX-BF16 and Linux granted the tile data (asked once a process). */
int amx_bf16_available(void);
/* gemm_panels_bf16's arguments, on k-pair panels; x rounded to bfloat16. K not a multiple of
 * 32 goes to gemm_panels_bf16 (amx.runs). */
void gemm_panels_bf16_amx(float *y, const float *x, const uint16_t *wp, int M, int N, int K,
                          int nthreads);

/* ---------------------------------------------------------------- quant_matmul.c */

int qmm_vector_bits(void);
void qmm_quantize_activations(int8_t *q, float *d, float *s, const float *x, int M, int K);
void qmm_q4_1(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads);
void qmm_q8_0(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads);
void qmm_i8(float *y, const float *x, const int8_t *w, const float *scale, int M, int N, int K,
            int nthreads);
/* x in two 8-bit limbs (quant_kquants.c's header) */
void qmm16_q4_1(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads);
void qmm16_q8_0(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads);
void dequant_q4_1(float *out, const uint8_t *w, int N, int K, int nthreads);
void dequant_q8_0(float *out, const uint8_t *w, int N, int K, int nthreads);
void dequant_i8(float *out, const int8_t *w, const float *scale, int N, int K, int nthreads);

/* ---------------------------------------------------------------- quant_kquants.c */

void qmm_q4_k(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads);
void qmm_q5_k(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads);
void qmm_q6_k(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads);
void qmm_q3_k(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads);
void qmm_q2_k(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads);
void qmm_q5_0(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads);
void qmm_q5_1(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads);
void qmm_iq4_nl(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads);
/* the many-row GEMM of q4_k, q5_k and q6_k (AVX512-VNNI builds: qgemm_available() 1) */
int qgemm_available(void);
void qgemm_q4_k(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads);
void qgemm_q5_k(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads);
void qgemm_q6_k(float *y, const float *x, const uint8_t *w, int M, int N, int K, int nthreads);
/* x in two 8-bit limbs (quant_kquants.c's header) */
void qmm16_q4_k(float *y, const float *x, const uint8_t *w, int M, int N, int K,
                int nthreads);
void qmm16_q5_k(float *y, const float *x, const uint8_t *w, int M, int N, int K,
                int nthreads);
void qmm16_q6_k(float *y, const float *x, const uint8_t *w, int M, int N, int K,
                int nthreads);
void qmm16_q3_k(float *y, const float *x, const uint8_t *w, int M, int N, int K,
                int nthreads);
void qmm16_q2_k(float *y, const float *x, const uint8_t *w, int M, int N, int K,
                int nthreads);
void qmm16_q5_0(float *y, const float *x, const uint8_t *w, int M, int N, int K,
                int nthreads);
void qmm16_q5_1(float *y, const float *x, const uint8_t *w, int M, int N, int K,
                int nthreads);
void qmm16_iq4_nl(float *y, const float *x, const uint8_t *w, int M, int N, int K,
                  int nthreads);
void dequant_q4_k(float *out, const uint8_t *w, int N, int K, int nthreads);
void dequant_q5_k(float *out, const uint8_t *w, int N, int K, int nthreads);
void dequant_q6_k(float *out, const uint8_t *w, int N, int K, int nthreads);
void dequant_q3_k(float *out, const uint8_t *w, int N, int K, int nthreads);
void dequant_q2_k(float *out, const uint8_t *w, int N, int K, int nthreads);
void dequant_q5_0(float *out, const uint8_t *w, int N, int K, int nthreads);
void dequant_q5_1(float *out, const uint8_t *w, int N, int K, int nthreads);
void dequant_iq4_nl(float *out, const uint8_t *w, int N, int K, int nthreads);
/* bfloat16 k-pair panels for the AMX GEMM (quant_common.h: dequant_bf16_panels) */
void dequant_panels_q4_k(uint16_t *panels, const uint8_t *w, int N, int K, int nthreads);
void dequant_panels_q5_k(uint16_t *panels, const uint8_t *w, int N, int K, int nthreads);
void dequant_panels_q6_k(uint16_t *panels, const uint8_t *w, int N, int K, int nthreads);
void dequant_panels_q3_k(uint16_t *panels, const uint8_t *w, int N, int K, int nthreads);
void dequant_panels_q2_k(uint16_t *panels, const uint8_t *w, int N, int K, int nthreads);
void dequant_panels_q5_0(uint16_t *panels, const uint8_t *w, int N, int K, int nthreads);
void dequant_panels_q5_1(uint16_t *panels, const uint8_t *w, int N, int K, int nthreads);
void dequant_panels_iq4_nl(uint16_t *panels, const uint8_t *w, int N, int K, int nthreads);

/* ---------------------------------------------------------------- llama_decode.c */

/* The fused decode driver (model_executor/layers/fused_decode.py) fills these through ctypes
 * Structures of the same fields in the same order; layers/native_linear.py's WeightFormat
 * mirrors this enum. */
enum { W_F32 = 0, W_Q4_1 = 1, W_Q8_0 = 2, W_I8 = 3, W_F32_PANELS = 4, W_BF16_PANELS = 5,
       W_Q4_K = 6, W_Q5_K = 7, W_Q6_K = 8, W_Q3_K = 9, W_Q2_K = 10, W_Q5_0 = 11, W_Q5_1 = 12,
       W_IQ4_NL = 13, W_F16_PANELS = 14 };

typedef struct {
    int64_t fmt;
    const void *weight;
    const float *scale; /* W_I8: one per output row */
    int64_t rows;       /* its output rows */
} segment_t;

/* A fused layer's shards may be stored in different formats (a GGUF Q4_K_M file's q/k Q4_K
 * with v Q6_K): its output rows are nseg segments in order, each multiplied in its own
 * format, as the layer path does shard by shard. */
#define LINEAR_MAX_SEGMENTS 3
typedef struct {
    int64_t nseg; /* 1..LINEAR_MAX_SEGMENTS */
    segment_t seg[LINEAR_MAX_SEGMENTS];
    const float *bias; /* NULL: none */
} linear_t;

typedef struct {
    const float *input_norm, *post_norm;
    linear_t qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    int64_t window; /* sliding window in keys, 0: none */
} layer_t;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t kv_type, block_size, rotary_half;
    const float *cos, *sin;
    float eps, scale;
    int64_t x16_rows; /* steps of at most this many rows run the block formats by qmm16_ */
} dims_t;

int llama_decode_f32(const dims_t *d, const layer_t *layers, float *x, float *residual,
                     int has_residual, int M, const int64_t *positions, const int64_t *slots,
                     const int32_t *block_tables, int max_blocks, const int32_t *ctx_lens,
                     int nthreads);

#endif
