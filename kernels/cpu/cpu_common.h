/* Helpers shared by the CPU kernels: bf16 <-> fp32 as torch rounds, a vectorisable exp, and
 * running a kernel's rows on several threads (parallel_rows uses more than one only for >= 32K
 * elements of work: below that, waking a thread costs more than it saves). */
#ifndef GENPOOL_CPU_COMMON_H
#define GENPOOL_CPU_COMMON_H
#include <math.h>
#include <stdint.h>

#include "cpu_pool.h"

/* fn over [bounds[i], bounds[i + 1]) for i < n (n <= MAX_THREADS) on n threads of the kernels'
 * pool (cpu_pool.c: shared by every kernel library, one thread count: torch.set_num_threads).
 * First error wins. */
static inline int run_ranges(range_fn fn, const void *args, const int64_t *bounds, int n) {
    return gp_pool_run(fn, args, bounds, n);
}

/* Clamp a thread count to [1, min(MAX_THREADS, items)]. */
static inline int thread_count(int nthreads, int64_t items) {
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if (nthreads > items) nthreads = (int)items;
    return nthreads < 1 ? 1 : nthreads;
}

/* Equal contiguous shares of [0, rows), one a thread (4 a thread measured no better: decision 0010). */
static int parallel_rows(range_fn fn, const void *args, int64_t rows, int64_t work_per_row, int nthreads) {
    const int n = rows * work_per_row < (1 << 15) ? 1 : thread_count(nthreads, rows);
    int64_t bounds[MAX_THREADS + 1];
    for (int i = 0; i <= n; i++) bounds[i] = rows * i / n;
    return run_ranges(fn, args, bounds, n);
}

/* bf16 <-> fp32 as torch converts: widening is exact, narrowing rounds to nearest even. */
static inline float bf16_f32(uint16_t h) {
    union { uint32_t u; float f; } c = {(uint32_t)h << 16};
    return c.f;
}

static inline uint16_t f32_bf16(float f) {
    union { float f; uint32_t u; } c = {f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}
/* Cephes' exp: clamp to [EXP_LO, EXP_HI] (underflow to ~1e-38, no inf), k = floor(x log2 e + 1/2),
 * r = x - k ln 2 (in two parts), exp = poly(r) * 2^k; within 2 ulp of expf. Shared by the scalar-
 * vectorised loop and the AVX2 / AVX-512 ones below. */
#define EXP_LO -87.3f
#define EXP_HI 88.37f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO 2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

/* In-place exp over an array, in loops GCC vectorises (glibc's vector expf needs -ffast-math,
 * which would also license reorderings the exact kernels must not have; a scalar expf call per
 * element made SwiGLU 3x slower than torch). The 2^n scale is built as integer bits in one loop
 * and read back as floats in the next (-fno-strict-aliasing). finite-math-only: GCC vectorises
 * fminf/fmaxf only when it may ignore NaN (inputs here are finite scores). */
__attribute__((optimize("finite-math-only"))) static void vexpf_inplace(float *x, int64_t len) {
    enum { CHUNK = 256 };
    int32_t bits[CHUNK];
    const float *scale = (const float *)bits;
    for (int64_t c = 0; c < len; c += CHUNK) {
        const int64_t n = len - c < CHUNK ? len - c : CHUNK;
        float *v = x + c;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const float y = fminf(fmaxf(v[i], EXP_LO), EXP_HI);
            const float t = y * EXP_LOG2E + 0.5f;
            int32_t ki = (int32_t)t; /* floor(t) without floorf, which GCC will not vectorise */
            ki -= (float)ki > t;
            const float k = (float)ki;
            const float r = (y - k * EXP_LN2_HI) + k * EXP_LN2_LO;
            float p = EXP_P0;
            p = p * r + EXP_P1;
            p = p * r + EXP_P2;
            p = p * r + EXP_P3;
            p = p * r + EXP_P4;
            p = p * r + EXP_P5;
            v[i] = p * r * r + r + 1.0f;
            bits[i] = (ki + 127) << 23;
        }
#pragma omp simd
        for (int64_t i = 0; i < n; i++) v[i] *= scale[i];
    }
}

/* SwiGLU on fp32: o[i] = silu(g[i]) * u[i] = g[i] / (1 + exp(-g[i])) * u[i], i < n. One definition
 * for the stand-alone kernel (cpu_silu_mul.c) and the GEMM's fused epilogue (cpu_gemm.c), so both
 * give the same bits. */
static inline void silu_mul_f32(const float *g, const float *u, float *o, int64_t n) {
    enum { CHUNK = 256 };
    float e[CHUNK];
    for (int64_t c = 0; c < n; c += CHUNK) {
        const int64_t m = n - c < CHUNK ? n - c : CHUNK;
#pragma omp simd
        for (int64_t i = 0; i < m; i++) e[i] = -g[c + i];
        vexpf_inplace(e, m);
#pragma omp simd
        for (int64_t i = 0; i < m; i++) o[c + i] = g[c + i] / (1.f + e[i]) * u[c + i];
    }
}

/* One row of a quantized product's tile into y: for SwiGLU (glu = the half width) silu(t[0:glu]) *
 * t[glu:2 glu], else t[0:cols] plus bias (bias already at the row's first column, or NULL). */
static inline void tile_row_out(const float *t, float *y, const float *bias, int64_t cols, int64_t glu) {
    if (glu)
        silu_mul_f32(t, t + glu, y, glu);
    else if (bias)
        for (int64_t j = 0; j < cols; j++) y[j] = t[j] + bias[j];
    else
        for (int64_t j = 0; j < cols; j++) y[j] = t[j];
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* The same exp's reduced part on a vector of V (intrinsics prefix W: _mm256 / _mm512): with
 * r = y - k ln 2 (in two parts), 1 + r + r^2 P(r); callers clamp y, round k and apply 2^k. */
#define DEFINE_EXP_REDUCED(name, V, W)                                                     \
    static inline V name(V y, V k) {                                                       \
        const V r = W##_fmadd_ps(k, W##_set1_ps(EXP_LN2_LO), W##_fnmadd_ps(k, W##_set1_ps(EXP_LN2_HI), y)); \
        V p = W##_set1_ps(EXP_P0);                                                         \
        p = W##_fmadd_ps(p, r, W##_set1_ps(EXP_P1));                                       \
        p = W##_fmadd_ps(p, r, W##_set1_ps(EXP_P2));                                       \
        p = W##_fmadd_ps(p, r, W##_set1_ps(EXP_P3));                                       \
        p = W##_fmadd_ps(p, r, W##_set1_ps(EXP_P4));                                       \
        p = W##_fmadd_ps(p, r, W##_set1_ps(EXP_P5));                                       \
        return W##_add_ps(W##_fmadd_ps(W##_mul_ps(p, r), r, r), W##_set1_ps(1.f));         \
    }

/* Lanes u < live of a mask (live <= 8): the ragged ends of 8-lane loops. */
static inline __m256i live8(int64_t live) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)live), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

DEFINE_EXP_REDUCED(exp_reduced256, __m256, _mm256)
/* The same exp on eight lanes, 2^k built as exponent bits (k lies in [-126, 127] after the clamp). */
static inline __m256 exp256_ps(__m256 x) {
    const __m256 y = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    const __m256 k = _mm256_floor_ps(_mm256_fmadd_ps(y, _mm256_set1_ps(EXP_LOG2E), _mm256_set1_ps(0.5f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(exp_reduced256(y, k), _mm256_castsi256_ps(bits));
}
#endif

#if defined(__AVX512F__)
DEFINE_EXP_REDUCED(exp_reduced512, __m512, _mm512)
/* The same exp on sixteen lanes, 2^k applied by scalef. */
static inline __m512 exp512_ps(__m512 x) {
    const __m512 y = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    const __m512 k = _mm512_roundscale_ps(_mm512_fmadd_ps(y, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    return _mm512_scalef_ps(exp_reduced512(y, k), k);
}
#endif

#if defined(__AVX512F__)
/* s[t] = exp(s[t] - mx) for t < n, in place; returns their sum, in an order fixed by n alone (16
 * lanes, a masked tail, then the lanes). One pass instead of the generic path's four;
 * shared by the prefill and decode attention kernels' softmax. */
static inline float exp_shift_sum(float *s, int64_t n, float mx) {
    const __m512 m = _mm512_set1_ps(mx);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 live = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
        const __m512 e = exp512_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), m));
        _mm512_mask_storeu_ps(s + t, live, e);
        acc = _mm512_mask_add_ps(acc, live, acc, e);
    }
    return _mm512_reduce_add_ps(acc);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The same on eight lanes: a masked tail, then the lanes summed in a fixed order. One pass instead
 * of the generic path's four (the softmax was ~25% of a single-thread call on a Zen 3). */
static inline float exp_shift_sum(float *s, int64_t n, float mx) {
    const __m256 m = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp256_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (t < n) {
        const __m256i live = live8(n - t);
        const __m256 e = _mm256_and_ps(exp256_ps(_mm256_sub_ps(_mm256_maskload_ps(s + t, live), m)), _mm256_castsi256_ps(live));
        _mm256_maskstore_ps(s + t, live, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lane[8], z = 0.f;
    _mm256_storeu_ps(lane, acc);
    for (int i = 0; i < 8; i++) z += lane[i];
    return z;
}
#else
/* Generic: shift, exp, then the sum in an order fixed by n alone (16 lanes, then the lanes). */
static inline float exp_shift_sum(float *s, int64_t n, float mx) {
#pragma omp simd
    for (int64_t t = 0; t < n; t++) s[t] -= mx;
    vexpf_inplace(s, n);
    float acc[16] = {0};
    int64_t t = 0;
    for (; t + 16 <= n; t += 16)
#pragma omp simd
        for (int i = 0; i < 16; i++) acc[i] += s[t + i];
    for (int i = 0; t + i < n; i++) acc[i] += s[t + i];
    float z = 0.f;
    for (int i = 0; i < 16; i++) z += acc[i];
    return z;
}
#endif
#endif
