/* Causal prefill attention over the paged KV cache on the CPU, fp32.
 *
 * Why: torch's CPU flash SDPA needs a gathered copy of K/V and ran prompt-sized sequences
 * (L = 64-350, head_dim 64) at 10-46 GFLOP/s here. This kernel reads K/V in place and runs both
 * products on the 6x16 register tile of the GEMM (cpu_tile.h): 1.2-2.5x SDPA at L = 64-350,
 * about even at 700, slower at 2048 (measured, three runs).
 *
 * Work item: (sequence, kv head, QB consecutive query positions). Its tile of R = QB * G rows
 * (the G query heads sharing the kv head, row r = position r / G, head r % G) meets each visible
 * KV block once: the K block is transposed into a [D][16] panel, S = Q K^T, masked (causal) and
 * folded into a running softmax (max m, sum l per row), then O += P V with V rows read in place.
 * Sequence i's query rows q_start[i] .. + q_len[i] are its last q_len[i] of kv_len[i] positions,
 * whose K/V are already in the cache. q, out: [T, Hq, D] contiguous; caches [blocks, bs, Hkv, D]
 * with a contiguous last dim; D a multiple of 16. Returns 0, or -1 out of memory, -2 block id out
 * of range, -3 bad lengths, -4 unsupported shape.
 */
#include "cpu_common.h"
#include "cpu_tile.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { QB = 16, KB = TILE_COLS }; /* query positions per item; KV tokens per S panel */

typedef struct {
    const float *q, *k, *v;
    float *out;
    const int32_t *tables, *q_start, *q_len, *kv_len;
    const int64_t *item_start; /* first item of each sequence, nseq + 1 entries */
    int64_t width, nseq, hq, hkv, d, bs, num_blocks, max_kv;
    int64_t k_sb, k_ss, k_sh, v_sb, v_ss, v_sh;
    float scale;
} job_t;

typedef struct {
    float *q, *o, *s, *m, *l; /* [R, D], [R, D], [R, KB], [R], [R] */
    /* K^T panels [panel][D][KB] of one (sequence, kv head), kept across that pair's query blocks
     * (a thread's items are consecutive): each panel is transposed once, not once per block. */
    float *kt;
    int64_t kt_seq, kt_h, kt_done;
} scratch_t;

/* The last token index of a panel of n that a query `last` tokens past the panel start sees:
 * -1 (none) for a query before the panel, n - 1 for one after it. */
static inline int64_t visible(int64_t last, int64_t n) {
    return last < -1 ? -1 : last < n - 1 ? last : n - 1;
}

/* Fold S (rows r < R, tokens t < n of this panel, first token at absolute position t0) into the
 * running softmax; leaves P (exp, masked entries exactly 0) in S and rescales O's rows. */
static void softmax_step(const job_t *j, scratch_t *w, int64_t R, int64_t first_pos, int64_t t0, int64_t n) {
    const int64_t G = j->hq / j->hkv, D = j->d;
    float corr[QB * 64];
    for (int64_t r = 0; r < R; r++) {
        float *s = w->s + r * KB, mx = w->m[r];
        const int lim = (int)visible(first_pos + r / G - t0, n);
#pragma omp simd reduction(max : mx)
        for (int t = 0; t < KB; t++) mx = t <= lim && s[t] > mx ? s[t] : mx;
        corr[r] = expf(w->m[r] - mx); /* 0 on the first panel (m = -inf) */
        w->m[r] = mx;
#pragma omp simd
        for (int t = 0; t < KB; t++) s[t] = t <= lim ? s[t] - mx : -100.f;
    }
    vexpf_inplace(w->s, R * KB);
    for (int64_t r = 0; r < R; r++) {
        float *s = w->s + r * KB, *o = w->o + r * D, z = 0.f;
        const int lim = (int)visible(first_pos + r / G - t0, n);
#pragma omp simd reduction(+ : z)
        for (int t = 0; t < KB; t++) {
            s[t] = t <= lim ? s[t] : 0.f; /* masked: exactly nothing */
            z += s[t];
        }
        w->l[r] = w->l[r] * corr[r] + z;
        if (corr[r] != 1.f)
#pragma omp simd
            for (int64_t c = 0; c < D; c++) o[c] *= corr[r];
    }
}

/* One work item: positions q0 .. q0 + nq - 1 of sequence `sq`, kv head h. */
static int item(const job_t *j, int64_t sq, int64_t h, int64_t q0, scratch_t *w) {
    const int64_t G = j->hq / j->hkv, D = j->d, bs = j->bs;
    const int64_t ql = j->q_len[sq], kl = j->kv_len[sq], nq = ql - q0 < QB ? ql - q0 : QB, R = nq * G;
    const int64_t first_pos = kl - ql + q0, last_pos = first_pos + nq - 1;
    const int32_t *tab = j->tables + sq * j->width;
    for (int64_t i = 0; i < nq; i++) /* Q rows, pre-scaled */
        for (int64_t g = 0; g < G; g++) {
            const float *src = j->q + ((j->q_start[sq] + q0 + i) * j->hq + h * G + g) * D;
            for (int64_t c = 0; c < D; c++) w->q[(i * G + g) * D + c] = src[c] * j->scale;
        }
    memset(w->o, 0, sizeof(float) * R * D);
    for (int64_t r = 0; r < R; r++) w->m[r] = -INFINITY, w->l[r] = 0.f;
    if (w->kt_seq != sq || w->kt_h != h) w->kt_seq = sq, w->kt_h = h, w->kt_done = 0;
    /* Panels of up to KB tokens that never cross a block, up to the last position any row sees. */
    for (int64_t t0 = 0, n, p = 0; t0 <= last_pos; t0 += n, p++) {
        const int64_t blk = tab[t0 / bs], off = t0 % bs, full = bs - off < KB ? bs - off : KB;
        if (blk < 0 || blk >= j->num_blocks) return -2;
        n = full < last_pos + 1 - t0 ? full : last_pos + 1 - t0;
        float *kt = w->kt + p * D * KB;
        if (p >= w->kt_done) { /* the whole panel: columns past n are masked for this item */
            const float *kb = j->k + blk * j->k_sb + off * j->k_ss + h * j->k_sh;
            for (int64_t t = 0; t < KB; t++)
                for (int64_t c = 0; c < D; c++) kt[c * KB + t] = t < full ? kb[t * j->k_ss + c] : 0.f;
            w->kt_done = p + 1;
        }
        tiles(w->q, D, kt, KB, D, w->s, KB, 0, R);
        softmax_step(j, w, R, first_pos, t0, n);
        const float *vb = j->v + blk * j->v_sb + off * j->v_ss + h * j->v_sh;
        for (int64_t c0 = 0; c0 < D; c0 += TILE_COLS) /* only n rows of V: the rest may be unwritten */
            tiles(w->s, KB, vb + c0, j->v_ss, n, w->o + c0, D, 1, R);
    }
    for (int64_t r = 0; r < R; r++) {
        float *dst = j->out + ((j->q_start[sq] + q0 + r / G) * j->hq + h * G + r % G) * D;
        const float inv = 1.f / w->l[r];
        for (int64_t c = 0; c < D; c++) dst[c] = w->o[r * D + c] * inv;
    }
    return 0;
}

/* Items [lo, hi) in (sequence, kv head, query block) order. */
static int items(const void *arg, int64_t lo, int64_t hi) {
    const job_t *j = (const job_t *)arg;
    const int64_t R = QB * (j->hq / j->hkv), D = j->d;
    const int64_t panels = (j->max_kv + j->bs - 1) / j->bs * ((j->bs + KB - 1) / KB); /* of the longest */
    float *buf = malloc(sizeof(float) * (2 * R * D + R * KB + 2 * R + panels * D * KB));
    if (!buf) return -1;
    scratch_t w = {buf, buf + R * D, buf + 2 * R * D, buf + 2 * R * D + R * KB, buf + 2 * R * D + R * KB + R,
                   buf + 2 * R * D + R * KB + 2 * R, -1, -1, 0};
    int status = 0;
    int64_t sq = 0;
    for (int64_t it = lo; it < hi && status == 0; it++) {
        while (j->item_start[sq + 1] <= it) sq++;
        const int64_t local = it - j->item_start[sq], nqb = (j->q_len[sq] + QB - 1) / QB;
        status = item(j, sq, local / nqb, (local % nqb) * QB, &w);
    }
    free(buf);
    return status;
}

int paged_prefill_attention(const float *q, const float *k, const float *v, float *out, const int32_t *tables,
                            int64_t width, const int32_t *q_start, const int32_t *q_len, const int32_t *kv_len,
                            int64_t nseq, int64_t hq, int64_t hkv, int64_t d, int64_t bs, int64_t num_blocks,
                            const int64_t *k_strides, const int64_t *v_strides, float scale, int nthreads) {
    if (d % TILE_COLS || hkv < 1 || hq % hkv || hq / hkv > 64 || bs < 1) return -4;
    int64_t *start = malloc(sizeof(int64_t) * (nseq + 1));
    if (!start) return -1;
    start[0] = 0;
    double total = 0; /* work ~ query positions x visible keys */
    int64_t max_kv = 1;
    for (int64_t s = 0; s < nseq; s++) {
        if (q_len[s] < 1 || kv_len[s] < q_len[s] || kv_len[s] > width * bs) {
            free(start);
            return -3;
        }
        start[s + 1] = start[s] + hkv * ((q_len[s] + QB - 1) / QB);
        if (kv_len[s] > max_kv) max_kv = kv_len[s];
        total += (double)q_len[s] * (kv_len[s] - q_len[s] / 2.0) * hkv;
    }
    job_t j = {q, k, v, out, tables, q_start, q_len, kv_len, start, width, nseq, hq, hkv, d, bs, num_blocks, max_kv,
               k_strides[0], k_strides[1], k_strides[2], v_strides[0], v_strides[1], v_strides[2], scale};
    const int n = total < 1e5 ? 1 : thread_count(nthreads, start[nseq]);
    int64_t bounds[MAX_THREADS + 1] = {0};
    double acc = 0;
    int b = 1;
    for (int64_t s = 0; s < nseq && b < n; s++) /* split items so that each thread gets ~total / n */
        for (int64_t it = start[s]; it < start[s + 1] && b < n; it++) {
            const int64_t q0 = ((it - start[s]) % ((q_len[s] + QB - 1) / QB)) * QB;
            acc += (double)QB * (kv_len[s] - q_len[s] + q0 + QB / 2);
            if (acc >= total * b / n) bounds[b++] = it + 1;
        }
    for (; b <= n; b++) bounds[b] = start[nseq];
    const int rc = run_ranges(items, &j, bounds, n);
    free(start);
    return rc;
}
