/* Scatter a step's K and V rows into the paged caches: row t of k / v goes to flat slot
 * slots[t] (slot = block * block_size + offset; negative = skip), one memcpy per row and cache.
 *
 * The reference (two index_copy_ calls after a mask check and casts) cost ~60 us per layer at
 * decode sizes here, ~12% of a small decode step's non-GEMM time. Rows: `row` elements
 * (Hkv * D) contiguous, rows k_rs / v_rs elements apart (v is a view into the fused qkv output);
 * caches contiguous [blocks, bs, Hkv, D]; esize bytes per element, same dtype everywhere, except
 * with to_bf16: fp32 rows into a bf16 cache (kv_cache_dtype bfloat16 under an fp32 model), each
 * element rounded to nearest even as torch's .to(torch.bfloat16).
 * Returns 0, or -2 for a slot outside the cache (nothing past it is written).
 */
#include <stdint.h>
#include <string.h>
#include "cpu_common.h"
#include "cpu_kernels.h"

static void row_to_bf16(uint16_t *dst, const float *src, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = f32_bf16(src[i]);
}

int write_kv(const void *k, const void *v, void *k_cache, void *v_cache, const int64_t *slots, int64_t t,
             int64_t row, int64_t k_rs, int64_t v_rs, int64_t nslots, int64_t esize, int to_bf16) {
    for (int64_t i = 0; i < t; i++)
        if (slots[i] >= nslots) return -2;
    const int64_t bytes = row * esize;
    for (int64_t i = 0; i < t; i++) {
        if (slots[i] < 0) continue;
        if (to_bf16) {
            row_to_bf16((uint16_t *)k_cache + slots[i] * row, (const float *)k + i * k_rs, row);
            row_to_bf16((uint16_t *)v_cache + slots[i] * row, (const float *)v + i * v_rs, row);
            continue;
        }
        memcpy((char *)k_cache + slots[i] * bytes, (const char *)k + i * k_rs * esize, bytes);
        memcpy((char *)v_cache + slots[i] * bytes, (const char *)v + i * v_rs * esize, bytes);
    }
    return 0;
}
