/* One layer of a block drafter's inference forward in one call (model/block.py, _BlockLayer.forward), fp32
 * activations, for one sequence or a batch of them, each over its own context cache: the layer's dozens of small
 * torch ops cost more than its matmuls at a block's 8-17 rows, and a batch's padded, masked contexts more still.
 *
 *   in    = [ctx (n rows, already normed context features) ; rmsnorm(x) (G rows)]   (per sequence)
 *   q,k,v = in @ Wqkv^T;  q (block rows only) and k get their per-head RMSNorm, then RoPE
 *   cache rows S0 .. S0 + n + G - 1 <- k, v   (the caller commits the n context rows, not the block's)
 *   x    += o_proj(attention(q, cache rows 0 .. S0 + n + G - 1))   (every key visible: bidirectional block)
 *   x    += down(silu(gate) * up),  [gate ; up] = rmsnorm(x) @ Wgu^T
 *
 * The matmuls are gemm.c's or, for an int8/int4 drafter, qgemm.c's (weights.h), attention is attention.c's; the
 * rest is plain loops over a few rows. Returns 0, -1 out of memory, -2 bad shapes, or the first failing kernel's
 * code. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "vecmath.h"
#include "weights.h"

/* y[i] = x[i] / sqrt(mean(x^2) + eps) * w[i], as torch's RMSNorm in fp32 (up to summation order). */
static void rmsnorm(const float *x, const float *w, int64_t n, float eps, float *y) {
    const float r = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] * r) * w[i];
}

/* rmsnorm over `rows` rows of d floats: a block drafter's context and final norms, which as torch ops (about ten
 * small ones each) cost more than the norm itself. */
void vs_rmsnorm(const float *x, int64_t rows, int64_t d, const float *w, float eps, float *y) {
    for (int64_t r = 0; r < rows; r++) rmsnorm(x + r * d, w, d, eps, y + r * d);
}

/* A head's RMSNorm, then RoPE with the signed-sin table of layers.py: out = x * cos + [x2, x1] * sin. */
static void norm_rope(const float *x, const float *w, int64_t D, float eps, const float *cos, const float *sin,
                      float *out) {
    float t[512];
    rmsnorm(x, w, D, eps, t);
    const int64_t h = D / 2;
    for (int64_t i = 0; i < h; i++) {
        out[i] = t[i] * cos[i] + t[i + h] * sin[i];
        out[i + h] = t[i + h] * cos[i + h] + t[i] * sin[i + h];
    }
}

/* y [M, N] = x [M, K] (contiguous rows) @ W^T; with mm_bf16 the input is first rounded to bf16 into `bits` [M, K],
 * so bf16 and int weights take the vdpbf16ps paths (as a bf16 drafter rounds its matmul inputs). */
static int mm(const float *x, int64_t M, int64_t K, const vs_weight *w, vs_qlinear_fn qlin, int64_t N, float *y,
              int mm_bf16, uint16_t *bits, int threads) {
    if (!mm_bf16) return weight_matmul(w, qlin, x, 0, M, K, NULL, N, y, threads);
    for (int64_t i = 0; i < M * K; i++) bits[i] = bf16_bits(x[i]);
    return weight_matmul(w, qlin, bits, 1, M, K, NULL, N, y, threads);
}

/* The layer for `nseq` sequences at once, each over its own context cache: the matmuls take every sequence's rows
 * together (weights read once a layer, not once a sequence: at 8 sequences the torch path over padded, masked
 * contexts took 4.2 ms a proposal), attention runs per sequence over its own cache. Rows are back to back per
 * sequence: x [nseq * G, d]; ctx and cos/sin as the sequences' `in` rows (ns[b] context rows, then G block rows;
 * ctx holds only the context rows, sum(ns) of them). Sequence b's cache: kcs[b], vcs[b] with head stride kshs[b]
 * and row stride ksss[b], its rows written from S0s[b]. w: the layer's qkv, o_proj, gate_up and down_proj
 * weights; qlin: qgemm.c's vs_qlinear, or NULL where none is quantized. */
int vs_block_layer_batch(float *x, int64_t nseq, int64_t G, int64_t d, const float *ctx, const int64_t *ns,
                         const float *ln1, const float *ln2, const float *qn, const float *kn, float eps,
                         const vs_weight *w, vs_qlinear_fn qlin, int64_t F, int64_t H, int64_t Hkv, int64_t D,
                         const float *cos, const float *sin, float *const *kcs, float *const *vcs,
                         const int64_t *kshs, const int64_t *ksss, const int64_t *S0s, int mm_bf16, int threads) {
    if (D > 512 || D % 2 != 0 || H % Hkv != 0 || G <= 0 || nseq <= 0) return -2;
    int64_t ntot = 0;
    for (int64_t b = 0; b < nseq; b++) {
        if (ns[b] < 0) return -2;
        ntot += ns[b];
    }
    const int64_t B = nseq * G, R = ntot + B, nq = H * D, nkv = Hkv * D, nqkv = nq + 2 * nkv;
    int rc = 0;
    float *in = (float *)malloc((size_t)(R * d) * sizeof(float));
    float *qkv = (float *)malloc((size_t)(R * nqkv) * sizeof(float));
    float *q = (float *)malloc((size_t)(B * nq) * sizeof(float));
    float *att = (float *)malloc((size_t)(B * nq) * sizeof(float));
    float *h = (float *)malloc((size_t)(B * d) * sizeof(float));
    float *gu = (float *)malloc((size_t)(B * 2 * F) * sizeof(float));
    const int64_t widest = R * d > B * nq ? (R * d > B * F ? R * d : B * F) : (B * nq > B * F ? B * nq : B * F);
    uint16_t *bits = mm_bf16 ? (uint16_t *)malloc((size_t)widest * sizeof(uint16_t)) : NULL;
    if (!in || !qkv || !q || !att || !h || !gu || (mm_bf16 && !bits)) {
        rc = -1;
        goto done;
    }
    for (int64_t b = 0, r = 0, c = 0; b < nseq; b++) { /* in: each sequence's context rows, then its normed block */
        if (ns[b]) memcpy(in + r * d, ctx + c * d, (size_t)(ns[b] * d) * sizeof(float));
        r += ns[b];
        c += ns[b];
        for (int64_t g = 0; g < G; g++, r++) rmsnorm(x + (b * G + g) * d, ln1, d, eps, in + r * d);
    }
    if ((rc = mm(in, R, d, &w[0], qlin, nqkv, qkv, mm_bf16, bits, threads))) goto done;
    for (int64_t b = 0, r0 = 0; b < nseq; r0 += ns[b] + G, b++) {
        const int64_t n = ns[b], ksh = kshs[b], kss = ksss[b], S0 = S0s[b];
        float *kc = kcs[b], *vc = vcs[b];
        for (int64_t r = 0; r < n + G; r++) {
            const float *row = qkv + (r0 + r) * nqkv, *c = cos + (r0 + r) * D, *s = sin + (r0 + r) * D;
            if (r >= n)
                for (int64_t hh = 0; hh < H; hh++)
                    norm_rope(row + hh * D, qn, D, eps, c, s, q + (b * G + r - n) * nq + hh * D);
            for (int64_t hh = 0; hh < Hkv; hh++) {
                norm_rope(row + nq + hh * D, kn, D, eps, c, s, kc + hh * ksh + (S0 + r) * kss);
                memcpy(vc + hh * ksh + (S0 + r) * kss, row + nq + nkv + hh * D, (size_t)D * sizeof(float));
            }
        }
        if ((rc = vs_attention(q + b * G * nq, 1, G, H, D, G * nq, nq, D, kc, vc, Hkv, S0 + n + G, 0, ksh, kss,
                               att + b * G * nq, -1, 1.0f / sqrtf((float)D), threads)))
            goto done;
    }
    if ((rc = mm(att, B, nq, &w[1], qlin, d, h, mm_bf16, bits, threads))) goto done;
    for (int64_t i = 0; i < B * d; i++) x[i] += h[i];
    for (int64_t g = 0; g < B; g++) rmsnorm(x + g * d, ln2, d, eps, h + g * d);
    if ((rc = mm(h, B, d, &w[2], qlin, 2 * F, gu, mm_bf16, bits, threads))) goto done;
    /* silu(gate) * up into the gate half (vecmath.h, 8 lanes, as the target's layers), rows split over the threads
     * (the second one would wait for the first otherwise); then the rows packed to [B, F] */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && B >= 4)
    for (int64_t g = 0; g < B; g++) silu_mul(gu + g * 2 * F, F, 0);
    for (int64_t g = 0; g < B; g++) memmove(gu + g * F, gu + g * 2 * F, (size_t)F * sizeof(float));
    if ((rc = mm(gu, B, F, &w[3], qlin, d, h, mm_bf16, bits, threads))) goto done;
    for (int64_t i = 0; i < B * d; i++) x[i] += h[i];
done:
    free(in);
    free(qkv);
    free(q);
    free(att);
    free(h);
    free(gu);
    free(bits);
    return rc;
}
