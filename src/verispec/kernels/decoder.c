/* The target's whole forward in one call (model/transformer.py, model/layers.py): embedding, every decoder layer
 * (RMSNorm, fused q/k/v, optional q/k RMSNorm, RoPE, the KV-cache write, attention, o_proj, residual, RMSNorm,
 * fused gate/up, SiLU, down, residual), the final norm and the LM head for the rows that need logits. At a decode
 * or verify step's few rows, the dozens of small torch ops per layer cost more than the matmuls; here they are
 * loops over a few rows between the matmuls (gemm.c) and attention (attention.c).
 *
 * A layer's four matmuls may each be dense (gemm.c's packs) or weight-only int8/int4 (qgemm.c's packs, bits and
 * group per weight). qgemm.c is a library of its own (native.py), so its vs_qlinear of the active instruction set
 * comes in as a pointer with each call; a quantized matmul is that one call, with the per-layer path's arguments
 * (x as the activations or their bf16 bits, fp32 out, then the same rounding), so it gives what QuantLinear gives.
 *
 * Numerics follow the torch path: with act_bf16 every value the torch path holds in bf16 is rounded to bf16 (to
 * nearest even) at the same point (after each matmul, norm, RoPE product and sum, SiLU, product and residual
 * add), attention is fp32 (over an fp32 cache, or a bf16 one holding the same bf16 values: vs_seq.kv_bf16, whose
 * scores attention.c sums in vdpbf16ps's order where the head dim is a multiple of 16), and matmuls accumulate in
 * fp32. Only summation orders inside a norm or a score and the exp of SiLU differ from torch's, so the two paths
 * agree to rounding. Every row is computed alone in one
 * fixed order, whatever else is in the call: a verify step gives each token exactly what one-token steps give.
 *
 * The rows of a call are sequences back to back (vs_seq): sequence i's rows sit after its own cache's `cached`
 * entries, at positions first .. first + rows - 1 (first = cached unless the cache dropped rows: a compressed
 * cache keeps its kept keys' positions, so its next position runs ahead of its row count), and attend causally to
 * that cache only. A draft tree's sequence gives its rows' positions and, per row, the rows it sees (its
 * ancestors and itself) instead: each row sees the first `seen` cached entries and those rows, in the order a
 * chain holding its path would (attention.c's vs_attention_tree), so a node gives what a one-token step at its path
 * gives. A target's tree sees every cached entry (seen = cached); a drafter growing a tree level by level keeps the
 * earlier levels in its cache and lists a node's ancestors among them. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "vecmath.h"
#include "weights.h"

/* Built with -DVS_PHASES (scripts/step_phases.py only): a forward adds its wall seconds per phase to vs_phases,
 * read through vs_phase_times(); each PHASE_END(ph) charges the time since the last mark to ph. The library the
 * package builds has none of it. */
#ifdef VS_PHASES
#include <time.h>
enum { PH_MATMUL, PH_ATTENTION, PH_HEAD, PH_SILU, PH_NORMS, PH_OTHER, PH_TOTAL, PHASES };
static double vs_phases[PHASES];
double *vs_phase_times(void) { return vs_phases; }
static inline double phase_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
#define PHASE_START double phase_t0_ = phase_now(), phase_first_ = phase_t0_
#define PHASE_END(ph)                                                                                                \
    do {                                                                                                             \
        const double t_ = phase_now();                                                                               \
        vs_phases[ph] += t_ - phase_t0_;                                                                             \
        phase_t0_ = t_;                                                                                              \
    } while (0)
#define PHASE_TOTAL vs_phases[PH_TOTAL] += phase_now() - phase_first_
#else
#define PHASE_START
#define PHASE_END(ph)
#define PHASE_TOTAL
#endif

typedef struct {
    vs_weight qkv, o, gate_up, down;
    const float *qkv_bias, *o_bias;       /* pad_bias()ed, or NULL */
    const float *ln1, *ln2, *q_norm, *k_norm; /* fp32 norm weights [d] and [D]; q/k norms NULL without them */
} vs_layer;

typedef struct {
    int64_t layers, d, heads, kv_heads, head_dim, ffn, vocab, max_pos;
    float eps;
    int32_t act_bf16;                /* bf16 model: round activations as the torch path does */
    const void *embed;               /* [vocab, d], bf16 bits (embed_bf16) or fp32 */
    int32_t embed_bf16;
    const float *final_norm;         /* [d] */
    vs_weight lm_head;               /* [head_rows, d]: dense, or int8/int4 (a quantized target's head) */
    int64_t head_rows;               /* logits per row: vocab for a target, a draft vocabulary's size for a drafter */
    const float *cos, *sin;          /* [max_pos, head_dim] fp32, sin signed as in layers.RotaryEmbedding */
    const vs_layer *layer;           /* [layers] */
    /* a feature drafter's input stage (model/feature.py; w_in.data NULL for a target): row r's input is
     * w_in [enorm(E[token_r]) ; fnorm(feat_r)] instead of E[token_r] */
    const float *enorm, *fnorm;      /* [d] */
    vs_weight w_in;                  /* [d, 2 d] */
} vs_model;

typedef struct {
    int64_t rows, cached;            /* new tokens; committed cache entries before them */
    int64_t first;                   /* the first new token's RoPE position (>= cached) */
    void *k, *v;                     /* layer 0, kv head 0, position 0 of this sequence's cache */
    int64_t layer_stride, head_stride, capacity; /* in elements; positions are head_dim elements apart */
    /* a draft tree's rows (all NULL for causal rows): positions [rows]; row t sees the first `seen` cache entries
     * (<= cached), then tails[t * tail_stride + j] for j < ntail[t] <= tail_stride, ascending cache rows in [seen,
     * cached + rows): its ancestors', whether written in this call or an earlier one, and its own last */
    const int64_t *pos, *tails, *ntail;
    int64_t seen, tail_stride;
    int64_t kv_bf16;                 /* the cache holds bf16 (a bf16 model's keys and values are bf16 values) */
} vs_seq;


/* y = act(w * act(x / sqrt(mean(x^2) + eps))), as layers.RMSNorm (fp32 normalisation, cast, then the weight). */
static void rmsnorm(const float *x, const float *w, int64_t n, float eps, int bf16, float *y) {
    const float r = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    const __m256 rv = _mm256_set1_ps(r);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, act8(bf16, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                                         act8(bf16, _mm256_mul_ps(_mm256_loadu_ps(x + i), rv)))));
    for (; i < n; i++) y[i] = act(bf16, w[i] * act(bf16, x[i] * r));
}

/* x[i] = act(x[i] + act(h[i])): a residual add as the torch path rounds it. */
static void residual(float *x, const float *h, int64_t n, int bf16) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, act8(bf16, _mm256_add_ps(_mm256_loadu_ps(x + i), act8(bf16, _mm256_loadu_ps(h + i)))));
    for (; i < n; i++) x[i] = act(bf16, x[i] + act(bf16, h[i]));
}

/* RoPE on one head in place: x * cos + [x2, x1] * sin, each product and the sum rounded as the torch path. */
static void rope(float *x, const float *cos, const float *sin, int64_t D, int bf16) {
    const int64_t h = D / 2;
    int64_t i = 0;
    for (; i + 8 <= h; i += 8) { /* the scalar tail's operations, 8 lanes at a time: the same values */
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + h);
        const __m256 c0 = act8(bf16, _mm256_loadu_ps(cos + i)), s0 = act8(bf16, _mm256_loadu_ps(sin + i));
        const __m256 c1 = act8(bf16, _mm256_loadu_ps(cos + i + h)), s1 = act8(bf16, _mm256_loadu_ps(sin + i + h));
        _mm256_storeu_ps(x + i, act8(bf16, _mm256_add_ps(act8(bf16, _mm256_mul_ps(a, c0)),
                                                         act8(bf16, _mm256_mul_ps(b, s0)))));
        _mm256_storeu_ps(x + i + h, act8(bf16, _mm256_add_ps(act8(bf16, _mm256_mul_ps(b, c1)),
                                                             act8(bf16, _mm256_mul_ps(a, s1)))));
    }
    for (; i < h; i++) {
        const float a = x[i], b = x[i + h];
        x[i] = act(bf16, act(bf16, a * act(bf16, cos[i])) + act(bf16, b * act(bf16, sin[i])));
        x[i + h] = act(bf16, act(bf16, b * act(bf16, cos[i + h])) + act(bf16, a * act(bf16, sin[i + h])));
    }
}


static void round_all(float *x, int64_t n, int bf16) {
    if (!bf16) return;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, bf16_round_ps(_mm256_loadu_ps(x + i)));
    for (; i < n; i++) x[i] = bf16_round(x[i]);
}

/* x [n] (bf16 values when bf16) into out in the activation dtype: fp32, or the bf16 bits (exact). */
static void store_act(const float *x, int64_t n, int bf16, void *out) {
    if (!bf16) {
        memcpy(out, x, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *o = (uint16_t *)out;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        o[i] = (uint16_t)(u >> 16);
    }
}

/* The matmul input: the activations themselves, or their bf16 bits in `bits` so that the BF16 kernels take them. */
static const void *mm_input(const float *x, int64_t n, int bf16, uint16_t *bits) {
    if (!bf16) return x;
    store_act(x, n, 1, bits);
    return bits;
}

/* tokens: [N] ids (checked by the caller); feats: [N, d] fp32 features where the model has an input stage, else
 * NULL; seqs: nseq sequences whose rows sum to N; hidden: layers + 1 pointers, each NULL or an [N, d] output in the
 * activation dtype (0: the embedding or the input stage's output, l: decoder layer l's output); logit_rows:
 * [n_logits] rows whose final-norm LM-head logits go to logits [n_logits, head_rows] in the activation dtype.
 * Returns 0, -1 out of memory, -2 bad shapes, -3 a token id out of range, -4 a logit row out of range (both checked
 * before anything is written), or the first failing kernel's code. qlin: qgemm.c's vs_qlinear, or NULL where
 * no weight is quantized. */
int vs_decoder_forward(const vs_model *m, const int64_t *tokens, const float *feats, int64_t N, const vs_seq *seqs,
                       int64_t nseq,
                       void *const *hidden, const int64_t *logit_rows, int64_t n_logits, void *logits, int threads,
                       vs_qlinear_fn qlin) {
    const int64_t d = m->d, H = m->heads, Hkv = m->kv_heads, D = m->head_dim, F = m->ffn;
    const int64_t nq = H * D, nkv = Hkv * D, nqkv = nq + 2 * nkv;
    const int bf16 = m->act_bf16;
    const int staged = m->w_in.data != NULL;
    PHASE_START;
    if (N <= 0 || D % 8 != 0 || D > 256 || Hkv <= 0 || H % Hkv != 0 || staged != (feats != NULL)) return -2;
    int64_t total = 0;
    for (int64_t s = 0; s < nseq; s++) {
        if (seqs[s].rows < 0 || seqs[s].cached < 0 || seqs[s].cached + seqs[s].rows > seqs[s].capacity ||
            seqs[s].first < seqs[s].cached || seqs[s].first + seqs[s].rows > m->max_pos ||
            (seqs[s].pos == NULL) != (seqs[s].tails == NULL) || (seqs[s].tails == NULL) != (seqs[s].ntail == NULL))
            return -2;
        if (seqs[s].kv_bf16 && !bf16) return -2; /* an fp32 model's keys would be rounded */
        if (seqs[s].pos && (seqs[s].seen < 0 || seqs[s].seen > seqs[s].cached || seqs[s].tail_stride < 0)) return -2;
        for (int64_t t = 0; seqs[s].pos && t < seqs[s].rows; t++) {
            const vs_seq *S = seqs + s;
            const int64_t *tl = S->tails + t * S->tail_stride;
            if (S->pos[t] < 0 || S->pos[t] >= m->max_pos || S->ntail[t] < 0 || S->ntail[t] > S->tail_stride)
                return -2;
            for (int64_t j = 0; j < S->ntail[t]; j++)
                if (tl[j] < S->seen || tl[j] >= S->cached + S->rows) return -2;
        }
        total += seqs[s].rows;
    }
    if (total != N) return -2;
    for (int64_t r = 0; r < N; r++)
        if (tokens[r] < 0 || tokens[r] >= m->vocab) return -3;
    for (int64_t i = 0; i < n_logits; i++)
        if (logit_rows[i] < 0 || logit_rows[i] >= N) return -4;
    int64_t widest = nqkv > 2 * F ? nqkv : 2 * F;
    if (widest < 2 * d) widest = 2 * d; /* the input stage's [enorm(e) ; fnorm(f)] */
    float *x = (float *)malloc((size_t)(N * d) * sizeof(float));
    float *h = (float *)malloc((size_t)(N * (d > nq ? d : nq)) * sizeof(float));
    float *big = (float *)malloc((size_t)(N * widest) * sizeof(float)); /* qkv, then gate/up */
    float *q = (float *)malloc((size_t)(N * nq) * sizeof(float));
    float *att = (float *)malloc((size_t)(N * nq) * sizeof(float));
    int64_t in_widest = F > nq ? F : nq; /* the widest matmul input: gate/up's, attention's or the input stage's */
    if (in_widest < 2 * d) in_widest = 2 * d;
    uint16_t *bits = (uint16_t *)malloc((size_t)(N * in_widest) * 2);
    float *cs = (float *)malloc((size_t)(2 * N * D) * sizeof(float)); /* each row's cos, sin */
    int64_t *row_seq = (int64_t *)malloc((size_t)N * sizeof(int64_t)); /* each row's sequence */
    int64_t *row0 = (int64_t *)malloc((size_t)(nseq > 0 ? nseq : 1) * sizeof(int64_t)); /* its first row */
    vs_attn_job *jobs = (vs_attn_job *)malloc((size_t)(nseq > 0 ? nseq : 1) * sizeof(vs_attn_job));
    int rc = 0;
    if (!x || !h || !big || !q || !att || !bits || !cs || !row_seq || !row0 || !jobs) {
        rc = -1;
        goto done;
    }
    for (int64_t r = 0; r < N; r++) {
        const int64_t t = tokens[r];
        if (m->embed_bf16) {
            const uint16_t *e = (const uint16_t *)m->embed + t * d;
            for (int64_t i = 0; i < d; i++) x[r * d + i] = bf16_value(e[i]);
        } else {
            memcpy(x + r * d, (const float *)m->embed + t * d, (size_t)d * sizeof(float));
        }
        if (!m->embed_bf16 && bf16) round_all(x + r * d, d, 1); /* the torch path's cast to the model's dtype */
    }
    if (staged) { /* x = w_in [enorm(x) ; fnorm(feats)], as FeatureDraftModel.inputs */
        for (int64_t r = 0; r < N; r++) {
            rmsnorm(x + r * d, m->enorm, d, m->eps, bf16, big + r * 2 * d);
            for (int64_t i = 0; i < d; i++) h[i] = act(bf16, feats[r * d + i]);
            rmsnorm(h, m->fnorm, d, m->eps, bf16, big + r * 2 * d + d);
        }
        if ((rc = weight_matmul(&m->w_in, qlin, mm_input(big, N * 2 * d, bf16, bits), bf16, N, 2 * d, NULL, d, x,
                                threads)))
            goto done;
        round_all(x, N * d, bf16);
    }
    for (int64_t s = 0, r = 0; s < nseq; r += seqs[s].rows, s++) {
        row0[s] = r;
        for (int64_t t = 0; t < seqs[s].rows; t++) row_seq[r + t] = s;
    }
    for (int64_t s = 0, r = 0; s < nseq; r += seqs[s].rows, s++)
        for (int64_t t = 0; t < seqs[s].rows; t++) {
            const int64_t at = seqs[s].pos ? seqs[s].pos[t] : seqs[s].first + t;
            memcpy(cs + (r + t) * 2 * D, m->cos + at * D, (size_t)D * sizeof(float));
            memcpy(cs + (r + t) * 2 * D + D, m->sin + at * D, (size_t)D * sizeof(float));
        }
    if (hidden && hidden[0]) store_act(x, N * d, bf16, hidden[0]);
    PHASE_END(PH_OTHER); /* checks, embedding, RoPE tables */
    const int par = N > 32 && threads > 1; /* a prefill's elementwise work is worth the second core */
    const int par_silu = N >= 4 && threads > 1; /* SiLU's exp and division pay for a fork from a few rows */
    for (int64_t l = 0; l < m->layers; l++) {
        const vs_layer *L = m->layer + l;
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
        for (int64_t r = 0; r < N; r++) rmsnorm(x + r * d, L->ln1, d, m->eps, bf16, h + r * d);
        PHASE_END(PH_NORMS);
        if ((rc = weight_matmul(&L->qkv, qlin, mm_input(h, N * d, bf16, bits), bf16, N, d, L->qkv_bias, nqkv, big,
                                threads)))
            goto done;
        PHASE_END(PH_MATMUL);
        round_all(big, N * nqkv, bf16);
        /* RoPE and the cache write, every sequence's rows in one loop */
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
        for (int64_t r = 0; r < N; r++) {
            const vs_seq *S = seqs + row_seq[r];
            const int64_t t = r - row0[row_seq[r]];
            const int64_t esz = S->kv_bf16 ? 2 : 4;
            char *kc = (char *)S->k + l * S->layer_stride * esz, *vc = (char *)S->v + l * S->layer_stride * esz;
            float *row = big + r * nqkv;
            const float *c = cs + r * 2 * D, *sn = c + D;
            for (int64_t hh = 0; hh < H + Hkv; hh++) { /* queries, then keys */
                float *v = row + hh * D;
                const float *w = hh < H ? L->q_norm : L->k_norm;
                if (w) rmsnorm(v, w, D, m->eps, bf16, v);
                rope(v, c, sn, D, bf16);
            }
            memcpy(q + r * nq, row, (size_t)nq * sizeof(float));
            for (int64_t g = 0; g < Hkv; g++) {
                const int64_t at = (g * S->head_stride + (S->cached + t) * D) * esz; /* bytes */
                store_act(row + nq + g * D, D, (int)S->kv_bf16, kc + at); /* bf16 values: exact either way */
                store_act(row + nq + nkv + g * D, D, (int)S->kv_bf16, vc + at);
            }
        }
        /* attention: one call (one parallel region) over every sequence's rows */
        for (int64_t s = 0; s < nseq; s++) {
            const vs_seq *S = seqs + s;
            const int64_t r0 = row0[s];
            const int64_t layer = l * S->layer_stride * (S->kv_bf16 ? 2 : 4); /* bytes */
            jobs[s] = (vs_attn_job){q + r0 * nq, (const char *)S->k + layer, (const char *)S->v + layer,
                                    att + r0 * nq, S->rows, S->cached + S->rows, nq, D, S->head_stride, D,
                                    S->tails ? S->seen : S->cached, S->tails, S->ntail, S->tail_stride,
                                    (int)S->kv_bf16};
        }
        PHASE_END(PH_OTHER); /* rounding, RoPE, the cache write */
        if ((rc = vs_attention_batch(jobs, nseq, H, D, Hkv, 1.0f / sqrtf((float)D), threads))) goto done;
        PHASE_END(PH_ATTENTION);
        round_all(att, N * nq, bf16);
        PHASE_END(PH_OTHER);
        if ((rc = weight_matmul(&L->o, qlin, mm_input(att, N * nq, bf16, bits), bf16, N, nq, L->o_bias, d, h, threads)))
            goto done;
        PHASE_END(PH_MATMUL);
        residual(x, h, N * d, bf16);
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
        for (int64_t r = 0; r < N; r++) rmsnorm(x + r * d, L->ln2, d, m->eps, bf16, h + r * d);
        PHASE_END(PH_NORMS); /* with the residual before it */
        if ((rc = weight_matmul(&L->gate_up, qlin, mm_input(h, N * d, bf16, bits), bf16, N, d, NULL, 2 * F, big,
                                threads)))
            goto done;
        PHASE_END(PH_MATMUL);
#pragma omp parallel for schedule(static) num_threads(threads) if (par_silu)
        for (int64_t r = 0; r < N; r++) silu_mul(big + r * 2 * F, F, bf16);
        PHASE_END(PH_SILU);
        float *gate = big; /* rows 2F apart: compact them for the down projection */
        for (int64_t r = 1; r < N; r++) memmove(gate + r * F, gate + r * 2 * F, (size_t)F * sizeof(float));
        PHASE_END(PH_OTHER);
        if ((rc = weight_matmul(&L->down, qlin, mm_input(gate, N * F, bf16, bits), bf16, N, F, NULL, d, h, threads)))
            goto done;
        PHASE_END(PH_MATMUL);
        residual(x, h, N * d, bf16);
        if (hidden && hidden[l + 1]) store_act(x, N * d, bf16, hidden[l + 1]);
    }
    PHASE_END(PH_OTHER);
    if (n_logits > 0) {
        for (int64_t i = 0; i < n_logits; i++)
            rmsnorm(x + logit_rows[i] * d, m->final_norm, d, m->eps, bf16, h + i * d);
        rc = weight_matmul_to(&m->lm_head, qlin, mm_input(h, n_logits * d, bf16, bits), bf16, n_logits, d, NULL,
                              m->head_rows, logits, bf16, threads);
        PHASE_END(PH_HEAD);
    }
    PHASE_TOTAL;
done:
    free(x);
    free(h);
    free(big);
    free(q);
    free(att);
    free(bits);
    free(cs);
    free(row_seq);
    free(row0);
    free(jobs);
    return rc;
}
