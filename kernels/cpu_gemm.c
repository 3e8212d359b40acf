/* fp32 GEMM for the model's linear layers: y[M, N] = x[M, K] @ W[K, N] (+ bias[N]).
 *
 * Why our own: MKL on an AVX2 EPYC ran decode-sized products (M = 1-48 rows) at 5-90 GFLOP/s and
 * repacked the weight on every call (its copy routine was 15% of an engine profile). Here the
 * weight is packed once, at load time, into column panels of NR = 16: wp[N/16][K][16], zero-padded
 * (kernels/cpu_gemm.py), which a 6x16 register tile reads front to back.
 *
 * Every output element is one FMA chain over k = 0..K-1 whatever M is, so a row's result does
 * not depend on what else is in the batch. Threads take disjoint ranges of panels; rows go in
 * blocks of MC so that a block of x stays in L2 while every panel streams past it.
 * x and y: row-major with leading dimensions ldx / ldy (elements). Returns 0.
 */
#include "cpu_common.h"
#include <string.h>

enum { NR = 16, MR = 6 };

typedef struct {
    const float *x, *wp, *bias;
    float *y;
    int64_t m, k, n, ldx, ldy, mc;
} gemm_t;

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* mr (<= MR) rows x one 16-column panel, twelve named accumulators: GCC kept an array of them on
 * the stack, storing it back on every k (measured: ~57 of ~200 GFLOP/s). Rows past mr repeat row
 * mr - 1 (loads that hit L1; their results are not stored). */
static inline __attribute__((always_inline)) void
tile(const gemm_t *g, const float *x, const float *wp, float *y, int64_t col, const int mr, const float *pf) {
    const int64_t K = g->k, ldx = g->ldx;
    const float *x0 = x, *x1 = x + (mr > 1 ? 1 : 0) * ldx, *x2 = x + (mr > 2 ? 2 : mr - 1) * ldx,
                *x3 = x + (mr > 3 ? 3 : mr - 1) * ldx, *x4 = x + (mr > 4 ? 4 : mr - 1) * ldx,
                *x5 = x + (mr > 5 ? 5 : mr - 1) * ldx;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < K; k++) {
        const __m256 b0 = _mm256_load_ps(wp + k * NR), b1 = _mm256_load_ps(wp + k * NR + 8);
        if (pf) _mm_prefetch((const char *)(pf + k * NR), _MM_HINT_T0);
        __m256 a;
#define ROW(i)                                    \
        a = _mm256_broadcast_ss(x##i + k);        \
        c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0); \
        c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
    }
    const __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    const int64_t cols = g->n - col < NR ? g->n - col : NR;
    for (int r = 0; r < mr; r++) {
        float out[NR];
        _mm256_storeu_ps(out, acc[r][0]);
        _mm256_storeu_ps(out + 8, acc[r][1]);
        if (g->bias)
            for (int c = 0; c < cols; c++) out[c] += g->bias[col + c];
        memcpy(y + r * g->ldy + col, out, sizeof(float) * cols);
    }
}
#else
/* Portable tile: the same per-element order (one chain over k), left to the compiler. */
static inline __attribute__((always_inline)) void
tile(const gemm_t *g, const float *x, const float *wp, float *y, int64_t col, const int mr, const float *pf) {
    (void)pf;
    float acc[MR][NR] = {{0}};
    for (int64_t k = 0; k < g->k; k++)
        for (int r = 0; r < mr; r++)
#pragma omp simd
            for (int c = 0; c < NR; c++) acc[r][c] = __builtin_fmaf(x[r * g->ldx + k], wp[k * NR + c], acc[r][c]);
    const int64_t cols = g->n - col < NR ? g->n - col : NR;
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < cols; c++) y[r * g->ldy + col + c] = acc[r][c] + (g->bias ? g->bias[col + c] : 0.f);
}
#endif

/* Rows [r0, r1) of one panel, MR at a time (the remainder with a smaller constant tile). The
 * first tile, which streams this panel in from memory, also asks for panel `next`'s lines (NULL:
 * none), so that the next panel's first tile finds them on the way: 5-15% faster at decode sizes
 * (measured, weights read from DRAM). */
static void panel_rows(const gemm_t *g, int64_t p, int64_t r0, int64_t r1, const float *next) {
    const float *wp = g->wp + p * g->k * NR;
    const int64_t col = p * NR;
    int64_t r = r0;
    for (; r + MR <= r1; r += MR, next = 0) tile(g, g->x + r * g->ldx, wp, g->y + r * g->ldy, col, MR, next);
    const float *x = g->x + r * g->ldx;
    float *y = g->y + r * g->ldy;
    switch (r1 - r) {
    case 5: tile(g, x, wp, y, col, 5, next); break;
    case 4: tile(g, x, wp, y, col, 4, next); break;
    case 3: tile(g, x, wp, y, col, 3, next); break;
    case 2: tile(g, x, wp, y, col, 2, next); break;
    case 1: tile(g, x, wp, y, col, 1, next); break;
    }
}

/* Panels [lo, hi) for all rows, one block of MC rows at a time. */
static int panels(const void *arg, int64_t lo, int64_t hi) {
    const gemm_t *g = (const gemm_t *)arg;
    for (int64_t r0 = 0; r0 < g->m; r0 += g->mc) {
        const int64_t r1 = r0 + g->mc < g->m ? r0 + g->mc : g->m;
        for (int64_t p = lo; p < hi; p++) panel_rows(g, p, r0, r1, p + 1 < hi ? g->wp + (p + 1) * g->k * NR : 0);
    }
    return 0;
}

int gemm_packed(const float *x, const float *wp, const float *bias, float *y, int64_t m, int64_t k,
                int64_t n, int64_t ldx, int64_t ldy, int nthreads) {
    /* ~256 KB of x per row block (half of this CPU's L2), a multiple of the tile height. */
    int64_t mc = (65536 / (k > 0 ? k : 1)) / MR * MR;
    if (mc < MR) mc = MR;
    gemm_t g = {x, wp, bias, y, m, k, n, ldx, ldy, mc};
    const int64_t np = (n + NR - 1) / NR;
    return parallel_rows(panels, &g, np, m * k * NR, nthreads);
}
