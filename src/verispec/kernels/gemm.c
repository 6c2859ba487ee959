/* Small-M matmuls for CPU inference: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 accumulation.
 *
 * One source, compiled once per instruction set (native.py builds each with its own flags; __AVX512F__ and
 * __AVX512BF16__ pick the code below): AVX2 + FMA (8-wide), AVX-512F (16-wide) and AVX-512 BF16 (vdpbf16ps for
 * bf16 inputs on bf16 weights). All three compute every output the same way, so they agree bit for bit:
 *
 *   acc = 0; for p in 0 .. K/2 - 1: acc = fma(x[2p+1], w[2p+1], acc); acc = fma(x[2p], w[2p], acc)
 *
 * then + bias, then the store (rounded to nearest even for a bf16 output). That order is vdpbf16ps's own (odd
 * product, then even, each rounded; a product of two bf16 values is exact in fp32, measured equal to this chain on
 * a Zen 4), so the BF16 path needs no other order. vdpbf16ps flushes denormal inputs and results to zero where an
 * FMA keeps them: outputs of the BF16 path can differ from the others only where a value falls below 1.2e-38.
 * Threads split column groups, never K, and a row's chain never depends on how many rows share the call, nor on
 * the thread count: a verify step over 9 tokens computes, for each token, exactly what a one-token step does.
 *
 * Packed weights (pack() in native.py), in blocks of 16 output columns (N16 = N rounded up to 16, K2 = K/2
 * rounded up, pad entries zero):
 *   bf16: wp[N16 / 16][K2][16][2]  (a column's pair 2p, 2p+1 adjacent: vdpbf16ps's operand)
 *   fp32: wp[N16 / 16][K2][2][16]  (k = 2p's 16 columns, then k = 2p+1's)
 * Rows are taken in tiles (wide: up to 6 rows x 64 columns; tall, for 7-12 rows: 12 x 32 at 16 lanes, 12 x 8 at
 * 8; AVX2's wide tiles are 6 x 16), all rows of a column group before the next, so a call streams each weight from memory once.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "vecmath.h"

#if defined(__AVX512F__)
#define v_odd(r) _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u)))
#define v_even(r) _mm512_castsi512_ps(_mm512_slli_epi32(r, 16))
#else
#define v_odd(r) _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u)))
#define v_even(r) _mm256_castsi256_ps(_mm256_slli_epi32(r, 16))
#endif

/* Software prefetch distance and hint in each block's stream. A decode or verify step streams every weight from
 * memory once and the FMAs of a tile wait on those loads; fetching 2 KB ahead overlaps the two (2-vCPU Zen 3, a
 * 33-matmul bf16 forward out of cache: 5.0 -> 3.8 ms at 1 row). Into L2 rather than L1 (2-vCPU Zen 4, the same
 * forward's matmuls at 1 row, best of 41 on a shared machine, three runs: 1.25-1.48 ms with T1, 1.67-2.34 with T0).
 * A prefetch never faults, so running past the end is harmless. */
#ifndef PREFETCH
#define PREFETCH 2048
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif

/* Store columns [n0, n0 + VW) of one output row, clipped at N. */
static inline void store_row(void *y, int out_bf16, int64_t n0, int64_t N, vf v) {
    float tmp[VW];
    vstoref(tmp, v);
    const int64_t n = N - n0 < VW ? N - n0 : VW;
    if (n <= 0) return;
    if (out_bf16) {
        uint16_t *o = (uint16_t *)y + n0;
        for (int64_t i = 0; i < n; i++) o[i] = bf16_bits(tmp[i]);
    } else if (n == VW) {
        vstoref((float *)y + n0, v);
    } else {
        memcpy((float *)y + n0, tmp, (size_t)n * sizeof(float));
    }
}

/* Where vector v of a tile starts, for pair 0: blocks are `bstride` bytes apart, a vector of an AVX2 block is the
 * second half of its 16 columns (VW columns x 2 bf16, or VW floats further on). */
#define WADDR(w, v, bstride, half_bytes) ((const char *)(w) + ((v) / VPB) * (bstride) + ((v) % VPB) * (half_bytes))

/* One tile of R rows x NV vectors. x: this tile's rows interleaved by pair, x[(p * R + m) * 2 + e] = x[m, 2p + e]
 * (one pointer plus constants for every broadcast). R and NV are constants at each call site (the INST functions
 * below), so the loops unroll and the accumulators stay in registers. */
#define FMA_TILE(NAME, WBF16)                                                                                      \
    static inline __attribute__((always_inline)) void NAME(const int R, const int NV, const float *x, int64_t K2,  \
                                                           const void *w, const float *bias, void *y, int64_t N,  \
                                                           int out_bf16, int64_t n0) {                            \
        const int64_t bstride = K2 * BLOCK * 2 * (WBF16 ? 2 : 4), pstride = BLOCK * 2 * (WBF16 ? 2 : 4);           \
        const int64_t half = VW * 4; /* bf16 pairs or fp32: VW columns are VW * 4 bytes */                        \
        vf acc[MR_TALL][NV_WIDE];                                                                                 \
        _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)                                                      \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[m][v] = vzero();                             \
        for (int64_t p = 0; p < K2; p++) {                                                                        \
            const float *xp = x + p * R * 2;                                                                      \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {                                                \
                const char *wv = WADDR(w, v, bstride, half) + p * pstride;                                        \
                if (v % VPB == 0) {                                                                               \
                    _mm_prefetch(wv + PREFETCH, PF_HINT);                                                     \
                    if (!WBF16) _mm_prefetch(wv + PREFETCH + 64, PF_HINT);                                    \
                }                                                                                                 \
                vf w1, w0;                                                                                        \
                if (WBF16) {                                                                                      \
                    const vi raw = vloadi(wv);                                                                    \
                    w1 = v_odd(raw);                                                                              \
                    w0 = v_even(raw);                                                                             \
                } else {                                                                                          \
                    w0 = vloadf((const float *)wv);                                                               \
                    w1 = vloadf((const float *)(wv + BLOCK * 4));                                                 \
                }                                                                                                 \
                _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)                                              \
                    acc[m][v] = vfma(vbcast(xp + 2 * m + 1), w1, acc[m][v]);                                      \
                _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)                                              \
                    acc[m][v] = vfma(vbcast(xp + 2 * m), w0, acc[m][v]);                                          \
            }                                                                                                     \
        }                                                                                                         \
        const size_t elt = out_bf16 ? 2 : 4;                                                                      \
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {                                                    \
            const vf bv = bias ? vloadf(bias + n0 + v * VW) : vzero();                                            \
            _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)                                                  \
                store_row((char *)y + m * N * elt, out_bf16, n0 + v * VW, N, bias ? vadd(acc[m][v], bv) : acc[m][v]); \
        }                                                                                                         \
    }

FMA_TILE(tile_fma_bf16, 1)
FMA_TILE(tile_fma_f32, 0)

#if defined(__AVX512BF16__)
/* The same chain through vdpbf16ps: x as bf16 pairs, x[p * R + m] = bits of x[m, 2p] | x[m, 2p + 1] << 16. */
static inline __attribute__((always_inline)) void tile_dp(const int R, const int NV, const uint32_t *x, int64_t K2,
                                                          const void *w, const float *bias, void *y, int64_t N,
                                                          int out_bf16, int64_t n0) {
    const int64_t bstride = K2 * BLOCK * 4, pstride = BLOCK * 4;
    __m512 acc[MR_TALL][NV_WIDE];
    _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[m][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K2; p++) {
        const uint32_t *xp = x + p * R;
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {
            const char *wv = (const char *)w + v * bstride + p * pstride;
            _mm_prefetch(wv + PREFETCH, PF_HINT);
            const __m512bh wb = (__m512bh)_mm512_loadu_si512((const void *)wv);
            _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)
                acc[m][v] = _mm512_dpbf16_ps(acc[m][v], wb, (__m512bh)_mm512_set1_epi32((int)xp[m]));
        }
    }
    const size_t elt = out_bf16 ? 2 : 4;
    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {
        const __m512 bv = bias ? _mm512_loadu_ps(bias + n0 + v * VW) : _mm512_setzero_ps();
        _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)
            store_row((char *)y + m * N * elt, out_bf16, n0 + v * VW, N, bias ? _mm512_add_ps(acc[m][v], bv) : acc[m][v]);
    }
}
#endif

#if VW == 8
/* AVX2 past 12 rows (prefills): each 16-column block's weights as fp32 [K2][2][16] (a bf16 block unpacked once
 * into scratch, shared by all row tiles; an fp32 pack is that layout already), then 6 x 16 tiles input by input in
 * the chain's order (pair p's odd input, then its even one): two weight vectors, six broadcasts each used twice at
 * once, twelve FMAs. 12 accumulators + 2 weights + 1 broadcast fit the 16 registers; tile_fma's pair-at-a-time
 * body keeps four weight vectors live and GCC spills half its accumulators there (2-vCPU Zen 3, 64 rows, one
 * thread: 50-55 GFLOP/s). Same chain, so the same results as every other tile. */
static inline __attribute__((always_inline)) void tile_k16(const int R, const float *x, int64_t K2, const float *w,
                                                           const float *bias, void *y, int64_t N, int out_bf16,
                                                           int64_t n0) {
    vf acc[MR_WIDE][2];
    _Pragma("GCC unroll 6") for (int m = 0; m < R; m++) acc[m][0] = acc[m][1] = vzero();
    k16_pairs(R, x, w, 0, K2, acc);
    const size_t elt = out_bf16 ? 2 : 4;
    _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++) {
        const vf bv = bias ? vloadf(bias + n0 + v * VW) : vzero();
        _Pragma("GCC unroll 6") for (int m = 0; m < R; m++)
            store_row((char *)y + m * N * elt, out_bf16, n0 + v * VW, N, bias ? vadd(acc[m][v], bv) : acc[m][v]);
    }
}

/* A bf16 block [K2][16][2] -> fp32 [K2][2][16] (exact: bf16 is fp32's upper half). */
static void unpack_block(const char *wb, int64_t K2, float *out) {
    for (int64_t p = 0; p < K2; p++) {
        const char *wp = wb + p * BLOCK * 4;
        const vi r0 = vloadi(wp), r1 = vloadi(wp + VW * 4);
        float *o = out + p * 2 * BLOCK;
        vstoref(o, v_even(r0));
        vstoref(o + VW, v_even(r1));
        vstoref(o + BLOCK, v_odd(r0));
        vstoref(o + BLOCK + VW, v_odd(r1));
    }
}

typedef void (*k16_fn)(const float *x, int64_t K2, const float *w, const float *bias, void *y, int64_t N, int ob,
                       int64_t n0);
#define INST_K16(R)                                                                                                \
    static __attribute__((noinline)) void k16_##R(const float *x, int64_t K2, const float *w, const float *bias,  \
                                                  void *y, int64_t N, int ob, int64_t n0) {                        \
        tile_k16(R, x, K2, w, bias, y, N, ob, n0);                                                                 \
    }
INST_K16(1) INST_K16(2) INST_K16(3) INST_K16(4) INST_K16(5) INST_K16(6)
static const k16_fn k16_table[MR_WIDE + 1] = {0, k16_1, k16_2, k16_3, k16_4, k16_5, k16_6};

/* Rows past MR_TALL on AVX2: x rearranged in chunks of 6 rows (xbuf as vs_linear makes it for wide tiles).
 * Returns 0, or -1 if out of memory. */
static int linear_k16(const float *xbuf, int64_t M, int64_t K2, const void *wp, int w_bf16, const float *bias,
                      int64_t N, void *y, int out_bf16, int threads) {
    const int64_t blocks = (N + BLOCK - 1) / BLOCK;
    const size_t bbytes = (size_t)K2 * BLOCK * 2 * (w_bf16 ? 2 : 4), yelt = out_bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1)
    {
        float *scratch = w_bf16 ? aligned_alloc(64, (size_t)K2 * 2 * BLOCK * sizeof(float)) : NULL;
        if (w_bf16 && !scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (w_bf16 && !scratch) continue;
            const char *wb = (const char *)wp + (size_t)b * bbytes;
            const float *w = (const float *)wb;
            if (w_bf16) {
                unpack_block(wb, K2, scratch);
                w = scratch;
            }
            for (int64_t m0 = 0; m0 < M; m0 += MR_WIDE) {
                const int rows = (int)(M - m0 < MR_WIDE ? M - m0 : MR_WIDE);
                k16_table[rows](xbuf + (size_t)m0 * K2 * 2, K2, w, bias, (char *)y + (size_t)m0 * N * yelt, N,
                                out_bf16, b * BLOCK);
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
#endif

/* One out-of-line function per (kernel, rows, vectors): compiled alone, each tile gets the whole register file
 * (inlined into the threaded loop, GCC spilled accumulators of the tall tiles, halving their speed). */
typedef void (*tile_fn)(const void *x, int64_t K2, const void *w, const float *bias, void *y, int64_t N, int ob,
                        int64_t n0);
#define INST1(KIND, XT, R, NV)                                                                                     \
    static __attribute__((noinline)) void KIND##_##R##_##NV(const void *x, int64_t K2, const void *w,              \
                                                            const float *bias, void *y, int64_t N, int ob,         \
                                                            int64_t n0) {                                          \
        tile_##KIND(R, NV, (const XT *)x, K2, w, bias, y, N, ob, n0);                                              \
    }
#if VW == 16
#define INST_WIDE(KIND, XT, R) INST1(KIND, XT, R, 1) INST1(KIND, XT, R, 2) INST1(KIND, XT, R, 3) INST1(KIND, XT, R, 4)
#define INST_TALL(KIND, XT, R) INST1(KIND, XT, R, 1) INST1(KIND, XT, R, 2)
#define ROW_WIDE(KIND, R) {KIND##_##R##_1, KIND##_##R##_2, KIND##_##R##_3, KIND##_##R##_4}
#define ROW_TALL(KIND, R) {KIND##_##R##_1, KIND##_##R##_2, 0, 0}
#else
#define INST_WIDE(KIND, XT, R) INST1(KIND, XT, R, 2)
#define INST_TALL(KIND, XT, R) INST1(KIND, XT, R, 1)
#define ROW_WIDE(KIND, R) {0, KIND##_##R##_2}
#define ROW_TALL(KIND, R) {KIND##_##R##_1, 0}
#endif
#define INST_ALL(KIND, XT)                                                                                         \
    INST_WIDE(KIND, XT, 1) INST_WIDE(KIND, XT, 2) INST_WIDE(KIND, XT, 3) INST_WIDE(KIND, XT, 4)                    \
    INST_WIDE(KIND, XT, 5) INST_WIDE(KIND, XT, 6) INST_TALL(KIND, XT, 7) INST_TALL(KIND, XT, 8)                    \
    INST_TALL(KIND, XT, 9) INST_TALL(KIND, XT, 10) INST_TALL(KIND, XT, 11) INST_TALL(KIND, XT, 12)                 \
    static const tile_fn KIND##_table[MR_TALL + 1][NV_WIDE] = {                                                     \
        {0}, ROW_WIDE(KIND, 1), ROW_WIDE(KIND, 2), ROW_WIDE(KIND, 3), ROW_WIDE(KIND, 4), ROW_WIDE(KIND, 5),        \
        ROW_WIDE(KIND, 6), ROW_TALL(KIND, 7), ROW_TALL(KIND, 8), ROW_TALL(KIND, 9), ROW_TALL(KIND, 10),            \
        ROW_TALL(KIND, 11), ROW_TALL(KIND, 12)};

INST_ALL(fma_bf16, float)
INST_ALL(fma_f32, float)
#if defined(__AVX512BF16__)
INST_ALL(dp, uint32_t)
#endif

/* x: [M, K] rows with stride ldx (elements), fp32 or bf16 (in_bf16); wp: packed weight (see the top), bf16
 * (w_bf16) or fp32; bias: fp32 [N16] or NULL; y: contiguous [M, N], bf16 (out_bf16) or fp32.
 *
 * Up to 6 rows, wide tiles (enough FMA chains in flight for a memory-bound step); 7-12 rows, one pass of tall
 * tiles, so a verify step streams each weight once; past 12, wide tiles 6 rows at a time (the weights of a column
 * group are reread from cache, not memory). Either way each output is the same chain: the choice never changes a
 * result. Returns 0, or -1 if out of memory. */
int vs_linear(const void *x, int in_bf16, int64_t M, int64_t K, int64_t ldx, const void *wp, int w_bf16,
              const float *bias, int64_t N, void *y, int out_bf16, int threads) {
    if (M <= 0 || N <= 0) return 0;
    const int wide = M <= MR_WIDE || M > MR_TALL;
    const int64_t nv_unit = wide ? NV_WIDE : NV_TALL, mr = wide ? MR_WIDE : MR_TALL, K2 = (K + 1) / 2;
#if defined(__AVX512BF16__)
    const int dp = in_bf16 && w_bf16; /* bf16 x bf16: vdpbf16ps on x's own bits */
#else
    const int dp = 0;
#endif
    /* x rearranged per chunk of mr rows, chunk c at offset c * mr * K2 * 2 (in 4-byte units), interleaved by pair */
    const size_t xunits = (size_t)(M * K2 * 2 > 0 ? M * K2 * 2 : 1);
    void *xbuf = malloc(xunits * 4);
    if (!xbuf) return -1;
    for (int64_t m0 = 0; m0 < M; m0 += mr) {
        const int64_t rows = M - m0 < mr ? M - m0 : mr;
        for (int64_t m = 0; m < rows; m++) {
            const char *src = (const char *)x + (size_t)(m0 + m) * ldx * (in_bf16 ? 2 : 4);
            if (dp) {
                uint32_t *dst = (uint32_t *)xbuf + m0 * K2;
                const uint16_t *s = (const uint16_t *)src;
                for (int64_t p = 0; p < K2; p++) {
                    const uint32_t lo = s[2 * p], hi = 2 * p + 1 < K ? s[2 * p + 1] : 0;
                    dst[p * rows + m] = lo | hi << 16;
                }
            } else {
                float *dst = (float *)xbuf + m0 * K2 * 2;
                for (int64_t k = 0; k < 2 * K2; k++) {
                    float v = 0.0f;
                    if (k < K) v = in_bf16 ? bf16_value(((const uint16_t *)src)[k]) : ((const float *)src)[k];
                    dst[((k / 2) * rows + m) * 2 + (k % 2)] = v;
                }
            }
        }
    }
#if VW == 8
    if (M > MR_TALL) {
        const int rc = linear_k16((const float *)xbuf, M, K2, wp, w_bf16, bias, N, y, out_bf16, threads);
        free(xbuf);
        return rc;
    }
#endif
    const int64_t nvec = (N + BLOCK - 1) / BLOCK * VPB, units = (nvec + nv_unit - 1) / nv_unit;
    const size_t bbytes = (size_t)K2 * BLOCK * 2 * (w_bf16 ? 2 : 4), yelt = out_bf16 ? 2 : 4;
    const size_t half = VW * 4; /* bytes from a block's start to its second AVX2 half, bf16 pairs or fp32 */
    const tile_fn(*table)[NV_WIDE] = dp ? 0 : (w_bf16 ? fma_bf16_table : fma_f32_table);
#if defined(__AVX512BF16__)
    if (dp) table = dp_table;
#endif
    const size_t xunit = dp ? 1 : 2; /* 4-byte units per (row, pair) of x */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && units > 1)
    for (int64_t u = 0; u < units; u++) {
        const int64_t v0 = u * nv_unit, nv = nvec - v0 < nv_unit ? nvec - v0 : nv_unit;
        const int64_t n0 = v0 * VW;
        const char *wb = (const char *)wp + (size_t)(v0 / VPB) * bbytes + (size_t)(v0 % VPB) * half;
        for (int64_t m0 = 0; m0 < M; m0 += mr) {
            const int rows = (int)(M - m0 < mr ? M - m0 : mr);
            const void *xr = (const uint32_t *)xbuf + (size_t)m0 * K2 * xunit;
            table[rows][nv - 1](xr, K2, wb, bias, (char *)y + (size_t)m0 * N * yelt, N, out_bf16, n0);
        }
    }
    free(xbuf);
    return 0;
}

/* The instruction set this build was compiled for: 1 AVX2 + FMA, 2 AVX-512F, 3 AVX-512 BF16. */
int vs_isa(void) {
#if defined(__AVX512BF16__)
    return 3;
#elif defined(__AVX512F__)
    return 2;
#else
    return 1;
#endif
}
