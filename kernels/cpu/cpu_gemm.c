/* fp32 GEMM for the model's linear layers: y[M, N] = x[M, K] @ W[K, N] (+ bias[N]).
 *
 * Why our own: MKL on an AVX2 EPYC ran decode-sized products (M = 1-48 rows) at 5-90 GFLOP/s and
 * repacked the weight on every call (its copy routine was 15% of an engine profile); on an AVX-512
 * Xeon ours runs them at 0.8-1.6x MKL (1.2-1.6x from 4 to 48 rows). Here the weight is packed
 * once, at load time, into column panels of NR (16 on AVX2, 32 on AVX-512): wp[N/NR][K][NR],
 * zero-padded (kernels/cpu/gemm.py), which the register tiles of cpu_tile.h read front to back,
 * two panels at a time where there are two.
 *
 * Every output element is one FMA chain over k = 0..K-1 whatever M is, so a row's result does
 * not depend on what else is in the batch. Threads take disjoint ranges of panels (decode-sized
 * batches) or of row tiles (prompt-sized); rows go in blocks of mc, packed six-interleaved
 * (pack_rows) so that a block stays in L2 while every panel streams past it, and K in slices that
 * keep the panels' slice in L1 (group_rows).
 * x and y: row-major with leading dimensions ldx / ldy (elements). Returns 0, or -1 out of memory.
 */
#include "cpu_common.h"
#include "cpu_gemm.h"
#include "cpu_tile.h"
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* KC: K slice, so that the slices of a tile call's panels stay in L1 while the row tiles pass over
 * them (a pair: 2 x 128 x 32 floats = 32 KB of 48 on AVX-512; one 256 x 16 panel = 16 KB on AVX2):
 * on a Zen 3 whole 576-deep panels ran at ~90 GFLOP/s against ~150 sliced; on an AVX-512 Xeon
 * decode-sized products gained 15-20% from slicing. KC_ROWS: the slice when threads split rows
 * (prompt-sized batches) on AVX-512: there slicing lost, since the partial sums wait in y, whose rows
 * lie a whole row apart: 2048 x 576 x 3072 ran at 120-130 GFLOP/s per core sliced 64-256 deep
 * against ~153 unsliced, the panels streaming from its 2 MB L2. ROW_SPLIT_TILES: tiles of rows per
 * thread from which threads split rows instead of panels. */
#if defined(__AVX512F__)
enum { NR = PANEL_COLS, KC = 4096 / NR, KC_ROWS = 1024, ROW_SPLIT_TILES = 8 };
#else
enum { NR = PANEL_COLS, KC = 4096 / NR, KC_ROWS = KC, ROW_SPLIT_TILES = 8 };
#endif

typedef struct {
    const float *x, *wp, *bias;
    float *y;
    int64_t m, k, n, ldx, ldy, mc, kc;
    int64_t glu; /* 0, or SwiGLU: n = I outputs, gate panel p pairs with up panel p + glu (= I / NR) */
    const gemm_next_t *next; /* NULL, or when threads split panels: prefetched as this one ends */
} gemm_t;

/* Panels of a weight with n output columns, counted as the loops step over them: SwiGLU (glu) runs
 * gate panel p with up panel p + n / NR, so only the n / NR gate panels lead. */
static inline int64_t panels_of(int64_t n, int64_t glu) { return glu ? n / NR : (n + NR - 1) / NR; }

/* The m rows of a block go in ceil(m / 6) tiles of nearly equal height (tile t: rows
 * [tile_start(t), tile_start(t + 1))): 20 rows as 5 + 5 + 5 + 5, not 6 + 6 + 6 + 2, whose last
 * tile does a third of the work at a much lower rate (its B loads are shared by two rows). */
static inline int64_t tile_start(int64_t m, int64_t t) { return m * t / tile_count(m); }

#if defined(__AVX512F__)
/* out[k * 6 + i] = r[i][k] for k < 16: the six rows' 16-float vectors interleaved, as six vectors
 * of 16. Output lane p of vector j is element (16j + p) / 6 (IDX) of row (16j + p) % 6, whose
 * lanes are the mask LANES[(i + 2j) % 6]: a masked permute per row. Scalar strided stores took
 * ~4% of a prompt-sized GEMM's time (2048 rows x 576: 204 vs 196 ms without packing). */
static inline void interleave6x16(const __m512 r[TILE_ROWS], float *out) {
    static const int32_t IDX[TILE_ROWS][16] = {
        {0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2},       {2, 2, 3, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 5, 5},
        {5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7},       {8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 10, 10, 10, 10},
        {10, 10, 11, 11, 11, 11, 11, 11, 12, 12, 12, 12, 12, 12, 13, 13},
        {13, 13, 13, 13, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15}};
    static const __mmask16 LANES[TILE_ROWS] = {0x1041, 0x2082, 0x4104, 0x8208, 0x0410, 0x0820};
#pragma GCC unroll 6
    for (int j = 0; j < TILE_ROWS; j++) {
        const __m512i ix = _mm512_loadu_si512(IDX[j]);
        __m512 o = _mm512_maskz_permutexvar_ps(LANES[(2 * j) % TILE_ROWS], ix, r[0]);
#pragma GCC unroll 5
        for (int i = 1; i < TILE_ROWS; i++) o = _mm512_mask_permutexvar_ps(o, LANES[(i + 2 * j) % TILE_ROWS], ix, r[i]);
        _mm512_storeu_ps(out + 16 * j, o);
    }
}
#endif

/* Rows [r0, r1) of x as tiles of up to six interleaved rows: ap[tile][k][6], unused lanes zero. */
static void pack_rows(const gemm_t *g, int64_t r0, int64_t r1, float *ap) {
    const int64_t K = g->k, m = r1 - r0;
    for (int64_t t = 0; t < tile_count(m); t++, ap += K * TILE_ROWS) {
        const int64_t a = tile_start(m, t), mr = tile_start(m, t + 1) - a;
        int64_t k0 = 0;
#if defined(__AVX512F__)
        for (; k0 + 16 <= K; k0 += 16) {
            __m512 r[TILE_ROWS];
            for (int64_t i = 0; i < TILE_ROWS; i++)
                r[i] = i < mr ? _mm512_loadu_ps(g->x + (r0 + a + i) * g->ldx + k0) : _mm512_setzero_ps();
            interleave6x16(r, ap + k0 * TILE_ROWS);
        }
#endif
        for (int64_t i = 0; i < TILE_ROWS; i++) {
            const float *x = g->x + (r0 + a + i) * g->ldx;
            if (i < mr)
                for (int64_t k = k0; k < K; k++) ap[k * TILE_ROWS + i] = x[k];
            else
                for (int64_t k = k0; k < K; k++) ap[k * TILE_ROWS + i] = 0.f;
        }
    }
}

/* Rows [r0, r1) (packed in ap) x panels [p, p + np) (np = 1, or 2 on AVX-512) into y (+ bias).
 * K goes in slices of at most KC so that the panels' slice stays in L1 while every tile of rows
 * passes over it (whole 576-deep panels did not fit: ~90 GFLOP/s instead of ~150 on AVX2); the
 * partial sums wait in y itself (or in `part`, [mc + 6, 2 * NR], for columns past n), reloaded per
 * slice, so each element is still one FMA chain over k in order. While these panels are worked on,
 * `next_rows` rows of the following ones (`next`, NULL: none) are prefetched in equal slices
 * (`pair`: a SwiGLU pair, its up panel `pair` panels of `pair_k` rows after the gate panel).
 * SwiGLU (g->glu): p is a gate panel, np 1; it and its up panel run as one pair into `part`, and
 * each tile's rows become silu(gate) * up in y once their last slice is done, while still in L1:
 * the [M, 2I] product never goes out to memory and back (the stand-alone kernel's two passes).
 * Every gate / up element is the plain GEMM's FMA chain, so the result is its bits. */
static void group_rows(const gemm_t *g, int64_t p, int64_t np, int64_t r0, int64_t r1, const float *ap,
                       float *part, const float *next, int64_t next_rows, int64_t pair, int64_t pair_k) {
    const int64_t K = g->k, col = p * NR, cols = g->n - col < np * NR ? g->n - col : np * NR;
    const int64_t m = r1 - r0, nt = tile_count(m), nk = (K + g->kc - 1) / g->kc, kc = (K + nk - 1) / nk;
    const int direct = !g->glu && cols == np * NR;
    float *c = direct ? g->y + r0 * g->ldy + col : part;
    const int64_t ldc = direct ? g->ldy : 2 * NR;
    const float *w0 = g->wp + p * K * NR, *w1 = w0 + (g->glu ? g->glu : 1) * K * NR;
    for (int64_t ks = 0, step = 0; ks < nk; ks++) {
        const int64_t k0 = ks * kc, k1 = k0 + kc < K ? k0 + kc : K;
        for (int64_t i = 0; i < nt; i++, step++) {
            const int64_t mr = tile_start(m, i + 1) - tile_start(m, i);
            int64_t f0 = next_rows * step / (nt * nk), f1 = next_rows * (step + 1) / (nt * nk);
            const float *pf = next ? next + f0 * NR : 0;
            if (pair && f0 >= pair_k) /* the second half of a SwiGLU pair's prefetch: its up panel */
                pf = next + (pair * pair_k + f0 - pair_k) * NR;
            else if (pair && f1 > pair_k)
                f1 = pair_k;
            const float *a = ap + (i * K + k0) * TILE_ROWS;
            float *ci = c + tile_start(m, i) * ldc;
            if (np == 2 || g->glu) /* constant np per call: each tile_group variant compiles branch-free */
                tile_rows(a, 1, TILE_ROWS, w0 + k0 * NR, w1 + k0 * NR, 2, k1 - k0, ci, ldc, ks > 0, pf, f1 - f0, mr);
            else
                tile_rows(a, 1, TILE_ROWS, w0 + k0 * NR, 0, 1, k1 - k0, ci, ldc, ks > 0, pf, f1 - f0, mr);
            if (g->glu && ks == nk - 1)
                for (int64_t r = 0; r < mr; r++)
                    silu_mul_f32(ci + r * ldc, ci + r * ldc + NR, g->y + (r0 + tile_start(m, i) + r) * g->ldy + col, NR);
        }
    }
    if (g->glu) return;
    for (int64_t r = r0; r < r1; r++) {
        float *out = g->y + r * g->ldy + col;
        if (!direct) memcpy(out, part + (r - r0) * ldc, sizeof(float) * cols);
        if (g->bias)
            for (int64_t j = 0; j < cols; j++) out[j] += g->bias[col + j];
    }
}

/* The next product's panels where the thread starting at panel p0 of this one will most likely
 * start (threads split both in proportion; where the rounding or the thread count differs it is a
 * panel off or a share off, which costs a wasted prefetch, never a wrong result), its first
 * PANEL_GROUP panels (SwiGLU: a gate panel and its up panel). */
static const float *next_panels(const gemm_t *g, int64_t p0, int64_t *rows, int64_t *pair, int64_t *pair_k) {
    const gemm_next_t *nx = g->next;
    const int64_t total = panels_of(nx->n, nx->glu), q0 = total * p0 / panels_of(g->n, g->glu);
    if (q0 >= total) return 0;
    *pair = nx->glu ? total : 0;
    *pair_k = nx->k;
    *rows = (nx->glu ? 2 : (total - q0 < PANEL_GROUP ? total - q0 : PANEL_GROUP)) * nx->k;
    return nx->wp + q0 * nx->k * NR;
}

/* Rows [m0, m1) x panels [p0, p1), one block of mc rows at a time (packed once per block), the
 * panels PANEL_GROUP at a time (SwiGLU: gate panels, one pair at a time). */
static int block(const gemm_t *g, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
    const int64_t rows = (m1 - m0 < g->mc ? m1 - m0 : g->mc) + TILE_ROWS; /* a decode step: a few */
    float *ap = malloc(sizeof(float) * rows * (g->k + 2 * NR));
    if (!ap) return -1;
    float *part = ap + rows * g->k;
    const int64_t group = g->glu ? 1 : PANEL_GROUP;
    for (int64_t r0 = m0; r0 < m1; r0 += g->mc) {
        const int64_t r1 = r0 + g->mc < m1 ? r0 + g->mc : m1;
        pack_rows(g, r0, r1, ap);
        for (int64_t p = p0; p < p1; p += group) {
            const int64_t np = p + 1 < p1 ? group : 1;
            const int64_t after = p1 - p - np < group ? p1 - p - np : group;
            /* SwiGLU prefetches the next gate panel, then its up panel (group_rows) */
            const float *nx = after ? g->wp + (p + np) * g->k * NR : 0;
            int64_t pf_rows = after ? (g->glu ? 2 : after) * g->k : 0, pair = g->glu, pair_k = g->k;
            if (!after && g->next && r1 == m1) /* this thread's last panels: the next product's first */
                nx = next_panels(g, p0, &pf_rows, &pair, &pair_k);
            group_rows(g, p, np, r0, r1, ap, part, nx, pf_rows, pair, pair_k);
        }
    }
    free(ap);
    return 0;
}

/* Decode-sized batches: threads split the panels, so the weight streams from memory once (each
 * thread packs the few rows itself). */
static int by_panels(const void *arg, int64_t lo, int64_t hi) {
    const gemm_t *g = (const gemm_t *)arg;
    return block(g, 0, g->m, lo, hi);
}

/* Prompt-sized batches: threads split the rows in whole tiles, so no row is packed twice and a
 * few wide panels cannot leave one thread idle (9 or 18 panels of a 576-wide layer split 5:4);
 * each thread then reads the whole weight, from cache, once per block of mc rows. */
static int by_rows(const void *arg, int64_t lo, int64_t hi) {
    const gemm_t *g = (const gemm_t *)arg;
    const int64_t m1 = hi * TILE_ROWS < g->m ? hi * TILE_ROWS : g->m;
    return block(g, lo * TILE_ROWS, m1, 0, panels_of(g->n, g->glu));
}

/* Rows per packed block, whole tiles: half the L2 cache's worth of x (sysconf; 512 KB if unknown). */
static int64_t row_block(int64_t k) {
    static long l2 = 0;
    if (!l2) {
        const long v = sysconf(_SC_LEVEL2_CACHE_SIZE);
        l2 = v > 0 ? v : 512 * 1024;
    }
    const int64_t mc = (int64_t)(l2 / 2 / sizeof(float)) / (k > 0 ? k : 1) / TILE_ROWS * TILE_ROWS;
    return mc < TILE_ROWS ? TILE_ROWS : mc;
}

/* The panel width this build packs for (16 with AVX2, 32 with AVX-512). */
int gemm_panel_width(void) { return NR; }

static int run(gemm_t *g, int nthreads) {
    const int64_t np = panels_of(g->n, g->glu), tiles = tile_count(g->m);
    const int split_rows = tiles >= ROW_SPLIT_TILES * nthreads;
    g->mc = row_block(g->k);
    g->kc = split_rows ? KC_ROWS : KC;
    const int64_t pair = g->glu ? 2 : 1; /* SwiGLU: each output column costs a gate and an up column */
    if (split_rows) {
        g->next = 0; /* each thread reads every panel, from cache: nothing to start early */
        return parallel_rows(by_rows, g, tiles, g->k * g->n * pair, nthreads);
    }
    return parallel_rows(by_panels, g, np, g->m * g->k * NR * pair, nthreads);
}

int gemm_packed_then(const float *x, const float *wp, const float *bias, float *y, int64_t m, int64_t k, int64_t n,
                     int64_t ldx, int64_t ldy, const gemm_next_t *next, int nthreads) {
    gemm_t g = {x, wp, bias, y, m, k, n, ldx, ldy, 0, 0, 0, next};
    return run(&g, nthreads);
}

int gemm_packed(const float *x, const float *wp, const float *bias, float *y, int64_t m, int64_t k,
                int64_t n, int64_t ldx, int64_t ldy, int nthreads) {
    return gemm_packed_then(x, wp, bias, y, m, k, n, ldx, ldy, 0, nthreads);
}

/* y[M, I] = silu(x @ gate) * (x @ up) for W = [gate | up] packed as one [K, 2I] weight (2I / NR
 * panels): the MLP's gate_up product and SwiGLU in one pass. Needs I to be whole panels (-4
 * otherwise: the caller runs the two steps apart). `next`: as gemm_packed_then. */
int gemm_packed_swiglu_then(const float *x, const float *wp, float *y, int64_t m, int64_t k, int64_t inter,
                            int64_t ldx, int64_t ldy, const gemm_next_t *next, int nthreads) {
    if (inter < NR || inter % NR) return -4;
    gemm_t g = {x, wp, 0, y, m, k, inter, ldx, ldy, 0, 0, inter / NR, next};
    return run(&g, nthreads);
}

int gemm_packed_swiglu(const float *x, const float *wp, float *y, int64_t m, int64_t k, int64_t inter,
                       int64_t ldx, int64_t ldy, int nthreads) {
    return gemm_packed_swiglu_then(x, wp, y, m, k, inter, ldx, ldy, 0, nthreads);
}
