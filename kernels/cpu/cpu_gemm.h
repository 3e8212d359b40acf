/* kernels/cpu/cpu_gemm.c's entry points, for the kernels that call it from C (cpu_decode_layers.c). */
#ifndef GENPOOL_CPU_GEMM_H
#define GENPOOL_CPU_GEMM_H
#include <stdint.h>

/* The product a caller runs next: wp packed [k, n], or with glu SwiGLU's [k, 2n] (gate | up).
 * Where threads split the panels (decode-sized batches), each thread prefetches its share's first
 * panels while it works on its last ones, so the next call does not start on a cold weight. */
typedef struct {
    const float *wp;
    int64_t k, n;
    int glu;
} gemm_next_t;

int gemm_packed(const float *x, const float *wp, const float *bias, float *y, int64_t m, int64_t k, int64_t n,
                int64_t ldx, int64_t ldy, int nthreads);
int gemm_packed_then(const float *x, const float *wp, const float *bias, float *y, int64_t m, int64_t k, int64_t n,
                     int64_t ldx, int64_t ldy, const gemm_next_t *next, int nthreads);
int gemm_packed_swiglu(const float *x, const float *wp, float *y, int64_t m, int64_t k, int64_t inter,
                       int64_t ldx, int64_t ldy, int nthreads);
int gemm_packed_swiglu_then(const float *x, const float *wp, float *y, int64_t m, int64_t k, int64_t inter,
                            int64_t ldx, int64_t ldy, const gemm_next_t *next, int nthreads);
#endif
