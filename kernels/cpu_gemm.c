/* fp32 GEMM for the model's linear layers: y[M, N] = x[M, K] @ W[K, N] (+ bias[N]).
 *
 * Why our own: MKL on an AVX2 EPYC ran decode-sized products (M = 1-48 rows) at 5-90 GFLOP/s and
 * repacked the weight on every call (its copy routine was 15% of an engine profile). Here the
 * weight is packed once, at load time, into column panels of NR = 16: wp[N/16][K][16], zero-padded
 * (kernels/cpu_gemm.py), which a 6x16 register tile reads front to back.
 *
 * Every output element is one FMA chain over k = 0..K-1 whatever M is, so a row's result does
 * not depend on what else is in the batch. Threads take disjoint ranges of panels; rows go in
 * blocks of MC, packed six-interleaved (pack_rows) so that a block stays in L2 while every panel
 * streams past it, and K in slices that keep a panel's slice in L1 (panel_rows).
 * x and y: row-major with leading dimensions ldx / ldy (elements). Returns 0, or -1 out of memory.
 */
#include "cpu_common.h"
#include "cpu_tile.h"
#include <stdlib.h>
#include <string.h>

enum { NR = TILE_COLS, KC = 256 };

typedef struct {
    const float *x, *wp, *bias;
    float *y;
    int64_t m, k, n, ldx, ldy, mc;
} gemm_t;

/* Rows [r0, r1) of x as tiles of six interleaved rows: ap[tile][k][6], rows past r1 zero. */
static void pack_rows(const gemm_t *g, int64_t r0, int64_t r1, float *ap) {
    const int64_t K = g->k;
    for (int64_t r = r0; r < r1; r += TILE_ROWS, ap += K * TILE_ROWS)
        for (int64_t i = 0; i < TILE_ROWS; i++) {
            const float *x = g->x + (r + i) * g->ldx;
            if (r + i < r1)
                for (int64_t k = 0; k < K; k++) ap[k * TILE_ROWS + i] = x[k];
            else
                for (int64_t k = 0; k < K; k++) ap[k * TILE_ROWS + i] = 0.f;
        }
}

/* Rows [r0, r1) (packed in ap) of one panel into y (+ bias). K goes in slices of at most KC so
 * that a slice of the panel (KC x 16) stays in L1 while every tile of rows passes over it (a whole
 * 576-deep panel did not fit, and the tiles ran at ~90 GFLOP/s instead of ~150 with one tile); the
 * partial sums wait in acc, so each element is still one FMA chain over k in order. While the
 * panel is worked on, panel `next` (NULL: none) is prefetched in equal slices, so that its first
 * tile finds it in cache. */
static void panel_rows(const gemm_t *g, int64_t p, int64_t r0, int64_t r1, const float *ap, float *acc,
                       const float *next) {
    const int64_t K = g->k, col = p * NR, cols = g->n - col < NR ? g->n - col : NR;
    const int64_t nt = (r1 - r0 + TILE_ROWS - 1) / TILE_ROWS, nk = (K + KC - 1) / KC, kc = (K + nk - 1) / nk;
    const float *wp = g->wp + p * K * NR;
    for (int64_t ks = 0, step = 0; ks < nk; ks++) {
        const int64_t k0 = ks * kc, k1 = k0 + kc < K ? k0 + kc : K;
        for (int64_t i = 0; i < nt; i++, step++) {
            const int64_t mr = r1 - r0 - i * TILE_ROWS < TILE_ROWS ? r1 - r0 - i * TILE_ROWS : TILE_ROWS;
            const int64_t f0 = K * step / (nt * nk), f1 = K * (step + 1) / (nt * nk);
            tile6x16p(ap + (i * K + k0) * TILE_ROWS, wp + k0 * NR, k1 - k0, acc + i * TILE_ROWS * NR, NR, ks > 0,
                      next ? next + f0 * NR : 0, f1 - f0, mr);
        }
    }
    for (int64_t r = r0; r < r1; r++) {
        float *out = acc + (r - r0) * NR;
        if (g->bias)
            for (int64_t c = 0; c < cols; c++) out[c] += g->bias[col + c];
        memcpy(g->y + r * g->ldy + col, out, sizeof(float) * cols);
    }
}

/* Panels [lo, hi) for all rows, one block of MC rows at a time (packed once per block). */
static int panels(const void *arg, int64_t lo, int64_t hi) {
    const gemm_t *g = (const gemm_t *)arg;
    float *ap = malloc(sizeof(float) * (g->mc + TILE_ROWS) * (g->k + NR));
    if (!ap) return -1;
    float *acc = ap + (g->mc + TILE_ROWS) * g->k; /* [mc + 6, 16] partial sums of one panel */
    for (int64_t r0 = 0; r0 < g->m; r0 += g->mc) {
        const int64_t r1 = r0 + g->mc < g->m ? r0 + g->mc : g->m;
        pack_rows(g, r0, r1, ap);
        for (int64_t p = lo; p < hi; p++)
            panel_rows(g, p, r0, r1, ap, acc, p + 1 < hi ? g->wp + (p + 1) * g->k * NR : 0);
    }
    free(ap);
    return 0;
}

int gemm_packed(const float *x, const float *wp, const float *bias, float *y, int64_t m, int64_t k,
                int64_t n, int64_t ldx, int64_t ldy, int nthreads) {
    /* ~256 KB of x per row block (half of this CPU's L2), a multiple of the tile height. */
    int64_t mc = (65536 / (k > 0 ? k : 1)) / TILE_ROWS * TILE_ROWS;
    if (mc < TILE_ROWS) mc = TILE_ROWS;
    gemm_t g = {x, wp, bias, y, m, k, n, ldx, ldy, mc};
    const int64_t np = (n + NR - 1) / NR;
    return parallel_rows(panels, &g, np, m * k * NR, nthreads);
}
