/* Quantized GEMM on integer dot products (AVX512-VNNI): y[M, N] = x[M, K] @ W (+ bias).
 *
 * Why: the widening kernel (cpu_qgemm.c) pays a conversion and an fp32 FMA per weight per row, so
 * a decode step is bound by that arithmetic (~13 ms for SmolLM2), not by the ~3 ms its packed bytes
 * take to stream. Here each row of x is quantized to int8 per block of AB = 32 inputs (dx = max|x| /
 * 127, as llama.cpp's q8 activations; a whole row's one scale, tried first, cost int8 weights 10x
 * their KL against fp32 on SmolLM2), and one vpdpbusd multiplies 64 unsigned weight bytes by 64
 * signed activation bytes into 16 int32 sums: the weights are used as stored, never widened.
 *
 * Layout (kernels/cpu/qgemm.py QPackedWeight, layout "vnni"): panels of VP = 16 output columns, in
 * which 4 consecutive k of one column share a 32-bit lane, as vpdpbusd sums them:
 *   int8  q[P][K / 4][16][4] bytes holding u = q + 128 (vpdpbusd's first operand is unsigned; the
 *         128 * sum(xq) that adds is removed per group in fp32, with the offset term: tile())
 *   int4  q[P][K / 8][16][4] bytes: low nibble k = 8j + i, high nibble k = 8j + 4 + i
 *   scales, offsets (or none) fp32 [P][K / g][16], W = scale * q + offset as in kernels/qtensor.py.
 * Then y[r, n] = sum_b scale[n, g(b)] * dx[r, b] * sum_{k in b} q[n, k] xq[r, k] + sum_g offset[n, g] *
 * sx[r, g], with sx the group's sum of the quantized x (sum of dx * sum(xq) over its blocks): the
 * product is then exactly W times the quantized activations. (The exact sum of x looks better and
 * is worse: with unsigned q and an offset, scale * q and offset are each larger than W, and their
 * rounding errors stop cancelling.)
 * The int32 sums cannot overflow for K < 60,000 (|u * xq| <= 255 * 127 a byte pair).
 * Threads split panels for decode-sized batches, rows for prompt-sized ones, as cpu_qgemm.c does.
 * Written on cpu_qdot.h's 16-lane vectors: vpdpbusd on AVX512-VNNI; on AVX2, vpmaddubsw + vpmaddwd
 * (int8 with vpsignb, cpu_qdot.h), whose int32 sums, and so results, are the same bits.
 * qvnni_available() returns the weight widths that run here (8 | 4, or 0), and the packer keeps
 * the widening layout for the others. Returns 0, or -1 out of memory, -2 a bad argument, -3
 * weights of a width that does not run here. */
#include "cpu_common.h"
#include "cpu_qdot.h"
#include "cpu_qgemm.h"
#include <stdlib.h>
#include <string.h>

/* A tile: TILE_ROWS rows x UNIT_PANELS panels. On AVX-512, 4 x 2 panels of int32 and fp32 sums
 * fill the 32 registers. AVX2 has 16 of half the width: 4 x 1, its dots one panel half at a time
 * and the fp32 sums in L1 (on Zen 3, 4 rows ran 1.2x 2-row tiles, and 6 rows 0.9x). */
#if QDOT_512
#define TILE_ROWS 4
#define UNIT_PANELS 2
#else
#define TILE_ROWS 4
#define UNIT_PANELS 1
#endif
/* ROW_SPLIT_TILES: threads split rows (by_rows) only from this many row tiles each; below, they
 * split the weight's panels (by_units). Split by rows, every thread reads every weight, which pays
 * only over enough rows: on a 2-core Zen 4, 30 SmolLM2 layers' int8 products at 32-96 rows ran
 * 3-7% faster split by panels than by rows (with the weights streaming from memory, as in a
 * decode step) and the same at 128-192 rows. The earlier bound, 4 tiles a thread, split from 32. */
enum { VP = 16, AB = 32, MAX_R = TILE_ROWS, CHUNK_TILES = 16, ROW_SPLIT_TILES = 16 };
/* From this many rows, weights packed for AMX (qweight_t.amx) run on its bf16 tiles (cpu_qgemm_amx.c). */
enum { AMX_MIN_ROWS = 32 };

typedef struct {
    const qweight_t *w;
    const int8_t *xq;        /* [M][K] */
    const float *dx;         /* [M][K / AB]: activation scale per block */
    const float *sx;         /* [M][G]: sum over the group's blocks of dx * sum(xq) (offset, shift) */
    const int32_t *xs;       /* [M][K / AB]: sum(xq) per block (the int8 sums' start, QDOT_DP8_BASE) */
    const float *bias;
    float *y;
    int64_t m, k, n, ldy;
    int64_t glu; /* 0, or SwiGLU: n = I outputs, gate panel p pairs with up panel p + glu (= I / VP) */
} vq_t;

int qvnni_available(void) {
    return QDOT_BITS;
}

#if QDOT_BITS

/* Rows [lo, hi) of x quantized per block of AB: xq = round(x / dx), dx = max|x| / 127; sx per
 * weight group: sum over its blocks of dx * sum(xq). */
typedef struct {
    const float *x;
    int64_t ldx, k, g;
    int8_t *xq;
    float *dx, *sx;
    int32_t *xs;
} quant_t;

static int quantize_rows(const void *arg, int64_t lo, int64_t hi) {
    const quant_t *a = (const quant_t *)arg;
    const int64_t B = a->k / AB, G = a->k / a->g, per = a->g / AB;
    for (int64_t r = lo; r < hi; r++)
        for (int64_t b = 0; b < B; b++) {
            const float *x = a->x + r * a->ldx + b * AB;
            int8_t *q = a->xq + r * a->k + b * AB;
            float d;
            const int32_t qsum = qd_quantize32(x, q, &d);
            a->dx[r * B + b] = d;
            a->xs[r * B + b] = qsum;
            if (b % per == 0) a->sx[r * G + b / per] = 0.f;
            a->sx[r * G + b / per] += d * (float)qsum;
        }
    return 0;
}

/* Rows r0 .. r0 + R of x against C (1 or 2) panels pan[]: out[r][c * VP + j] (R, C and ONE
 * compile-time after inlining, so every accumulator is a register). Per activation block: int32
 * sums from zero, then acc += sums * (scale * dx); per weight group: acc += (offset - 128 * scale)
 * * sx, the int8 shift's correction and the offset term in one FMA (sx = the group's sum of dx *
 * sum(xq)). ONE (one group over all K, as int8 per channel): the scale is the same for every
 * block, so acc += sums * dx and the scale multiplies once at the end, 8 fewer multiplies a block
 * than scale * dx per block (they share the FMA ports with vpdpbusd). */
static inline __attribute__((always_inline)) void tile(const vq_t *a, int64_t r0, const int R, const int64_t *pan,
                                                       const int C, float *out, const int ONE) {
    const qweight_t *w = a->w;
    const int64_t K = a->k, g = w->group, G = K / g, B = K / AB;
    const int64_t pbytes = w->bits == 8 ? K * VP : K * VP / 2; /* one panel's bytes */
    const vf_t shift = vf_set1(w->bits == 8 ? -128.f : 0.f);
#if QDOT_512
    vf_t acc[MAX_R][2];
#define ACC(r, c) acc[r][c]
#else /* the fp32 sums wait in out (L1): AVX2's 16 registers hold a block's int32 sums and weights */
#define ACC(r, c) (*(vf_t *)(out + ((r) * C + (c)) * VP))
#endif
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int c = 0; c < C; c++) ACC(r, c) = vf_zero();
    for (int64_t gi = 0; gi < G; gi++) {
        vf_t s[2];
#pragma GCC unroll 2
        for (int c = 0; c < C; c++) s[c] = vf_load(w->scales + (pan[c] * G + gi) * VP);
        for (int64_t b = gi * g / AB; b < (gi + 1) * g / AB; b++) {
            vi_t ia[MAX_R][2];
            const int8_t *xb = a->xq + r0 * K + b * AB;
            const int64_t at = b * AB * VP * w->bits / 8; /* the block's offset in a panel */
            const uint8_t *wp[2] = {w->q + pan[0] * pbytes + at, w->q + pan[C - 1] * pbytes + at};
            if (w->bits == 8)
                dots8(ia, R, C, wp, xb, K, a->xs + r0 * B + b, B);
            else
                dots4(ia, R, C, wp, xb, K);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const vf_t d = vf_set1(a->dx[(r0 + r) * B + b]);
#pragma GCC unroll 2
                for (int c = 0; c < C; c++)
                    ACC(r, c) = vf_fmadd(vi_to_f(ia[r][c]), ONE ? d : vf_mul(s[c], d), ACC(r, c));
            }
            if (!QDOT_512) __asm__ volatile("" ::: "memory"); /* keeps GCC from holding out's sums in registers */
        }
        if (w->offsets || w->bits == 8) {
#pragma GCC unroll 2
            for (int c = 0; c < C; c++) {
                const vf_t o = w->offsets ? vf_load(w->offsets + (pan[c] * G + gi) * VP) : vf_zero();
                const vf_t f = vf_fmadd(shift, s[c], o); /* offset - 128 * scale */
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const vf_t sx = vf_set1(a->sx[(r0 + r) * G + gi]);
                    ACC(r, c) = ONE ? vf_fmadd(ACC(r, c), s[c], vf_mul(f, sx)) : vf_fmadd(f, sx, ACC(r, c));
                }
            }
        } else if (ONE) {
#pragma GCC unroll 2
            for (int c = 0; c < C; c++)
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) ACC(r, c) = vf_mul(ACC(r, c), s[c]);
        }
    }
#if QDOT_512
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int c = 0; c < C; c++) vf_store(out + (r * C + c) * VP, acc[r][c]);
#endif
#undef ACC
}

#define TILE_CASE(R, C) \
    case (R) * 4 + (C): if (one) tile(a, r0, R, pan, C, out, 1); else tile(a, r0, R, pan, C, out, 0); break;

static void tile_any(const vq_t *a, int64_t r0, int R, const int64_t *pan, int C, float *out) {
    const int one = a->w->group == a->k;
    switch (R * 4 + C) {
        TILE_CASE(1, 1) TILE_CASE(1, 2)
#if TILE_ROWS > 1
        TILE_CASE(2, 1) TILE_CASE(2, 2)
#endif
#if TILE_ROWS > 2
        TILE_CASE(3, 1) TILE_CASE(3, 2)
#endif
#if TILE_ROWS > 3
        TILE_CASE(4, 1) TILE_CASE(4, 2)
#endif
    }
}

/* Units: SwiGLU gate panels (with their up panels), else UNIT_PANELS panels. */
static inline int64_t units_of(const vq_t *a) {
    const int64_t panels = a->glu ? a->n / VP : (a->n + VP - 1) / VP;
    return a->glu ? panels : (panels + UNIT_PANELS - 1) / UNIT_PANELS;
}

/* Rows [r0, r1) x units [u0, u1): per unit, every row tile (the unit's weights stay in L1). */
static void block(const vq_t *a, int64_t r0, int64_t r1, int64_t u0, int64_t u1) {
    float out[MAX_R * 2 * VP] __attribute__((aligned(64)));
    const int64_t panels = (a->n + VP - 1) / VP;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t p = a->glu ? u : UNIT_PANELS * u, pan[2] = {p, a->glu ? p + a->glu : p + 1};
        const int C = a->glu || (UNIT_PANELS == 2 && p + 1 < panels) ? 2 : 1;
        const int64_t col = p * VP, cols = a->glu ? VP : (a->n - col < C * VP ? a->n - col : C * VP);
        for (int64_t r = r0; r < r1; r += MAX_R) {
            const int R = (int)(r1 - r < MAX_R ? r1 - r : MAX_R);
            tile_any(a, r, R, pan, C, out);
            for (int i = 0; i < R; i++)
                tile_row_out(out + i * C * VP, a->y + (r + i) * a->ldy + col, a->bias ? a->bias + col : 0, cols,
                             a->glu ? VP : 0);
        }
    }
}

static int by_units(const void *arg, int64_t lo, int64_t hi) {
    block((const vq_t *)arg, 0, ((const vq_t *)arg)->m, lo, hi);
    return 0;
}

/* Prompt-sized: threads take tiles of rows, in chunks whose xq (CHUNK_TILES * MAX_R rows) stays in L2. */
static int by_rows(const void *arg, int64_t lo, int64_t hi) {
    const vq_t *a = (const vq_t *)arg;
    const int64_t r1 = hi * MAX_R < a->m ? hi * MAX_R : a->m, units = units_of(a);
    for (int64_t r = lo * MAX_R; r < r1; r += CHUNK_TILES * MAX_R)
        block(a, r, r + CHUNK_TILES * MAX_R < r1 ? r + CHUNK_TILES * MAX_R : r1, 0, units);
    return 0;
}

static int run(vq_t *a, const float *x, int64_t ldx, int nthreads) {
    const qweight_t *w = a->w;
    if (!(w->bits & QDOT_BITS)) return -3;
    if ((w->bits != 8 && w->bits != 4) || w->group <= 0 || w->group % AB || a->k % w->group || a->m < 0 || a->n <= 0)
        return -2;
    if (a->m == 0) return 0;
    if (w->amx && a->m >= AMX_MIN_ROWS) {
        const int rc = qamx_gemm(x, w, a->bias, a->y, a->m, a->k, a->n, ldx, a->ldy, a->glu, nthreads);
        if (rc != -3) return rc; /* -3: not a weight the tiles take; the dot products do */
    }
    const int64_t G = a->k / w->group, B = a->k / AB;
    int8_t *xq = malloc((size_t)(a->m * a->k));
    float *fs = malloc(sizeof(float) * a->m * (B + G));
    int32_t *xs = malloc(sizeof(int32_t) * a->m * B);
    int rc = -1;
    if (xq && fs && xs) {
        const quant_t qa = {x, ldx, a->k, w->group, xq, fs, fs + a->m * B, xs};
        rc = parallel_rows(quantize_rows, &qa, a->m, a->k, nthreads);
        a->xq = xq, a->dx = fs, a->sx = fs + a->m * B, a->xs = xs;
        const int64_t tiles = (a->m + MAX_R - 1) / MAX_R, pair = a->glu ? 2 : 1;
        if (!rc)
            rc = tiles >= ROW_SPLIT_TILES * nthreads
                     ? parallel_rows(by_rows, a, tiles, a->k * a->n * pair, nthreads)
                     : parallel_rows(by_units, a, units_of(a), a->m * a->k * UNIT_PANELS * VP * pair, nthreads);
    }
    free(xq), free(fs), free(xs);
    return rc;
}
#endif

int qvnni_gemm(const float *x, const qweight_t *w, const float *bias, float *y, int64_t m, int64_t k, int64_t n,
               int64_t ldx, int64_t ldy, int nthreads) {
#if QDOT_BITS
    vq_t a = {w, 0, 0, 0, 0, bias, y, m, k, n, ldy, 0};
    return run(&a, x, ldx, nthreads);
#else
    (void)x, (void)w, (void)bias, (void)y, (void)m, (void)k, (void)n, (void)ldx, (void)ldy, (void)nthreads;
    return -3;
#endif
}

/* y[M, I] = silu(x @ gate) * (x @ up) for W = [gate | up] packed as one [K, 2I] weight (I whole panels). */
int qvnni_gemm_swiglu(const float *x, const qweight_t *w, float *y, int64_t m, int64_t k, int64_t inter,
                      int64_t ldx, int64_t ldy, int nthreads) {
#if QDOT_BITS
    if (inter < VP || inter % VP) return -4;
    vq_t a = {w, 0, 0, 0, 0, 0, y, m, k, inter, ldy, inter / VP};
    return run(&a, x, ldx, nthreads);
#else
    (void)x, (void)w, (void)y, (void)m, (void)k, (void)inter, (void)ldx, (void)ldy, (void)nthreads;
    return -3;
#endif
}
