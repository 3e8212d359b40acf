/* Neox / HF rotate_half rotary embedding for q and k in one pass, out of place.
 * For each token t at position p and each head: with x1, x2 the two halves (in fp32) and
 * cos, sin = cos_sin[p, :D/2], cos_sin[p, D/2:], the result is [x1 cos - x2 sin, x2 cos + x1 sin]
 * rounded to the dtype, with the same roundings as the torch reference (no fused multiply-add),
 * so fp32 results are bit-identical. The reference needs ~14 torch ops per call.
 * x: [T, H, D] with row stride sx (heads contiguous, D contiguous); out: [T, H, D] contiguous. */
#include <stdint.h>

#include "cpu_common.h"
#include "cpu_kernels.h"

typedef struct {
    const void *q, *k;
    void *qo, *ko;
    const int64_t *pos;
    const float *cs;
    int64_t hq, hk, d, sq, sk, max_pos;
    int dtype;
} args_t;

__attribute__((optimize("fp-contract=off")))
static void rotate(const void *x, void *o, int64_t heads, int64_t d, const float *c, int dtype) {
    const int64_t half = d / 2;
    const float *s = c + half;
    for (int64_t h = 0; h < heads; h++) {
        if (dtype == 0) {
            const float *x1 = (const float *)x + h * d, *x2 = x1 + half;
            float *o1 = (float *)o + h * d, *o2 = o1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                o1[i] = x1[i] * c[i] - x2[i] * s[i];
                o2[i] = x2[i] * c[i] + x1[i] * s[i];
            }
        } else {
            const uint16_t *x1 = (const uint16_t *)x + h * d, *x2 = x1 + half;
            uint16_t *o1 = (uint16_t *)o + h * d, *o2 = o1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = bf16_f32(x1[i]), b = bf16_f32(x2[i]);
                o1[i] = f32_bf16(a * c[i] - b * s[i]);
                o2[i] = f32_bf16(b * c[i] + a * s[i]);
            }
        }
    }
}

static int rows(const void *vargs, int64_t lo, int64_t hi) {
    const args_t *a = (const args_t *)vargs;
    const int64_t es = a->dtype == 0 ? 4 : 2;
    for (int64_t t = lo; t < hi; t++) {
        const int64_t p = a->pos[t];
        if (p < 0 || p >= a->max_pos) return -1;
        const float *c = a->cs + p * a->d;
        rotate((const char *)a->q + t * a->sq * es, (char *)a->qo + t * a->hq * a->d * es, a->hq, a->d, c, a->dtype);
        rotate((const char *)a->k + t * a->sk * es, (char *)a->ko + t * a->hk * a->d * es, a->hk, a->d, c, a->dtype);
    }
    return 0;
}

/* Returns 0, or -1 when a position lies outside the cos/sin table. */
int rotary(const void *q, const void *k, void *qo, void *ko, const int64_t *pos, const float *cs, int64_t n,
           int64_t hq, int64_t hk, int64_t d, int64_t sq, int64_t sk, int64_t max_pos, int dtype, int nthreads) {
    args_t a = {q, k, qo, ko, pos, cs, hq, hk, d, sq, sk, max_pos, dtype};
    return parallel_rows(rows, &a, n, (hq + hk) * d, nthreads);
}
