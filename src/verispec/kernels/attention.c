/* Attention of new queries over a KV cache on CPU (decode and verify steps, prefills): fp32 sums, AVX2 + FMA (p @ V
 * and the softmax on 512-bit registers where the build has AVX-512F, each lane the same operations), and AVX-512
 * BF16's vdpbf16ps for the scores over a bf16 cache (the pair scores below).
 *
 * out[b, t, h] = softmax_s(scale * q[b, t, h] . k[b, h / G, s]) @ v[b, h / G, s], over keys s < limit(t):
 * limit(t) = causal_from + t + 1 (capped at S), or every key when causal_from < 0. G = H / Hkv query heads share a
 * key/value head (GQA). Each (b, t, h) is computed alone, in one fixed order that depends only on its own limit,
 * so a query's result does not depend on how many other queries are in the call, nor on the thread count.
 *
 * q: rows of D floats at q + b * qsb + t * qst + h * qsh; k, v: rows at b * ksb + g * ksh + s * kss (the cache's
 * [B, Hkv, S_max, D] layout; k and v share strides); out: contiguous [B, T, H, D]. D must be a multiple of 8.
 * Returns 0, -1 if out of memory, -2 for unsupported shapes.
 *
 * vs_attention_tree: query t sees keys [0, causal_from) and then the keys tails[t * W + j], j < ntail[t] (a draft
 * tree's ancestors and itself, ascending), in that order. Those extra keys are read one by one but scored, weighed
 * and summed in exactly the order a causal query would use if they sat right after the first causal_from keys, so a
 * tree node's output is bit-identical to the same query's in a chain holding its path (what a one-token step gives).
 *
 * A GQA group's queries go two at a time through the score loops (scores8x2; pair_block2 on AVX-512 BF16) and two
 * or, on AVX-512, four at a time through p @ V (pv2, pv4), each key and value row loaded once for all of them; each
 * query's sums keep their order, so grouping changes no bit.
 *
 * vs_attention_batch: many sequences' queries, each over its own cache (vs_attn_job), in one call; a cache may hold
 * bf16 keys and values (a bf16 model's are bf16 values: exact, half the bytes a step streams). Its scores are then
 * the pair scores where D is a multiple of 16 (see prep_pair_q: the same exact products, summed in vdpbf16ps's
 * order, straight off the bf16 rows on AVX-512 BF16), else the fp32 scores of its values; p @ V reads its values as
 * the fp32 values they are. So a bf16 cache gives an fp32 cache's result bit for bit only where D % 16 != 0 or
 * D > 512, and to rounding elsewhere; every other property above holds for both. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "attention.h"
#include "vecmath.h"

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Eight horizontal sums at once: lane j is ((a_j0 + a_j1) + (a_j2 + a_j3)) + ((a_j4 + a_j5) + (a_j6 + a_j7)). */
static inline __m256 hsum8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    t0 = _mm256_hadd_ps(t0, t1);
    t2 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t2, 0x20), _mm256_permute2f128_ps(t0, t2, 0x31));
}

/* One horizontal sum in hsum8's order, so a key's score is the same whether it falls in a full block of 8. */
static inline float hsum(__m256 v) {
    float x[8];
    _mm256_storeu_ps(x, v);
    return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

/* scores[j] = scale * q . k[j] for the cnt keys of one block (k: its first row, rows kss apart): all eight at once
 * when the block is full, else one by one (the last keys of the cache). */
static inline void scores8(const float *q, const float *k, int64_t kss, int64_t D, int64_t cnt, float scale,
                           float *scores) {
    if (cnt == 8) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(q + d);
            for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * kss + d), a[j]);
        }
        _mm256_storeu_ps(scores, _mm256_mul_ps(hsum8(a), _mm256_set1_ps(scale)));
        return;
    }
    for (int64_t s = 0; s < cnt; s++) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + s * kss + d), a);
        scores[s] = hsum(a) * scale;
    }
}

/* acc[0, 8 * vecs) += sum_{s in [s0, s1)} p[s] v[s, 0, 8 * vecs), in order of s; `vecs` is a constant at each call
 * site, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void pv(const int vecs, const float *p, const float *v, int64_t kss,
                                                      int64_t s0, int64_t s1, float *acc_mem) {
    __m256 acc[8];
    _Pragma("GCC unroll 8") for (int i = 0; i < vecs; i++) acc[i] = _mm256_loadu_ps(acc_mem + 8 * i);
    for (int64_t s = s0; s < s1; s++) {
        const __m256 ps = _mm256_broadcast_ss(p + s);
        _Pragma("GCC unroll 8") for (int i = 0; i < vecs; i++)
            acc[i] = _mm256_fmadd_ps(ps, _mm256_loadu_ps(v + s * kss + 8 * i), acc[i]);
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < vecs; i++) _mm256_storeu_ps(acc_mem + 8 * i, acc[i]);
}

#if defined(__AVX512F__)
/* pv on 16 lanes: lane d still sums p[s] v[s, d] in order of s, so the bits are pv's. On a Zen 5 the 512-bit loops
 * ran faster (scripts/kernel_ab.py); on a Zen 4, which splits each 512-bit FMA in two, steps timed the same. */
static inline __attribute__((always_inline)) void pv16(const int vecs, const float *p, const float *v, int64_t kss,
                                                        int64_t s0, int64_t s1, float *acc_mem) {
    __m512 acc[4];
    _Pragma("GCC unroll 4") for (int i = 0; i < vecs; i++) acc[i] = _mm512_loadu_ps(acc_mem + 16 * i);
    for (int64_t s = s0; s < s1; s++) {
        const __m512 ps = _mm512_set1_ps(p[s]);
        _Pragma("GCC unroll 4") for (int i = 0; i < vecs; i++)
            acc[i] = _mm512_fmadd_ps(ps, _mm512_loadu_ps(v + s * kss + 16 * i), acc[i]);
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < vecs; i++) _mm512_storeu_ps(acc_mem + 16 * i, acc[i]);
}
#endif

static void pv_any(int64_t D, const float *p, const float *v, int64_t kss, int64_t s0, int64_t s1, float *acc) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
#if defined(__AVX512F__)
        if ((D - d0) % 16 == 0) {
            switch ((D - d0 >= 64 ? 64 : D - d0) / 16) {
                case 1: pv16(1, p, v + d0, kss, s0, s1, acc + d0); continue;
                case 2: pv16(2, p, v + d0, kss, s0, s1, acc + d0); continue;
                case 3: pv16(3, p, v + d0, kss, s0, s1, acc + d0); continue;
                default: pv16(4, p, v + d0, kss, s0, s1, acc + d0); continue;
            }
        }
#endif
        switch ((D - d0 >= 64 ? 64 : D - d0) / 8) {
            case 1: pv(1, p, v + d0, kss, s0, s1, acc + d0); break;
            case 2: pv(2, p, v + d0, kss, s0, s1, acc + d0); break;
            case 3: pv(3, p, v + d0, kss, s0, s1, acc + d0); break;
            case 4: pv(4, p, v + d0, kss, s0, s1, acc + d0); break;
            case 5: pv(5, p, v + d0, kss, s0, s1, acc + d0); break;
            case 6: pv(6, p, v + d0, kss, s0, s1, acc + d0); break;
            case 7: pv(7, p, v + d0, kss, s0, s1, acc + d0); break;
            default: pv(8, p, v + d0, kss, s0, s1, acc + d0); break;
        }
    }
}

/* A GQA group's queries two at a time: each key and value row loaded once for both queries' FMAs. AVX-512VL's 32
 * vector registers hold 2 x 8 accumulators; AVX2's 16 hold 2 x 4. IN_REG keeps GCC from folding the shared load back
 * into both FMAs as memory operands (two loads again). */
#if defined(__AVX512VL__)
#define PAIR_KEYS 8 /* keys a paired score pass covers */
#define PAIR_DIMS 64 /* dimensions a paired p @ V pass covers */
#define IN_REG(x) __asm__("" : "+v"(x))
#else
#define PAIR_KEYS 4
#define PAIR_DIMS 32
#define IN_REG(x) __asm__("" : "+x"(x))
#endif

/* scores8 for two queries over one full block, each score summed in scores8's (hsum8's) order, so a query's result
 * does not depend on whether it was paired. */
static inline void scores8x2(const float *q0, const float *q1, const float *k, int64_t kss, int64_t D, float scale,
                             float *scores0, float *scores1) {
    for (int j0 = 0; j0 < 8; j0 += PAIR_KEYS) {
        __m256 a[PAIR_KEYS], b[PAIR_KEYS];
        for (int j = 0; j < PAIR_KEYS; j++) a[j] = b[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 qa = _mm256_loadu_ps(q0 + d), qb = _mm256_loadu_ps(q1 + d);
            for (int j = 0; j < PAIR_KEYS; j++) {
                __m256 kv = _mm256_loadu_ps(k + (j0 + j) * kss + d);
                IN_REG(kv);
                a[j] = _mm256_fmadd_ps(qa, kv, a[j]);
                b[j] = _mm256_fmadd_ps(qb, kv, b[j]);
            }
        }
#if PAIR_KEYS == 8
        _mm256_storeu_ps(scores0, _mm256_mul_ps(hsum8(a), _mm256_set1_ps(scale)));
        _mm256_storeu_ps(scores1, _mm256_mul_ps(hsum8(b), _mm256_set1_ps(scale)));
#else /* hsum8's tree for four keys: lane j of hadd(hadd(a0, a1), hadd(a2, a3)) sums key j's first four lanes, lane
       * j + 4 its last four */
        const __m256 ta = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        const __m256 tb = _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]), _mm256_hadd_ps(b[2], b[3]));
        const __m128 s = _mm_set1_ps(scale);
        const __m128 sa = _mm_add_ps(_mm256_castps256_ps128(ta), _mm256_extractf128_ps(ta, 1));
        const __m128 sb = _mm_add_ps(_mm256_castps256_ps128(tb), _mm256_extractf128_ps(tb, 1));
        _mm_storeu_ps(scores0 + j0, _mm_mul_ps(sa, s));
        _mm_storeu_ps(scores1 + j0, _mm_mul_ps(sb, s));
#endif
    }
}

#if defined(__AVX512F__)
/* pv for four queries over the same keys [s0, s1) (p: their rows sp apart, acc: theirs), each in pv's order: each
 * value row loaded once for four queries' FMAs, 4 x 4 accumulators. D must be a multiple of 64. */
static void pv4(int64_t D, const float *p, int64_t sp, const float *v, int64_t kss, int64_t s0, int64_t s1,
                float *const *acc) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        __m512 a[4][4];
        for (int q = 0; q < 4; q++)
            for (int i = 0; i < 4; i++) a[q][i] = _mm512_loadu_ps(acc[q] + d0 + 16 * i);
        for (int64_t s = s0; s < s1; s++) {
            __m512 vv[4];
            for (int i = 0; i < 4; i++) {
                vv[i] = _mm512_loadu_ps(v + s * kss + d0 + 16 * i);
                IN_REG(vv[i]);
            }
            for (int q = 0; q < 4; q++) {
                const __m512 pq = _mm512_set1_ps(p[q * sp + s]);
                for (int i = 0; i < 4; i++) a[q][i] = _mm512_fmadd_ps(pq, vv[i], a[q][i]);
            }
        }
        for (int q = 0; q < 4; q++)
            for (int i = 0; i < 4; i++) _mm512_storeu_ps(acc[q] + d0 + 16 * i, a[q][i]);
    }
}
#endif

/* pv for two queries over the same keys [s0, s1), each query's sum in pv's order. D must be a multiple of
 * PAIR_DIMS. */
static void pv2(int64_t D, const float *p0, const float *p1, const float *v, int64_t kss, int64_t s0, int64_t s1,
                float *acc0, float *acc1) {
#if defined(__AVX512F__) && PAIR_DIMS == 64 /* pv16's lanes (the same bits as eight), 2 x 4 accumulators */
    for (int64_t d0 = 0; d0 < D; d0 += PAIR_DIMS) {
        __m512 a[4], b[4];
        for (int i = 0; i < 4; i++) {
            a[i] = _mm512_loadu_ps(acc0 + d0 + 16 * i);
            b[i] = _mm512_loadu_ps(acc1 + d0 + 16 * i);
        }
        for (int64_t s = s0; s < s1; s++) {
            const __m512 pa = _mm512_set1_ps(p0[s]), pb = _mm512_set1_ps(p1[s]);
            for (int i = 0; i < 4; i++) {
                __m512 vv = _mm512_loadu_ps(v + s * kss + d0 + 16 * i);
                IN_REG(vv);
                a[i] = _mm512_fmadd_ps(pa, vv, a[i]);
                b[i] = _mm512_fmadd_ps(pb, vv, b[i]);
            }
        }
        for (int i = 0; i < 4; i++) {
            _mm512_storeu_ps(acc0 + d0 + 16 * i, a[i]);
            _mm512_storeu_ps(acc1 + d0 + 16 * i, b[i]);
        }
    }
#else
    enum { VECS = PAIR_DIMS / 8 };
    for (int64_t d0 = 0; d0 < D; d0 += PAIR_DIMS) {
        __m256 a[VECS], b[VECS];
        for (int i = 0; i < VECS; i++) {
            a[i] = _mm256_loadu_ps(acc0 + d0 + 8 * i);
            b[i] = _mm256_loadu_ps(acc1 + d0 + 8 * i);
        }
        for (int64_t s = s0; s < s1; s++) {
            const __m256 pa = _mm256_broadcast_ss(p0 + s), pb = _mm256_broadcast_ss(p1 + s);
            for (int i = 0; i < VECS; i++) {
                __m256 vv = _mm256_loadu_ps(v + s * kss + d0 + 8 * i);
                IN_REG(vv);
                a[i] = _mm256_fmadd_ps(pa, vv, a[i]);
                b[i] = _mm256_fmadd_ps(pb, vv, b[i]);
            }
        }
        for (int i = 0; i < VECS; i++) {
            _mm256_storeu_ps(acc0 + d0 + 8 * i, a[i]);
            _mm256_storeu_ps(acc1 + d0 + 8 * i, b[i]);
        }
    }
#endif
}

/* One key's score in scores8's order (its remainder loop, which equals a full block's lane). */
static inline float score1(const float *q, const float *k, int64_t D, float scale) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a);
    return hsum(a) * scale;
}

/* Scores over a bf16 cache with D a multiple of 16 (the "pair" scores): q . k summed as vdpbf16ps sums bf16 pairs
 * on 8 lanes. Lane l (0..7) of a key's sum takes, for each 16-dim chunk c in order, dim c + 2l + 1 and then dim
 * c + 2l, each product exact (q and k are bf16 values: a bf16 model's queries are rounded before attention, and a
 * query that is not is rounded here) and each sum rounded once, i.e. two FMAs; the 8 lanes then go through hsum8's
 * tree (hsum for a key alone: the same lane). AVX-512 BF16 runs it as 256-bit vdpbf16ps straight off the cache's
 * rows (no widening, half the multiply instructions), a query pair's two in one 512-bit one (pair_block2: faster
 * on a Zen 5; a Zen 4 runs it as two halves, at the same speed); the other builds widen a block of rows once into
 * "split" fp32 rows (per chunk: the pairs' 8 odd dims, then their 8 even ones; queries alike) and run the same
 * FMAs, so every build gives the same bits
 * (vdpbf16ps flushes values below 1.2e-38 to zero where an FMA keeps them: only there can builds differ, gemm.c's
 * one caveat). A query is prepared once per group() call (prep_pair_q); the loops are scores8's and scores8x2's. */
#if defined(__AVX512BF16__)
/* a query's values as bf16 bits, in order */
static inline void prep_pair_q(const float *q, int64_t D, float *out) {
    uint16_t *o = (uint16_t *)out;
    for (int64_t d = 0; d < D; d++) o[d] = bf16_bits(q[d]);
}

#define LOADBH(p) ((__m256bh)_mm256_loadu_si256((const __m256i *)(p)))

/* one key (a row of the cache) */
static inline float pair_score1(const float *qp, const void *k, int64_t D, float scale) {
    const uint16_t *q = (const uint16_t *)qp, *kr = (const uint16_t *)k;
    __m256 a = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) a = _mm256_dpbf16_ps(a, LOADBH(q + c), LOADBH(kr + c));
    return hsum(a) * scale;
}

/* hadd_ps on each 256-bit half of a and b: per 128-bit lane (a0 + a1, a2 + a3, b0 + b1, b2 + b3) */
static inline __m512 hadd16(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Two queries over one full block of 8 keys, query 0 in the low half of each register and query 1 in the high
 * half (each key row loaded once into both): every lane sums what pair_block's does, in its order, and the tree is
 * hsum8's on both halves at once. */
static inline void pair_block2(const uint16_t *q0, const uint16_t *q1, const uint16_t *k, int64_t kss, int64_t D,
                               float scale, float *scores0, float *scores1) {
    __m512 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) {
        const __m512bh x = (__m512bh)_mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(q0 + c))),
            _mm256_loadu_si256((const __m256i *)(q1 + c)), 1);
        for (int j = 0; j < 8; j++) {
            const __m256i kj = _mm256_loadu_si256((const __m256i *)(k + j * kss + c));
            a[j] = _mm512_dpbf16_ps(a[j], x, (__m512bh)_mm512_broadcast_i64x4(kj));
        }
    }
    __m512 t0 = hadd16(hadd16(a[0], a[1]), hadd16(a[2], a[3])), t2 = hadd16(hadd16(a[4], a[5]), hadd16(a[6], a[7]));
    /* 128-bit lanes: t0 = (q0 keys 0-3 lo, hi, q1 lo, hi), t2 the same for keys 4-7 */
    const __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(t0, t2, _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(t0, t2, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 r = _mm512_mul_ps(_mm512_shuffle_f32x4(sum, sum, _MM_SHUFFLE(3, 1, 2, 0)), _mm512_set1_ps(scale));
    _mm256_storeu_ps(scores0, _mm512_castps512_ps256(r));
    _mm256_storeu_ps(scores1, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1)));
}

/* NQ (1 or 2) queries over one full block of 8 keys (rows kss elements apart), each key row loaded once for all:
 * two in pair_block2, one on 8 accumulators, chunk by chunk */
static inline __attribute__((always_inline)) void pair_block(const int NQ, const float *qp0, const float *qp1,
                                                             const uint16_t *k, int64_t kss, int64_t D, float scale,
                                                             float *scores0, float *scores1) {
    const uint16_t *q0 = (const uint16_t *)qp0;
    if (NQ == 2) {
        pair_block2(q0, (const uint16_t *)qp1, k, kss, D, scale, scores0, scores1);
        return;
    }
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) {
        const __m256bh x0 = LOADBH(q0 + c);
        for (int j = 0; j < 8; j++) a[j] = _mm256_dpbf16_ps(a[j], x0, LOADBH(k + j * kss + c));
    }
    _mm256_storeu_ps(scores0, _mm256_mul_ps(hsum8(a), _mm256_set1_ps(scale)));
}

/* the block's key rows as the score loops read them: the cache's own bf16 rows */
static inline const void *pair_rows(const void *k, int64_t kss, int64_t s0, int64_t n, int64_t D, float *buf,
                                    int64_t *stride) {
    (void)n, (void)D, (void)buf;
    *stride = kss;
    return (const uint16_t *)k + s0 * kss;
}
#else
/* a query as split rows (see above), each value rounded to bf16 */
static inline void prep_pair_q(const float *q, int64_t D, float *out) {
    for (int64_t c = 0; c < D; c += 16)
        for (int64_t l = 0; l < 8; l++) {
            out[c + l] = bf16_round(q[c + 2 * l + 1]);
            out[c + 8 + l] = bf16_round(q[c + 2 * l]);
        }
}

/* bf16 rows [s0, s0 + n) widened into buf as split rows, D floats apart (exact) */
static inline const void *pair_rows(const void *k, int64_t kss, int64_t s0, int64_t n, int64_t D, float *buf,
                                    int64_t *stride) {
    const __m256i odd = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *src = (const uint16_t *)k + (s0 + r) * kss;
        float *o = buf + r * D;
        for (int64_t c = 0; c < D; c += 16) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(src + c));
            _mm256_storeu_ps(o + c, _mm256_castsi256_ps(_mm256_and_si256(x, odd)));
            _mm256_storeu_ps(o + c + 8, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
        }
    }
    *stride = D;
    return buf;
}

/* one key: its row split, then score1's loop (scores8's lane order) */
static inline float pair_score1(const float *qp, const void *k, int64_t D, float scale) {
    float row[512]; /* group() takes pair scores for D <= 512 only */
    int64_t st;
    return score1(qp, (const float *)pair_rows(k, 0, 0, 1, D, row, &st), D, scale);
}

/* NQ queries over one full block of 8 split rows: scores8's loop for one query, scores8x2's for two (each key
 * vector loaded once for both) */
static inline __attribute__((always_inline)) void pair_block(const int NQ, const float *qp0, const float *qp1,
                                                             const float *k, int64_t kss, int64_t D, float scale,
                                                             float *scores0, float *scores1) {
    if (NQ == 1)
        scores8(qp0, k, kss, D, 8, scale, scores0);
    else
        scores8x2(qp0, qp1, k, kss, D, scale, scores0, scores1);
}
#endif

#define KEY_CHUNK 32 /* keys of V (8 KB at D = 64) kept in L1 while every query of the group reads them */
/* Keys (values) prefetched PF_KEYS (KEY_CHUNK) rows ahead of the score (p @ V) loop: a step streams the cache from
 * memory once (9 queries over 609 keys, 8 layers out of cache: 1.89 -> 1.69 ms on a 2-vCPU Zen 3). A prefetch
 * never faults, so reaching past the cache's end is harmless. */
#define PF_KEYS 32
/* Queries per group() call: their score rows (QCHUNK x S floats, 96 KB at 750 keys) stay in L2 between the score,
 * softmax and p @ V passes; a prefill's hundreds of queries otherwise stream megabytes per pass (743 causal queries
 * over 743 keys, one layer: 20.6 -> 8.4 ms; a verify step's 18 queries per head fit in one chunk). */
#define QCHUNK 32

static inline void prefetch_rows(const void *rows, int64_t n, int64_t bytes) { /* n rows `bytes` apart */
    const char *c = (const char *)rows;
    for (int64_t j = 0; j < n * bytes; j += 64) _mm_prefetch(c + j, _MM_HINT_T0);
}

/* A cache's rows [s0, s0 + n) of head_dim D as fp32 rows D apart: in place for an fp32 cache (kss floats apart), or
 * from a bf16 cache (kss elements apart) widened exactly into buf (a bf16 is the top half of the fp32 it stands for),
 * once for every query of the group; the kernels above then read the same floats either way. */
static inline const float *rows_f32(const void *base, int kv16, int64_t kss, int64_t s0, int64_t n, int64_t D,
                                    float *buf, int64_t *stride) {
    if (!kv16) {
        *stride = kss;
        return (const float *)base + s0 * kss;
    }
    const uint16_t *src = (const uint16_t *)base + s0 * kss;
#if defined(__AVX512F__)
    if (D % 16 == 0) { /* the same bits, 16 at a time */
        for (int64_t r = 0; r < n; r++)
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(buf + r * D + d, _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + r * kss + d))), 16)));
        *stride = D;
        return buf;
    }
#endif
    for (int64_t r = 0; r < n; r++)
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(buf + r * D + d, _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + r * kss + d))), 16)));
    *stride = D;
    return buf;
}

/* All nq queries that share one key/value head: scores block by block of keys (each block read once from L2 for
 * every query), then each query's softmax, then p @ V chunk by chunk. n[i]: the first keys query i sees; tail
 * (NULL for none) and m: tail[i] lists m[i] more keys it sees after them; qs[i]: its vector; o[i]: its output row;
 * p: nq rows of sp floats. k, v: fp32 rows kss floats apart, or bf16 rows kss elements apart where kv16 (widened a
 * block at a time into buf, KEY_CHUNK x D floats). */
static void group(const float *const *qs, float *const *o, const int64_t *n, const int64_t *const *tail,
                  const int64_t *m, int64_t nq, const void *k, const void *v, int64_t kss, int64_t D, int64_t S,
                  float scale, float *p, int64_t sp, int kv16, float *buf, float *qp) {
    const int64_t esz = kv16 ? 2 : 4;
    const int pairs = kv16 && D % 16 == 0 && D <= 512; /* the pair scores (see prep_pair_q) */
    int64_t nmax = 0, st;
    for (int64_t i = 0; i < nq; i++) nmax = n[i] > nmax ? n[i] : nmax;
    if (pairs)
        for (int64_t i = 0; i < nq; i++) prep_pair_q(qs[i], D, qp + i * D);
    for (int64_t s0 = 0; s0 < nmax; s0 += 8) {
        prefetch_rows((const char *)k + (s0 + PF_KEYS) * kss * esz, 8, kss * esz);
        const int64_t cnt = S - s0 < 8 ? S - s0 : 8; /* a block may run past n[i]: those scores are never read */
        if (pairs) {
            const void *kb = cnt == 8 ? pair_rows(k, kss, s0, cnt, D, buf, &st) : NULL; /* a partial one: key by key */
            for (int64_t i = 0; i < nq; i++) {
                if (n[i] <= s0) continue;
                float *pi = p + i * sp + s0;
                if (cnt < 8) { /* the cache's last keys, one by one */
                    for (int64_t j = 0; j < cnt; j++)
                        pi[j] = pair_score1(qp + i * D, (const uint16_t *)k + (s0 + j) * kss, D, scale);
                } else if (i + 1 < nq && n[i + 1] > s0) {
                    pair_block(2, qp + i * D, qp + (i + 1) * D, kb, st, D, scale, pi, pi + sp);
                    i++;
                } else {
                    pair_block(1, qp + i * D, NULL, kb, st, D, scale, pi, NULL);
                }
            }
            continue;
        }
        const float *kb = rows_f32(k, kv16, kss, s0, cnt, D, buf, &st);
        for (int64_t i = 0; i < nq; i++) {
            if (n[i] <= s0) continue;
            if (cnt == 8 && i + 1 < nq && n[i + 1] > s0) {
                scores8x2(qs[i], qs[i + 1], kb, st, D, scale, p + i * sp + s0, p + (i + 1) * sp + s0);
                i++;
                continue;
            }
            scores8(qs[i], kb, st, D, cnt, scale, p + i * sp + s0);
        }
    }
    if (tail) /* after the blocks, which may have written past n[i] */
        for (int64_t i = 0; i < nq; i++)
            for (int64_t j = 0; j < m[i]; j++)
                p[i * sp + n[i] + j] =
                    pairs ? pair_score1(qp + i * D, (const uint16_t *)k + tail[i][j] * kss, D, scale)
                          : score1(qs[i], rows_f32(k, kv16, kss, tail[i][j], 1, D, buf, &st), D, scale);
    for (int64_t i = 0; i < nq; i++) {
        float *pi = p + i * sp;
        const int64_t ni = n[i] + (tail ? m[i] : 0), n8 = (ni + 7) & ~(int64_t)7;
        __m256 mv = _mm256_set1_ps(-INFINITY);
        int64_t s = 0;
        for (; s + 8 <= ni; s += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(pi + s));
        float m = hmax(mv);
        for (; s < ni; s++) m = pi[s] > m ? pi[s] : m;
        for (s = ni; s < n8; s++) pi[s] = -INFINITY;
        mv = _mm256_set1_ps(m);
        __m256 lsum = _mm256_setzero_ps();
        s = 0;
#if defined(__AVX512F__) /* 16 scores at a time, summed into lsum eight by eight in the same order */
        for (; s + 16 <= n8; s += 16) {
            __m512 e = exp16_ps(_mm512_sub_ps(_mm512_loadu_ps(pi + s), _mm512_set1_ps(m)));
            if (s + 16 > ni) /* lanes past n contribute nothing */
                e = _mm512_maskz_mov_ps((__mmask16)((1u << (ni - s)) - 1), e);
            _mm512_storeu_ps(pi + s, e);
            lsum = _mm256_add_ps(lsum, _mm512_castps512_ps256(e));
            lsum = _mm256_add_ps(lsum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
        }
#endif
        for (; s < n8; s += 8) {
            __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(pi + s), mv));
            if (s + 8 > ni) { /* lanes past n contribute nothing */
                const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(ni - s)), lane)));
            }
            _mm256_storeu_ps(pi + s, e);
            lsum = _mm256_add_ps(lsum, e);
        }
        const float inv = 1.0f / hsum(lsum);
        s = 0;
#if defined(__AVX512F__)
        for (; s + 16 <= ni; s += 16)
            _mm512_storeu_ps(pi + s, _mm512_mul_ps(_mm512_loadu_ps(pi + s), _mm512_set1_ps(inv)));
#endif
        for (; s < ni; s++) pi[s] *= inv; /* normalised weights: p @ V is then the output itself */
        for (int64_t d = 0; d < D; d++) o[i][d] = 0.0f;
    }
    for (int64_t s0 = 0; s0 < nmax; s0 += KEY_CHUNK) {
        prefetch_rows((const char *)v + (s0 + KEY_CHUNK) * kss * esz, KEY_CHUNK, kss * esz);
        const int64_t s1 = nmax < s0 + KEY_CHUNK ? nmax : s0 + KEY_CHUNK;
        const float *vb = rows_f32(v, kv16, kss, s0, s1 - s0, D, buf, &st);
        for (int64_t i = 0; i < nq; i++) {
            if (n[i] <= s0) continue;
            const int64_t e = (n[i] < s1 ? n[i] : s1) - s0;
#if defined(__AVX512F__)
            if (D % 64 == 0 && i + 3 < nq && n[i + 3] > s0) { /* four queries: the keys all four see first */
                int64_t all = e, eq;
                for (int q = 1; q < 4; q++) all = (eq = (n[i + q] < s1 ? n[i + q] : s1) - s0) < all ? eq : all;
                all = all > 0 ? all : 0; /* a query in between may see none of this chunk */
                pv4(D, p + i * sp + s0, sp, vb, st, 0, all, o + i);
                for (int q = 0; q < 4; q++) {
                    eq = (n[i + q] < s1 ? n[i + q] : s1) - s0;
                    if (eq > all) pv_any(D, p + (i + q) * sp + s0, vb, st, all, eq, o[i + q]);
                }
                i += 3;
                continue;
            }
#endif
            if (D % PAIR_DIMS == 0 && i + 1 < nq && n[i + 1] > s0) { /* the keys both see together, then the rest */
                const int64_t e1 = (n[i + 1] < s1 ? n[i + 1] : s1) - s0, both = e < e1 ? e : e1;
                pv2(D, p + i * sp + s0, p + (i + 1) * sp + s0, vb, st, 0, both, o[i], o[i + 1]);
                if (e > both) pv_any(D, p + i * sp + s0, vb, st, both, e, o[i]);
                if (e1 > both) pv_any(D, p + (i + 1) * sp + s0, vb, st, both, e1, o[i + 1]);
                i++;
                continue;
            }
            pv_any(D, p + i * sp + s0, vb, st, 0, e, o[i]);
        }
    }
    if (tail) /* the same accumulation, continued key by key */
        for (int64_t i = 0; i < nq; i++)
            for (int64_t j = 0; j < m[i]; j++)
                pv_any(D, p + i * sp + n[i] + j, rows_f32(v, kv16, kss, tail[i][j], 1, D, buf, &st), D, 0, 1,
                       o[i]); /* one row: the stride is never read (st as an argument was read unsequenced) */
}

/* Every job's (job, kv head) units in one parallel region: a step over many requests forks once per layer, not once
 * per request (64 one-token requests over 16 cached positions: 512 forks a step; one region: 15.6-16.0 -> 14.5 ms a
 * forward on a 2-vCPU Zen 4, scripts/packed_step_cost.py). Units are
 * handed out one at a time, so a prefill's long unit does not hold back the decode rows placed after it; each
 * query is computed alone whichever thread takes it, so results do not depend on the schedule. */
int vs_attention_batch(const vs_attn_job *jobs, int64_t njobs, int64_t H, int64_t D, int64_t Hkv, float scale,
                       int threads) {
    if (D % 8 != 0 || Hkv <= 0 || H % Hkv != 0 || njobs < 0) return -2;
    const int64_t G = H / Hkv, units = njobs * Hkv;
    int64_t nq_max = 1, sp = 8;
    for (int64_t b = 0; b < njobs; b++) {
        const vs_attn_job *J = jobs + b;
        if (J->T < 0 || J->S < 0) return -2;
        if (J->tails) { /* every listed key inside the cache, before anything is read */
            if (J->causal_from < 0 || J->causal_from > J->S || J->W < 0 || !J->ntail) return -2;
            for (int64_t t = 0; t < J->T; t++) {
                if (J->ntail[t] < 0 || J->ntail[t] > J->W) return -2;
                for (int64_t j = 0; j < J->ntail[t]; j++)
                    if (J->tails[t * J->W + j] < 0 || J->tails[t * J->W + j] >= J->S) return -2;
            }
        }
        if (G * J->T > nq_max) nq_max = G * J->T;
        if (((J->S + 7) & ~(int64_t)7) > sp) sp = (J->S + 7) & ~(int64_t)7;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
    {
        float *p = (float *)malloc((size_t)((nq_max < QCHUNK ? nq_max : QCHUNK) * sp) * sizeof(float));
        const float **qs = (const float **)malloc((size_t)nq_max * sizeof(float *));
        float **o = (float **)malloc((size_t)nq_max * sizeof(float *));
        int64_t *n = (int64_t *)malloc((size_t)nq_max * sizeof(int64_t));
        const int64_t **tl = (const int64_t **)malloc((size_t)nq_max * sizeof(int64_t *));
        int64_t *m = (int64_t *)malloc((size_t)nq_max * sizeof(int64_t));
        float *buf = (float *)malloc((size_t)(KEY_CHUNK * D) * sizeof(float)); /* a bf16 block widened */
        float *qp = (float *)malloc((size_t)(QCHUNK * D) * sizeof(float)); /* a chunk's queries for pair scores */
        const int ok = p && qs && o && n && tl && m && buf && qp;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++) {
            if (!ok) continue;
            const vs_attn_job *J = jobs + u / Hkv;
            const int64_t g = u % Hkv, S = J->S;
            int64_t live = 0;
            for (int64_t t = 0; t < J->T; t++) {
                int64_t nt = J->tails ? J->causal_from : J->causal_from < 0 ? S : J->causal_from + t + 1;
                nt = nt > S ? S : nt;
                const int64_t mt = J->tails ? J->ntail[t] : 0;
                for (int64_t j = 0; j < G; j++) {
                    const int64_t h = g * G + j;
                    float *oi = J->out + (t * H + h) * D;
                    if (nt + mt <= 0) { /* no key visible: zeros, where softmax over nothing is undefined */
                        for (int64_t d = 0; d < D; d++) oi[d] = 0.0f;
                        continue;
                    }
                    qs[live] = J->q + t * J->qst + h * J->qsh;
                    o[live] = oi;
                    tl[live] = J->tails ? J->tails + t * J->W : NULL;
                    m[live] = mt;
                    n[live++] = nt;
                }
            }
            const int64_t head = g * J->ksh * (J->kv_bf16 ? 2 : 4); /* bytes to this kv head's rows */
            for (int64_t c = 0; c < live; c += QCHUNK) /* a prefill's queries a chunk at a time: p stays in L2 */
                group(qs + c, o + c, n + c, J->tails ? tl + c : NULL, J->tails ? m + c : NULL,
                      live - c < QCHUNK ? live - c : QCHUNK, (const char *)J->k + head, (const char *)J->v + head,
                      J->kss, D, S, scale, p, sp, J->kv_bf16, buf, qp);
        }
        free(p);
        free(qs);
        free(o);
        free(n);
        free(tl);
        free(m);
        free(buf);
        free(qp);
    }
    return failed ? -1 : 0;
}

/* B batch entries as B jobs of one batched call. */
static int attend(const float *q, int64_t B, int64_t T, int64_t H, int64_t D, int64_t qsb, int64_t qst, int64_t qsh,
                  const float *k, const float *v, int64_t Hkv, int64_t S, int64_t ksb, int64_t ksh, int64_t kss,
                  float *out, int64_t causal_from, const int64_t *tails, const int64_t *ntail, int64_t W,
                  float scale, int threads) {
    if (B < 0) return -2;
    vs_attn_job *jobs = (vs_attn_job *)malloc((size_t)(B > 0 ? B : 1) * sizeof(vs_attn_job));
    if (!jobs) return -1;
    for (int64_t b = 0; b < B; b++)
        jobs[b] = (vs_attn_job){q + b * qsb, k + b * ksb, v + b * ksb, out + b * T * H * D, T, S, qst, qsh, ksh, kss,
                                causal_from, tails, ntail, W, 0};
    const int rc = vs_attention_batch(jobs, B, H, D, Hkv, scale, threads);
    free(jobs);
    return rc;
}

int vs_attention(const float *q, int64_t B, int64_t T, int64_t H, int64_t D, int64_t qsb, int64_t qst, int64_t qsh,
                 const float *k, const float *v, int64_t Hkv, int64_t S, int64_t ksb, int64_t ksh, int64_t kss,
                 float *out, int64_t causal_from, float scale, int threads) {
    return attend(q, B, T, H, D, qsb, qst, qsh, k, v, Hkv, S, ksb, ksh, kss, out, causal_from, NULL, NULL, 0,
                  scale, threads);
}

/* tails [T, W]: row t's extra keys in its first ntail[t] <= W entries */
int vs_attention_tree(const float *q, int64_t B, int64_t T, int64_t H, int64_t D, int64_t qsb, int64_t qst,
                      int64_t qsh, const float *k, const float *v, int64_t Hkv, int64_t S, int64_t ksb, int64_t ksh,
                      int64_t kss, float *out, int64_t causal_from, const int64_t *tails, const int64_t *ntail,
                      int64_t W, float scale, int threads) {
    if (!tails || !ntail) return -2;
    return attend(q, B, T, H, D, qsb, qst, qsh, k, v, Hkv, S, ksb, ksh, kss, out, causal_from, tails, ntail, W,
                  scale, threads);
}
