/* Small-M matmuls for CPU inference with AVX2 + FMA: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * W is packed once into column groups of 16: wp[N16 / 16][K][16] (N16 = N rounded up to 16, pad rows zero), in
 * bf16 (raw uint16 bits) or fp32. Each output is accumulated by one fp32 FMA chain over k = 0..K-1, in that order,
 * and the bias is added last. Threads split the column groups, never K. So a row's result does not depend on how
 * many other rows are in the call, nor on the thread count: a verify step over 9 tokens computes, for each token,
 * exactly what a one-token decode step computes.
 *
 * Rows are taken 6 at a time (12 accumulators: 6 rows x 2 vectors of 8 columns), all rows of a column group
 * before the next group, so the group's weights (K x 64 bytes at most) are read from memory once per call, and
 * prefetched ahead of the FMAs that use them.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define COLS 8 /* columns per packed block: one AVX2 vector */
#define MR_WIDE 6 /* rows of a two-block tile (12 accumulators) */
#define MR_TALL 12 /* rows of a one-block tile (12 accumulators) */
/* Software prefetch distance in the packed weights. A decode or verify step streams every weight from memory once
 * and the FMAs of a tile wait on those loads; fetching 2 KB ahead overlaps the two (shipped target, bf16, a 33-matmul
 * forward with its weights out of cache, 2-vCPU Zen 3: 5.0 -> 3.8 ms at 1 row, 11.2 -> 7.7 ms at 9 rows). A
 * prefetch never faults, so running past the end of the weights is harmless. */
#define PREFETCH 2048

static inline __m256 load_w_bf16(const void *w, int64_t i) {
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m256 load_w_f32(const void *w, int64_t i) { return _mm256_loadu_ps((const float *)w + i); }

/* fp32 -> bf16, round to nearest even; a NaN stays a (quiet) NaN. */
static inline __m128i to_bf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(qnan), nan));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* Store columns [n0, n0 + 8) of one output row, clipped at N. */
static inline void store8(void *y, int out_bf16, int64_t n0, int64_t N, __m256 v) {
    if (n0 + COLS <= N) {
        if (out_bf16)
            _mm_storeu_si128((__m128i *)((uint16_t *)y + n0), to_bf16(v));
        else
            _mm256_storeu_ps((float *)y + n0, v);
        return;
    }
    if (n0 >= N) return;
    if (out_bf16) {
        uint16_t tmp[COLS];
        _mm_storeu_si128((__m128i *)tmp, to_bf16(v));
        memcpy((uint16_t *)y + n0, tmp, (N - n0) * sizeof(uint16_t));
    } else {
        float tmp[COLS];
        _mm256_storeu_ps(tmp, v);
        memcpy((float *)y + n0, tmp, (N - n0) * sizeof(float));
    }
}

/* `rows` x (8 * `blocks`) outputs. Both are compile-time constants at every call site (the switches below), so the
 * loops unroll and the accumulators stay in registers. x is the tile's rows interleaved, x[k * rows + m], so every
 * broadcast is one pointer plus a constant (12 row pointers would not fit in registers beside the accumulators).
 * w points at block n0 / 8; blocks are K * 8 apart. */
#define TILE(NAME, LOAD, ESZ)                                                                                     \
    static inline __attribute__((always_inline)) void NAME(                                                        \
        const int rows, const int blocks, const float *x, int64_t K, const void *w, const float *bias, void *y,   \
        int64_t N, int out_bf16, int64_t n0) {                                                                    \
        __m256 acc[MR_TALL][2];                                                                                   \
        _Pragma("GCC unroll 12") for (int m = 0; m < rows; m++)                                                   \
            _Pragma("GCC unroll 2") for (int b = 0; b < blocks; b++) acc[m][b] = _mm256_setzero_ps();             \
        for (int64_t k = 0; k < K; k++) {                                                                         \
            if (k % (64 / (COLS * ESZ)) == 0) /* a line of each block's weights, PREFETCH bytes ahead */          \
                _Pragma("GCC unroll 2") for (int b = 0; b < blocks; b++)                                          \
                    _mm_prefetch((const char *)w + ((b * K + k) * COLS * ESZ + PREFETCH), _MM_HINT_T0);           \
            __m256 wv[2];                                                                                         \
            _Pragma("GCC unroll 2") for (int b = 0; b < blocks; b++) wv[b] = LOAD(w, (b * K + k) * COLS);         \
            _Pragma("GCC unroll 12") for (int m = 0; m < rows; m++) {                                             \
                __m256 xv = _mm256_broadcast_ss(x + k * rows + m);                                                \
                _Pragma("GCC unroll 2") for (int b = 0; b < blocks; b++)                                          \
                    acc[m][b] = _mm256_fmadd_ps(xv, wv[b], acc[m][b]);                                            \
            }                                                                                                     \
        }                                                                                                         \
        size_t elt = out_bf16 ? 2 : 4;                                                                            \
        _Pragma("GCC unroll 2") for (int b = 0; b < blocks; b++) {                                                \
            __m256 bv = bias ? _mm256_loadu_ps(bias + n0 + b * COLS) : _mm256_setzero_ps();                       \
            _Pragma("GCC unroll 12") for (int m = 0; m < rows; m++) {                                             \
                __m256 v = bias ? _mm256_add_ps(acc[m][b], bv) : acc[m][b];                                       \
                store8((char *)y + m * N * elt, out_bf16, n0 + b * COLS, N, v);                                   \
            }                                                                                                     \
        }                                                                                                         \
    }

TILE(tile_bf16, load_w_bf16, 2)
TILE(tile_f32, load_w_f32, 4)

/* One out-of-line function per (weight dtype, rows, blocks): compiled alone, each tile gets the whole register
 * file (inlined into the threaded loop, GCC spilled accumulators of the 9-12-row tiles, halving their speed). */
#define INST(R, B)                                                                                                \
    static __attribute__((noinline)) void bf16_##R##_##B(const float *x, int64_t K, const void *w,               \
                                                         const float *bias, void *y, int64_t N, int ob, int64_t n0) { \
        tile_bf16(R, B, x, K, w, bias, y, N, ob, n0);                                                             \
    }                                                                                                             \
    static __attribute__((noinline)) void f32_##R##_##B(const float *x, int64_t K, const void *w,                \
                                                        const float *bias, void *y, int64_t N, int ob, int64_t n0) { \
        tile_f32(R, B, x, K, w, bias, y, N, ob, n0);                                                              \
    }
INST(1, 2) INST(2, 2) INST(3, 2) INST(4, 2) INST(5, 2) INST(6, 2)
INST(1, 1) INST(2, 1) INST(3, 1) INST(4, 1) INST(5, 1) INST(6, 1) INST(7, 1) INST(8, 1) INST(9, 1) INST(10, 1)
INST(11, 1) INST(12, 1)

#define CALL(P, R, B) P##_##R##_##B(xr, K, wb, bias, yr, N, out_bf16, n0)
#define CASE(P, R, B) case R: CALL(P, R, B); break;
#define WIDE_CASES(P) CASE(P, 1, 2) CASE(P, 2, 2) CASE(P, 3, 2) CASE(P, 4, 2) CASE(P, 5, 2) default: CALL(P, 6, 2);
#define TALL_CASES(P) CASE(P, 1, 1) CASE(P, 2, 1) CASE(P, 3, 1) CASE(P, 4, 1) CASE(P, 5, 1) CASE(P, 6, 1) \
    CASE(P, 7, 1) CASE(P, 8, 1) CASE(P, 9, 1) CASE(P, 10, 1) CASE(P, 11, 1) default: CALL(P, 12, 1);

/* x: [M, K] rows with stride ldx (elements), fp32 or bf16 (in_bf16); wp: packed weight [ceil(N / 16) * 2][K][8],
 * bf16 (w_bf16) or fp32; bias: fp32 [ceil(N / 16) * 16] or NULL; y: contiguous [M, N], bf16 (out_bf16) or fp32.
 *
 * Up to 6 rows, each tile covers two blocks (16 columns; enough FMA chains in flight for a memory-bound step);
 * at 7-12 rows, one block and all rows, so a verify step of 7-12 tokens streams each weight once; past 12, two
 * blocks and 6 rows at a time.
 * Returns 0, or -1 if out of memory. */
int vs_linear(const void *x, int in_bf16, int64_t M, int64_t K, int64_t ldx, const void *wp, int w_bf16,
              const float *bias, int64_t N, void *y, int out_bf16, int threads) {
    if (M <= 0 || N <= 0) return 0;
    /* 7-12 rows: one pass of tall tiles. Otherwise wide tiles, 6 rows at a time: fewer loads per FMA, and past 12
     * rows (a prefill) the weights of a column pair are reread from cache, not memory. Either way each output is
     * the same FMA chain, so the choice never changes a result. */
    const int wide = M <= MR_WIDE || M > MR_TALL;
    const int64_t per_unit = wide ? 2 : 1, mr = wide ? MR_WIDE : MR_TALL;
    /* x in fp32, each chunk of mr rows interleaved: chunk c at xf + c * mr * K, element (m, k) at k * rows + m */
    float *xf = (float *)malloc((size_t)(M * K > 0 ? M * K : 1) * sizeof(float));
    if (!xf) return -1;
    for (int64_t m0 = 0; m0 < M; m0 += mr) {
        const int64_t rows = M - m0 < mr ? M - m0 : mr;
        float *dst = xf + m0 * K;
        for (int64_t m = 0; m < rows; m++) {
            if (in_bf16) {
                const uint16_t *src = (const uint16_t *)x + (m0 + m) * ldx;
                for (int64_t k = 0; k < K; k++) {
                    const uint32_t bits = (uint32_t)src[k] << 16;
                    memcpy(dst + k * rows + m, &bits, sizeof(float));
                }
            } else {
                const float *src = (const float *)x + (m0 + m) * ldx;
                for (int64_t k = 0; k < K; k++) dst[k * rows + m] = src[k];
            }
        }
    }
    const int64_t units = ((N + 15) / 16) * 2 / per_unit;
    const size_t welt = w_bf16 ? 2 : 4, yelt = out_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t u = 0; u < units; u++) {
        const int64_t n0 = u * per_unit * COLS;
        const void *wb = (const char *)wp + (size_t)(u * per_unit) * K * COLS * welt;
        for (int64_t m0 = 0; m0 < M; m0 += mr) {
            const int rows = (int)(M - m0 < mr ? M - m0 : mr);
            const float *xr = xf + m0 * K;
            void *yr = (char *)y + (size_t)m0 * N * yelt;
            if (wide && w_bf16) {
                switch (rows) { WIDE_CASES(bf16) }
            } else if (wide) {
                switch (rows) { WIDE_CASES(f32) }
            } else if (w_bf16) {
                switch (rows) { TALL_CASES(bf16) }
            } else {
                switch (rows) { TALL_CASES(f32) }
            }
        }
    }
    free(xf);
    return 0;
}

/* 1 when this CPU runs the kernels above (AVX2 and FMA), else 0. */
int vs_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
