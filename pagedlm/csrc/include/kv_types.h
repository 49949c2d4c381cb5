/* Element types of the KV cache and the conversions to and from float32. */
#ifndef PAGEDLM_KV_TYPES_H
#define PAGEDLM_KV_TYPES_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Must match pagedlm/kernels/kv_types.py's KV_TYPE_CODES. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

static inline size_t kv_elem_size(int kv_type) { return kv_type == KV_F32 ? 4 : 2; }

/* bfloat16 is the top half of a float32: widening is exact. */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest, ties to even (as torch's .to(torch.bfloat16)); NaN stays a quiet NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* float16 through the compiler's _Float16 (F16C instructions where the CPU has them); the
 * narrowing rounds to nearest even, as torch does. */
static inline void kv_load_row(float* dst, const void* src, int n, int kv_type) {
    if (kv_type == KV_BF16) {
        const uint16_t* s = (const uint16_t*)src;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else if (kv_type == KV_F16) {
        const _Float16* s = (const _Float16*)src;
        for (int i = 0; i < n; i++) dst[i] = (float)s[i];
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

static inline void kv_store_row(void* dst, const float* src, int n, int kv_type) {
    if (kv_type == KV_BF16) {
        uint16_t* d = (uint16_t*)dst;
        for (int i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else if (kv_type == KV_F16) {
        _Float16* d = (_Float16*)dst;
        for (int i = 0; i < n; i++) d[i] = (_Float16)src[i];
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

#endif
