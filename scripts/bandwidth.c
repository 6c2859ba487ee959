/* Reads `bytes` of memory once with `threads` threads (AVX2 loads, four independent sums): the streaming read
 * bandwidth that a decode step's weight reads are held against (scripts/kernel_cost.py). */
#include <immintrin.h>
#include <stdint.h>

float vs_read(const float *buf, int64_t bytes, int threads) {
    float total = 0.0f;
    const int64_t n = bytes / (int64_t)sizeof(float) / 32 * 32;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i += 32) {
            a = _mm256_add_ps(a, _mm256_loadu_ps(buf + i));
            b = _mm256_add_ps(b, _mm256_loadu_ps(buf + i + 8));
            c = _mm256_add_ps(c, _mm256_loadu_ps(buf + i + 16));
            d = _mm256_add_ps(d, _mm256_loadu_ps(buf + i + 24));
        }
        float t[8];
        _mm256_storeu_ps(t, _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
        for (int j = 0; j < 8; j++) total += t[j];
    }
    return total;
}
