/* The register tile under the CPU GEMM and prefill attention: c[r][0:16] (+)= sum over k < K of
 * a[r * rs + k * ks] * b[k * 16 + 0:16], for r < mr <= 6 (tile6x16p; tile_group, below, puts one
 * or two panels side by side).
 *
 * Twelve named AVX2 accumulators (6 rows x 2 vectors), one FMA chain per element over k in order,
 * so an element's value does not depend on mr or on the other rows. GCC kept an array of
 * accumulators on the stack, storing it on every k (~57 of ~200 GFLOP/s, measured); named
 * variables stay in registers. Rows past mr are neither read nor computed where mr is a constant
 * (tile_rows below makes it one), so a partial tile costs what its rows cost.
 * `accumulate`: start from c's values instead of zero. `pf`, if not NULL, is prefetched at
 * pf[k * 16] for k < pf_len (a slice of the next panel). */
#ifndef GENPOOL_CPU_TILE_H
#define GENPOOL_CPU_TILE_H
#include <stdint.h>

enum { TILE_ROWS = 6, TILE_COLS = 16 };

/* Tiles that cover m rows. */
static inline int64_t tile_count(int64_t m) { return (m + TILE_ROWS - 1) / TILE_ROWS; }

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* Declares the twelve accumulators acc<row><half>: zero, or cp's first mr rows when accumulating. */
#define TILE_LOAD_ROW(cp, ldc, mr, i)                                              \
    if ((mr) > i) {                                                                \
        acc##i##0 = _mm256_loadu_ps((cp) + i * (ldc));                             \
        acc##i##1 = _mm256_loadu_ps((cp) + i * (ldc) + 8);                         \
    }
#define TILE_ACC_INIT(cp, ldc, mr, accumulate)                                     \
    __m256 acc00 = _mm256_setzero_ps(), acc01 = acc00, acc10 = acc00, acc11 = acc00; \
    __m256 acc20 = acc00, acc21 = acc00, acc30 = acc00, acc31 = acc00;             \
    __m256 acc40 = acc00, acc41 = acc00, acc50 = acc00, acc51 = acc00;             \
    if (accumulate) {                                                              \
        TILE_LOAD_ROW(cp, ldc, mr, 0) TILE_LOAD_ROW(cp, ldc, mr, 1)                \
        TILE_LOAD_ROW(cp, ldc, mr, 2) TILE_LOAD_ROW(cp, ldc, mr, 3)                \
        TILE_LOAD_ROW(cp, ldc, mr, 4) TILE_LOAD_ROW(cp, ldc, mr, 5)                \
    }
/* acc<i><0,1> += x_i * (b0, b1) with x_i broadcast from a_i. */
#define TILE_FMA_ROW(i, a_i)                                                       \
    if (mr > i) {                                                                  \
        const __m256 x = _mm256_broadcast_ss(a_i);                                 \
        acc##i##0 = _mm256_fmadd_ps(x, b0, acc##i##0);                             \
        acc##i##1 = _mm256_fmadd_ps(x, b1, acc##i##1);                             \
    }

static inline __attribute__((always_inline)) void
tile_store(float *c, int64_t ldc, int64_t mr, const __m256 acc[TILE_ROWS][2]) {
    for (int64_t i = 0; i < mr; i++) {
        _mm256_storeu_ps(c + i * ldc, acc[i][0]);
        _mm256_storeu_ps(c + i * ldc + 8, acc[i][1]);
    }
}
#define TILE_ACC_STORE(cp, ldc, mr)                                                \
    {                                                                              \
        const __m256 all[TILE_ROWS][2] = {{acc00, acc01}, {acc10, acc11}, {acc20, acc21}, \
                                          {acc30, acc31}, {acc40, acc41}, {acc50, acc51}}; \
        tile_store(cp, ldc, mr, all);                                              \
    }

/* The tile with A element (i, k) at a[i * rs + k * ks] (rows past mr neither read nor stored when
 * mr is a constant) and B a packed panel (ldb 16): the GEMM's hot loop (A packed six-interleaved:
 * rs 1, ks 6, constants) and prefill attention's (A row-major: rs = the row length, ks 1). One
 * pointer and fixed or loop-invariant offsets instead of six row pointers, and the prefetching
 * iterations split off (the six-pointer version spent about as many instructions on addresses and
 * loop control as on FMAs: ~55% of the FMA peak, vs ~80%). Unrolling by two ran out of registers. */
static inline __attribute__((always_inline)) void
tile6x16p(const float *ap, const int64_t rs, const int64_t ks, const float *b, int64_t K, float *c, int64_t ldc,
          int accumulate, const float *pf, int64_t pf_len, int64_t mr) {
    TILE_ACC_INIT(c, ldc, mr, accumulate)
#define STEP(k)                                                                    \
    {                                                                              \
        const __m256 b0 = _mm256_loadu_ps(b + (k) * TILE_COLS);                    \
        const __m256 b1 = _mm256_loadu_ps(b + (k) * TILE_COLS + 8);                \
        const float *a = ap + (k) * ks;                                            \
        TILE_FMA_ROW(0, a) TILE_FMA_ROW(1, a + rs) TILE_FMA_ROW(2, a + 2 * rs)     \
        TILE_FMA_ROW(3, a + 3 * rs) TILE_FMA_ROW(4, a + 4 * rs) TILE_FMA_ROW(5, a + 5 * rs) \
    }
    int64_t k = 0;
    const int64_t kp = pf ? (pf_len < K ? pf_len : K) : 0;
    for (; k < kp; k++) {
        _mm_prefetch((const char *)(pf + k * TILE_COLS), _MM_HINT_T0);
        STEP(k)
    }
    for (; k < K; k++) STEP(k)
#undef STEP
    TILE_ACC_STORE(c, ldc, mr)
}
#else
/* Portable: the same per-element order, left to the compiler; A element (r, k) at a[r * rs + k * ks]. */
static inline __attribute__((always_inline)) void
tile_portable(const float *a, int64_t rs, int64_t ks, const float *b, int64_t ldb, int64_t K, float *c,
              int64_t ldc, int accumulate, int64_t mr) {
    for (int64_t r = 0; r < mr; r++) {
        float acc[TILE_COLS];
        for (int j = 0; j < TILE_COLS; j++) acc[j] = accumulate ? c[r * ldc + j] : 0.f;
        for (int64_t k = 0; k < K; k++)
#pragma omp simd
            for (int j = 0; j < TILE_COLS; j++) acc[j] = __builtin_fmaf(a[r * rs + k * ks], b[k * ldb + j], acc[j]);
        for (int j = 0; j < TILE_COLS; j++) c[r * ldc + j] = acc[j];
    }
}

static inline void tile6x16p(const float *ap, int64_t rs, int64_t ks, const float *b, int64_t K, float *c,
                             int64_t ldc, int accumulate, const float *pf, int64_t pf_len, int64_t mr) {
    (void)pf, (void)pf_len;
    tile_portable(ap, rs, ks, b, TILE_COLS, K, c, ldc, accumulate, mr);
}
#endif

/* The tile over `np` packed panels: six rows of A (element (i, k) at ap[i * rs + k * ks]) against `np` adjacent
 * panels (b[k * PANEL_COLS + j] of each, np = 1 or PANEL_GROUP), whose columns land side by side in
 * c, as tile6x16p. `np` is a constant at every call, so each variant compiles without the branches.
 * On AVX-512 a panel is 32 columns, two zmm vectors per row: one panel gives the AVX2 tile's twelve
 * FMA chains, a pair twenty-four (hot in L1: ~94% of the measured FMA peak for the pair vs ~85%
 * single, since it needs 10 loads per 24 FMAs instead of 8 per 12). `pf`: `pf_rows` rows of
 * PANEL_COLS floats of the next panels, prefetched into L2 over the first iterations, np a k. */
#if defined(__AVX512F__)
enum { PANEL_COLS = 32, PANEL_GROUP = 2 }; /* PANEL_GROUP: panels the GEMM hands one tile call */
#define W_INIT(i, v)                                                               \
    __m512 w##i##v = _mm512_setzero_ps();                                          \
    if (accumulate && mr > i && v / 2 < np) w##i##v = _mm512_loadu_ps(c + i * ldc + v * 16);
#define W_FMA(i, v) \
    if (mr > i) w##i##v = _mm512_fmadd_ps(_mm512_set1_ps(a[i * rs]), b##v, w##i##v);
#define W_STORE(i, v)                                                              \
    if (mr > i && v / 2 < np) _mm512_storeu_ps(c + i * ldc + v * 16, w##i##v);
#define W_ROWS(M, v) M(0, v) M(1, v) M(2, v) M(3, v) M(4, v) M(5, v)
#define W_PF(row)                                                                  \
    {                                                                              \
        _mm_prefetch((const char *)(pf + (row) * PANEL_COLS), _MM_HINT_T1);       \
        _mm_prefetch((const char *)(pf + (row) * PANEL_COLS + 16), _MM_HINT_T1);  \
    }

static inline __attribute__((always_inline)) void
tile_group(const float *ap, const int64_t rs, const int64_t ks, const float *p0, const float *p1, const int np,
           int64_t K, float *c, int64_t ldc, int accumulate, const float *pf, int64_t pf_rows, int64_t mr) {
    W_ROWS(W_INIT, 0) W_ROWS(W_INIT, 1) W_ROWS(W_INIT, 2) W_ROWS(W_INIT, 3)
#define STEP(k)                                                                    \
    {                                                                              \
        const __m512 b0 = _mm512_loadu_ps(p0 + (k) * PANEL_COLS);                  \
        const __m512 b1 = _mm512_loadu_ps(p0 + (k) * PANEL_COLS + 16);             \
        const float *a = ap + (k) * ks;                                            \
        W_ROWS(W_FMA, 0) W_ROWS(W_FMA, 1)                                          \
        if (np == 2) {                                                             \
            const __m512 b2 = _mm512_loadu_ps(p1 + (k) * PANEL_COLS);              \
            const __m512 b3 = _mm512_loadu_ps(p1 + (k) * PANEL_COLS + 16);         \
            W_ROWS(W_FMA, 2) W_ROWS(W_FMA, 3)                                      \
        }                                                                          \
    }
    int64_t k = 0;
    for (const int64_t kp = pf ? ((pf_rows + np - 1) / np < K ? (pf_rows + np - 1) / np : K) : 0; k < kp; k++) {
        for (int64_t r = np * k; r < np * k + np && r < pf_rows; r++) W_PF(r)
        STEP(k)
    }
    for (; k < K; k++) STEP(k)
#undef STEP
    W_ROWS(W_STORE, 0) W_ROWS(W_STORE, 1) W_ROWS(W_STORE, 2) W_ROWS(W_STORE, 3)
}
#else
/* One panel at a time: two 256 x 16 slices would fill a Zen 3's 32 KB L1, where one was measured;
 * AVX2's 16 registers hold one tile's twelve accumulators, so a group is tiles side by side. */
enum { PANEL_COLS = TILE_COLS, PANEL_GROUP = 1 };
static inline __attribute__((always_inline)) void
tile_group(const float *ap, const int64_t rs, const int64_t ks, const float *p0, const float *p1, const int np,
           int64_t K, float *c, int64_t ldc, int accumulate, const float *pf, int64_t pf_rows, int64_t mr) {
    const float *panel[2] = {p0, p1};
    for (int i = 0; i < np; i++)
        tile6x16p(ap, rs, ks, panel[i], K, c + i * PANEL_COLS, ldc, accumulate,
                  pf ? pf + pf_rows * i / np * PANEL_COLS : 0, pf_rows * (i + 1) / np - pf_rows * i / np, mr);
}
#endif

/* tile_group with mr made a compile-time constant in each case, so that a partial tile skips the
 * FMAs of the rows it lacks: a 20-row decode step computes 20 rows, not 4 x 6 = 24. */
static inline __attribute__((always_inline)) void
tile_rows(const float *ap, const int64_t rs, const int64_t ks, const float *p0, const float *p1, const int np,
          int64_t K, float *c, int64_t ldc, int accumulate, const float *pf, int64_t pf_rows, int64_t mr) {
#define TILE_ROWS_CASE(m) tile_group(ap, rs, ks, p0, p1, np, K, c, ldc, accumulate, pf, pf_rows, m)
    switch (mr) {
    case 1: TILE_ROWS_CASE(1); break;
    case 2: TILE_ROWS_CASE(2); break;
    case 3: TILE_ROWS_CASE(3); break;
    case 4: TILE_ROWS_CASE(4); break;
    case 5: TILE_ROWS_CASE(5); break;
    default: TILE_ROWS_CASE(6); break;
    }
#undef TILE_ROWS_CASE
}
#endif
