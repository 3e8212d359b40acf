/* One core's peak multiply-add rate, for benchmarks/floor.py: independent chains of zmm vpdpbusd
 * (int8 x uint8, 64 multiply-adds an instruction) and of zmm vfmadd231ps (16 fp32 ones), enough
 * chains to cover each instruction's latency. Prints "vnni <G MAC/s> fma <G MAC/s>"; "vnni 0"
 * where the compiler does not target AVX512-VNNI, "fma 0" without AVX-512. */
#include <stdio.h>
#include <time.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

enum { CHAINS = 12, ITERS = 50000000 };

int main(void) {
    double vnni = 0, fma = 0, t0;
#if defined(__AVX512VNNI__)
    __m512i a[CHAINS], b = _mm512_set1_epi8(3), c = _mm512_set1_epi8(5);
    for (int i = 0; i < CHAINS; i++) a[i] = _mm512_set1_epi32(i);
    t0 = now();
    for (long n = 0; n < ITERS; n++) {
#pragma GCC unroll 12
        for (int i = 0; i < CHAINS; i++) a[i] = _mm512_dpbusd_epi32(a[i], b, c);
        __asm__ volatile("" : "+v"(b)); /* the loop cannot be folded away */
    }
    vnni = (double)ITERS * CHAINS * 64 / (now() - t0) / 1e9;
    long s = 0;
    for (int i = 0; i < CHAINS; i++) s += _mm512_reduce_add_epi32(a[i]);
    if (s == 1) puts("");
#endif
#if defined(__AVX512F__)
    __m512 f[CHAINS], x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
    for (int i = 0; i < CHAINS; i++) f[i] = _mm512_set1_ps((float)i);
    t0 = now();
    for (long n = 0; n < ITERS; n++) {
#pragma GCC unroll 12
        for (int i = 0; i < CHAINS; i++) f[i] = _mm512_fmadd_ps(f[i], x, y);
        __asm__ volatile("" : "+v"(x));
    }
    fma = (double)ITERS * CHAINS * 16 / (now() - t0) / 1e9;
    float fs = 0;
    for (int i = 0; i < CHAINS; i++) fs += _mm512_reduce_add_ps(f[i]);
    if (fs == 1) puts("");
#endif
    printf("vnni %.2f fma %.2f\n", vnni, fma);
    return 0;
}
