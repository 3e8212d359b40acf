/* Scatter a step's K and V rows into the paged caches: row t of k / v goes to flat slot
 * slots[t] (slot = block * block_size + offset; negative = skip), one memcpy per row and cache.
 *
 * The reference (two index_copy_ calls after a mask check and casts) cost ~60 us per layer at
 * decode sizes here, ~12% of a small decode step's non-GEMM time. Rows: `row` elements
 * (Hkv * D) contiguous, rows k_rs / v_rs elements apart (v is a view into the fused qkv output);
 * caches contiguous [blocks, bs, Hkv, D]; esize bytes per element, same dtype everywhere, except
 * with mode 1: fp32 rows into a bf16 cache (kv_cache_dtype bfloat16 under an fp32 model), each
 * element rounded to nearest even as torch's .to(torch.bfloat16); with mode 2, fp32 rows into an
 * int8 cache (kv_cache_dtype int8): each head's d elements quantized, then their groups' fp32
 * scales (kernels/kvq.py, the reference these bits match; kv_int8_row(d) bytes a head).
 * Returns 0, or -2 for a slot outside the cache (nothing past it is written).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "cpu_common.h"
#include "cpu_kernels.h"

enum { COPY = 0, TO_BF16 = 1, TO_INT8 = 2 };

static void row_to_bf16(uint16_t *dst, const float *src, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = f32_bf16(src[i]);
}

/* scale = max|x| / 127 and inv = 127 / max|x| (one division a group). inv is 0 for an all-zero
 * group, and where it would not be finite (max|x| below ~4e-37, or infinite): its elements are 0. */
static inline float group_scale(float amax, float *inv) {
    const float r = amax > 0.f ? 127.f / amax : 0.f;
    *inv = r <= FLT_MAX ? r : 0.f;
    return amax / 127.f;
}

/* Elements times inv, rounded to nearest even (the fp32 product first: the reference rounds it),
 * saturated to +-127; a NaN product (a NaN element, or inf times 0) is 0, never cast (undefined). */
static inline void round_group(int8_t *dst, const float *src, int64_t n, float inv) {
    for (int64_t i = 0; i < n; i++) {
        const float y = src[i] * inv, x = y == y ? nearbyintf(y) : 0.f;
        dst[i] = (int8_t)(x > 127.f ? 127.f : x < -127.f ? -127.f : x);
    }
}

/* One vector of d elements as kvq.quantize: per group of KV_GROUP, scale = max|x| / 127 and
 * q = nearbyint(x * (127 / max|x|)) (the default rounding, half to even, as torch.round; a
 * product, not x / scale: one division a group); the groups' scales after the d elements.
 * ~3.5x a bf16 cache's writes (0.38 against 0.11 ms for a 1,024-token layer of SmolLM2, one
 * thread, Zen 4): ~1% of a prompt-heavy mix. AVX-512 intrinsics for whole groups were no faster. */
static void vec_to_int8(int8_t *dst, const float *src, int64_t d) {
    for (int64_t g0 = 0, gi = 0; g0 < d; g0 += KV_GROUP, gi++) {
        const int64_t n = d - g0 < KV_GROUP ? d - g0 : KV_GROUP;
        float amax = 0.f, inv; /* NaN elements left out, as the reference does */
#pragma omp simd reduction(max : amax)
        for (int64_t i = 0; i < n; i++) amax = fabsf(src[g0 + i]) > amax ? fabsf(src[g0 + i]) : amax;
        const float scale = group_scale(amax, &inv);
        round_group(dst + g0, src + g0, n, inv);
        memcpy(dst + d + 4 * gi, &scale, sizeof scale);
    }
}

static void row_to_int8(int8_t *dst, const float *src, int64_t row, int64_t d) {
    for (int64_t h = 0; h < row / d; h++) vec_to_int8(dst + h * kv_int8_row(d), src + h * d, d);
}

int write_kv(const void *k, const void *v, void *k_cache, void *v_cache, const int64_t *slots, int64_t t,
             int64_t row, int64_t k_rs, int64_t v_rs, int64_t nslots, int64_t esize, int mode, int64_t d) {
    for (int64_t i = 0; i < t; i++)
        if (slots[i] >= nslots) return -2;
    const int64_t bytes = row * esize;
    for (int64_t i = 0; i < t; i++) {
        if (slots[i] < 0) continue;
        if (mode == TO_INT8) {
            const int64_t qrow = row / d * kv_int8_row(d);
            row_to_int8((int8_t *)k_cache + slots[i] * qrow, (const float *)k + i * k_rs, row, d);
            row_to_int8((int8_t *)v_cache + slots[i] * qrow, (const float *)v + i * v_rs, row, d);
            continue;
        }
        if (mode == TO_BF16) {
            row_to_bf16((uint16_t *)k_cache + slots[i] * row, (const float *)k + i * k_rs, row);
            row_to_bf16((uint16_t *)v_cache + slots[i] * row, (const float *)v + i * v_rs, row);
            continue;
        }
        memcpy((char *)k_cache + slots[i] * bytes, (const char *)k + i * k_rs * esize, bytes);
        memcpy((char *)v_cache + slots[i] * bytes, (const char *)v + i * v_rs * esize, bytes);
    }
    return 0;
}
