/* One core's peak multiply-add rate, for benchmarks/floor.py: independent chains, enough to cover
 * each instruction's latency, of what the quantized kernels multiply with (cpu_qdot.h):
 * - int8: zmm vpdpbusd (64 multiply-adds an instruction); on AVX2, ymm vpmaddubsw + vpmaddwd by ones
 *   + vpaddd, the sequence that sums int8 products into int32 without saturating (32);
 * - int4: the same on AVX-512; on AVX2, vpmaddubsw + vpaddw (32), as int4 blocks sum 16-bit;
 * - fma: vfmadd231ps, zmm (16 fp32) or ymm (8);
 * - amx_bf16: AMX tdpbf16ps on 4 accumulator tiles (16 x 16 outputs x 32 bf16 products, 8192).
 * Prints "int8 <G MAC/s> int4 <G MAC/s> fma <G MAC/s> amx_bf16 <G MAC/s>"; 0 for what the compiler
 * does not target or the OS does not grant. */
#include <stdio.h>
#include <time.h>
#if defined(__AVX2__)
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

static __attribute__((unused)) double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Enough chains to cover the latencies, few enough to stay in registers (32 zmm, 16 ymm). */
#if defined(__AVX512F__)
enum { CHAINS = 12 };
#else
enum { CHAINS = 10 };
#endif
enum { ITERS = 50000000 };

/* CHAINS independent accumulators through STEP, ITERS times; returns G steps a second. */
#define CHAINED(T, init, STEP, reduce)                                                                 \
    do {                                                                                               \
        T acc[CHAINS];                                                                                 \
        for (int i = 0; i < CHAINS; i++) acc[i] = init(i);                                             \
        const double t0 = now();                                                                       \
        for (long n = 0; n < ITERS; n++) {                                                             \
            _Pragma("GCC unroll 16") for (int i = 0; i < CHAINS; i++) acc[i] = STEP(acc[i]);           \
        }                                                                                              \
        rate = (double)ITERS * CHAINS / (now() - t0) / 1e9;                                            \
        double sink = 0;                                                                               \
        for (int i = 0; i < CHAINS; i++) sink += reduce(acc[i]);                                       \
        if (sink == 1.5) puts("");                                                                     \
    } while (0)

#if defined(__AVX512VNNI__)
static __m512i i512(int i) { return _mm512_set1_epi32(i); }
static __m512i dpbusd(__m512i a) { return _mm512_dpbusd_epi32(a, _mm512_set1_epi8(3), _mm512_set1_epi8(5)); }
static double r512i(__m512i a) { return _mm512_reduce_add_epi32(a); }
#endif
#if defined(__AVX512F__)
static __m512 f512(int i) { return _mm512_set1_ps((float)i); }
static __m512 fma512(__m512 a) { return _mm512_fmadd_ps(a, _mm512_set1_ps(1.0001f), _mm512_set1_ps(0.9999f)); }
static double r512f(__m512 a) { return _mm512_reduce_add_ps(a); }
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512VNNI__)
/* AVX2's int8 and int4 sequences in assembly: GCC kept spilling chained intrinsics here. Four
 * independent sums, each fed by its own multiplicand register, one step = 4 sequences. */
#define SEQ8(x, t, acc) \
    "vpmaddubsw %%ymm15, " x ", " t "\n vpmaddwd %%ymm14, " t ", " t "\n vpaddd " t ", " acc ", " acc "\n"
#define SEQ4(x, t, acc) "vpmaddubsw %%ymm15, " x ", " t "\n vpaddw " t ", " acc ", " acc "\n"
#define CLOBBERS \
    "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", "ymm11", "ymm14", "ymm15"
static double avx2_seq_rate(int bits) {
    __asm__ volatile("vpcmpeqw %%ymm14, %%ymm14, %%ymm14\n vpsrlw $15, %%ymm14, %%ymm14\n"
                     "vpxor %%ymm15, %%ymm15, %%ymm15" ::: "ymm14", "ymm15");
    const double t0 = now();
    for (long n = 0; n < ITERS; n++) {
        if (bits == 8)
            __asm__ volatile(SEQ8("%%ymm4", "%%ymm8", "%%ymm0") SEQ8("%%ymm5", "%%ymm9", "%%ymm1")
                             SEQ8("%%ymm6", "%%ymm10", "%%ymm2") SEQ8("%%ymm7", "%%ymm11", "%%ymm3") ::: CLOBBERS);
        else
            __asm__ volatile(SEQ4("%%ymm4", "%%ymm8", "%%ymm0") SEQ4("%%ymm5", "%%ymm9", "%%ymm1")
                             SEQ4("%%ymm6", "%%ymm10", "%%ymm2") SEQ4("%%ymm7", "%%ymm11", "%%ymm3") ::: CLOBBERS);
    }
    return (double)ITERS * 4 / (now() - t0) / 1e9;
}
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
static __m256 f256(int i) { return _mm256_set1_ps((float)i); }
static __m256 fma256(__m256 a) { return _mm256_fmadd_ps(a, _mm256_set1_ps(1.0001f), _mm256_set1_ps(0.9999f)); }
static double r256f(__m256 a) { return _mm256_cvtss_f32(a); }
#endif

int main(void) {
    double int8 = 0, int4 = 0, fma = 0, amx = 0, rate = 0;
    (void)rate;
#if defined(__AVX512VNNI__)
    CHAINED(__m512i, i512, dpbusd, r512i);
    int8 = int4 = rate * 64;
#elif defined(__AVX2__) && defined(__FMA__)
    int8 = avx2_seq_rate(8) * 32;
    int4 = avx2_seq_rate(4) * 32;
#endif
#if defined(__AVX512F__)
    CHAINED(__m512, f512, fma512, r512f);
    fma = rate * 16;
#elif defined(__AVX2__) && defined(__FMA__)
    CHAINED(__m256, f256, fma256, r256f);
    fma = rate * 8;
#endif
#if defined(__AMX_BF16__)
    amx = amx_bf16(now);
#endif
    printf("int8 %.2f int4 %.2f fma %.2f amx_bf16 %.2f\n", int8, int4, fma, amx);
    return 0;
}
