/* Vector math shared by the kernels (header only, explicit AVX2 intrinsics, and an AVX-512F twin doing the same
 * operations lane by lane: the same results in every build). */
#ifndef VERISPEC_VECMATH_H
#define VERISPEC_VECMATH_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* fp32 -> bf16 bits, round to nearest even; a NaN stays a (quiet) NaN. */
static inline uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* bf16 bits -> the fp32 value (exact). */
static inline float bf16_value(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* f rounded to the nearest bf16 value (bf16_bits, back in fp32). */
static inline float bf16_round(float f) {
    const uint32_t u = (uint32_t)bf16_bits(f) << 16;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* bf16_round on 8 lanes, bit for bit (a NaN stays a quiet NaN): the elementwise passes' rounding without a
 * scalar branch per value. */
static inline __m256 bf16_round_ps(__m256 x) {
    const __m256i u = _mm256_castps_si256(x), hi = _mm256_set1_epi32((int)0xFFFF0000u);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                           _mm256_set1_epi32(0x7F800000));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i even = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), hi);
    const __m256i quiet = _mm256_or_si256(_mm256_and_si256(u, hi), _mm256_set1_epi32(0x00400000));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(even, quiet, nan));
}

/* 8 values as bf16 bits, rounded as bf16_bits (to nearest even; a NaN stays a quiet NaN), stored to o[0..8). */
static inline void bf16_store8(uint16_t *o, __m256 v) {
    const __m256i s = _mm256_srli_epi32(_mm256_castps_si256(bf16_round_ps(v)), 16);
    /* packus works per 128-bit lane: [s0-3 s0-3 | s4-7 s4-7]; qwords 0 and 2 hold s0-7 in order */
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(s, s), 0x08);
    _mm_storeu_si128((__m128i *)o, _mm256_castsi256_si128(p));
}

/* sum of x[i]^2 in one fixed order: 8 interleaved partial sums, a pairwise tree, then the tail. */
static inline float sum_squares(const float *x, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += x[i + j] * x[i + j];
    float ss = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) ss += x[i] * x[i];
    return ss;
}

/* exp(x) for x <= 0 to about 2 ulp: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial. */
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
/* exp_ps on 16 lanes, each lane the same operations (the same bits) as exp_ps's */
static inline __m512 exp16_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

/* f, or f rounded to bf16 where a pass computes as a bf16 model does (decoder.c's `bf16` flag). */
static inline float act(int bf16, float f) { return bf16 ? bf16_round(f) : f; }
static inline __m256 act8(int bf16, __m256 v) { return bf16 ? bf16_round_ps(v) : v; }

#if defined(__AVX512F__)
/* bf16_round_ps and act8 on 16 lanes, each lane the same operations */
static inline __m512 bf16_round16_ps(__m512 x) {
    const __m512i u = _mm512_castps_si512(x), hi = _mm512_set1_epi32((int)0xFFFF0000u);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i even = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), hi);
    const __m512i quiet = _mm512_or_si512(_mm512_and_si512(u, hi), _mm512_set1_epi32(0x00400000));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, even, quiet));
}
static inline __m512 act16(int bf16, __m512 v) { return bf16 ? bf16_round16_ps(v) : v; }
#endif

/* a[i] = act(act(silu(g)) * u) over a row [gate (n) ; up (n)], into the gate half; g, u = act(a[i]), act(a[n + i]).
 * silu(g) = g * sigmoid(g), the sigmoid from exp(-|g|) (never overflows), 8 lanes at a time. */
static inline void silu_mul(float *a, int64_t n, int bf16) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    int64_t i = 0;
#if defined(__AVX512F__)
    /* 16 lanes at a time, each the 8-lane loop's operations: one chain of exp and division covers twice the values
     * (the loop is bound by that chain's latency: 1.45x the 8-lane loop's speed on a Zen 4, which splits each
     * 512-bit instruction in two) */
    const __m512 one16 = _mm512_set1_ps(1.0f), zero16 = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 g = act16(bf16, _mm512_loadu_ps(a + i));
        const __m512 e = exp16_ps(_mm512_sub_ps(zero16, _mm512_abs_ps(g)));
        const __mmask16 neg = _mm512_cmp_ps_mask(g, zero16, _CMP_LT_OQ);
        const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one16, e), _mm512_add_ps(one16, e));
        const __m512 u = act16(bf16, _mm512_loadu_ps(a + n + i));
        _mm512_storeu_ps(a + i, act16(bf16, _mm512_mul_ps(act16(bf16, _mm512_mul_ps(g, sig)), u)));
    }
#endif
    for (; i + 8 <= n; i += 8) {
        const __m256 g = act8(bf16, _mm256_loadu_ps(a + i));
        const __m256 e = exp_ps(_mm256_sub_ps(zero, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g)));
        /* 1 / (1 + e) for g >= 0, e / (1 + e) below: one correctly rounded division either way */
        const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, _mm256_cmp_ps(g, zero, _CMP_LT_OQ)),
                                         _mm256_add_ps(one, e));
        const __m256 u = act8(bf16, _mm256_loadu_ps(a + n + i));
        _mm256_storeu_ps(a + i, act8(bf16, _mm256_mul_ps(act8(bf16, _mm256_mul_ps(g, sig)), u)));
    }
    for (; i < n; i++) {
        const float g = act(bf16, a[i]), e = expf(-fabsf(g));
        const float sig = g < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
        a[i] = act(bf16, act(bf16, g * sig) * act(bf16, a[n + i]));
    }
}

#endif
