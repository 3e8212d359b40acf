/* cpu_decode_attention.c's AVX-512 loops for head size 64 (FAST64 = 1 where the compiler targets
 * AVX-512, else 0): scores and P V for up to 3 query heads of a GQA group per K / V load. */
#ifndef GENPOOL_CPU_DECODE_ATTENTION512_H
#define GENPOOL_CPU_DECODE_ATTENTION512_H
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h> /* here only: the kernels also build for CPUs without it (aarch64) */
/* AVX-512 for head size 64, the K/V vectors read straight from the cache (bf16 widened, int8
 * dequantized in the register as it is loaded: the same fp32 values, so a bf16 or int8 cache still
 * gives the bits of the fp32 kernel over its widening). Up to 3 query heads of a GQA group share each K and V load. Added on
 * a 2-core AMX Xeon: 30 layers of B = 48 rows x 450 tokens took 58.8 ms (fp32 cache) and 40.3 ms
 * (bf16) on the AVX2 code, which widened bf16 blocks into a buffer and read each K vector once per
 * head. */
#define FAST64 1
/* 16 elements at element offset off as fp32, for cache type kt: 0 fp32, 1 bf16 (widened), 2 int8
 * (times their group's scale sc: (float)q * sc, the one rounding kernels/kvq.py's widen makes). */
static inline __m512 ld16(const void *base, int64_t off, const int kt, float sc) {
    if (kt == 2)
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                 _mm_loadu_si128((const __m128i *)((const int8_t *)base + off)))),
                             _mm512_set1_ps(sc));
    if (kt == 1)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off))), 16));
    return _mm512_loadu_ps((const float *)base + off);
}

/* The two group scales (elements 0-31, 32-63) of the int8 vector at element (byte) offset off: their
 * 8 bytes after the 64 elements (kernels/kvq.py). */
static inline void scales64(const void *base, int64_t off, const int kt, float sc[2]) {
    sc[0] = sc[1] = 0.f;
    if (kt == 2) __builtin_memcpy(sc, (const int8_t *)base + off + 64, 2 * sizeof(float));
}

/* The 4 lane sums of a[0..3], in order; each token's sum in one fixed tree (cpu_attn_dots.h). */
static inline __m128 hsum4(const __m512 a[4]) {
    __m256 h[4];
    for (int u = 0; u < 4; u++)
        h[u] = _mm256_add_ps(_mm512_castps512_ps256(a[u]), _mm512_extractf32x8_ps(a[u], 1));
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* s[g * ls + t] = q[g] . k[t] for g < gc <= 3 heads, t < n tokens at element offset off, stride st. */
static inline __attribute__((always_inline)) void
dots64(const float *q, const void *k, int64_t off, int64_t st, int64_t n, float *s, int64_t ls, const int gc,
       const int kt) {
    __m512 qv[3][4];
    for (int g = 0; g < gc; g++)
        for (int c = 0; c < 4; c++) qv[g][c] = _mm512_loadu_ps(q + g * 64 + 16 * c);
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        __m512 acc[3][4];
        float sc[4][2];
        for (int u = 0; u < 4; u++) scales64(k, off + (t + u) * st, kt, sc[u]);
        for (int g = 0; g < gc; g++)
            for (int u = 0; u < 4; u++) acc[g][u] = _mm512_setzero_ps();
        for (int c = 0; c < 4; c++)
            for (int u = 0; u < 4; u++) {
                const __m512 kv = ld16(k, off + (t + u) * st + 16 * c, kt, sc[u][c >> 1]);
                for (int g = 0; g < gc; g++) acc[g][u] = _mm512_fmadd_ps(qv[g][c], kv, acc[g][u]);
            }
        for (int g = 0; g < gc; g++) _mm_storeu_ps(s + g * ls + t, hsum4(acc[g]));
    }
    for (; t < n; t++) {
        __m512 acc[3];
        float sc[2];
        scales64(k, off + t * st, kt, sc);
        for (int g = 0; g < gc; g++) acc[g] = _mm512_setzero_ps();
        for (int c = 0; c < 4; c++) {
            const __m512 kv = ld16(k, off + t * st + 16 * c, kt, sc[c >> 1]);
            for (int g = 0; g < gc; g++) acc[g] = _mm512_fmadd_ps(qv[g][c], kv, acc[g]);
        }
        for (int g = 0; g < gc; g++) { /* hsum4's tree, as the tokens above: not reduce_add's */
            const __m512 one[4] = {acc[g], _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            s[g * ls + t] = _mm_cvtss_f32(hsum4(one));
        }
    }
}

/* acc[g * 64 : +64] += sum over t < n of p[g * ps + t] * v[t], g < gc <= 3. */
static inline __attribute__((always_inline)) void
axpys64(const float *p, int64_t ps, const void *v, int64_t off, int64_t st, int64_t n, float *acc, const int gc,
        const int kt) {
    __m512 a[3][4];
    for (int g = 0; g < gc; g++)
        for (int c = 0; c < 4; c++) a[g][c] = _mm512_loadu_ps(acc + g * 64 + 16 * c);
    for (int64_t t = 0; t < n; t++) {
        __m512 vv[4];
        float sc[2];
        scales64(v, off + t * st, kt, sc);
        for (int c = 0; c < 4; c++) vv[c] = ld16(v, off + t * st + 16 * c, kt, sc[c >> 1]);
        for (int g = 0; g < gc; g++) {
            const __m512 w = _mm512_set1_ps(p[g * ps + t]);
            for (int c = 0; c < 4; c++) a[g][c] = _mm512_fmadd_ps(w, vv[c], a[g][c]);
        }
    }
    for (int g = 0; g < gc; g++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + g * 64 + 16 * c, a[g][c]);
}

/* gc and the cache type kt as compile-time constants (every accumulator a register). */
#define CASES64(fn, gc, kt, ...) \
    switch ((gc) * 3 + (kt)) { \
    case 3: fn(__VA_ARGS__, 1, 0); break; \
    case 4: fn(__VA_ARGS__, 1, 1); break; \
    case 5: fn(__VA_ARGS__, 1, 2); break; \
    case 6: fn(__VA_ARGS__, 2, 0); break; \
    case 7: fn(__VA_ARGS__, 2, 1); break; \
    case 8: fn(__VA_ARGS__, 2, 2); break; \
    case 9: fn(__VA_ARGS__, 3, 0); break; \
    case 10: fn(__VA_ARGS__, 3, 1); break; \
    default: fn(__VA_ARGS__, 3, 2); break; \
    }
#else
#define FAST64 0
#define CASES64(...) {} /* never reached: FAST64 is 0 */
#endif
#endif
