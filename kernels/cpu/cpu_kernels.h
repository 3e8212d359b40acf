/* The element-wise and attention kernels' entry points, for the kernels that call them from C
 * (cpu_decode_layers.c); each defining file includes this too, so the compiler checks that the
 * two agree. The GEMM's are in cpu_gemm.h. */
#ifndef GENPOOL_CPU_KERNELS_H
#define GENPOOL_CPU_KERNELS_H
#include <stdint.h>

void rms_norm(const void *x, const void *res, const void *w, void *out, void *sum_out, int64_t n, int64_t h,
              int64_t sx, int64_t sr, int64_t so, int64_t ss, float eps, int dtype, int nthreads);
int rotary(const void *q, const void *k, void *qo, void *ko, const int64_t *pos, const float *cs, int64_t n,
           int64_t hq, int64_t hk, int64_t d, int64_t sq, int64_t sk, int64_t max_pos, int dtype, int nthreads);
int write_kv(const void *k, const void *v, void *k_cache, void *v_cache, const int64_t *slots, int64_t t,
             int64_t row, int64_t k_rs, int64_t v_rs, int64_t nslots, int64_t esize, int mode, int64_t d);
/* kv_cache_dtype int8 (kernels/kvq.py): a K/V vector's d int8 elements, then one fp32 scale per group of
 * KV_GROUP elements (the last group may be shorter): kv_int8_row(d) bytes. */
enum { KV_GROUP = 32 };
static inline int64_t kv_int8_row(int64_t d) { return d + 4 * ((d + KV_GROUP - 1) / KV_GROUP); }
/* Bytes per cache element for kv_dtype 0 fp32, 1 bf16, 2 int8. */
static inline int64_t kv_esize(int kv_dtype) { return kv_dtype == 0 ? 4 : kv_dtype == 1 ? 2 : 1; }
/* Elements [c0, c0 + n) of the int8 vector `vec` of d elements as fp32: (float)q * its group's scale
 * (kvq.widen's one rounding), a run of one group at a time. Decode and prefill attention both read
 * through this, so a prompt row keeps decode's bits. */
static inline void kv_int8_widen(float *restrict dst, const int8_t *restrict vec, int64_t d, int64_t c0,
                                 int64_t n) {
    for (int64_t i = 0; i < n;) {
        const int64_t g = (c0 + i) / KV_GROUP, end = (g + 1) * KV_GROUP - c0 < n ? (g + 1) * KV_GROUP - c0 : n;
        float sc;
        __builtin_memcpy(&sc, vec + d + 4 * g, sizeof sc);
#pragma omp simd
        for (int64_t c = i; c < end; c++) dst[c] = (float)vec[c0 + c] * sc;
        i = end;
    }
}
int paged_decode_attention(const void *q, const void *k, const void *v, void *out, const int32_t *tables,
                           const int32_t *lens, int64_t nrows, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
                           int64_t width, int64_t num_blocks, const int64_t *k_strides, const int64_t *v_strides,
                           float scale, int dtype, int kv_dtype, int nthreads);
#endif
