/* kernels/cpu/cpu_qgemm.c's entry points, for the kernels that call it from C (cpu_decode_layers.c). */
#ifndef GENPOOL_CPU_QGEMM_H
#define GENPOOL_CPU_QGEMM_H
#include <stdint.h>

/* A quantized weight packed in column panels (kernels/cpu/qgemm.py QPackedWeight). Layout
 * QLAYOUT_PANELS (cpu_qgemm.c, widened to fp32): q int8 [P][K][NR] or int4 [P][K][NR / 2];
 * scales, offsets (NULL: none) fp32 [P][K / group][NR]. Layout QLAYOUT_VNNI (cpu_qgemm_vnni.c,
 * integer dot products): 16-column panels with 4 consecutive k a 32-bit lane (see there). */
enum { QLAYOUT_PANELS = 0, QLAYOUT_VNNI = 1 };
typedef struct {
    const uint8_t *q;
    const float *scales, *offsets;
    int64_t group, bits, layout;
    int64_t amx; /* QLAYOUT_VNNI: prompt-sized products run on AMX tiles where they can (cpu_qgemm_amx.c) */
} qweight_t;

int qgemm_packed(const float *x, const qweight_t *w, const float *bias, float *y, int64_t m, int64_t k, int64_t n,
                 int64_t ldx, int64_t ldy, int nthreads);
int qgemm_packed_swiglu(const float *x, const qweight_t *w, float *y, int64_t m, int64_t k, int64_t inter,
                        int64_t ldx, int64_t ldy, int nthreads);
int qvnni_available(void); /* weight widths the dot products run here: 8 | 4 (VNNI), 4 (AVX2), 0 */
int qvnni_gemm(const float *x, const qweight_t *w, const float *bias, float *y, int64_t m, int64_t k, int64_t n,
               int64_t ldx, int64_t ldy, int nthreads);
int qvnni_gemm_swiglu(const float *x, const qweight_t *w, float *y, int64_t m, int64_t k, int64_t inter,
                      int64_t ldx, int64_t ldy, int nthreads);
/* cpu_qgemm_amx.c: whether AMX bf16 tiles run here (CPU and OS); y = x @ W on them for 8-bit weights
 * with one scale per channel (glu: SwiGLU as qvnni_gemm_swiglu, n = I), else -3 */
int qamx_ready(void);
int qamx_gemm(const float *x, const qweight_t *w, const float *bias, float *y, int64_t m, int64_t k, int64_t n,
              int64_t ldx, int64_t ldy, int64_t glu, int nthreads);
int qgemm_widen_bf16(const qweight_t *w, uint16_t *out, int64_t k, int64_t n, int nthreads);
#endif
