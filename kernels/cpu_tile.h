/* The register tile under the CPU GEMM and prefill attention: c[r][0:16] (+)= sum over k < K of
 * a[r * lda + k] * b[k * ldb + 0:16], for r < mr <= 6.
 *
 * Twelve named AVX2 accumulators (6 rows x 2 vectors), one FMA chain per element over k in order,
 * so an element's value does not depend on mr or on the other rows. GCC kept an array of
 * accumulators on the stack, storing it on every k (~57 of ~200 GFLOP/s, measured); named
 * variables stay in registers. Rows past mr repeat row mr - 1 (L1 hits; not stored).
 * `accumulate`: start from c's values instead of zero. `pf`: if not NULL, prefetch pf[k * 16] for
 * k < pf_len (a slice of a GEMM's next panel). */
#ifndef GENPOOL_CPU_TILE_H
#define GENPOOL_CPU_TILE_H
#include <stdint.h>

enum { TILE_ROWS = 6, TILE_COLS = 16 };

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __attribute__((always_inline)) void
tile6x16(const float *a, int64_t lda, const float *b, int64_t ldb, int64_t K, float *c, int64_t ldc,
         int accumulate, const float *pf, int64_t pf_len, const int mr) {
    const float *a0 = a, *a1 = a + (mr > 1 ? 1 : 0) * lda, *a2 = a + (mr > 2 ? 2 : mr - 1) * lda,
                *a3 = a + (mr > 3 ? 3 : mr - 1) * lda, *a4 = a + (mr > 4 ? 4 : mr - 1) * lda,
                *a5 = a + (mr > 5 ? 5 : mr - 1) * lda;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    if (accumulate) {
#define LOAD(i)                                                                   \
        if (mr > i) {                                                             \
            c##i##0 = _mm256_loadu_ps(c + i * ldc);                               \
            c##i##1 = _mm256_loadu_ps(c + i * ldc + 8);                           \
        }
        LOAD(0) LOAD(1) LOAD(2) LOAD(3) LOAD(4) LOAD(5)
#undef LOAD
    }
    for (int64_t k = 0; k < K; k++) {
        const __m256 b0 = _mm256_loadu_ps(b + k * ldb), b1 = _mm256_loadu_ps(b + k * ldb + 8);
        if (pf && k < pf_len) _mm_prefetch((const char *)(pf + k * TILE_COLS), _MM_HINT_T0);
        __m256 x;
#define ROW(i)                                     \
        x = _mm256_broadcast_ss(a##i + k);         \
        c##i##0 = _mm256_fmadd_ps(x, b0, c##i##0); \
        c##i##1 = _mm256_fmadd_ps(x, b1, c##i##1);
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
    }
#define STORE(i)                                                                  \
    if (mr > i) {                                                                 \
        _mm256_storeu_ps(c + i * ldc, c##i##0);                                   \
        _mm256_storeu_ps(c + i * ldc + 8, c##i##1);                               \
    }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
#undef STORE
}

/* tile6x16 with A packed as ap[k * 6 + i] (all six rows; only mr are loaded and stored): the
 * GEMM's hot loop. One pointer and constant offsets instead of six strided row pointers, the
 * loop unrolled by two and the prefetching iterations split off: the strided version spent about
 * as many instructions on addresses and loop control as on FMAs and ran at ~55% of the FMA peak. */
static inline __attribute__((always_inline)) void
tile6x16p(const float *ap, const float *b, int64_t K, float *c, int64_t ldc, int accumulate, const float *pf,
          int64_t pf_len, int64_t mr) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    if (accumulate) {
#define LOAD(i)                                                                   \
        if (mr > i) {                                                             \
            c##i##0 = _mm256_loadu_ps(c + i * ldc);                               \
            c##i##1 = _mm256_loadu_ps(c + i * ldc + 8);                           \
        }
        LOAD(0) LOAD(1) LOAD(2) LOAD(3) LOAD(4) LOAD(5)
#undef LOAD
    }
#define STEP(k)                                                                    \
    {                                                                              \
        const __m256 b0 = _mm256_loadu_ps(b + (k) * TILE_COLS);                    \
        const __m256 b1 = _mm256_loadu_ps(b + (k) * TILE_COLS + 8);                \
        const float *a = ap + (k) * TILE_ROWS;                                     \
        __m256 x;                                                                  \
        x = _mm256_broadcast_ss(a + 0), c00 = _mm256_fmadd_ps(x, b0, c00), c01 = _mm256_fmadd_ps(x, b1, c01); \
        x = _mm256_broadcast_ss(a + 1), c10 = _mm256_fmadd_ps(x, b0, c10), c11 = _mm256_fmadd_ps(x, b1, c11); \
        x = _mm256_broadcast_ss(a + 2), c20 = _mm256_fmadd_ps(x, b0, c20), c21 = _mm256_fmadd_ps(x, b1, c21); \
        x = _mm256_broadcast_ss(a + 3), c30 = _mm256_fmadd_ps(x, b0, c30), c31 = _mm256_fmadd_ps(x, b1, c31); \
        x = _mm256_broadcast_ss(a + 4), c40 = _mm256_fmadd_ps(x, b0, c40), c41 = _mm256_fmadd_ps(x, b1, c41); \
        x = _mm256_broadcast_ss(a + 5), c50 = _mm256_fmadd_ps(x, b0, c50), c51 = _mm256_fmadd_ps(x, b1, c51); \
    }
    int64_t k = 0;
    const int64_t kp = pf && pf_len < K ? pf_len : pf ? K : 0;
    for (; k < kp; k++) {
        _mm_prefetch((const char *)(pf + k * TILE_COLS), _MM_HINT_T0);
        STEP(k)
    }
    for (; k < K; k++) STEP(k)
#undef STEP
    const __m256 acc[TILE_ROWS][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (int64_t i = 0; i < mr; i++) {
        _mm256_storeu_ps(c + i * ldc, acc[i][0]);
        _mm256_storeu_ps(c + i * ldc + 8, acc[i][1]);
    }
}
#else
/* Portable: the same per-element order, left to the compiler. */
static inline __attribute__((always_inline)) void
tile6x16(const float *a, int64_t lda, const float *b, int64_t ldb, int64_t K, float *c, int64_t ldc,
         int accumulate, const float *pf, int64_t pf_len, const int mr) {
    (void)pf, (void)pf_len;
    for (int r = 0; r < mr; r++) {
        float acc[TILE_COLS];
        for (int j = 0; j < TILE_COLS; j++) acc[j] = accumulate ? c[r * ldc + j] : 0.f;
        for (int64_t k = 0; k < K; k++)
#pragma omp simd
            for (int j = 0; j < TILE_COLS; j++) acc[j] = __builtin_fmaf(a[r * lda + k], b[k * ldb + j], acc[j]);
        for (int j = 0; j < TILE_COLS; j++) c[r * ldc + j] = acc[j];
    }
}

static inline __attribute__((always_inline)) void
tile6x16p(const float *ap, const float *b, int64_t K, float *c, int64_t ldc, int accumulate, const float *pf,
          int64_t pf_len, int64_t mr) {
    (void)pf, (void)pf_len;
    for (int64_t r = 0; r < mr; r++) {
        float acc[TILE_COLS];
        for (int j = 0; j < TILE_COLS; j++) acc[j] = accumulate ? c[r * ldc + j] : 0.f;
        for (int64_t k = 0; k < K; k++)
#pragma omp simd
            for (int j = 0; j < TILE_COLS; j++) acc[j] = __builtin_fmaf(ap[k * TILE_ROWS + r], b[k * TILE_COLS + j], acc[j]);
        for (int j = 0; j < TILE_COLS; j++) c[r * ldc + j] = acc[j];
    }
}
#endif

/* tile6x16 over rows [0, m) in tiles of 6, the remainder with a smaller constant tile; `pf`
 * goes to the first tile only. */
static inline __attribute__((always_inline)) void
tiles(const float *a, int64_t lda, const float *b, int64_t ldb, int64_t K, float *c, int64_t ldc,
      int accumulate, const float *pf, int64_t pf_len, int64_t m) {
    int64_t r = 0;
    for (; r + TILE_ROWS <= m; r += TILE_ROWS, pf = 0)
        tile6x16(a + r * lda, lda, b, ldb, K, c + r * ldc, ldc, accumulate, pf, pf_len, TILE_ROWS);
    a += r * lda;
    c += r * ldc;
    switch (m - r) {
    case 5: tile6x16(a, lda, b, ldb, K, c, ldc, accumulate, pf, pf_len, 5); break;
    case 4: tile6x16(a, lda, b, ldb, K, c, ldc, accumulate, pf, pf_len, 4); break;
    case 3: tile6x16(a, lda, b, ldb, K, c, ldc, accumulate, pf, pf_len, 3); break;
    case 2: tile6x16(a, lda, b, ldb, K, c, ldc, accumulate, pf, pf_len, 2); break;
    case 1: tile6x16(a, lda, b, ldb, K, c, ldc, accumulate, pf, pf_len, 1); break;
    }
}
#endif
