/* Quantized GEMM: y[M, N] = x[M, K] @ W[K, N] (+ bias) with W held as int8 or packed int4.
 *
 * Why: a decode step reads every weight once per step, so its time is the bytes it streams; fp32
 * weights are 4 bytes each, these 1 (int8) or 0.5 (int4) plus a group's scale (and offset). The
 * weight is packed once (kernels/cpu/qgemm.py) into the fp32 GEMM's column panels of NR (16 on
 * AVX2, 32 on AVX-512): q[P][K][NR] int8, or [P][K][NR / 2] bytes for int4 (byte j of a row: column
 * j in the low nibble, column j + NR / 2 in the high one, so one widening load and a shift/mask give
 * two vectors of columns); scales (and offsets) [P][K / g][NR] fp32: W = scale * q + offset.
 * A slice of KC rows of one or two panels is widened in registers (AVX-512 / AVX2 / portable,
 * chosen by the build's -march=native) into an fp32 buffer that stays in L1, and cpu_tile.h's
 * register tile runs every row tile of x over it, reading x in place (row-major: rs = ldx, ks = 1).
 * Each output is one FMA chain over k in order, as in cpu_gemm.c, and the widening is exact for
 * the formats whose scale * q is an exact product (GGUF Q8_0/Q4_0/Q4_1, AWQ), so the result is
 * the fp32 GEMM's over the dequantized weight, bit for bit (tests/test_quant_kernels.py).
 * Threads split panels for decode-sized batches (the weight streams once), rows for prompt-sized
 * ones (each thread widens every panel for its own rows: K * N widenings against M / 2 * K * N FMAs).
 * Returns 0, or -1 out of memory, -2 a bad argument. */
#include "cpu_common.h"
#include "cpu_qgemm.h"
#include "cpu_tile.h"
#include <stdlib.h>
#include <string.h>

enum { NR = PANEL_COLS, KC = 4096 / NR, ROW_SPLIT_TILES = 8 };

typedef struct {
    const float *x, *scales, *offsets, *bias;
    const uint8_t *q;
    float *y;
    int64_t m, k, n, g, bits, ldx, ldy;
    int64_t glu; /* 0, or SwiGLU: n = I outputs, gate panel p pairs with up panel p + glu (= I / NR) */
} qgemm_t;

/* Panels the loops step over: SwiGLU leads with its n / NR gate panels. */
static inline int64_t panels_of(const qgemm_t *a) { return a->glu ? a->n / NR : (a->n + NR - 1) / NR; }

static inline int64_t row_bytes(const qgemm_t *a) { return a->bits == 8 ? NR : NR / 2; }

/* Rows [k0, k1) of panel p, widened to fp32 in out[(k - k0) * NR + j]: a group's scales (and
 * offsets) are loaded once and held in registers while its rows stream past (a division per row
 * to find its group cost more than the widening itself). */
static void widen(const qgemm_t *a, int64_t p, int64_t k0, int64_t k1, float *out) {
    const int64_t rb = row_bytes(a), groups = a->k / a->g;
    const float *sc = a->scales + p * groups * NR, *of = a->offsets ? a->offsets + p * groups * NR : 0;
    for (int64_t kg = k0 / a->g, k = k0; k < k1; kg++) {
        const int64_t ke = (kg + 1) * a->g < k1 ? (kg + 1) * a->g : k1;
        const float *s = sc + kg * NR, *o = of ? of + kg * NR : 0;
        const uint8_t *q = a->q + (p * a->k + k) * rb;
#if defined(__AVX512F__)
        const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
        const __m512 o0 = o ? _mm512_loadu_ps(o) : _mm512_setzero_ps(), o1 = o ? _mm512_loadu_ps(o + 16) : o0;
        for (; k < ke; k++, q += rb, out += NR) {
            __m512 w0, w1;
            if (a->bits == 8) {
                w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
                w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
            } else {
                const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
                w0 = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
                w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
            }
            /* with an offset, scale * q is exact (see the top): the FMA rounds as mul-then-add would */
            _mm512_storeu_ps(out, o ? _mm512_fmadd_ps(w0, s0, o0) : _mm512_mul_ps(w0, s0));
            _mm512_storeu_ps(out + 16, o ? _mm512_fmadd_ps(w1, s1, o1) : _mm512_mul_ps(w1, s1));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
        const __m256 o0 = o ? _mm256_loadu_ps(o) : _mm256_setzero_ps(), o1 = o ? _mm256_loadu_ps(o + 8) : o0;
        for (; k < ke; k++, q += rb, out += NR) {
            __m256 w0, w1;
            if (a->bits == 8) {
                w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
                w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8))));
            } else {
                const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
                w0 = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
                w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
            }
            _mm256_storeu_ps(out, o ? _mm256_fmadd_ps(w0, s0, o0) : _mm256_mul_ps(w0, s0));
            _mm256_storeu_ps(out + 8, o ? _mm256_fmadd_ps(w1, s1, o1) : _mm256_mul_ps(w1, s1));
        }
#else
        for (; k < ke; k++, q += rb, out += NR)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t h = NR / 2;
                const float qj = a->bits == 8 ? (float)(int8_t)q[j] : (float)(j < h ? q[j] & 15 : q[j - h] >> 4);
                out[j] = o ? __builtin_fmaf(qj, s[j], o[j]) : qj * s[j];
            }
#endif
    }
}

/* Rows [r0, r1) x panels [p0, p1), np (1 or PANEL_GROUP) panels at a time, K in slices of KC:
 * widen the slice into buf, then every row tile of x over it; columns past n go through `part`.
 * SwiGLU (a->glu): gate panel p and its up panel go side by side into `part`, and each tile's rows
 * become silu(gate) * up in y after the last slice (cpu_gemm.c's epilogue, the same bits). */
static int block(const qgemm_t *a, int64_t r0, int64_t r1, int64_t p0, int64_t p1) {
    const int64_t m = r1 - r0, nt = tile_count(m), step = a->glu ? 1 : PANEL_GROUP;
    float *buf = aligned_alloc(64, sizeof(float) * (2 * KC * NR + (m + TILE_ROWS) * 2 * NR));
    if (!buf) return -1;
    float *part = buf + 2 * KC * NR;
    for (int64_t p = p0; p < p1; p += step) {
        const int64_t np = a->glu ? 2 : (p + 1 < p1 ? PANEL_GROUP : 1), col = p * NR;
        const int64_t second = a->glu ? p + a->glu : p + 1;
        const int64_t cols = a->glu ? NR : (a->n - col < np * NR ? a->n - col : np * NR);
        const int direct = !a->glu && cols == np * NR;
        float *c = direct ? a->y + r0 * a->ldy + col : part;
        const int64_t ldc = direct ? a->ldy : 2 * NR;
        for (int64_t k0 = 0; k0 < a->k; k0 += KC) {
            const int64_t kc = a->k - k0 < KC ? a->k - k0 : KC;
            widen(a, p, k0, k0 + kc, buf);
            if (np == 2) widen(a, second, k0, k0 + kc, buf + KC * NR);
            for (int64_t t = 0; t < nt; t++) {
                const int64_t ta = m * t / nt, mr = m * (t + 1) / nt - ta;
                const float *xt = a->x + (r0 + ta) * a->ldx + k0;
                if (np == 2)
                    tile_rows(xt, a->ldx, 1, buf, buf + KC * NR, 2, kc, c + ta * ldc, ldc, k0 > 0, 0, 0, mr);
                else
                    tile_rows(xt, a->ldx, 1, buf, 0, 1, kc, c + ta * ldc, ldc, k0 > 0, 0, 0, mr);
            }
        }
        for (int64_t r = r0; r < r1; r++) {
            float *out = a->y + r * a->ldy + col, *cr = part + (r - r0) * ldc;
            if (a->glu) {
                silu_mul_f32(cr, cr + NR, out, NR);
                continue;
            }
            if (!direct) memcpy(out, cr, sizeof(float) * cols);
            if (a->bias)
                for (int64_t j = 0; j < cols; j++) out[j] += a->bias[col + j];
        }
    }
    free(buf);
    return 0;
}

static int by_panels(const void *arg, int64_t lo, int64_t hi) {
    const qgemm_t *a = (const qgemm_t *)arg;
    return block(a, 0, a->m, lo, hi);
}

/* Prompt-sized: threads take whole tiles of rows, blocks of 96 rows (x's slice stays in L2). */
static int by_rows(const void *arg, int64_t lo, int64_t hi) {
    const qgemm_t *a = (const qgemm_t *)arg;
    const int64_t r1 = hi * TILE_ROWS < a->m ? hi * TILE_ROWS : a->m, panels = panels_of(a);
    for (int64_t r = lo * TILE_ROWS; r < r1; r += 16 * TILE_ROWS) {
        const int rc = block(a, r, r + 16 * TILE_ROWS < r1 ? r + 16 * TILE_ROWS : r1, 0, panels);
        if (rc) return rc;
    }
    return 0;
}

/* The panel width this build packs for (16 with AVX2, 32 with AVX-512). */
int qgemm_panel_width(void) { return NR; }

static int run(const qgemm_t *a, int nthreads) {
    if ((a->bits != 8 && a->bits != 4) || a->g <= 0 || a->k % a->g || a->m < 0 || a->k <= 0 || a->n <= 0) return -2;
    const int64_t tiles = tile_count(a->m), pair = a->glu ? 2 : 1;
    if (tiles >= ROW_SPLIT_TILES * nthreads)
        return parallel_rows(by_rows, a, tiles, a->k * a->n * pair, nthreads);
    return parallel_rows(by_panels, a, panels_of(a), (a->m + 1) * a->k * NR * pair, nthreads);
}

int qgemm_packed(const float *x, const qweight_t *w, const float *bias, float *y, int64_t m, int64_t k, int64_t n,
                 int64_t ldx, int64_t ldy, int nthreads) {
    if (w->layout == QLAYOUT_VNNI) return qvnni_gemm(x, w, bias, y, m, k, n, ldx, ldy, nthreads);
    const qgemm_t a = {x, w->scales, w->offsets, bias, w->q, y, m, k, n, w->group, w->bits, ldx, ldy, 0};
    return run(&a, nthreads);
}

/* y[M, I] = silu(x @ gate) * (x @ up) for W = [gate | up] packed as one [K, 2I] weight; I must be
 * whole panels (-4 otherwise). */
int qgemm_packed_swiglu(const float *x, const qweight_t *w, float *y, int64_t m, int64_t k, int64_t inter,
                        int64_t ldx, int64_t ldy, int nthreads) {
    if (w->layout == QLAYOUT_VNNI) return qvnni_gemm_swiglu(x, w, y, m, k, inter, ldx, ldy, nthreads);
    if (inter < NR || inter % NR) return -4;
    const qgemm_t a = {x, w->scales, w->offsets, 0, w->q, y, m, k, inter, w->group, w->bits, ldx, ldy, inter / NR};
    return run(&a, nthreads);
}

/* Prompt-sized products on bf16 hardware (AMX / AVX512-BF16) go to torch's bf16 GEMM instead
 * (kernels/cpu/qgemm.py): this widens the whole weight once per call into out [K, N] bf16 (rounded
 * to nearest even), panels split between threads. */
typedef struct {
    const qgemm_t *a;
    uint16_t *out;
} widen_t;

static int widen_panels(const void *arg, int64_t lo, int64_t hi) {
    const widen_t *w = (const widen_t *)arg;
    const qgemm_t *a = w->a;
    float *buf = aligned_alloc(64, sizeof(float) * KC * NR);
    if (!buf) return -1;
    for (int64_t p = lo; p < hi; p++) {
        const int64_t col = p * NR, cols = a->n - col < NR ? a->n - col : NR;
        for (int64_t k0 = 0; k0 < a->k; k0 += KC) {
            const int64_t kc = a->k - k0 < KC ? a->k - k0 : KC;
            widen(a, p, k0, k0 + kc, buf);
            for (int64_t k = 0; k < kc; k++) {
                uint16_t *o = w->out + (k0 + k) * a->n + col;
                const float *b = buf + k * NR;
                int64_t j = 0;
#if defined(__AVX512BF16__) /* the same rounding (nearest even) as f32_bf16, 16 at a time */
                for (; j + 16 <= cols; j += 16)
                    _mm256_storeu_si256((__m256i *)(o + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(b + j)));
#endif
                for (; j < cols; j++) o[j] = f32_bf16(b[j]);
            }
        }
    }
    free(buf);
    return 0;
}

int qgemm_widen_bf16(const qweight_t *w, uint16_t *out, int64_t k, int64_t n, int nthreads) {
    const qgemm_t a = {0, w->scales, w->offsets, 0, w->q, 0, 1, k, n, w->group, w->bits, 0, 0, 0};
    if (w->layout != QLAYOUT_PANELS) return -2;
    if ((a.bits != 8 && a.bits != 4) || a.g <= 0 || k % a.g || k <= 0 || n <= 0) return -2;
    const widen_t arg = {&a, out};
    return parallel_rows(widen_panels, &arg, (n + NR - 1) / NR, k * NR, nthreads);
}
