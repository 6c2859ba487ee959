/* Which of the kernels' instruction sets this CPU and its OS run, built without any ISA flags so that calling it is
 * safe everywhere. Bits: 0 AVX2, 1 FMA, 2 AVX-512F, 3 AVX-512BW, 4 AVX-512VL, 5 AVX-512DQ, 6 AVX-512 BF16,
 * 7 AVX-512 VNNI. */
int vs_cpu_features(void) {
    __builtin_cpu_init();
    int bits = 0;
    bits |= __builtin_cpu_supports("avx2") ? 1 << 0 : 0;
    bits |= __builtin_cpu_supports("fma") ? 1 << 1 : 0;
    bits |= __builtin_cpu_supports("avx512f") ? 1 << 2 : 0;
    bits |= __builtin_cpu_supports("avx512bw") ? 1 << 3 : 0;
    bits |= __builtin_cpu_supports("avx512vl") ? 1 << 4 : 0;
    bits |= __builtin_cpu_supports("avx512dq") ? 1 << 5 : 0;
    bits |= __builtin_cpu_supports("avx512bf16") ? 1 << 6 : 0;
    bits |= __builtin_cpu_supports("avx512vnni") ? 1 << 7 : 0;
    return bits;
}
