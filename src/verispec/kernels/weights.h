/* A matmul weight as decoder.c and blocklayer.c take it: dense (gemm.c's pack, bf16 or fp32) or weight-only
 * int8/int4 (qgemm.c's pack). qgemm.c is a library of its own (native.py), so its vs_qlinear of the active
 * instruction set comes in as a pointer with each call. */
#ifndef VERISPEC_WEIGHTS_H
#define VERISPEC_WEIGHTS_H

#include <stdint.h>

int vs_linear(const void *x, int in_bf16, int64_t M, int64_t K, int64_t ldx, const void *wp, int w_bf16,
              const float *bias, int64_t N, void *y, int out_bf16, int threads);

/* qgemm.c's entry point (see vs_qlinear there) */
typedef int (*vs_qlinear_fn)(const void *x, int in_bf16, int64_t M, int64_t K, int64_t ldx, const void *wp, int bits,
                             int64_t group, int act_bits, const float *bias, int64_t N, void *y, int out_bf16,
                             int threads);

typedef struct {
    const void *data; /* packed weight: gemm.c's (bits 0) or qgemm.c's */
    int32_t bf16;     /* dense: bf16 (else fp32) weights */
    int32_t bits;     /* 0: dense; 4 or 8: int weights, `group` inputs per scale */
    int64_t group;
    int32_t act_bits; /* quantized: 16 (x as it is) or 8 (x rounded to int8 per group: W4A8) */
} vs_weight;

/* y [M, N] = x [M, K] (contiguous rows) @ w^T (+ bias), bf16 (out_bf16) or fp32, by gemm.c or (w->bits)
 * qgemm.c; -2 for a quantized weight without qlin. */
static inline int weight_matmul_to(const vs_weight *w, vs_qlinear_fn qlin, const void *x, int in_bf16, int64_t M,
                                   int64_t K, const float *bias, int64_t N, void *y, int out_bf16, int threads) {
    if (!w->bits) return vs_linear(x, in_bf16, M, K, K, w->data, w->bf16, bias, N, y, out_bf16, threads);
    if (!qlin) return -2;
    return qlin(x, in_bf16, M, K, K, w->data, w->bits, w->group, w->act_bits, bias, N, y, out_bf16, threads);
}

/* weight_matmul_to with fp32 y */
static inline int weight_matmul(const vs_weight *w, vs_qlinear_fn qlin, const void *x, int in_bf16, int64_t M,
                                int64_t K, const float *bias, int64_t N, float *y, int threads) {
    return weight_matmul_to(w, qlin, x, in_bf16, M, K, bias, N, y, 0, threads);
}

#endif
