/* One core's peak multiply-add rate, for benchmarks/floor.py: independent chains of zmm vpdpbusd
 * (int8 x uint8, 64 multiply-adds an instruction) and of zmm vfmadd231ps (16 fp32 ones), enough
 * chains to cover each instruction's latency; and AMX tdpbf16ps on 4 accumulator tiles (16 x 16
 * outputs x 32 bf16 products each, 8192 multiply-adds). Prints "vnni <G MAC/s> fma <G MAC/s>
 * amx_bf16 <G MAC/s>"; 0 for what the compiler does not target or the OS does not grant. */
#include <stdio.h>
#include <time.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
static const struct {
    unsigned char palette, start_row, reserved[14];
    unsigned short colsb[16];
    unsigned char rows[16];
} CONFIG __attribute__((aligned(64))) = {1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

static double amx_bf16(double (*clock)(void)) {
    static unsigned char a[1024] __attribute__((aligned(64))), b[1024] __attribute__((aligned(64)));
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 0;
    _tile_loadconfig(&CONFIG);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, a, 64);
    _tile_loadd(5, a, 64);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b, 64);
    const long iters = 5000000;
    const double t0 = clock();
    for (long n = 0; n < iters; n++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    const double t = clock() - t0;
    _tile_stored(0, a, 64);
    _tile_release();
    return 4.0 * iters * 8192 / t / 1e9;
}
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
    double amx = 0;
#if defined(__AMX_BF16__)
    amx = amx_bf16(now);
#endif
    printf("vnni %.2f fma %.2f amx_bf16 %.2f\n", vnni, fma, amx);
    return 0;
}
