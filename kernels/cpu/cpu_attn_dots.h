/* Attention scores q . k[t] and a row's softmax, one definition for decode and prefill attention.
 *
 * Why one: a prompt row's attention must be the bits decode attention gives for the same position.
 * A resumed job prefills the tokens the dead worker decoded one by one (so does a preempted and
 * recomputed sequence); if the two kernels summed q . k in different orders, the resumed KV
 * would differ in the last bits and a seeded draw near a boundary would later pick another token
 * (the Zen 3 CI failure of d966326). So each score has one fixed order, whatever the caller, the
 * grouping of tokens or the tail: lane u of 8 (16 for AVX-512 at head size 64) sums the products
 * of elements u, u + lanes, ... as an FMA chain, then the lanes add in a fixed tree.
 */
#ifndef GENPOOL_CPU_ATTN_DOTS_H
#define GENPOOL_CPU_ATTN_DOTS_H
#include <math.h>
#include <stdint.h>

#include "cpu_common.h"              /* exp_shift_sum, live8 */
#include "cpu_decode_attention512.h" /* FAST64, dots64: AVX-512 at head size 64 */

/* The lane tree of hsum8 below, in scalar code: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). */
static inline float tree8(const float l[8]) {
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* s[t] = q . k[t * st] for t < n: the lanes' FMA chains (fmaf: no contraction choice left to the
 * compiler, one instruction where the CPU has FMA), then tree8. For head sizes the vector code
 * does not take, and CPUs without AVX2. Whole eights of elements as one 8-lane step each (the
 * compiler vectorises it), the last D % 8 into lanes 0 .. D % 8 - 1. */
static inline __attribute__((always_inline)) void
dots_scalar(const float *q, const float *k, int64_t st, int64_t n, float *s, const int64_t D) {
    for (int64_t t = 0; t < n; t++) {
        const float *kt = k + t * st;
        float l[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= D; i += 8)
#pragma omp simd
            for (int u = 0; u < 8; u++) l[u] = fmaf(q[i + u], kt[i + u], l[u]);
        for (int u = 0; i + u < D; u++) l[u] = fmaf(q[i + u], kt[i + u], l[u]);
        s[t] = tree8(l);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* Lane u of the result = the sum of a[u]'s lanes in tree8's order: eight horizontal sums sharing
 * their shuffles. */
static inline __m256 hsum8(const __m256 a[8]) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s03 = _mm256_hadd_ps(s01, s23), s47 = _mm256_hadd_ps(s45, s67); /* per 128-bit lane */
    return _mm256_add_ps(_mm256_permute2f128_ps(s03, s47, 0x20), _mm256_permute2f128_ps(s03, s47, 0x31));
}

/* dots_scalar's sums for rows q (and q + D with two = 1) against tokens t .. t + TOK - 1, TOK = 8
 * for one row, 4 for two: hsum8 of one accumulator per (row, token), so lane r * TOK + u holds
 * row r's token t + u. Unless whole, tokens past n - 1 repeat token n - 1 (their lanes are not
 * stored): the group at the end costs what a whole one does, with no branch inside. */
static inline __attribute__((always_inline)) __m256
dots_group(const float *q, const float *k, int64_t st, int64_t t, int64_t n, const int64_t D, const int two,
           const int whole) {
    const int tok = two ? 4 : 8;
    int64_t kr[8]; /* element offsets of the tokens' rows: clamped only in the last group (~8% of decode) */
    for (int u = 0; u < tok; u++) kr[u] = (whole || t + u < n ? t + u : n - 1) * st;
    __m256 acc[8];
    for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
        const __m256 q0 = _mm256_loadu_ps(q + i), q1 = two ? _mm256_loadu_ps(q + D + i) : q0;
        for (int u = 0; u < tok; u++) {
            const __m256 kv = _mm256_loadu_ps(k + kr[u] + i);
            acc[u] = _mm256_fmadd_ps(q0, kv, acc[u]);
            if (two) acc[4 + u] = _mm256_fmadd_ps(q1, kv, acc[4 + u]);
        }
    }
    return hsum8(acc);
}

/* dots_scalar's sums, eight tokens at a time with one accumulator each. One dot product at a time
 * was bound by its chain of dependent FMAs plus a horizontal sum per token (~4x slower, measured):
 * eight independent chains keep both FMA ports busy and share the horizontal sums. */
static inline __attribute__((always_inline)) void
dots(const float *q, const float *k, int64_t st, int64_t n, float *s, const int64_t D) {
    if (D % 8) {
        dots_scalar(q, k, st, n, s, D);
        return;
    }
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) _mm256_storeu_ps(s + t, dots_group(q, k, st, t, n, D, 0, 1));
    if (t < n) _mm256_maskstore_ps(s + t, live8(n - t), dots_group(q, k, st, t, n, D, 0, 0));
}

/* dots for two query rows q and q + D at once (D % 8 == 0), four tokens at a time: a K vector loaded once
 * serves both rows. Prompt rows share their keys: one row at a time left prefill's scores bound
 * by the loads. */
static inline __attribute__((always_inline)) void
dots2(const float *q, const float *k, int64_t st, int64_t n, float *s, int64_t ls, const int64_t D) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) { /* plain stores: masked ones are slow on AMD */
        const __m256 h = dots_group(q, k, st, t, n, D, 1, 1);
        _mm_storeu_ps(s + t, _mm256_castps256_ps128(h));
        _mm_storeu_ps(s + ls + t, _mm256_extractf128_ps(h, 1));
    }
    if (t < n) {
        const __m256 h = dots_group(q, k, st, t, n, D, 1, 0);
        const __m128i live = _mm256_castsi256_si128(live8(n - t));
        _mm_maskstore_ps(s + t, live, _mm256_castps256_ps128(h));
        _mm_maskstore_ps(s + ls + t, live, _mm256_extractf128_ps(h, 1));
    }
}
#else
#define dots dots_scalar
#endif

/* s[r * ls + t] = q[r * D : +D] . k[t * st] (fp32 rows) for r < rows, t < n, in the order decode
 * attention uses for head size D: several query rows per K load where the code allows. */
static inline __attribute__((always_inline)) void
attn_dots(const float *q, int64_t rows, const float *k, int64_t st, int64_t n, float *s, int64_t ls, const int64_t D) {
    int64_t r = 0;
    if (FAST64 && D == 64)
        for (; r < rows; r += 3) CASES64(dots64, rows - r < 3 ? rows - r : 3, 0, q + r * D, k, 0, st, n, s + r * ls, ls)
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0)
        for (; r + 2 <= rows; r += 2) /* D a constant for the usual sizes: the loop over it unrolled */
            D == 64 ? dots2(q + r * D, k, st, n, s + r * ls, ls, 64) : dots2(q + r * D, k, st, n, s + r * ls, ls, D);
#endif
    for (; r < rows; r++) dots(q + r * D, k, st, n, s + r * ls, D);
}

/* A row's softmax over its n scores, as both kernels run it: the max, then exp(s - max) in place
 * (unnormalised) and their sum (exp_shift_sum's fixed order), returned. */
static inline float softmax_row(float *s, int64_t n) {
    float mx = s[0];
#pragma omp simd reduction(max : mx)
    for (int64_t t = 1; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    return exp_shift_sum(s, n, mx);
}
#endif
