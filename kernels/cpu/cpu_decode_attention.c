/* Paged decode attention on the CPU: one query token per row, K/V read in place.
 *
 * The torch reference gathers every sequence's blocks into a padded copy and then runs SDPA
 * over it, so the KV cache (at batch 48, fp32, about 2x the weights per step) crosses memory
 * three times. Here each row walks its block table block by block and reads each K and V
 * vector from memory once for all query heads of the vector's GQA group (K from L1 for the
 * group's later heads; V, on AVX2, into one register for up to three heads: axpys_heads).
 *
 * Caches: [num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous, fp32 or bf16
 * (kv_dtype 0 / 1), or int8 (2: kernels/kvq.py's rows, kv_int8_row(head_dim) bytes, strides in bytes); q and
 * out: [rows, num_heads, head_dim] contiguous, fp32 or bf16 (dtype): a bf16 or int8 cache under
 * fp32 activations is kv_cache_dtype bfloat16 / int8. Scores, softmax and the
 * weighted sum of V are in fp32. Work is split over threads by KV length.
 * Returns 0, or a negative code: -1 out of memory, -2 block id out of range, -3 bad length.
 */
#include "cpu_common.h"
#include "cpu_kernels.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const void *q, *k, *v;
    void *out;
    const int32_t *tables, *lens;
    int64_t hq, hkv, d, bs, width, num_blocks;
    int64_t k_sb, k_ss, k_sh, v_sb, v_ss, v_sh; /* element strides: block, slot, head */
    float scale;
    int dtype, kv_dtype; /* q and out; the caches */
    int64_t max_len;
    int64_t k_lines, v_lines; /* cache lines from a block's first K (V) element to its last */
    int64_t k_per, v_per;     /* lines per prefetch slice: ceil(lines / hq) */
} job_t;

/* Software prefetch: the hardware prefetchers do not cross into the next block (another place in
 * the cache), so each block was a cold start; asking for the next one while this one is worked on
 * made the kernel ~25% faster at batch 48 (measured, 36 MB of K/V per layer; ~1.8x on a Zen 4 at
 * 20 rows), and asking PF_AHEAD = 2 blocks ahead instead of 1 another 4-5% (Zen 4, 20-48 rows). */
enum { PF_AHEAD = 2 };
typedef struct {
    const char *p;      /* NULL: nothing to fetch */
    int64_t lines, per; /* the block's cache lines; lines per slice */
} pf_t;

/* K (is_v = 0) or V block `blk`, or nothing for an id out of range (refused later, not read). */
static inline pf_t block_pf(const job_t *j, int is_v, int64_t blk) {
    if (blk < 0 || blk >= j->num_blocks) return (pf_t){0, 0, 0};
    const int64_t es = kv_esize(j->kv_dtype);
    if (is_v) return (pf_t){(const char *)j->v + blk * j->v_sb * es, j->v_lines, j->v_per};
    return (pf_t){(const char *)j->k + blk * j->k_sb * es, j->k_lines, j->k_per};
}

/* The block `idx` places along the read order of a row with nb blocks: its K blocks, its V
 * blocks, then the next row's K blocks (next_row < 0: none; its length is checked only when it is
 * attended, so its block count is clamped to the table's width here). */
static inline pf_t block_at(const job_t *j, const int32_t *tab, int64_t nb, int64_t next_row, int64_t idx) {
    if (idx < nb) return block_pf(j, 0, tab[idx]);
    if (idx < 2 * nb) return block_pf(j, 1, tab[idx - nb]);
    if (next_row < 0) return (pf_t){0, 0, 0};
    int64_t next_nb = (j->lens[next_row] + j->bs - 1) / j->bs;
    next_nb = next_nb < 0 ? 0 : next_nb < j->width ? next_nb : j->width;
    idx -= 2 * nb;
    return idx < next_nb ? block_pf(j, 0, j->tables[next_row * j->width + idx]) : (pf_t){0, 0, 0};
}

/* Slice `part` (a query head): a block is fetched in slices of f.per lines, one per head's pass
 * over the block before, so that the requests are spread over that work instead of queueing all
 * at once. Slice sizes come precomputed: two divisions per call here were ~18% of a hot row's
 * time (Zen 3, single thread, K/V in L2). */
static inline void prefetch_slice(pf_t f, int64_t part) {
    if (!f.p) return;
    const int64_t lo = part * f.per, hi = lo + f.per < f.lines ? lo + f.per : f.lines;
    for (int64_t l = lo; l < hi; l++) __builtin_prefetch(f.p + 64 * l, 0, 2);
}

/* Pointer to a K or V vector as fp32: in place for fp32, converted into tmp for bf16. */
static inline const float *vec(const void *base, int64_t off, int dtype, int64_t d, float *tmp) {
    if (dtype == 0) return (const float *)base + off;
    const uint16_t *p = (const uint16_t *)base + off;
    uint32_t *bits = (uint32_t *)tmp; /* bf16 is the top half of an fp32 (-fno-strict-aliasing) */
#pragma omp simd
    for (int64_t i = 0; i < d; i++) bits[i] = (uint32_t)p[i] << 16;
    return tmp;
}

/* The n <= bs vectors of one block and kv head as fp32 rows `*stride` apart: in place for fp32,
 * widened (bf16) or dequantized (int8) into tmp [bs, D] (once per block and head, not once per
 * query head). */
static inline const float *block_rows(const job_t *j, const void *base, int64_t off, int64_t slot_stride,
                                      int64_t n, int64_t D, float *tmp, int64_t *stride) {
    if (j->kv_dtype == 0) {
        *stride = slot_stride;
        return (const float *)base + off;
    }
    for (int64_t t = 0; t < n; t++)
        if (j->kv_dtype == 2) kv_int8_widen(tmp + t * D, (const int8_t *)base + off + t * slot_stride, D, 0, D);
        else vec(base, off + t * slot_stride, 1, D, tmp + t * D);
    *stride = D;
    return tmp;
}

/* acc[0:D] += sum over t < n of p[t] * v[t * st : +D]; the accumulator stays in registers
 * across the tokens (a local array of constant size D). */
static inline __attribute__((always_inline)) void
axpys_scalar(const float *p, const float *v, int64_t st, int64_t n, float *acc, const int64_t D) {
    float a[D];
#pragma omp simd
    for (int64_t i = 0; i < D; i++) a[i] = acc[i];
    for (int64_t t = 0; t < n; t++) {
#pragma omp simd
        for (int64_t i = 0; i < D; i++) a[i] = fmaf(p[t], v[t * st + i], a[i]); /* as prefill's tiles */
    }
#pragma omp simd
    for (int64_t i = 0; i < D; i++) acc[i] = a[i];
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* axpys_scalar with explicit registers, 64 columns at a time: GCC kept the local array in memory,
 * storing it back after every token. */
static inline __attribute__((always_inline)) void
axpys(const float *p, const float *v, int64_t st, int64_t n, float *acc, const int64_t D) {
    if (D % 8) {
        axpys_scalar(p, v, st, n, acc, D);
        return;
    }
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
        const int64_t w = D - c0 < 64 ? D - c0 : 64;
        __m256 a[8];
        for (int c = 0; c < 8; c++) a[c] = 8 * c < w ? _mm256_loadu_ps(acc + c0 + 8 * c) : _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const __m256 pt = _mm256_broadcast_ss(p + t);
            const float *vt = v + t * st + c0;
            for (int c = 0; c < 8; c++)
                if (8 * c < w) a[c] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8 * c), a[c]);
        }
        for (int c = 0; c < 8; c++)
            if (8 * c < w) _mm256_storeu_ps(acc + c0 + 8 * c, a[c]);
    }
}

/* axpys for gc <= 3 query heads sharing one V block (GQA), 32 columns at a time: each V vector is
 * loaded once for the gc heads (12 accumulators, 3 weights and the vector fill the 16 registers)
 * instead of once per head, which left axpys load-bound. p: head g's weights at p + g * ps. Each
 * element is the same FMA chain over t as axpys', so results are bit-identical. */
static inline __attribute__((always_inline)) void
axpys_heads(const float *p, int64_t ps, const float *v, int64_t st, int64_t n, float *acc, const int64_t D,
            const int gc) {
    for (int64_t c0 = 0; c0 < D; c0 += 32) {
        __m256 a[3][4];
        for (int g = 0; g < gc; g++)
            for (int c = 0; c < 4; c++) a[g][c] = _mm256_loadu_ps(acc + g * D + c0 + 8 * c);
        for (int64_t t = 0; t < n; t++) {
            __m256 w[3];
            for (int g = 0; g < gc; g++) w[g] = _mm256_broadcast_ss(p + g * ps + t);
            const float *vt = v + t * st + c0;
            for (int c = 0; c < 4; c++) {
                __m256 x = _mm256_loadu_ps(vt + 8 * c);
                __asm__("" : "+x"(x)); /* one load in a register: GCC would fold it into each FMA */
                for (int g = 0; g < gc; g++) a[g][c] = _mm256_fmadd_ps(w[g], x, a[g][c]);
            }
        }
        for (int g = 0; g < gc; g++)
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc + g * D + c0 + 8 * c, a[g][c]);
    }
}
#define HEADS_AT_ONCE 3
#else
#define axpys axpys_scalar
#define HEADS_AT_ONCE 1
#endif

#include "cpu_attn_dots.h" /* dots, and FAST64's loops: the AVX-512 ones for head size 64 */

/* Heads [g0, g0 + gc) of one kv head over one V block: together where the vector code allows. */
static inline __attribute__((always_inline)) void
axpys_group(const float *p, int64_t ps, const float *v, int64_t st, int64_t n, float *acc, const int64_t D,
            int64_t gc) {
#if HEADS_AT_ONCE > 1
    if (D % 32 == 0) {
        if (gc == 3) axpys_heads(p, ps, v, st, n, acc, D, 3);
        else if (gc == 2) axpys_heads(p, ps, v, st, n, acc, D, 2);
        else axpys_heads(p, ps, v, st, n, acc, D, 1);
        return;
    }
#endif
    for (int64_t g = 0; g < gc; g++) axpys(p + g * ps, v, st, n, acc + g * D, D);
}

/* Scores of every query head of one row against every cached token: s[head * len + t].
 * Inlined with D a compile-time constant for the common head sizes (see DISPATCH_D). */
static inline __attribute__((always_inline)) int
row_scores_d(const job_t *j, int64_t row, int64_t len, const float *qf, float *s, float *tmp, int64_t next_row,
             const int64_t D) {
    const int64_t G = j->hq / j->hkv, bs = j->bs, nb = (len + bs - 1) / bs;
    const int fast = FAST64 && D == 64, step = fast ? 3 : 1;
    const int32_t *tab = j->tables + row * j->width;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t blk = tab[b], n = len - b * bs < bs ? len - b * bs : bs;
        if (blk < 0 || blk >= j->num_blocks) return -2;
        /* PF_AHEAD along K, V, next row's K; at b = 0 also the block after this one, which no
         * earlier step asked for when this row is a thread's first (or has one block) */
        const pf_t next = block_at(j, tab, nb, next_row, b + PF_AHEAD);
        const pf_t also = b == 0 ? block_at(j, tab, nb, next_row, 1) : (pf_t){0, 0, 0};
        for (int64_t h = 0; h < j->hkv; h++) {
            /* FAST64: K read in place, 3 heads a pass; else a widened block, one head a pass */
            int64_t st = 0;
            const float *k = fast ? 0 : block_rows(j, j->k, blk * j->k_sb + h * j->k_sh, j->k_ss, n, D, tmp, &st);
            for (int64_t g0 = h * G; g0 < (h + 1) * G; g0 += step) {
                const int64_t gc = (h + 1) * G - g0 < step ? (h + 1) * G - g0 : step;
                for (int64_t g = g0; g < g0 + gc; g++) prefetch_slice(next, g), prefetch_slice(also, g);
                if (fast)
                    CASES64(dots64, gc, j->kv_dtype, qf + g0 * D, j->k, blk * j->k_sb + h * j->k_sh, j->k_ss, n,
                            s + g0 * len + b * bs, len)
                else
                    dots(qf + g0 * D, k, st, n, s + g0 * len + b * bs, D);
            }
        }
    }
    return 0;
}

/* acc[head] = sum over tokens of p[head * len + t] * V[t, kv head of head]; each head's
 * accumulator stays in registers across a block (a local array of constant size D). */
static inline __attribute__((always_inline)) void
row_values_d(const job_t *j, int64_t row, int64_t len, const float *p, float *acc, float *tmp, int64_t next_row,
             const int64_t D) {
    const int64_t G = j->hq / j->hkv, bs = j->bs, nb = (len + bs - 1) / bs;
    const int fast = FAST64 && D == 64, step = fast ? 3 : HEADS_AT_ONCE;
    const int32_t *tab = j->tables + row * j->width;
    memset(acc, 0, sizeof(float) * j->hq * D);
    for (int64_t b = 0; b < nb; b++) {
        const int64_t blk = tab[b], n = len - b * bs < bs ? len - b * bs : bs;
        const pf_t next = block_at(j, tab, nb, next_row, nb + b + PF_AHEAD); /* past V: next row's K */
        for (int64_t h = 0; h < j->hkv; h++) {
            int64_t st = 0;
            const float *v = fast ? 0 : block_rows(j, j->v, blk * j->v_sb + h * j->v_sh, j->v_ss, n, D, tmp, &st);
            for (int64_t g0 = h * G; g0 < (h + 1) * G; g0 += step) {
                const int64_t gc = (h + 1) * G - g0 < step ? (h + 1) * G - g0 : step;
                for (int64_t g = g0; g < g0 + gc; g++) prefetch_slice(next, g);
                if (fast)
                    CASES64(axpys64, gc, j->kv_dtype, p + g0 * len + b * bs, len, j->v, blk * j->v_sb + h * j->v_sh,
                            j->v_ss, n, acc + g0 * D)
                else
                    axpys_group(p + g0 * len + b * bs, len, v, st, n, acc + g0 * D, D, gc);
            }
        }
    }
}

/* Unrolled, fully vectorised inner loops for the usual head sizes; any other size still works. */
#define DISPATCH_D(fn, ...) \
    (j->d == 64 ? fn(__VA_ARGS__, 64) : j->d == 128 ? fn(__VA_ARGS__, 128) : fn(__VA_ARGS__, j->d))

static int row_scores(const job_t *j, int64_t row, int64_t len, const float *qf, float *s, float *tmp,
                      int64_t next_row) {
    return DISPATCH_D(row_scores_d, j, row, len, qf, s, tmp, next_row);
}

static void row_values(const job_t *j, int64_t row, int64_t len, const float *p, float *acc, float *tmp,
                       int64_t next_row) {
    DISPATCH_D(row_values_d, j, row, len, p, acc, tmp, next_row);
}

/* One sequence row, all heads: K and V of each block are read once, front to back. */
static int attend(const job_t *j, int64_t row, int64_t next_row, float *qf, float *acc, float *s, float *tmp) {
    const int64_t D = j->d, len = j->lens[row];
    if (len < 1 || len > j->width * j->bs) return -3;
    for (int64_t g = 0; g < j->hq; g++) {
        const float *qv = vec(j->q, (row * j->hq + g) * D, j->dtype, D, tmp);
        for (int64_t i = 0; i < D; i++) qf[g * D + i] = qv[i] * j->scale;
    }
    int rc = row_scores(j, row, len, qf, s, tmp, next_row);
    if (rc) return rc;
    float sum[j->hq];
    for (int64_t g = 0; g < j->hq; g++) sum[g] = softmax_row(s + g * len, len);
    row_values(j, row, len, s, acc, tmp, next_row);
    for (int64_t g = 0; g < j->hq; g++) {
        const float inv = 1.f / sum[g];
        const int64_t off = (row * j->hq + g) * D;
        for (int64_t i = 0; i < D; i++) {
            const float o = acc[g * D + i] * inv;
            if (j->dtype == 0) ((float *)j->out)[off + i] = o;
            else ((uint16_t *)j->out)[off + i] = f32_bf16(o);
        }
    }
    return 0;
}

/* Rows [lo, hi) with this thread's scratch: scaled q, accumulators, one widened block, scores. */
static int rows(const void *arg, int64_t lo, int64_t hi) {
    const job_t *j = (const job_t *)arg;
    const int64_t HD = j->hq * j->d;
    float *buf = malloc(sizeof(float) * (2 * HD + j->bs * j->d + j->hq * j->max_len));
    if (!buf) return -1;
    int status = 0;
    for (int64_t row = lo; row < hi && status == 0; row++)
        status = attend(j, row, row + 1 < hi ? row + 1 : -1, buf, buf + HD, buf + 2 * HD + j->bs * j->d, buf + 2 * HD);
    free(buf);
    return status;
}

int paged_decode_attention(const void *q, const void *k, const void *v, void *out,
                           const int32_t *tables, const int32_t *lens, int64_t nrows,
                           int64_t hq, int64_t hkv, int64_t d, int64_t bs, int64_t width,
                           int64_t num_blocks, const int64_t *k_strides, const int64_t *v_strides,
                           float scale, int dtype, int kv_dtype, int nthreads) {
    job_t j = {q, k, v, out, tables, lens, hq, hkv, d, bs, width, num_blocks,
               k_strides[0], k_strides[1], k_strides[2], v_strides[0], v_strides[1], v_strides[2],
               scale, dtype, kv_dtype, 1, 0, 0};
    const int64_t esize = kv_esize(kv_dtype), vec_len = kv_dtype == 2 ? kv_int8_row(d) : d; /* int8: scales */
    j.k_lines = (((bs - 1) * j.k_ss + (hkv - 1) * j.k_sh + vec_len) * esize + 63) / 64;
    j.v_lines = (((bs - 1) * j.v_ss + (hkv - 1) * j.v_sh + vec_len) * esize + 63) / 64;
    j.k_per = hq > 0 ? (j.k_lines + hq - 1) / hq : 0; /* hq = 0: no head, nothing prefetched */
    j.v_per = hq > 0 ? (j.v_lines + hq - 1) / hq : 0;
    int64_t total = 0;
    for (int64_t r = 0; r < nrows; r++) {
        total += lens[r];
        if (lens[r] > j.max_len) j.max_len = lens[r];
    }
    int n = total * hkv * d < (1 << 16) ? 1 : thread_count(nthreads, nrows); /* small: one thread */
    /* Split rows so that each thread gets about the same number of K/V vectors to read. */
    int64_t bounds[MAX_THREADS + 1] = {0}, r = 0, acc = 0;
    for (int i = 0; i < n; i++) {
        const int64_t goal = total * (i + 1) / n;
        while (r < nrows && (acc < goal || i == n - 1)) acc += lens[r++];
        bounds[i + 1] = r;
    }
    return run_ranges(rows, &j, bounds, n);
}
