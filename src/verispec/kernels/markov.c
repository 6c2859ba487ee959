/* DSpark's Markov head, greedy, for one request: x_j = argmax_v (U[j, v] + b_j[v]) with the transition bias
 * b_j = W1[x_{j-1}] @ W2^T and x_0 = the anchor (algorithms.md §3.1). The loop is sequential in j (each step needs
 * the token before it), so in torch it is a handful of small ops per position; here it is one call per block.
 *
 * U: [span, V] block logits, rows ldu apart; w1: [V, r] (markov_in); w2t: [r, V] (markov_out's weight,
 * transposed); all fp32. Ties go to the lowest index and a NaN wins, as torch.argmax does. Writes span tokens.
 * Returns 0, or -1 if out of memory or a token is out of range. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define CHUNK 1024 /* columns of the bias accumulated at a time: 4 KB, stays in L1 across the r passes */

int vs_markov_greedy(const float *U, int64_t span, int64_t ldu, int64_t V, const float *w1, const float *w2t,
                     int64_t r, int64_t anchor, int64_t *out) {
    float *acc = (float *)malloc(CHUNK * sizeof(float));
    if (!acc) return -1;
    int64_t prev = anchor;
    for (int64_t j = 0; j < span; j++) {
        if (prev < 0 || prev >= V) {
            free(acc);
            return -1;
        }
        const float *e = w1 + prev * r;
        const float *u = U + j * ldu;
        int64_t best = -1;
        float best_v = 0.0f;
        for (int64_t v0 = 0; v0 < V; v0 += CHUNK) {
            const int64_t n = V - v0 < CHUNK ? V - v0 : CHUNK;
            for (int64_t v = 0; v < n; v++) acc[v] = 0.0f;
            for (int64_t i = 0; i < r; i++) {
                const float ei = e[i];
                const float *w = w2t + i * V + v0;
                for (int64_t v = 0; v < n; v++) acc[v] += ei * w[v];
            }
            for (int64_t v = 0; v < n; v++) {
                const float x = u[v0 + v] + acc[v];
                if (best < 0 || x > best_v || (isnan(x) && !isnan(best_v))) {
                    best = v0 + v;
                    best_v = x;
                }
            }
        }
        out[j] = best;
        prev = best;
    }
    free(acc);
    return 0;
}
