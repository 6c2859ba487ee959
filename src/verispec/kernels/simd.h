/* The vector width each build of gemm.c and qgemm.c works at: AVX-512 (16 fp32 lanes) where the build has
 * __AVX512F__, else AVX2 + FMA (8), and the tile shapes both share. Included after <immintrin.h>. */
#ifndef VERISPEC_SIMD_H
#define VERISPEC_SIMD_H

#include "vecmath.h"

#if defined(__AVX512F__)
#define VW 16 /* fp32 lanes per vector */
typedef __m512 vf;
typedef __m512i vi;
#define vzero() _mm512_setzero_ps()
#define vbcast(p) _mm512_set1_ps(*(p))
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vloadf(p) _mm512_loadu_ps(p)
#define vstoref(p, v) _mm512_storeu_ps(p, v)
#define vloadi(p) _mm512_loadu_si512((const void *)(p))
#else
#define VW 8
typedef __m256 vf;
typedef __m256i vi;
#define vzero() _mm256_setzero_ps()
#define vbcast(p) _mm256_broadcast_ss(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vloadf(p) _mm256_loadu_ps(p)
#define vstoref(p, v) _mm256_storeu_ps(p, v)
#define vloadi(p) _mm256_loadu_si256((const __m256i *)(p))
#endif

#define BLOCK 16 /* columns per packed block */

/* A vector's VW values as bf16 bits at o, rounded as bf16_bits: in registers (a store through a buffer and two
 * narrower reloads of it stalls on store forwarding). */
static inline void vstore_bf16(uint16_t *o, vf v) {
#if VW == 16
    bf16_store8(o, _mm512_castps512_ps256(v));
    bf16_store8(o + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#else
    bf16_store8(o, v);
#endif
}

/* The prefill tiles of gemm.c and qgemm.c (AVX2, 6 x 16): pairs [p0, p1) of fp32 weights [K2][2][BLOCK] (pair p's
 * even input's columns, then its odd input's) into acc[R][2], input by input in the chain's order (odd, then
 * even); x is the tile's rows interleaved by pair. Two weight vectors and one broadcast live beside 12 sums. */
static inline __attribute__((always_inline)) void k16_pairs(const int R, const float *x, const float *w, int64_t p0,
                                                            int64_t p1, vf acc[][2]) {
    for (int64_t p = p0; p < p1; p++) {
        const float *xp = x + p * R * 2, *wp = w + p * 2 * BLOCK;
        _Pragma("GCC unroll 2") for (int e = 1; e >= 0; e--) {
            const vf a = vloadf(wp + e * BLOCK), b = vloadf(wp + e * BLOCK + VW);
            _Pragma("GCC unroll 6") for (int m = 0; m < R; m++) {
                const vf s = vbcast(xp + 2 * m + e);
                acc[m][0] = vfma(s, a, acc[m][0]);
                acc[m][1] = vfma(s, b, acc[m][1]);
            }
        }
    }
}
#define VPB (BLOCK / VW) /* vectors per block: 1 (AVX-512) or 2 (AVX2) */
#define MR_WIDE 6
#define MR_TALL 12
#define NV_WIDE (VW == 16 ? 4 : 2) /* vectors per wide tile: 64 columns (AVX-512), 16 (AVX2) */
#define NV_TALL (VW == 16 ? 2 : 1) /* vectors per tall tile */

#endif
