/* SwiGLU activation: out[t, i] = silu(x[t, i]) * x[t, I + i] over the fused gate_up output
 * x [T, 2I], in one pass. The reference (F.silu on a strided half, then a multiply with the other
 * strided half) makes two passes through a buffer that, at prefill sizes, is far out of cache.
 * silu(g) = g / (1 + exp(-g)) in fp32 (silu_mul_f32, cpu_common.h, shared with the GEMM's fused
 * epilogue); dtype 0 = fp32, 1 = bf16. */
#include <math.h>
#include <stdint.h>

#include "cpu_common.h"

typedef struct {
    const void *x;
    void *out;
    int64_t inter, sx;
    int dtype;
} args_t;

static void rows_f32(const args_t *a, int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; r++) {
        const float *g = (const float *)a->x + r * a->sx;
        silu_mul_f32(g, g + a->inter, (float *)a->out + r * a->inter, a->inter);
    }
}

static void rows_bf16(const args_t *a, int64_t lo, int64_t hi) {
    enum { CHUNK = 256 };
    const int64_t n = a->inter;
    float gf[CHUNK], e[CHUNK];
    for (int64_t r = lo; r < hi; r++) {
        const uint16_t *g = (const uint16_t *)a->x + r * a->sx, *u = g + n;
        uint16_t *o = (uint16_t *)a->out + r * n;
        for (int64_t c = 0; c < n; c += CHUNK) {
            const int64_t m = n - c < CHUNK ? n - c : CHUNK;
            for (int64_t i = 0; i < m; i++) { gf[i] = bf16_f32(g[c + i]); e[i] = -gf[i]; }
            vexpf_inplace(e, m);
            /* torch rounds silu's result to bf16 before the multiply */
            for (int64_t i = 0; i < m; i++)
                o[c + i] = f32_bf16(bf16_f32(f32_bf16(gf[i] / (1.f + e[i]))) * bf16_f32(u[c + i]));
        }
    }
}

static int rows(const void *vargs, int64_t lo, int64_t hi) {
    const args_t *a = (const args_t *)vargs;
    if (a->dtype == 0) rows_f32(a, lo, hi);
    else rows_bf16(a, lo, hi);
    return 0;
}

void silu_mul(const void *x, void *out, int64_t t, int64_t inter, int64_t sx, int dtype, int nthreads) {
    args_t a = {x, out, inter, sx, dtype};
    parallel_rows(rows, &a, t, 3 * inter, nthreads);
}
