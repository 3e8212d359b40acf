/* Fused residual add + RMSNorm, one pass per row, rounding exactly where the torch reference
 * (and HF Llama) rounds: sum = x + residual in the model dtype; y = sum * rsqrt(mean(sum^2) + eps)
 * in fp32, cast to the dtype; out = weight * y in the dtype. The reference spends 7 torch ops
 * (each a pass over memory, and at prefill sizes each a fresh allocation) on what is one pass.
 * dtype 0 = fp32, 1 = bf16. x, residual, out, sum_out: [rows, h] with the given row strides. */
#include <math.h>
#include <stdint.h>

#include "cpu_common.h"
#include "cpu_kernels.h"

typedef struct {
    const void *x, *res, *w;
    void *out, *sum_out;
    int64_t h, sx, sr, so, ss;
    float eps;
    int dtype;
} args_t;

static inline float ld(const void *p, int64_t i, int dtype) {
    return dtype == 0 ? ((const float *)p)[i] : bf16_f32(((const uint16_t *)p)[i]);
}

/* One row: v = the residual sum as stored in the dtype, widened to fp32 into v[]. */
static float row_sum(const args_t *a, int64_t r, float *restrict v) {
    const int64_t h = a->h;
    if (a->dtype == 0) {
        const float *restrict x = (const float *)a->x + r * a->sx;
        const float *restrict res = (const float *)a->res + r * a->sr;
        float *restrict sum = (float *)a->sum_out + r * a->ss;
        if (a->res) {
#pragma omp simd
            for (int64_t i = 0; i < h; i++) v[i] = sum[i] = x[i] + res[i];
        } else {
#pragma omp simd
            for (int64_t i = 0; i < h; i++) v[i] = sum[i] = x[i];
        }
    } else {
        uint16_t *sum = (uint16_t *)a->sum_out + r * a->ss;
        for (int64_t i = 0; i < h; i++) {
            float t = ld(a->x, r * a->sx + i, 1);
            if (a->res) t += ld(a->res, r * a->sr + i, 1);
            sum[i] = f32_bf16(t);
            v[i] = bf16_f32(sum[i]);
        }
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < h; i++) ss += v[i] * v[i];
    return ss;
}

static int rows(const void *vargs, int64_t lo, int64_t hi) {
    const args_t *a = (const args_t *)vargs;
    const int64_t h = a->h;
    float v[h];
    for (int64_t r = lo; r < hi; r++) {
        const float inv = 1.f / sqrtf(row_sum(a, r, v) / (float)h + a->eps);
        if (a->dtype == 0) {
            const float *w = (const float *)a->w;
            float *out = (float *)a->out + r * a->so;
#pragma omp simd
            for (int64_t i = 0; i < h; i++) out[i] = w[i] * (v[i] * inv);
        } else {
            uint16_t *out = (uint16_t *)a->out + r * a->so;
            for (int64_t i = 0; i < h; i++)
                out[i] = f32_bf16(ld(a->w, i, 1) * bf16_f32(f32_bf16(v[i] * inv)));
        }
    }
    return 0;
}

void rms_norm(const void *x, const void *res, const void *w, void *out, void *sum_out, int64_t n, int64_t h,
              int64_t sx, int64_t sr, int64_t so, int64_t ss, float eps, int dtype, int nthreads) {
    args_t a = {x, res, w, out, sum_out, h, sx, sr, so, ss, eps, dtype};
    parallel_rows(rows, &a, n, 4 * h, nthreads);
}
