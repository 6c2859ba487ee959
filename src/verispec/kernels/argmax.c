/* Greedy token choice: the argmax of each row of logits, by torch.argmax's rule (the first index of the maximum;
 * a NaN counts as the maximum, the first NaN wins). torch's CPU argmax compares one element at a time: 9 rows of
 * an 8192-token vocabulary took 110 us in fp32 and 230 us in bf16 on a 2-vCPU AVX2 machine, against a ~10 ms
 * step; here 8 lanes at a time, one thread.
 *
 * x: [rows, cols] fp32, or bf16 as raw uint16 bits (bf16 != 0), rows ld elements apart. Writes rows indices. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float value(const void *x, int bf16, int64_t i) {
    if (!bf16) return ((const float *)x)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline __m256 load8(const void *x, int bf16, int64_t i) {
    if (!bf16) return _mm256_loadu_ps((const float *)x + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The scalar rule, from index `from` given the best so far (a row with a NaN takes this path whole). */
static int64_t scalar_from(const void *x, int bf16, int64_t cols, int64_t from, int64_t best, float bv) {
    for (int64_t c = from; c < cols; c++) {
        const float v = value(x, bf16, c);
        if (isnan(v)) return isnan(bv) ? best : c;
        if (best < 0 || v > bv) {
            best = c;
            bv = v;
        }
    }
    return best;
}

static int64_t row_argmax(const void *x, int bf16, int64_t cols) {
    if (cols < 8) return scalar_from(x, bf16, cols, 0, -1, 0.0f);
    /* Per lane the first maximum (strict >), then the lanes' maxima by value and lowest index. */
    __m256 best = load8(x, bf16, 0);
    __m256 nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
    __m256i bidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), idx = bidx;
    const __m256i eight = _mm256_set1_epi32(8);
    const int64_t full = cols / 8 * 8;
    for (int64_t c = 8; c < full; c += 8) {
        const __m256 v = load8(x, bf16, c);
        idx = _mm256_add_epi32(idx, eight);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
        best = _mm256_blendv_ps(best, v, gt);
        bidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bidx), _mm256_castsi256_ps(idx), gt));
    }
    if (_mm256_movemask_ps(nan)) return scalar_from(x, bf16, cols, 0, -1, 0.0f);
    float vals[8];
    int32_t ids[8];
    _mm256_storeu_ps(vals, best);
    _mm256_storeu_si256((__m256i *)ids, bidx);
    int64_t b = ids[0];
    float bv = vals[0];
    for (int l = 1; l < 8; l++)
        if (vals[l] > bv || (vals[l] == bv && ids[l] < b)) {
            b = ids[l];
            bv = vals[l];
        }
    return scalar_from(x, bf16, cols, full, b, bv);
}

int vs_argmax(const void *x, int bf16, int64_t rows, int64_t cols, int64_t ld, int64_t *out) {
    const size_t elt = bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax((const char *)x + (size_t)(r * ld) * elt, bf16, cols);
    return 0;
}
