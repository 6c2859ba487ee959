/* DSpark's Markov head, greedy, for one request: x_j = argmax_v (U[j, v] + b_j[v]) with the transition bias
 * b_j = W1[x_{j-1}] @ W2^T and x_0 = the anchor (algorithms.md §3.1). The loop is sequential in j (each step needs
 * the token before it), so in torch it is a handful of small ops per position; here it is one call per block.
 *
 * U: [span, V] block logits, rows ldu apart; w1: [V1, r] (markov_in, every token); w2t: [r, V] (markov_out's
 * weight, transposed); all fp32. `vocab` (NULL: the identity, V == V1) maps the V columns to token ids, ascending:
 * a draft vocabulary (FR-Spec) that U and w2t were cut to. Ties go to the lowest index and a NaN wins, as
 * torch.argmax does. Writes span token ids. The columns are split over `threads` (the bias is 2 MB of W2 per
 * position at V = 8192, r = 64: two cores read it twice as fast), in one parallel region for the whole block.
 * Returns 0, or -1 if out of memory or a token is out of range. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define CHUNK 1024 /* columns of the bias accumulated at a time: 4 KB, stays in L1 across the r passes */
#define MAX_THREADS 64

/* argmax of U[v] + bias[v] over v in [v0, v1), by torch.argmax's rule; *best_v gets the value. */
static int64_t argmax_range(const float *u, const float *e, const float *w2t, int64_t r, int64_t V, int64_t v0,
                            int64_t v1, float *acc, float *best_v) {
    int64_t best = -1;
    float bv = 0.0f;
    for (int64_t c0 = v0; c0 < v1; c0 += CHUNK) {
        const int64_t n = v1 - c0 < CHUNK ? v1 - c0 : CHUNK;
        for (int64_t v = 0; v < n; v++) acc[v] = 0.0f;
        for (int64_t i = 0; i < r; i++) {
            const float ei = e[i];
            const float *w = w2t + i * V + c0;
            for (int64_t v = 0; v < n; v++) acc[v] += ei * w[v];
        }
        for (int64_t v = 0; v < n; v++) {
            const float x = u[c0 + v] + acc[v];
            if (best < 0 || x > bv || (isnan(x) && !isnan(bv))) {
                best = c0 + v;
                bv = x;
            }
        }
    }
    *best_v = bv;
    return best;
}

int vs_markov_greedy(const float *U, int64_t span, int64_t ldu, int64_t V, const float *w1, int64_t V1,
                     const float *w2t, int64_t r, int64_t anchor, const int64_t *vocab, int64_t *out, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (V / threads < CHUNK) threads = 1; /* small vocabularies: not worth a fork */
    if (anchor < 0 || anchor >= V1) return -1;
    int64_t idx[MAX_THREADS];
    float val[MAX_THREADS];
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int tid = 0, nt = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        /* each thread takes one contiguous range of the columns; ranges are merged in order, so ties still go to
         * the lowest index */
        const int64_t per = (V + nt - 1) / nt, v0 = tid * per, v1 = v0 + per < V ? v0 + per : V;
        float *acc = (float *)malloc(CHUNK * sizeof(float));
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        }
        int64_t prev = anchor;
        for (int64_t j = 0; j < span; j++) {
#pragma omp barrier
            /* every thread reads `failed` and prev after the barrier, so all leave the loop together */
            int stop;
#pragma omp atomic read
            stop = failed;
            if (stop) break;
            idx[tid] = -1;
            if (v0 < v1) idx[tid] = argmax_range(U + j * ldu, w1 + prev * r, w2t, r, V, v0, v1, acc, &val[tid]);
#pragma omp barrier
            int64_t best = -1;
            float bv = 0.0f;
            for (int i = 0; i < nt; i++) { /* every thread merges the same values in the same order */
                if (idx[i] < 0) continue;
                if (best < 0 || val[i] > bv || (isnan(val[i]) && !isnan(bv))) {
                    best = idx[i];
                    bv = val[i];
                }
            }
            const int64_t token = best < 0 ? -1 : vocab ? vocab[best] : best;
            if (tid == 0) out[j] = token;
            if (token < 0 || token >= V1) {
#pragma omp atomic write
                failed = 1;
                break; /* every thread saw the same token */
            }
            prev = token;
        }
        free(acc);
    }
    return failed ? -1 : 0;
}
