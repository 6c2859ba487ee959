/* attention.c's entry points, for the kernels that call it (decoder.c, blocklayer.c). */
#ifndef VS_ATTENTION_H
#define VS_ATTENTION_H
#include <stdint.h>

int vs_attention(const float *q, int64_t B, int64_t T, int64_t H, int64_t D, int64_t qsb, int64_t qst, int64_t qsh,
                 const float *k, const float *v, int64_t Hkv, int64_t S, int64_t ksb, int64_t ksh, int64_t kss,
                 float *out, int64_t causal_from, float scale, int threads);
int vs_attention_tree(const float *q, int64_t B, int64_t T, int64_t H, int64_t D, int64_t qsb, int64_t qst,
                      int64_t qsh, const float *k, const float *v, int64_t Hkv, int64_t S, int64_t ksb, int64_t ksh,
                      int64_t kss, float *out, int64_t causal_from, const int64_t *tails, const int64_t *ntail,
                      int64_t W, float scale, int threads);

/* One sequence's share of a batched call (vs_attention_batch): its queries (q + t * qst + h * qsh), its cache's keys
 * and values (elements g * ksh + s * kss from k, the same for v: fp32, or bf16 where kv_bf16), its output rows
 * (contiguous [T, H, D]), its S keys, the first causal limit (vs_attention's causal_from) and, for a draft tree, its
 * tails (vs_attention_tree's; else NULL). */
typedef struct {
    const float *q;
    const void *k, *v;
    float *out;
    int64_t T, S, qst, qsh, ksh, kss, causal_from;
    const int64_t *tails, *ntail;
    int64_t W;
    int kv_bf16;
} vs_attn_job;

int vs_attention_batch(const vs_attn_job *jobs, int64_t njobs, int64_t H, int64_t D, int64_t Hkv, float scale,
                       int threads);
#endif
