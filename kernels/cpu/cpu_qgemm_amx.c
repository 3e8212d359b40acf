/* Prompt-sized products of int8 weights (one scale per output channel) on AMX bf16 tiles (Intel
 * Sapphire Rapids and later): y[M, N] = x[M, K] @ W, W = scale[n] * q[n, k].
 *
 * Why bf16 and not the int8 tile product: the int8 path quantizes activations per block of 32
 * inputs (cpu_qgemm_vnni.c, decision 0005), so each block's int32 sums would leave the tiles to be
 * scaled: a tile store and an AVX-512 pass per 32 inputs, which measured no faster than vpdpbusd.
 * In bf16 the tiles accumulate fp32 over all of K and are stored once. Every int8 weight is exact
 * in bf16 (8 significant bits), so the only rounding is x's to bf16, finer than the int8 path's
 * per-block quantization; the scale multiplies the fp32 sums at the end.
 *
 * Weights stay packed in cpu_qgemm_vnni.c's layout, [P][K / 4][16][4] bytes of q + 128. A thread
 * takes units of 2 panels (or a SwiGLU gate panel and its up panel), widens the unit's bytes to the
 * tiles' B layout once ([K / 2][16][2] bf16 a panel), then runs every 32-row tile of x against it:
 * tiles 0-3 hold the sums of (rows 0-15 | 16-31) x (panel 0 | 1); 4, 5 the two row tiles' 32 inputs;
 * 6, 7 the two panels' 32 inputs. x is rounded to bf16 once, padded with zero rows to a multiple
 * of 32 (the padding's sums are never written out).
 *
 * Linux grants a process the tile registers' state only when it asks (arch_prctl
 * ARCH_REQ_XCOMP_PERM); qamx_ready() asks once and says whether the tiles run here. */
#include "cpu_common.h"
#include "cpu_qgemm.h"
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { VP = 16, KT = 32, ROWS = 32 };
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int ready;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void ask(void) {
    ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* Built only where -march=native has AMX; the request fails (EINVAL) on a kernel or CPU without it. */
int qamx_ready(void) {
    pthread_once(&once, ask);
    return ready;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* A static table: GCC drops stores into a local one as dead (it does not see ldtilecfg read them),
 * and the instruction then faults on an all-zero configuration. */
static const tilecfg_t CONFIG __attribute__((aligned(64))) = {
    .palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

typedef struct {
    const qweight_t *w;
    const uint16_t *xb; /* [M rounded up to ROWS][K] bf16 */
    const float *bias;
    float *y;
    int64_t m, k, n, ldy, glu;
} amx_t;

/* x rows [lo, hi) to bf16, rounded to nearest even (vcvtneps2bf16). */
typedef struct {
    const float *x;
    int64_t ldx, k;
    uint16_t *xb;
} tobf_t;

static int to_bf16(const void *arg, int64_t lo, int64_t hi) {
    const tobf_t *a = (const tobf_t *)arg;
    for (int64_t r = lo; r < hi; r++)
        for (int64_t j = 0; j < a->k; j += 16) {
            const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(a->x + r * a->ldx + j));
            _mm256_storeu_si256((__m256i *)(a->xb + r * a->k + j), (__m256i)v);
        }
    return 0;
}

/* One panel's bytes to the B layout: a 64-byte lane row holds k = 4t .. 4t + 3 of 16 columns; its
 * bf16 (q = u - 128, exact) go to pair rows 2t (k 4t, 4t + 1) and 2t + 1 (k 4t + 2, 4t + 3). */
static void widen_panel(const uint8_t *src, int64_t K, uint16_t *dst) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t t = 0; t < K / 4; t++) {
        const __m512i q = _mm512_xor_si512(_mm512_loadu_si512(src + t * 64), flip); /* u - 128 as int8 */
        __m512 f[4];
        for (int i = 0; i < 4; i++)
            f[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q, i)));
        const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]), hi = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
        _mm512_storeu_si512(dst + (2 * t) * 32, _mm512_permutex2var_epi32(lo, even, hi));
        _mm512_storeu_si512(dst + (2 * t + 1) * 32, _mm512_permutex2var_epi32(lo, odd, hi));
    }
}

/* Sums of 32 rows of xb (from row r) x the unit's widened panels wb[C] into out[32][C * VP]. */
static void tile_rows(const amx_t *a, int64_t r, const uint16_t *wb, int C, float *out) {
    const int64_t K = a->k, xs = K * 2, pb = K * VP; /* x row stride in bytes; a widened panel's bf16 */
    const uint16_t *x0 = a->xb + r * K, *x1 = x0 + 16 * K;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += KT) {
        _tile_loadd(4, x0 + k, xs);
        _tile_loadd(5, x1 + k, xs);
        _tile_loadd(6, wb + k * VP, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (C == 2) {
            _tile_loadd(7, wb + pb + k * VP, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    const int64_t ld = C * VP * 4; /* out's row stride in bytes */
    _tile_stored(0, out, ld);
    _tile_stored(2, out + 16 * C * VP, ld);
    if (C == 2) {
        _tile_stored(1, out + VP, ld);
        _tile_stored(3, out + 16 * C * VP + VP, ld);
    }
}

/* Rows of out (32 x C panels of sums) scaled per column, plus bias or through SwiGLU, into y. */
static void emit(const amx_t *a, int64_t r, const int64_t *pan, int C, float *out) {
    const int64_t rows = a->m - r < ROWS ? a->m - r : ROWS, col = pan[0] * VP;
    const int64_t cols = a->glu ? VP : (a->n - col < C * VP ? a->n - col : C * VP);
    for (int64_t i = 0; i < rows; i++) {
        float *t = out + i * C * VP;
        for (int c = 0; c < C; c++) {
            const __m512 s = _mm512_loadu_ps(a->w->scales + pan[c] * VP); /* one group: scales [P][1][16] */
            _mm512_storeu_ps(t + c * VP, _mm512_mul_ps(_mm512_loadu_ps(t + c * VP), s));
        }
        tile_row_out(t, a->y + (r + i) * a->ldy + col, a->bias ? a->bias + col : 0, cols, a->glu ? VP : 0);
    }
}

static int by_units(const void *arg, int64_t lo, int64_t hi) {
    const amx_t *a = (const amx_t *)arg;
    const int64_t K = a->k, panels = (a->n + VP - 1) / VP;
    uint16_t *wb = aligned_alloc(64, sizeof(uint16_t) * 2 * K * VP);
    float out[ROWS * 2 * VP] __attribute__((aligned(64)));
    if (!wb) return -1;
    _tile_loadconfig(&CONFIG);
    for (int64_t u = lo; u < hi; u++) {
        const int64_t p = a->glu ? u : 2 * u, pan[2] = {p, a->glu ? p + a->glu : p + 1};
        const int C = a->glu || p + 1 < panels ? 2 : 1;
        for (int c = 0; c < C; c++) widen_panel(a->w->q + pan[c] * K * VP, K, wb + c * K * VP);
        for (int64_t r = 0; r < a->m; r += ROWS) {
            tile_rows(a, r, wb, C, out);
            emit(a, r, pan, C, out);
        }
    }
    _tile_release();
    free(wb);
    return 0;
}

int qamx_gemm(const float *x, const qweight_t *w, const float *bias, float *y, int64_t m, int64_t k, int64_t n,
              int64_t ldx, int64_t ldy, int64_t glu, int nthreads) {
    if (!qamx_ready() || w->bits != 8 || w->group != k || k % KT || w->offsets) return -3;
    const int64_t mp = (m + ROWS - 1) / ROWS * ROWS;
    uint16_t *xb = aligned_alloc(64, sizeof(uint16_t) * mp * k);
    if (!xb) return -1;
    memset(xb + m * k, 0, sizeof(uint16_t) * (mp - m) * k);
    const tobf_t t = {x, ldx, k, xb};
    int rc = parallel_rows(to_bf16, &t, m, k, nthreads);
    const amx_t a = {w, xb, bias, y, m, k, n, ldy, glu};
    const int64_t units = glu ? n / VP : ((n + VP - 1) / VP + 1) / 2;
    if (!rc) rc = parallel_rows(by_units, &a, units, mp * k * 2 * VP, nthreads);
    free(xb);
    return rc;
}
#else
int qamx_ready(void) {
    return 0;
}
int qamx_gemm(const float *x, const qweight_t *w, const float *bias, float *y, int64_t m, int64_t k, int64_t n,
              int64_t ldx, int64_t ldy, int64_t glu, int nthreads) {
    (void)x, (void)w, (void)bias, (void)y, (void)m, (void)k, (void)n, (void)ldx, (void)ldy, (void)glu, (void)nthreads;
    return -3;
}
#endif
