/* Weight-only int8 / int4 matmuls for CPU inference: y[M, N] = x[M, K] @ (q * scale)[N, K]^T (+ bias), with q
 * integers (int8, or int4 in [-8, 7]) and one fp32 scale per output column and group of `group` inputs (int8 per
 * channel: group = K). x is fp32 or bf16 (used as its fp32 values), y fp32 or bf16 (rounded to nearest even).
 *
 * One source, compiled per instruction set like gemm.c (AVX2 + FMA 8-wide; AVX-512F and AVX-512 BF16 16-wide,
 * the same code). Every output is one fixed chain, per group g in ascending order:
 *
 *   s = 0; for each pair (2p, 2p + 1) of g: s = fma(x[2p+1], q[2p+1], s); s = fma(x[2p], q[2p], s)
 *   acc = fma(s, scale[g], acc)                                        (acc = 0 before the first group)
 *
 * then + bias, then the store. q converts to fp32 exactly, however a path unpacks it (AVX2: shifts and cvt;
 * AVX-512: a 16-entry table through vpermps), so all paths agree bit for bit. The pair order is gemm.c's (odd,
 * then even: vdpbf16ps's own), so the AVX-512 BF16 path takes bf16 x on int4 and int8 weights through vdpbf16ps
 * (nibbles through vpermw to bf16, bytes through cvt; both exact, and the products of bf16 x and q exact in
 * fp32): the same chain, with gemm.c's one caveat (vdpbf16ps flushes values below 1.2e-38 to zero where an FMA
 * keeps them).
 * Threads split column blocks, never K, and tiles never change a chain: a row's result is the same whatever the
 * number of rows in the call, the tile it falls in and the thread count.
 *
 * Packed weights (qpack() in native.py), in blocks of 16 output columns (N16 = N rounded up to 16, pad columns
 * zero), each block one stream of its groups in order (K is padded with zeros, to even for int8 and to a
 * multiple of 8 for int4, only where one group spans it):
 *   int4: per 8 inputs, 16 columns x 4 bytes: column j's int32 holds nibbles q[k0], q[k2], q[k4], q[k6], q[k1],
 *         q[k3], q[k5], q[k7] from bit 0 up, so a shift by 4t puts pair t's even input in the low 16-bit half's
 *         low nibble and its odd input in the high half's (vpermw's bf16 pair, vpermps's even input)
 *   int8: per pair, 32 bytes: 16 columns' q[., 2p], then 16 columns' q[., 2p + 1]
 * then the group's 16 fp32 scales (64 bytes). An AVX2 vector takes the second 8 columns at +32 bytes (int4,
 * scales) or +8 (int8). Rows are taken in gemm.c's tiles (wide: up to 6 rows x 64 columns; tall, for 7-12 rows: 12 x 32
 * at 16 lanes, 12 x 8 at 8; AVX2's wide tiles are 6 x 16): a block's weights are unpacked once per pair and used
 * by every row of the tile.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "vecmath.h"

#if defined(__AVX512F__)
#define vcvt(i) _mm512_cvtepi32_ps(i)
/* VW columns' bytes, sign-extended to int32 lanes */
#define vbytes(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
/* int4: vpermps reads only an index's low 4 bits: the low nibble, or the high one after a shift */
#define NIBBLE_TABLE const vf lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
#define v_nib(e, pos) _mm512_permutexvar_ps(_mm512_srli_epi32(e, 4 * (pos)), lut) /* nibble pos of each lane */
#else
#define vcvt(i) _mm256_cvtepi32_ps(i)
#define vbytes(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define NIBBLE_TABLE
#define v_nib(e, pos) _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(e, 28 - 4 * (pos)), 28))
#endif

#define SCALE_BYTES (BLOCK * 4)
/* Prefetch distance and hint in each block's stream, as gemm.c's (a quarter or half as many bytes per pair). */
#ifndef PREFETCH
#define PREFETCH 1024
#endif
/* W4A8's distance. AVX-512: 16 KB, several blocks' streams ahead (a thread's units are adjacent blocks); at 2 KB a
 * verify step's tiles still waited on memory: the w4a8-head forward ran 0.96 / 0.96 / 0.95 / 0.95x the time at 1 /
 * 3 / 5 / 9 rows at 16 KB (scripts/kernel_ab.py, Zen 4; 4 KB no gain, 32 KB as 16). AVX2, at half the pace, ran
 * 1.04-1.05x the time at 5-9 rows with 16 KB and keeps twice W4A16's distance. */
#ifndef A8_PREFETCH
#if defined(__AVX512F__)
#define A8_PREFETCH 16384
#else
#define A8_PREFETCH (2 * PREFETCH)
#endif
#endif
/* From A8_L1_ROWS rows a W4A8 tile is bound by its integer products and waited on L2: it prefetches into L1 (Zen 4,
 * w4a8-head, 3-9 rows: 0.89-0.96x the time on AVX-512 BF16, 0.91-0.96x on AVX2; at 2 rows L1 cost 1.09x). */
#ifndef A8_L1_ROWS
#define A8_L1_ROWS 3
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif

/* Store columns [n0, n0 + VW) of one output row plus the bias ([N] or NULL), clipped at N. */
static inline void store_row(void *y, int out_bf16, int64_t n0, int64_t N, const float *bias, vf v) {
    float tmp[VW];
    const int64_t n = N - n0 < VW ? N - n0 : VW;
    if (n <= 0) return;
    if (bias && n == VW) {
        v = vadd(v, vloadf(bias + n0));
    } else if (bias) {
        float b[VW] = {0};
        memcpy(b, bias + n0, (size_t)n * sizeof(float));
        v = vadd(v, vloadf(b));
    }
    if (n == VW) {
        if (out_bf16)
            vstore_bf16((uint16_t *)y + n0, v);
        else
            vstoref((float *)y + n0, v);
        return;
    }
    vstoref(tmp, v);
    if (out_bf16) {
        uint16_t *o = (uint16_t *)y + n0;
        for (int64_t i = 0; i < n; i++) o[i] = bf16_bits(tmp[i]);
    } else {
        memcpy((float *)y + n0, tmp, (size_t)n * sizeof(float));
    }
}

/* One tile of R rows x NV vectors for BITS-bit weights. x: this tile's rows interleaved by pair,
 * x[(p * R + m) * 2 + e] = x[m, 2p + e]; w: the first block's stream, blocks bstride bytes apart. R, NV and BITS
 * are constants at each call site, so the loops unroll and the partial sums stay in registers; the group sums
 * acc live in memory (touched once per group). */
static inline __attribute__((always_inline)) void tile_q(const int R, const int NV, const int BITS, const float *x,
                                                         int64_t G2, int64_t groups, const char *w, int64_t bstride,
                                                         int64_t sxo, const float *bias, void *y, int64_t N,
                                                         int out_bf16, int64_t n0) {
    /* G2 pairs per group; pb bytes per pair of a block (int4: 4 pairs in one 64-byte step); hb: an AVX2 vector's
     * second half */
    const int64_t pb = BITS == 4 ? BLOCK : 2 * BLOCK, gbytes = G2 * pb + SCALE_BYTES, hb = BITS == 4 ? 32 : 8;
    NIBBLE_TABLE
    float acc[MR_TALL][NV_WIDE][VW] __attribute__((aligned(64)));
    _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) vstoref(acc[m][v], vzero());
    for (int64_t g = 0; g < groups; g++) {
        vf s[MR_TALL][NV_WIDE];
        _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) s[m][v] = vzero();
        const char *wg = w + g * gbytes;
        const float *xg = x + g * G2 * R * 2;
        const int step = BITS == 4 ? 4 : 1; /* pairs per load */
        /* input by input (a pair's odd one, then its even one: the chain's order), that input's NV weight vectors
         * first, then row by row: R * NV sums, NV weights and one broadcast live; the vector-outer order kept
         * every row's broadcasts live and GCC spilled (read off the assembly, AVX2 and AVX-512) */
        for (int64_t p0 = 0; p0 < G2; p0 += step) {
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v += VPB)
                _mm_prefetch(wg + (v / VPB) * bstride + p0 * pb + PREFETCH, PF_HINT);
            _Pragma("GCC unroll 4") for (int t = 0; t < step; t++) {
                const float *xp = xg + (p0 + t) * R * 2;
                _Pragma("GCC unroll 2") for (int odd = 1; odd >= 0; odd--) {
                    vf wt[NV_WIDE];
                    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {
                        const char *wv = wg + (v / VPB) * bstride + p0 * pb + (v % VPB) * hb;
                        wt[v] = BITS == 4 ? v_nib(vloadi(wv), 4 * odd + t) : vcvt(vbytes(wv + odd * BLOCK));
                    }
                    _Pragma("GCC unroll 12") for (int m = 0; m < R; m++) {
                        const vf b = vbcast(xp + 2 * m + odd);
                        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) s[m][v] = vfma(b, wt[v], s[m][v]);
                    }
                }
            }
        }
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {
            const char *sv = wg + (v / VPB) * bstride + G2 * pb + (v % VPB) * VW * 4 + sxo;
            const vf sc = vloadf((const float *)sv);
            _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)
                vstoref(acc[m][v], vfma(s[m][v], sc, vloadf(acc[m][v])));
        }
    }
    const size_t elt = out_bf16 ? 2 : 4;
    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)
        _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)
            store_row((char *)y + m * N * elt, out_bf16, n0 + v * VW, N, bias, vloadf(acc[m][v]));
}

#if defined(__AVX512BF16__)
/* bf16 bits of a nibble's value (0 .. 7, -8 .. -1), twice: vpermw's 32 entries */
static const uint16_t BF16_NIBBLE[32] __attribute__((aligned(64))) = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040,
    0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0xC100, 0xC0E0, 0xC0C0, 0xC0A0,
    0xC080, 0xC040, 0xC000, 0xBF80};

/* A pair's 16 columns of int8 weights (16 even inputs' bytes, then 16 odd ones') as bf16 pairs, exact: an int8
 * converts to fp32 with its low 16 bits zero, so its bf16 bits are the fp32's high half. */
static inline __m512i bf16_pairs_i8(const char *p) {
    const __m512i even = _mm512_castps_si512(vcvt(vbytes(p))), odd = _mm512_castps_si512(vcvt(vbytes(p + BLOCK)));
    return _mm512_or_si512(odd, _mm512_srli_epi32(even, 16));
}

/* int4 or int8 weights, bf16 x: the same chain through vdpbf16ps. x as bf16 pairs, x[p * R + m] = bits of x[m, 2p]
 * | x[m, 2p + 1] << 16 (gemm.c's); vpermw reads a 16-bit index's low 5 bits, so the table repeats its 16 values.
 * SRC: 4 or 8, the packed stream of that many bits; 0, unpack_dp's scratch (a pair's 16 columns already bf16 pairs,
 * 64 bytes): prefills unpack each block once rather than once per 6 rows. The same chain every way. */
static inline __attribute__((always_inline)) void tile_dp(const int R, const int NV, const int SRC,
                                                          const uint32_t *x, int64_t G2, int64_t groups,
                                                          const char *w, int64_t bstride, const float *bias,
                                                          void *y, int64_t N, int out_bf16, int64_t n0) {
    /* bytes per pair of a block, per group; pairs per step (int4: one 64-byte load holds 4) */
    const int64_t pb = SRC == 0 ? 4 * BLOCK : SRC == 8 ? 2 * BLOCK : BLOCK, gbytes = G2 * pb + SCALE_BYTES;
    const int step = SRC == 4 ? 4 : 1;
    const __m512i lut = _mm512_loadu_si512((const void *)BF16_NIBBLE);
    float acc[MR_TALL][NV_WIDE][VW] __attribute__((aligned(64)));
    _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) vstoref(acc[m][v], vzero());
    for (int64_t g = 0; g < groups; g++) {
        __m512 s[MR_TALL][NV_WIDE];
        _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) s[m][v] = vzero();
        const char *wg = w + g * gbytes;
        const uint32_t *xg = x + g * G2 * R;
        /* pair by pair, each pair's NV weight vectors first, then row by row: R * NV sums, NV weights and one
         * broadcast live (30 registers at most); the vector-outer order kept 4R broadcasts live and spilled */
        for (int64_t p0 = 0; p0 < G2; p0 += step) {
            if (SRC)
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)
                    _mm_prefetch(wg + v * bstride + p0 * pb + PREFETCH, PF_HINT);
            _Pragma("GCC unroll 4") for (int t = 0; t < step; t++) {
                __m512bh wb[NV_WIDE];
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {
                    const char *wv = wg + v * bstride + p0 * pb;
                    wb[v] = SRC == 0   ? (__m512bh)_mm512_loadu_si512((const void *)wv)
                            : SRC == 8 ? (__m512bh)bf16_pairs_i8(wv)
                                       : (__m512bh)_mm512_permutexvar_epi16(
                                             _mm512_srli_epi32(_mm512_loadu_si512((const void *)wv), 4 * t), lut);
                }
                const uint32_t *xp = xg + (p0 + t) * R;
                _Pragma("GCC unroll 12") for (int m = 0; m < R; m++) {
                    const __m512bh b = (__m512bh)_mm512_set1_epi32((int)xp[m]);
                    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) s[m][v] = _mm512_dpbf16_ps(s[m][v], wb[v], b);
                }
            }
        }
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {
            const vf sc = vloadf((const float *)(wg + v * bstride + G2 * pb));
            _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)
                vstoref(acc[m][v], vfma(s[m][v], sc, vloadf(acc[m][v])));
        }
    }
    const size_t elt = out_bf16 ? 2 : 4;
    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)
        _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)
            store_row((char *)y + m * N * elt, out_bf16, n0 + v * VW, N, bias, vloadf(acc[m][v]));
}

/* One int4 or int8 block's packed stream -> the same stream with each pair's weights as bf16 pairs (64 bytes a
 * pair, the exact values tile_dp makes of them), the scales copied: tile_dp's SRC 0 input. */
static void unpack_dp(const char *wb, int bits, int64_t G2, int64_t groups, char *out) {
    const __m512i lut = _mm512_loadu_si512((const void *)BF16_NIBBLE);
    const int64_t pb = bits == 4 ? BLOCK : 2 * BLOCK;
    for (int64_t g = 0; g < groups; g++) {
        const char *wg = wb + g * (G2 * pb + SCALE_BYTES);
        char *og = out + g * (G2 * 4 * BLOCK + SCALE_BYTES);
        if (bits == 4) {
            for (int64_t p0 = 0; p0 < G2; p0 += 4) {
                const __m512i e = _mm512_loadu_si512((const void *)(wg + p0 * BLOCK));
                _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++)
                    _mm512_storeu_si512((void *)(og + (p0 + t) * 4 * BLOCK),
                                        _mm512_permutexvar_epi16(_mm512_srli_epi32(e, 4 * t), lut));
            }
        } else {
            for (int64_t p = 0; p < G2; p++)
                _mm512_storeu_si512((void *)(og + p * 4 * BLOCK), bf16_pairs_i8(wg + p * pb));
        }
        memcpy(og + G2 * 4 * BLOCK, wg + G2 * pb, SCALE_BYTES);
    }
}
#endif

/* One out-of-line function per (bits, rows, vectors), as gemm.c's: each tile gets the whole register file. */
typedef void (*qtile_fn)(const void *x, int64_t G2, int64_t groups, const char *w, int64_t bstride, int64_t sxo,
                         const float *bias, void *y, int64_t N, int ob, int64_t n0);
#define INST1(BITS, R, NV)                                                                                         \
    static __attribute__((noinline)) void q##BITS##_##R##_##NV(const void *x, int64_t G2, int64_t groups,          \
                                                               const char *w, int64_t bstride, int64_t sxo,       \
                                                               const float *bias, void *y, int64_t N, int ob,     \
                                                               int64_t n0) {                                      \
        (void)sxo;                                                                                                 \
        TILE_##BITS(R, NV, x, G2, groups, w, bstride, sxo, bias, y, N, ob, n0);                                    \
    }
#define TILE_4(R, NV, x, ...) tile_q(R, NV, 4, (const float *)(x), __VA_ARGS__)
#define TILE_8(R, NV, x, ...) tile_q(R, NV, 8, (const float *)(x), __VA_ARGS__)
#define TILE_dp(SRC, R, NV, x, G2, groups, w, bstride, sxo, ...)                                                  \
    tile_dp(R, NV, SRC, (const uint32_t *)(x), G2, groups, w, bstride, __VA_ARGS__)
#define TILE_dp4(...) TILE_dp(4, __VA_ARGS__)
#define TILE_dp8(...) TILE_dp(8, __VA_ARGS__)
#define TILE_dpu(...) TILE_dp(0, __VA_ARGS__)
#if VW == 16
#define INST_WIDE(B, R) INST1(B, R, 1) INST1(B, R, 2) INST1(B, R, 3) INST1(B, R, 4)
#define INST_TALL(B, R) INST1(B, R, 1) INST1(B, R, 2)
#define ROW_WIDE(B, R) {q##B##_##R##_1, q##B##_##R##_2, q##B##_##R##_3, q##B##_##R##_4}
#define ROW_TALL(B, R) {q##B##_##R##_1, q##B##_##R##_2, 0, 0}
#else
#define INST_WIDE(B, R) INST1(B, R, 2)
#define INST_TALL(B, R) INST1(B, R, 1)
#define ROW_WIDE(B, R) {0, q##B##_##R##_2}
#define ROW_TALL(B, R) {q##B##_##R##_1, 0}
#endif
#define INST_ALL(B)                                                                                                \
    INST_WIDE(B, 1) INST_WIDE(B, 2) INST_WIDE(B, 3) INST_WIDE(B, 4) INST_WIDE(B, 5) INST_WIDE(B, 6)                \
    INST_TALL(B, 7) INST_TALL(B, 8) INST_TALL(B, 9) INST_TALL(B, 10) INST_TALL(B, 11) INST_TALL(B, 12)             \
    static const qtile_fn q##B##_table[MR_TALL + 1][NV_WIDE] = {                                                    \
        {0}, ROW_WIDE(B, 1), ROW_WIDE(B, 2), ROW_WIDE(B, 3), ROW_WIDE(B, 4), ROW_WIDE(B, 5), ROW_WIDE(B, 6),       \
        ROW_TALL(B, 7), ROW_TALL(B, 8), ROW_TALL(B, 9), ROW_TALL(B, 10), ROW_TALL(B, 11), ROW_TALL(B, 12)};

INST_ALL(4)
INST_ALL(8)
#if defined(__AVX512BF16__)
INST_ALL(dp4)
INST_ALL(dp8)
INST_WIDE(dpu, 1) INST_WIDE(dpu, 2) INST_WIDE(dpu, 3) INST_WIDE(dpu, 4) INST_WIDE(dpu, 5) INST_WIDE(dpu, 6)
static const qtile_fn qdpu_table[MR_WIDE + 1][NV_WIDE] = {
    {0}, ROW_WIDE(dpu, 1), ROW_WIDE(dpu, 2), ROW_WIDE(dpu, 3), ROW_WIDE(dpu, 4), ROW_WIDE(dpu, 5), ROW_WIDE(dpu, 6)};

/* bf16 x on int4 or int8 past 12 rows (prefills): each unit's blocks unpacked once into per-thread scratch
 * (unpack_dp), then 6-row wide tiles over it. Returns 0, or -1 if out of memory. */
static int qlinear_dpu(const uint32_t *xbuf, int64_t M, int bits, int64_t G2, int64_t groups, const char *wp,
                       int64_t bstride, const float *bias, int64_t N, void *y, int out_bf16, int threads) {
    const int64_t nvec = (N + BLOCK - 1) / BLOCK, units = (nvec + NV_WIDE - 1) / NV_WIDE, K2 = groups * G2;
    const int64_t ustride = groups * (G2 * 4 * BLOCK + SCALE_BYTES); /* scratch bytes per block */
    const size_t yelt = out_bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
    {
        char *w = aligned_alloc(64, (size_t)(NV_WIDE * ustride));
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (!w) continue;
            const int64_t v0 = u * NV_WIDE, nv = nvec - v0 < NV_WIDE ? nvec - v0 : NV_WIDE;
            for (int64_t v = 0; v < nv; v++)
                unpack_dp(wp + (size_t)(v0 + v) * bstride, bits, G2, groups, w + v * ustride);
            for (int64_t m0 = 0; m0 < M; m0 += MR_WIDE) {
                const int rows = (int)(M - m0 < MR_WIDE ? M - m0 : MR_WIDE);
                qdpu_table[rows][nv - 1](xbuf + m0 * K2, G2, groups, w, ustride, 0, bias,
                                         (char *)y + (size_t)m0 * N * yelt, N, out_bf16, v0 * VW);
            }
        }
        free(w);
    }
    return failed ? -1 : 0;
}
#endif

#if VW == 8
/* AVX2 past 12 rows (prefills), as gemm.c's linear_k16: each 16-column block's q unpacked once into fp32 scratch
 * [K2][2][16] (exact) with its scales [groups][16], shared by every row tile, then 6 x 16 tiles input by input in
 * the chain's order (pair p's odd input, then its even one), the group sums s in registers and acc in memory.
 * tile_q's pair-at-a-time body unpacks every block again for each 6 rows. Same chain: the same results. */
static inline __attribute__((always_inline)) void qtile_k16(const int R, const float *x, int64_t G2, int64_t groups,
                                                            const float *w, const float *sc, const float *bias,
                                                            void *y, int64_t N, int out_bf16, int64_t n0) {
    float acc[MR_WIDE][2][VW] __attribute__((aligned(32)));
    _Pragma("GCC unroll 6") for (int m = 0; m < R; m++) vstoref(acc[m][0], vzero()), vstoref(acc[m][1], vzero());
    for (int64_t g = 0; g < groups; g++) {
        vf s[MR_WIDE][2];
        _Pragma("GCC unroll 6") for (int m = 0; m < R; m++) s[m][0] = s[m][1] = vzero();
        k16_pairs(R, x, w, g * G2, (g + 1) * G2, s);
        const vf c0 = vloadf(sc + g * BLOCK), c1 = vloadf(sc + g * BLOCK + VW);
        _Pragma("GCC unroll 6") for (int m = 0; m < R; m++) {
            vstoref(acc[m][0], vfma(s[m][0], c0, vloadf(acc[m][0])));
            vstoref(acc[m][1], vfma(s[m][1], c1, vloadf(acc[m][1])));
        }
    }
    const size_t elt = out_bf16 ? 2 : 4;
    _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++)
        _Pragma("GCC unroll 6") for (int m = 0; m < R; m++)
            store_row((char *)y + m * N * elt, out_bf16, n0 + v * VW, N, bias, vloadf(acc[m][v]));
}

/* One block's packed stream (see the top) -> w [K2][2][16] fp32 (pair p's even input's 16 columns, then its odd
 * input's) and sc [groups][16]. */
static void unpack_qblock(const char *wb, int bits, int64_t G2, int64_t groups, float *w, float *sc) {
    const int64_t pb = bits == 4 ? BLOCK : 2 * BLOCK, gbytes = G2 * pb + SCALE_BYTES;
    for (int64_t g = 0; g < groups; g++) {
        const char *wg = wb + g * gbytes;
        float *wo = w + g * G2 * 2 * BLOCK;
        if (bits == 4) {
            for (int64_t p0 = 0; p0 < G2; p0 += 4)
                for (int h = 0; h < 2; h++) {
                    const vi e = vloadi(wg + p0 * pb + h * 32);
                    _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {
                        vstoref(wo + (p0 + t) * 2 * BLOCK + h * VW, v_nib(e, t));
                        vstoref(wo + (p0 + t) * 2 * BLOCK + BLOCK + h * VW, v_nib(e, 4 + t));
                    }
                }
        } else {
            for (int64_t p = 0; p < G2; p++)
                for (int h = 0; h < 2; h++) {
                    const char *wv = wg + p * pb + h * 8;
                    vstoref(wo + p * 2 * BLOCK + h * VW, vcvt(vbytes(wv)));
                    vstoref(wo + p * 2 * BLOCK + BLOCK + h * VW, vcvt(vbytes(wv + BLOCK)));
                }
        }
        for (int h = 0; h < 2; h++) vstoref(sc + g * BLOCK + h * VW, vloadf((const float *)(wg + G2 * pb + h * 32)));
    }
}

typedef void (*qk16_fn)(const float *x, int64_t G2, int64_t groups, const float *w, const float *sc,
                        const float *bias, void *y, int64_t N, int ob, int64_t n0);
#define INST_QK16(R)                                                                                               \
    static __attribute__((noinline)) void qk16_##R(const float *x, int64_t G2, int64_t groups, const float *w,    \
                                                   const float *sc, const float *bias, void *y, int64_t N, int ob, \
                                                   int64_t n0) {                                                   \
        qtile_k16(R, x, G2, groups, w, sc, bias, y, N, ob, n0);                                                    \
    }
INST_QK16(1) INST_QK16(2) INST_QK16(3) INST_QK16(4) INST_QK16(5) INST_QK16(6)
static const qk16_fn qk16_table[MR_WIDE + 1] = {0, qk16_1, qk16_2, qk16_3, qk16_4, qk16_5, qk16_6};

/* Rows past MR_TALL on AVX2: xbuf in chunks of 6 rows, as vs_qlinear makes it. Returns 0, or -1 if out of memory. */
static int qlinear_k16(const float *xbuf, int64_t M, int64_t G2, int64_t groups, const void *wp, int bits,
                       int64_t bstride, const float *bias, int64_t N, void *y, int out_bf16, int threads) {
    const int64_t blocks = (N + BLOCK - 1) / BLOCK, K2 = groups * G2;
    const size_t yelt = out_bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1)
    {
        float *w = aligned_alloc(64, (size_t)(K2 * 2 + groups) * BLOCK * sizeof(float));
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (!w) continue;
            float *sc = w + K2 * 2 * BLOCK;
            unpack_qblock((const char *)wp + (size_t)b * bstride, bits, G2, groups, w, sc);
            for (int64_t m0 = 0; m0 < M; m0 += MR_WIDE) {
                const int rows = (int)(M - m0 < MR_WIDE ? M - m0 : MR_WIDE);
                qk16_table[rows](xbuf + (size_t)m0 * K2 * 2, G2, groups, w, sc, bias,
                                 (char *)y + (size_t)m0 * N * yelt, N, out_bf16, b * BLOCK);
            }
        }
        free(w);
    }
    return failed ? -1 : 0;
}
#endif

/* ---- int4 weights with int8 activations (act_bits 8: W4A8) -------------------------------------------------
 * Each row's inputs are rounded to int8 per group of the weight (s = amax / 127, q = rint(x / s), 0 where the
 * group is all zero), and a group's sum of products is an exact integer: the int4 stream's nibbles, XORed with 8
 * (w + 8 in [0, 15], unsigned), times q (signed) through vpdpbusd (AVX-512 VNNI) or vpmaddubsw + vpmaddwd (AVX2,
 * AVX-512BW: no pair sum reaches int16's range, 15 * 127 * 2), from -8 * sum(q) on. Exact integers in any order,
 * so tiles and ISAs agree; the float part is one chain per output, per group g in ascending order:
 *
 *   acc = acc + (isum_g * s[m, g]) * scale[n, g]                        (acc = 0 before the first group)
 *
 * then + bias, then the store: the same operations, in the same order, as quant.act8's torch reference, so the
 * native and torch results are bit-identical. vpdpbusd retires 64 multiply-adds an instruction against
 * vdpbf16ps's 32, at the same rate on a Zen 4 (~3.6 G a core, either): the 32 matmuls of a zoo/target forward ran
 * 1.6-1.75x faster than W4A16's at 16-256 rows and 1.14x at 9 in groups of 128, 1.36-1.47x and 0.98x in groups of
 * 32, where the per-group epilogue weighs 4x more (scripts/qgemm_cost.py, reports/quant/zen4-w4a8-short/); one-row
 * steps read the same bytes either way.
 * An int4 stream's 8-input step holds, per column, nibbles of inputs 0, 2, 4, 6, 1, 3, 5, 7 from bit 0 up: its
 * low nibbles are the bytes of inputs (0, 4, 1, 5), its high ones (2, 6, 3, 7), so x is laid out as those bytes. */
#if VW == 16
/* a group's steps unrolled whole (see tile_a8); AVX2 spilled twice as much so, and keeps the loop */
#define A8_UNROLL _Pragma("GCC unroll 16")
#define vset1i(v) _mm512_set1_epi32(v)
#define vsrli4(e) _mm512_srli_epi32(e, 4)
#define vnib8(e, x88, m0f) _mm512_ternarylogic_epi32(e, x88, m0f, 0x28) /* (e ^ 0x88..) & 0x0F.. */
#define vmul(a, b) _mm512_mul_ps(a, b)
#if defined(__AVX512VNNI__)
#define vdot4(s, w, x, ones) _mm512_dpbusd_epi32(s, w, x)
#else
#define A8_PAIRS16 1
#define vpairs(w, x) _mm512_maddubs_epi16(w, x)
#define vadd16(a, b) _mm512_add_epi16(a, b)
#define vwiden(s, p, ones) _mm512_add_epi32(s, _mm512_madd_epi16(p, ones))
#define vzeroi() _mm512_setzero_si512()
#endif
#else
#define A8_UNROLL _Pragma("GCC unroll 1")
#define vset1i(v) _mm256_set1_epi32(v)
#define vsrli4(e) _mm256_srli_epi32(e, 4)
#define vnib8(e, x88, m0f) _mm256_and_si256(_mm256_xor_si256(e, x88), m0f)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define A8_PAIRS16 1
#define vpairs(w, x) _mm256_maddubs_epi16(w, x)
#define vadd16(a, b) _mm256_add_epi16(a, b)
#define vwiden(s, p, ones) _mm256_add_epi32(s, _mm256_madd_epi16(p, ones))
#define vzeroi() _mm256_setzero_si256()
#endif
/* Without VNNI a step's products come in int16 pair sums (vpmaddubsw: two products, |sum| <= 2 * 15 * 127 = 3810),
 * which add up in int16 over up to four steps (eight sums, <= 30480: no wrap) before one vpmaddwd widens them:
 * 2.25 instructions per pair sum instead of 3 (vpmaddubsw, vpmaddwd, vpaddd), the same exact integers. */
#if defined(A8_PAIRS16)
#define A8_ACC(m, v, W, B) p16[m][v] = vadd16(p16[m][v], vpairs(W, B))
#else
#define A8_ACC(m, v, W, B) s[m][v] = vdot4(s[m][v], W, B, ones)
#endif

/* One tile of R rows x NV vectors: x this tile's rows, per group, per 8-input step o, per row two int32 of bytes
 * (inputs 0, 4, 1, 5 and 2, 6, 3, 7); xs, xc: the rows' per-group s and 8 * sum(q), `groups` apart. G8C: the
 * steps per group where the call site knows them (4: groups of 32, 16: of 128), else 0 (G8 at run time): a
 * group's steps then unroll whole, and no sum is carried round a loop (GCC copied every carried sum between
 * registers at the loop's end, 34 moves per 144 vpdpbusd at 9 x 2). */
static inline __attribute__((always_inline)) void tile_a8(const int R, const int NV, const int G8C, const int32_t *x,
                                                          const float *xs, const int32_t *xc, int64_t G8,
                                                          int64_t groups, const char *w, int64_t bstride,
                                                          const float *bias, void *y, int64_t N, int out_bf16,
                                                          int64_t n0) {
    if (G8C) G8 = G8C;
    const int64_t gbytes = G8 * 4 * BLOCK + SCALE_BYTES; /* an 8-input step is 4 bytes a column */
    const vi x88 = vset1i((int)0x88888888u), m0f = vset1i(0x0F0F0F0F), ones = vset1i(0x00010001);
    (void)ones; /* vpmaddwd's pair sums (no VNNI) */
    float acc[MR_TALL][NV_WIDE][VW] __attribute__((aligned(64)));
    _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) vstoref(acc[m][v], vzero());
    _Pragma("GCC unroll 1") for (int64_t g = 0; g < groups; g++) {
        vi s[MR_TALL][NV_WIDE]; /* from -8 * sum(q): the sums of w * q, exactly, after the group */
        _Pragma("GCC unroll 12") for (int m = 0; m < R; m++) {
            const vi c = vset1i(-xc[m * groups + g]);
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) s[m][v] = c;
        }
        const char *wg = w + g * gbytes;
        const int32_t *xg = x + g * G8 * R * 2;
#if defined(A8_PAIRS16)
        vi p16[MR_TALL][NV_WIDE]; /* int16 pair sums since the last widening */
        _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) p16[m][v] = vzeroi();
#endif
        A8_UNROLL for (int64_t o = 0; o < G8; o++) {
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v += VPB) {
                const char *ahead = wg + (v / VPB) * bstride + o * 4 * BLOCK + A8_PREFETCH;
                if (R >= A8_L1_ROWS) /* R is each tile's constant: one hint compiled per tile */
                    _mm_prefetch(ahead, _MM_HINT_T0);
                else
                    _mm_prefetch(ahead, PF_HINT);
            }
            const int32_t *xp = xg + o * R * 2;
            if (VW == 16) {
                /* both nibbles' weights for every vector, then row by row both broadcasts: 2 * NV weights, R * NV
                 * sums and two broadcasts live. Unpacking per nibble in two passes left GCC copying and spilling
                 * the sums every step (12 register moves and 8 spills a step at 9 x 2, read off the assembly);
                 * integer sums are exact in any order, so the products' order is free. */
                vi lo[NV_WIDE], hi[NV_WIDE];
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {
                    const vi e = vloadi(wg + (v / VPB) * bstride + o * 4 * BLOCK + (v % VPB) * 32);
                    lo[v] = vnib8(e, x88, m0f);
                    hi[v] = vnib8(vsrli4(e), x88, m0f);
                }
                _Pragma("GCC unroll 12") for (int m = 0; m < R; m++) {
                    const vi bl = vset1i(xp[2 * m]), bh = vset1i(xp[2 * m + 1]);
                    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {
                        A8_ACC(m, v, lo[v], bl);
                        A8_ACC(m, v, hi[v], bh);
                    }
                }
            } else {
                /* AVX2's 16 registers: the low nibbles' weights for every vector, then every row; then the high
                 * ones (NV weights live, not 2 * NV) */
                _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
                    vi wt[NV_WIDE];
                    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {
                        const vi e = vloadi(wg + (v / VPB) * bstride + o * 4 * BLOCK + (v % VPB) * 32);
                        wt[v] = vnib8(h ? vsrli4(e) : e, x88, m0f);
                    }
                    _Pragma("GCC unroll 12") for (int m = 0; m < R; m++) {
                        const vi bx = vset1i(xp[2 * m + h]);
                        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) A8_ACC(m, v, wt[v], bx);
                    }
                }
            }
#if defined(A8_PAIRS16)
            if ((o & 3) == 3 || o == G8 - 1) /* four steps' pair sums, or the group's last: widen them */
                _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)
                    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {
                        s[m][v] = vwiden(s[m][v], p16[m][v], ones);
                        p16[m][v] = vzeroi();
                    }
#endif
        }
        _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {
            const char *sv = wg + (v / VPB) * bstride + G8 * 4 * BLOCK + (v % VPB) * VW * 4;
            const vf sc = vloadf((const float *)sv);
            _Pragma("GCC unroll 12") for (int m = 0; m < R; m++) {
                const vf f = vcvt(s[m][v]);
                vstoref(acc[m][v], vadd(vloadf(acc[m][v]), vmul(vmul(f, vbcast(xs + m * groups + g)), sc)));
            }
        }
    }
    const size_t elt = out_bf16 ? 2 : 4;
    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)
        _Pragma("GCC unroll 12") for (int m = 0; m < R; m++)
            store_row((char *)y + m * N * elt, out_bf16, n0 + v * VW, N, bias, vloadf(acc[m][v]));
}

typedef void (*a8tile_fn)(const int32_t *x, const float *xs, const int32_t *xc, int64_t G8, int64_t groups,
                          const char *w, int64_t bstride, const float *bias, void *y, int64_t N, int ob, int64_t n0);
#define INST_A8G(R, NV, G)                                                                                         \
    static __attribute__((noinline)) void a8_##R##_##NV##_##G(const int32_t *x, const float *xs, const int32_t *xc, \
                                                              int64_t G8, int64_t groups, const char *w,          \
                                                              int64_t bstride, const float *bias, void *y, int64_t N, \
                                                              int ob, int64_t n0) {                               \
        tile_a8(R, NV, G, x, xs, xc, G8, groups, w, bstride, bias, y, N, ob, n0);                                 \
    }
/* Each tile for groups of 32 and 128 inputs (4 and 16 steps) and any other (0), except AVX2's one-row tiles, which
 * keep one tile for all: on the AVX2 build (Zen 4, kernel_ab, 30 interleaved repeats) the specialised tiles made
 * verify steps and prefills 0.92-0.95x the time and a whole ngram@dspark generation on w4a8-head 0.98x, but a plain
 * one (one-row steps) 1.06x. */
#define INST_A8(R, NV) INST_A8G(R, NV, 4) INST_A8G(R, NV, 16) INST_A8G(R, NV, 0)
#define A8_G8S 3
#define A8_GI(G8) ((G8) == 4 ? 0 : (G8) == 16 ? 1 : 2)
/* Tile shapes: GCC keeps at most ~18 int32 sums in registers here (a 6 x 4 or 10 x 2 tile spilled and ran at
 * 70% of a 4 x 4's 3.3 G vpdpbusd/s a core, Zen 4). AVX-512: 1-2 rows x 4 vectors, 3-9 rows x 2 (a verify of
 * k = 8 in one tile; at 3-4 rows the 4 x 4 tile's sums rotate through registers and spill each step, and the
 * forward's 32 matmuls ran 4-7% slower than in 2-vector tiles, Zen 4), past 9 chunks of 8 x 2; AVX2 (16
 * registers): 4 x 2. */
#if VW == 16
#define A8_ROWS 9
#define INST_A8_4(R) INST_A8(R, 1) INST_A8(R, 2) INST_A8(R, 3) INST_A8(R, 4)
#define INST_A8_2(R) INST_A8(R, 1) INST_A8(R, 2)
#define A8_4(R, G) {a8_##R##_1_##G, a8_##R##_2_##G, a8_##R##_3_##G, a8_##R##_4_##G}
#define A8_2(R, G) {a8_##R##_1_##G, a8_##R##_2_##G, 0, 0}
#define A8_TABLE(G) {{0}, A8_4(1, G), A8_4(2, G), A8_2(3, G), A8_2(4, G), A8_2(5, G), A8_2(6, G), A8_2(7, G), \
                     A8_2(8, G), A8_2(9, G)}
INST_A8_4(1) INST_A8_4(2)
INST_A8_2(3) INST_A8_2(4) INST_A8_2(5) INST_A8_2(6) INST_A8_2(7) INST_A8_2(8) INST_A8_2(9)
static const a8tile_fn a8_table[A8_G8S][A8_ROWS + 1][NV_WIDE] = {A8_TABLE(4), A8_TABLE(16), A8_TABLE(0)};
/* rows per chunk and vectors per unit for M rows */
#define A8_MR(M) ((M) <= 4 ? 4 : (M) <= 9 ? 9 : 8)
#define A8_NV(M) ((M) <= 2 ? 4 : 2)
#else
#define A8_ROWS 4
INST_A8G(1, 1, 0) INST_A8G(1, 2, 0)
INST_A8(2, 1) INST_A8(2, 2) INST_A8(3, 1) INST_A8(3, 2) INST_A8(4, 1) INST_A8(4, 2)
#define A8_TABLE(G) {{0}, {a8_1_1_0, a8_1_2_0}, {a8_2_1_##G, a8_2_2_##G}, {a8_3_1_##G, a8_3_2_##G},               \
                     {a8_4_1_##G, a8_4_2_##G}}
static const a8tile_fn a8_table[A8_G8S][A8_ROWS + 1][NV_WIDE] = {A8_TABLE(4), A8_TABLE(16), A8_TABLE(0)};
#define A8_MR(M) 4
#define A8_NV(M) 2
#endif

/* One group of n inputs (fp32 or bf16) as int8 q, stored in the tiles' byte order: 8-input step o's bytes at
 * dst + o * step_bytes, inputs 0, 4, 1, 5, 2, 6, 3, 7 (n rounded up to 8, the rest zero). Returns s, sets *sum.
 * AVX2 over 8 inputs at a time where n allows (division and round to nearest even, as the scalar tail: the same
 * q); v: n floats of scratch. */
static float quantize_group8(const void *src, int in_bf16, int64_t n, float *v, int8_t *dst, int64_t step_bytes,
                             int32_t *sum) {
    static const int slot[8] = {0, 2, 4, 6, 1, 3, 5, 7}; /* input k of a step -> its byte */
    float amax = 0.0f;
    int64_t j = 0;
    if (n % 8 == 0) {
        __m256 mx = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (; j < n; j += 8) {
            const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)src + j));
            const __m256 x = in_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                     : _mm256_loadu_ps((const float *)src + j);
            _mm256_storeu_ps(v + j, x);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, x));
        }
        float t[8];
        _mm256_storeu_ps(t, mx);
        for (int i = 0; i < 8; i++) amax = t[i] > amax ? t[i] : amax;
    } else {
        for (; j < n; j++) {
            v[j] = in_bf16 ? bf16_value(((const uint16_t *)src)[j]) : ((const float *)src)[j];
            const float a = v[j] < 0 ? -v[j] : v[j];
            amax = a > amax ? a : amax;
        }
    }
    const float s = amax / 127.0f;
    const int64_t steps = (n + 7) / 8;
    *sum = 0;
    if (amax == 0.0f) {
        for (int64_t o = 0; o < steps; o++) memset(dst + o * step_bytes, 0, 8);
        return s;
    }
    if (n % 8 == 0) {
        const __m256 vs = _mm256_set1_ps(s), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
        __m256i acc = _mm256_setzero_si256();
        for (int64_t o = 0; o < steps; o++) {
            const __m256 t = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(v + 8 * o), vs),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256i qi = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(t, hi), lo));
            acc = _mm256_add_epi32(acc, qi);
            /* |q| <= 127, so the saturating packs are exact: bytes q0..q3 in the low lane, q4..q7 in the high */
            const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(qi, qi), _mm256_setzero_si256());
            const __m128i mixed = _mm_unpacklo_epi8(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
            _mm_storel_epi64((__m128i *)(dst + o * step_bytes), mixed); /* q0, q4, q1, q5, q2, q6, q3, q7 */
        }
        int32_t t[8];
        _mm256_storeu_si256((__m256i *)t, acc);
        for (int i = 0; i < 8; i++) *sum += t[i];
    } else {
        for (int64_t o = 0; o < steps; o++) {
            int8_t *d = dst + o * step_bytes;
            for (int k = 0; k < 8; k++) {
                int32_t qk = 0;
                if (8 * o + k < n) {
                    float t = nearbyintf(v[8 * o + k] / s);
                    t = t > 127.0f ? 127.0f : t < -127.0f ? -127.0f : t;
                    qk = (int32_t)t;
                }
                d[slot[k]] = (int8_t)qk;
                *sum += qk;
            }
        }
    }
    return s;
}

/* One (row, group) unit of x as int8 (see the W4A8 note): xq in chunks of mr rows (a chunk at m0 starts at
 * m0 * K8 * 2 int32, K8 = groups * G8 steps; inside, [group][step][row][2]), xs [M][groups] scales, xc [M][groups]
 * 8 * sum(q). v: `group` floats of scratch. */
static void quantize_unit(const void *x, int in_bf16, int64_t M, int64_t ldx, int64_t group, int64_t groups,
                          int64_t G8, int64_t mr, int64_t u, float *v, int32_t *xq, float *xs, int32_t *xc) {
    const int64_t K8 = groups * G8, m = u / groups, g = u % groups;
    const int64_t m0 = m / mr * mr, rows = M - m0 < mr ? M - m0 : mr, r = m - m0;
    const char *src = (const char *)x + ((size_t)m * ldx + (size_t)g * group) * (in_bf16 ? 2 : 4);
    int8_t *dst = (int8_t *)(xq + m0 * K8 * 2) + (g * G8 * rows + r) * 8;
    int32_t sum;
    xs[m * groups + g] = quantize_group8(src, in_bf16, group, v, dst, rows * 8, &sum);
    xc[m * groups + g] = 8 * sum;
}

/* The W4A8 matmul (vs_qlinear with act_bits 8). Returns 0 or -1 if out of memory. x is rounded to int8 and the
 * tiles run in one parallel region, the rounding's (row, group) units split over the threads and a barrier between
 * the two: at a verify step's few rows a region of its own costs more than the rounding it splits. */
static int qlinear_a8(const void *x, int in_bf16, int64_t M, int64_t ldx, const void *wp, int64_t group,
                      int64_t groups, const float *bias, int64_t N, void *y, int out_bf16, int threads) {
    const int64_t G8 = (group + 7) / 8, K8 = groups * G8, mr = A8_MR(M), nv_unit = A8_NV(M);
    int32_t *xq = malloc((size_t)(M * K8 * 2) * sizeof(int32_t)), *xc = malloc((size_t)(M * groups) * 4);
    float *xs = malloc((size_t)(M * groups) * sizeof(float));
    if (!xq || !xs || !xc) {
        free(xq), free(xs), free(xc);
        return -1;
    }
    const int64_t nvec = (N + BLOCK - 1) / BLOCK * VPB, units = (nvec + nv_unit - 1) / nv_unit;
    const int64_t bstride = groups * (G8 * 4 * BLOCK + SCALE_BYTES); /* units start on whole blocks */
    const size_t yelt = out_bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
    {
        float *v = malloc((size_t)group * sizeof(float));
        if (!v) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < M * groups; u++)
            if (v) quantize_unit(x, in_bf16, M, ldx, group, groups, G8, mr, u, v, xq, xs, xc);
        free(v); /* the loop's barrier: every unit is rounded before any tile reads it */
        int bad;
#pragma omp atomic read
        bad = failed;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (bad) continue;
            const int64_t v0 = u * nv_unit, nv = nvec - v0 < nv_unit ? nvec - v0 : nv_unit;
            const char *wb = (const char *)wp + (size_t)(v0 / VPB) * bstride + (v0 % VPB) * 32;
            for (int64_t m0 = 0; m0 < M; m0 += mr) {
                const int rows = (int)(M - m0 < mr ? M - m0 : mr);
                a8_table[A8_GI(G8)][rows][nv - 1](xq + m0 * K8 * 2, xs + m0 * groups, xc + m0 * groups, G8, groups, wb,
                                                  bstride, bias, (char *)y + (size_t)m0 * N * yelt, N, out_bf16,
                                                  v0 * VW);
            }
        }
    }
    free(xq), free(xs), free(xc);
    return failed ? -1 : 0;
}

/* x: [M, K] rows ldx elements apart, fp32 or bf16 (in_bf16); wp: packed weight (see the top) of `bits` (4, 8)
 * with `group` inputs per scale; act_bits: 16 (x as it is) or 8 (int4 weights: x rounded to int8, W4A8); bias:
 * fp32 [N] or NULL; y: contiguous [M, N], bf16 (out_bf16) or fp32. Tiles as
 * vs_linear's (gemm.c). Returns 0, -1 if out of memory, -2 for bits, group or K the layout cannot hold. */
int vs_qlinear(const void *x, int in_bf16, int64_t M, int64_t K, int64_t ldx, const void *wp, int bits,
               int64_t group, int act_bits, const float *bias, int64_t N, void *y, int out_bf16, int threads) {
    const int64_t align = bits == 4 ? 8 : 2; /* inputs per load step */
    if ((bits != 4 && bits != 8) || group <= 0 || K <= 0 || K % group || (group % align && group != K)) return -2;
    if (act_bits != 16 && !(act_bits == 8 && bits == 4)) return -2; /* int8 activations: int4 weights only */
    if (M <= 0 || N <= 0) return 0;
    if (act_bits == 8) return qlinear_a8(x, in_bf16, M, ldx, wp, group, K / group, bias, N, y, out_bf16, threads);
    const int wide = M <= MR_WIDE || M > MR_TALL;
    const int64_t nv_unit = wide ? NV_WIDE : NV_TALL, mr = wide ? MR_WIDE : MR_TALL;
    const int64_t groups = K / group, G2 = (group + align - 1) / align * align / 2, K2 = groups * G2;
#if defined(__AVX512BF16__)
    const int dp = in_bf16; /* bf16 x: vdpbf16ps on x's own bits */
#else
    const int dp = 0;
#endif
    /* x rearranged per chunk of mr rows, interleaved by pair (pad inputs zero): fp32 x[(p * rows + m) * 2 + e]
     * at chunk offset m0 * K2 * 2 floats, or (dp) bf16 pairs x[p * rows + m] at m0 * K2 */
    float *xbuf = malloc((size_t)(M * K2 * 2) * sizeof(float));
    if (!xbuf) return -1;
    /* (group, position in the group) loops rather than a division per input: the fill costs a prefill as much as
     * the tiles otherwise (G2 is only known at run time) */
    for (int64_t m0 = 0; m0 < M; m0 += mr) {
        const int64_t rows = M - m0 < mr ? M - m0 : mr;
        for (int64_t m = 0; m < rows; m++) {
            const char *src = (const char *)x + (size_t)(m0 + m) * ldx * (in_bf16 ? 2 : 4);
            for (int64_t g = 0; g < groups; g++) {
                const int64_t p0 = g * G2; /* the group's first pair */
                if (dp && 2 * G2 == group) { /* no padding: x's own bf16 pairs, as gemm.c's fill */
                    uint32_t *dst = (uint32_t *)xbuf + m0 * K2;
                    const uint16_t *s = (const uint16_t *)src + g * group;
                    for (int64_t j = 0; j < G2; j++) dst[(p0 + j) * rows + m] = s[2 * j] | (uint32_t)s[2 * j + 1] << 16;
                    continue;
                }
                for (int64_t j = 0; j < 2 * G2; j++) {
                    const int64_t p = p0 + (j >> 1), e = j & 1, kk = g * group + j;
                    const int in = j < group;
                    if (dp) {
                        uint16_t *dst = (uint16_t *)((uint32_t *)xbuf + m0 * K2);
                        dst[(p * rows + m) * 2 + e] = in ? ((const uint16_t *)src)[kk] : 0;
                    } else {
                        float v = 0.0f;
                        if (in) v = in_bf16 ? bf16_value(((const uint16_t *)src)[kk]) : ((const float *)src)[kk];
                        xbuf[m0 * K2 * 2 + (p * rows + m) * 2 + e] = v;
                    }
                }
            }
        }
    }
    const int64_t nvec = (N + BLOCK - 1) / BLOCK * VPB, units = (nvec + nv_unit - 1) / nv_unit;
    const int64_t bstride = groups * (G2 * (bits == 4 ? BLOCK : 2 * BLOCK) + SCALE_BYTES);
#if defined(__AVX512BF16__)
    if (dp && M > MR_TALL) {
        const int rc = qlinear_dpu((const uint32_t *)xbuf, M, bits, G2, groups, (const char *)wp, bstride, bias, N,
                                   y, out_bf16, threads);
        free(xbuf);
        return rc;
    }
#endif
#if VW == 8
    if (M > MR_TALL) {
        const int rc = qlinear_k16(xbuf, M, G2, groups, wp, bits, bstride, bias, N, y, out_bf16, threads);
        free(xbuf);
        return rc;
    }
#endif
    /* a unit starting at an AVX2 block's second half (tall tiles: one vector) starts hb bytes into each load of
     * its columns, and 32 into its scales (sxo more than hb) */
    const int64_t hb = bits == 4 ? 32 : 8, sxo = 32 - hb;
    const size_t yelt = out_bf16 ? 2 : 4, xunit = dp ? 1 : 2; /* 4-byte units per (row, pair) of x */
    const qtile_fn(*table)[NV_WIDE] = bits == 4 ? q4_table : q8_table;
#if defined(__AVX512BF16__)
    if (dp) table = bits == 4 ? qdp4_table : qdp8_table;
#endif
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && units > 1)
    for (int64_t u = 0; u < units; u++) {
        const int64_t v0 = u * nv_unit, nv = nvec - v0 < nv_unit ? nvec - v0 : nv_unit;
        const int64_t n0 = v0 * VW;
        const char *wb = (const char *)wp + (size_t)(v0 / VPB) * bstride + (v0 % VPB) * hb;
        for (int64_t m0 = 0; m0 < M; m0 += mr) {
            const int rows = (int)(M - m0 < mr ? M - m0 : mr);
            table[rows][nv - 1]((const uint32_t *)xbuf + m0 * K2 * xunit, G2, groups, wb, bstride, (v0 % VPB) * sxo,
                                bias, (char *)y + (size_t)m0 * N * yelt, N, out_bf16, n0);
        }
    }
    free(xbuf);
    return 0;
}
