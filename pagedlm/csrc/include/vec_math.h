/* Small float32 math shared by the kernels: the reassociation attribute, exp(x) for x <= 0
 * (scalar and on 16 lanes) and the horizontal sum of 8 lanes. */
#ifndef PAGEDLM_VEC_MATH_H
#define PAGEDLM_VEC_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* Allow reassociation only, so dot products and sums use vector (tree) reductions. Not
 * -ffast-math: no finite-math, flush-to-zero or approximate-reciprocal assumptions. */
#if defined(__GNUC__) && !defined(__clang__)
#define REASSOC __attribute__((optimize("associative-math", "no-signed-zeros", "no-trapping-math")))
#else
#define REASSOC
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

#ifdef __AVX512F__
/* exp_neg on 16 lanes (the same polynomial; scalef supplies the 2^n). */
static inline __m512 exp_neg16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 tail_mask(int left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}
#endif

#ifdef __AVX2__
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#endif
