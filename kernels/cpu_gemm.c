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
#include "cpu_tile.h"
#include <string.h>

enum { NR = TILE_COLS };

typedef struct {
    const float *x, *wp, *bias;
    float *y;
    int64_t m, k, n, ldx, ldy, mc;
} gemm_t;

/* Rows [r0, r1) of one panel into y (+ bias), through a 6 x 16 scratch tile so that a partial
 * last panel writes only its own columns. The first tile, which streams this panel in from
 * memory, also asks for panel `next`'s lines (NULL: none), so that the next panel's first tile
 * finds them on the way: 5-15% faster at decode sizes (measured, weights read from DRAM). */
static void panel_rows(const gemm_t *g, int64_t p, int64_t r0, int64_t r1, const float *next) {
    const float *wp = g->wp + p * g->k * NR;
    const int64_t col = p * NR, cols = g->n - col < NR ? g->n - col : NR;
    float out[TILE_ROWS * NR];
    for (int64_t r = r0; r < r1; r += TILE_ROWS, next = 0) {
        const int64_t mr = r1 - r < TILE_ROWS ? r1 - r : TILE_ROWS;
        tiles(g->x + r * g->ldx, g->ldx, wp, NR, g->k, out, NR, 0, next, mr);
        for (int64_t i = 0; i < mr; i++) {
            if (g->bias)
                for (int64_t c = 0; c < cols; c++) out[i * NR + c] += g->bias[col + c];
            memcpy(g->y + (r + i) * g->ldy + col, out + i * NR, sizeof(float) * cols);
        }
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
    int64_t mc = (65536 / (k > 0 ? k : 1)) / TILE_ROWS * TILE_ROWS;
    if (mc < TILE_ROWS) mc = TILE_ROWS;
    gemm_t g = {x, wp, bias, y, m, k, n, ldx, ldy, mc};
    const int64_t np = (n + NR - 1) / NR;
    return parallel_rows(panels, &g, np, m * k * NR, nthreads);
}
