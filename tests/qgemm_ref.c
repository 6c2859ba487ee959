/* The chain qgemm.c promises, written out as scalars from the unpacked weights (tests/test_qgemm.py's reference):
 * per group, s = fma(x[2p+1], q[2p+1], s); s = fma(x[2p], q[2p], s) over its pairs (a missing odd input is 0),
 * acc = fma(s, scale, acc); then acc + bias. fmaf is libm's, exact by C99 whatever the build flags. */
#include <math.h>
#include <stdint.h>

void ref_qlinear(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scales, int64_t group,
                 const float *bias, int64_t N, float *y) {
    const int64_t groups = K / group;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                float s = 0.0f;
                for (int64_t k = g * group; k < (g + 1) * group; k += 2) {
                    const float x1 = k + 1 < (g + 1) * group ? x[m * K + k + 1] : 0.0f;
                    const float q1 = k + 1 < (g + 1) * group ? (float)q[n * K + k + 1] : 0.0f;
                    s = fmaf(x1, q1, s);
                    s = fmaf(x[m * K + k], (float)q[n * K + k], s);
                }
                acc = fmaf(s, scales[n * groups + g], acc);
            }
            y[m * N + n] = bias ? acc + bias[n] : acc;
        }
}
