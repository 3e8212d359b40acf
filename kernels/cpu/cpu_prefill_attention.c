/* Causal prefill attention over the paged KV cache on the CPU: fp32 activations, caches in fp32,
 * bf16 (kv_dtype 1, kv_cache_dtype bfloat16: widened exactly when K and V are packed) or int8
 * (kv_dtype 2: kernels/kvq.py's rows, dequantized when packed as decode attention does).
 *
 * Each row is decode attention's result for its position, bit for bit (tests/kernels/
 * test_kernels_cpu_prefill.py): a resumed job prefills positions its first worker decoded one by
 * one, as do a preempted and recomputed sequence and speculative verification, and their KV must
 * come out the same for the continuation to be exact. So a row runs decode attention's arithmetic:
 * scores in its order (cpu_attn_dots.h), one softmax over all the row's keys (max, then
 * exp_shift_sum), and P V as one FMA chain per element over the keys in order from zero.
 *
 * Why a kernel of its own: torch's CPU flash SDPA needs a gathered copy of K/V and ran prompt-sized
 * sequences (L = 64-350, head_dim 64) at 10-46 GFLOP/s on a Zen 3. Here the rows of a work item
 * share each packed K and V: the scores take two rows per K load (three on AVX-512), P V runs on
 * the GEMM's register tiles (cpu_tile.h) over packed V panels. Matching decode's order costs the
 * scores their horizontal sums: 1.3-1.5x the time of the earlier kernel, which summed q . k along
 * the GEMM tile and folded the softmax per 512-key chunk (measured on a Zen 3, docs/kernels.md).
 *
 * Work item: (sequence, kv head, qb consecutive query positions). Its R = qb * G rows (the G query
 * heads sharing the kv head; row r = position r / G, head r % G) are copied once (pre-scaled Q);
 * the sequence's K and V are packed once per (sequence, kv head) and thread, read from the cache
 * in place, and kept across that pair's items. Threads claim items one at a time from a shared
 * counter, a pair's items from its last query block down: the first item a thread takes of a
 * pair packs every key the later ones need, and the cheapest items (fewest keys) come last, so
 * the threads finish together. A static split by estimated work took 4.6-5.6% longer on
 * SmolLM2-shaped chunks (2 threads, Zen 4): it packed a pair's keys again where a thread's range
 * began, and its estimate left out per-item costs. Scores S = Q K^T over
 * each row's keys, a chunk of keys at a time; each row's softmax; O += P V a chunk at a time.
 * Each output row depends on its own position only, so results do not depend on the batch, the
 * chunking of the prompt or the threads.
 * Sequence i's query rows q_start[i] .. + q_len[i] are its last q_len[i] of kv_len[i] positions,
 * whose K/V are already in the cache. q, out: [T, Hq, D] contiguous; caches [blocks, bs, Hkv, D]
 * with a contiguous last dim. Returns 0, or -1 out of memory, -2 block id out of range, -3 bad
 * lengths, -4 unsupported shape.
 */
#include "cpu_common.h"
#include "cpu_attn_dots.h"
#include "cpu_kernels.h" /* kv_int8_widen */
#include "cpu_tile.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ROWS: query rows an item aims at (8 tiles of 6); KCH: keys per chunk of the two products, so
 * that a chunk's K rows or V panels stay in L2 (~128 KB each at D = 64) across the item's rows.
 * GC: columns of one tile call. */
enum { ROWS = 48, KCH = 512, GC = PANEL_COLS * PANEL_GROUP };

typedef struct {
    const float *q;
    const void *k, *v; /* fp32, bf16 (kv_dtype 1) or int8 rows (2), widened while packing */
    float *out;
    const int32_t *tables, *q_start, *q_len, *kv_len;
    const int64_t *item_start; /* first item of each sequence, nseq + 1 entries */
    int64_t width, nseq, hq, hkv, d, bs, num_blocks;
    int64_t k_sb, k_ss, k_sh, v_sb, v_ss, v_sh;
    int64_t qb, dpad, lmax; /* query positions per item; D and the longest sequence rounded up to GC */
    int64_t ls;             /* S's row stride: lmax + a cache line, so that rows 4 KB apart do not share L1 sets */
    float scale;
    int kv_dtype;
    int64_t *next; /* the next unclaimed item, shared by the threads (atomic) */
} job_t;

typedef struct {
    float *qr, *s, *o, *l; /* rows padded to whole tiles: Q [R][D], S then P [R][ls], O [R][dpad]; sums [R] */
    float *kp, *vp;        /* K rows [lmax][D]; V panels [dpad / PC][lmax][PC] */
    int64_t seq, h, done;  /* whose keys kp / vp hold, and how many are packed */
} scratch_t;

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }
static inline int64_t tile_height(int64_t R, int64_t i) { return R - i * TILE_ROWS < TILE_ROWS ? R - i * TILE_ROWS : TILE_ROWS; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* n elements of a cache row into dst, from element c0 of the D-element vector at off: fp32 copied,
 * bf16 widened (exact), int8 as decode attention reads it (kv_int8_widen); no row (src NULL):
 * zeros. Locals and restrict so that the loops vectorise: with dst possibly aliasing the job, the
 * compiler reloaded its fields per element, and these copies took ~15% of the kernel's time. */
static inline void widen_row(float *restrict dst, const void *src, int64_t off, int64_t D, int64_t c0, int64_t n,
                             int kt) {
    if (!src) {
        memset(dst, 0, sizeof(float) * n);
    } else if (kt == 2) {
        kv_int8_widen(dst, (const int8_t *)src + off, D, c0, n);
    } else if (kt == 1) {
        const uint16_t *restrict h = (const uint16_t *)src + off + c0;
#pragma omp simd
        for (int64_t c = 0; c < n; c++) dst[c] = bf16_f32(h[c]);
    } else {
        memcpy(dst, (const float *)src + off + c0, sizeof(float) * n);
    }
}

/* Keys [w->done, upto) of (sq, h) into the K rows and V panels; keys past kv_len as zeros. */
static int pack_kv(const job_t *j, scratch_t *w, int64_t sq, int64_t h, int64_t upto) {
    const int64_t D = j->d, PC = PANEL_COLS, kl = j->kv_len[sq], dpad = j->dpad, lmax = j->lmax;
    const int kt = j->kv_dtype;
    const int32_t *tab = j->tables + sq * j->width;
    if (w->seq != sq || w->h != h) w->seq = sq, w->h = h, w->done = 0;
    for (int64_t t = w->done; t < upto; t++) {
        float *kp = w->kp + t * D, *vp = w->vp + t * PC;
        int64_t kr = 0, vr = 0; /* element offsets of the key's K and V rows (t < kl) */
        if (t < kl) {
            const int64_t blk = tab[t / j->bs], off = t % j->bs;
            if (blk < 0 || blk >= j->num_blocks) return -2;
            kr = blk * j->k_sb + off * j->k_ss + h * j->k_sh;
            vr = blk * j->v_sb + off * j->v_ss + h * j->v_sh;
        }
        const void *ks = t < kl ? j->k : 0, *vs = t < kl ? j->v : 0;
        widen_row(kp, ks, kr, D, 0, D, kt);
        for (int64_t c0 = 0; c0 < dpad; c0 += PC, vp += lmax * PC) { /* one panel's PC columns */
            const int64_t n = min64(PC, D > c0 ? D - c0 : 0);
            widen_row(vp, vs, vr, D, c0, n, kt);
            memset(vp + n, 0, sizeof(float) * (PC - n)); /* the panel's columns past D */
        }
    }
    if (upto > w->done) w->done = upto;
    return 0;
}

/* The item's rows of Q, scaled; rows past R (up to a whole tile) zero. */
static void copy_q(const job_t *j, scratch_t *w, int64_t sq, int64_t h, int64_t q0, int64_t R) {
    const int64_t G = j->hq / j->hkv, D = j->d;
    const float scale = j->scale;
    for (int64_t r = 0; r < round_up(R, TILE_ROWS); r++) {
        float *restrict dst = w->qr + r * D;
        if (r >= R) {
            memset(dst, 0, sizeof(float) * D);
            continue;
        }
        const float *restrict src = j->q + ((j->q_start[sq] + q0 + r / G) * j->hq + h * G + r % G) * D;
#pragma omp simd
        for (int64_t c = 0; c < D; c++) dst[c] = src[c] * scale;
    }
}

/* S = Q K^T, each row over the keys it sees (row r: positions up to first_pos + r / G) and up to
 * 5 more (rows go in sixes; softmax_rows masks the extra), in decode attention's order
 * (attn_dots), a chunk of keys at a time for all rows. */
static void scores(const job_t *j, scratch_t *w, int64_t R, int64_t first_pos, int64_t last_pos) {
    const int64_t G = j->hq / j->hkv, D = j->d;
    for (int64_t c0 = 0; c0 <= last_pos; c0 += KCH)
        for (int64_t r = 0; r < R; r += 6) {
            const int64_t rows = min64(R - r, 6), n = min64(first_pos + (r + rows - 1) / G + 1 - c0, KCH);
            if (n > 0) attn_dots(w->qr + r * D, rows, w->kp + c0 * D, D, n, w->s + r * j->ls + c0, j->ls, D);
        }
}

/* Each row's softmax over all its keys at once (softmax_row, as decode attention's): S becomes P
 * (exp(s - max), unnormalised; entries up to last_pos past the row's keys exactly 0), l its sum. */
static void softmax_rows(const job_t *j, scratch_t *w, int64_t R, int64_t first_pos, int64_t last_pos) {
    const int64_t G = j->hq / j->hkv;
    for (int64_t r = 0; r < R; r++) {
        float *s = w->s + r * j->ls;
        const int64_t vis = first_pos + r / G + 1;
        w->l[r] = softmax_row(s, vis);
        for (int64_t t = vis; t <= last_pos; t++) s[t] = 0.f;
    }
}

/* Keys of the chunk [c0, c0 + n) that tile i's rows see (its last row's position bounds them), <= 0
 * when none: a tile's product stops there, not at the item's last position. */
static inline int64_t tile_keys(const job_t *j, int64_t R, int64_t i, int64_t first_pos, int64_t c0, int64_t n) {
    const int64_t last_row = i * TILE_ROWS + tile_height(R, i) - 1, seen = first_pos + last_row / (j->hq / j->hkv) + 1 - c0;
    return seen < n ? seen : n;
}

/* O += P V over the keys [c0, c0 + n): each output element one FMA chain over the keys in order
 * from zero, carried across chunks (accumulate), as decode attention's. Keys a row does not see
 * add exact zeros. */
static void values(const job_t *j, scratch_t *w, int64_t R, int64_t first_pos, int64_t c0, int64_t n) {
    const int64_t PC = PANEL_COLS;
    for (int64_t i = 0; i < tile_count(R); i++) {
        const int64_t mr = tile_height(R, i), ni = tile_keys(j, R, i, first_pos, c0, n);
        for (int64_t c = 0; ni > 0 && c < j->dpad; c += GC) { /* ni keys only: V past them may be unwritten */
            const float *vp = w->vp + (c / PC * j->lmax + c0) * PC;
            tile_rows(w->s + i * TILE_ROWS * j->ls + c0, j->ls, 1, vp, vp + j->lmax * PC, PANEL_GROUP, ni,
                      w->o + i * TILE_ROWS * j->dpad + c, j->dpad, 1, 0, 0, mr);
        }
    }
}

/* One work item: positions q0 .. q0 + nq - 1 of sequence `sq`, kv head h. */
static int item(const job_t *j, int64_t sq, int64_t h, int64_t q0, scratch_t *w) {
    const int64_t G = j->hq / j->hkv, D = j->d, ql = j->q_len[sq], kl = j->kv_len[sq];
    const int64_t nq = min64(ql - q0, j->qb), R = nq * G;
    const int64_t first_pos = kl - ql + q0, last_pos = first_pos + nq - 1;
    const int rc = pack_kv(j, w, sq, h, round_up(last_pos + 1, GC));
    if (rc) return rc;
    copy_q(j, w, sq, h, q0, R);
    scores(j, w, R, first_pos, last_pos);
    softmax_rows(j, w, R, first_pos, last_pos);
    memset(w->o, 0, sizeof(float) * round_up(R, TILE_ROWS) * j->dpad);
    for (int64_t c0 = 0; c0 <= last_pos; c0 += KCH) values(j, w, R, first_pos, c0, min64(last_pos + 1 - c0, KCH));
    const int64_t dp = j->dpad;
    for (int64_t r = 0; r < R; r++) { /* locals and restrict, as widen_row's */
        float *restrict dst = j->out + ((j->q_start[sq] + q0 + r / G) * j->hq + h * G + r % G) * D;
        const float *restrict o = w->o + r * dp;
        const float inv = 1.f / w->l[r];
#pragma omp simd
        for (int64_t c = 0; c < D; c++) dst[c] = o[c] * inv;
    }
    return 0;
}

/* Claims items until none is left; lo and hi are unused (the threads share j->next). Item it of
 * sequence sq is kv head local / nqb, query block nqb - 1 - local % nqb (a pair's last block
 * first). Scratch per thread: the packed K and V of the batch's longest sequence, (D + dpad) x
 * lmax floats (2 x 4 MB at 16K tokens, D 64), the rows' scores over it, R x lmax (3 MB there),
 * plus ~40 KB of rows. */
static int items(const void *arg, int64_t lo, int64_t hi) {
    (void)lo, (void)hi;
    const job_t *j = (const job_t *)arg;
    const int64_t last = j->item_start[j->nseq];
    if (__atomic_load_n(j->next, __ATOMIC_RELAXED) >= last) return 0; /* all claimed (by any range) */
    const int64_t R = round_up(j->qb * (j->hq / j->hkv), TILE_ROWS), D = j->d, dp = j->dpad, L = j->lmax;
    const int64_t sizes[6] = {R * D, R * j->ls, R * dp, R, L * D, dp * L};
    int64_t total = 0;
    for (int i = 0; i < 6; i++) total += sizes[i];
    float *buf = malloc(sizeof(float) * total);
    if (!buf) return -1;
    float *part[6];
    for (int64_t i = 0, off = 0; i < 6; off += sizes[i], i++) part[i] = buf + off;
    scratch_t w = {part[0], part[1], part[2], part[3], part[4], part[5], -1, -1, 0};
    int status = 0;
    int64_t sq = 0, it;
    while (status == 0 && (it = __atomic_fetch_add(j->next, 1, __ATOMIC_RELAXED)) < last) {
        while (j->item_start[sq + 1] <= it) sq++; /* a thread's claims only grow */
        const int64_t local = it - j->item_start[sq], nqb = (j->q_len[sq] + j->qb - 1) / j->qb;
        status = item(j, sq, local / nqb, (nqb - 1 - local % nqb) * j->qb, &w);
    }
    if (status) __atomic_store_n(j->next, last, __ATOMIC_RELAXED); /* the call fails: the others stop */
    free(buf);
    return status;
}

int paged_prefill_attention(const float *q, const void *k, const void *v, float *out, const int32_t *tables,
                            int64_t width, const int32_t *q_start, const int32_t *q_len, const int32_t *kv_len,
                            int64_t nseq, int64_t hq, int64_t hkv, int64_t d, int64_t bs, int64_t num_blocks,
                            const int64_t *k_strides, const int64_t *v_strides, float scale, int kv_dtype,
                            int nthreads) {
    if (d < 1 || hkv < 1 || hq % hkv || hq / hkv > 64 || bs < 1) return -4;
    int64_t *start = malloc(sizeof(int64_t) * (nseq + 1));
    if (!start) return -1;
    const int64_t G = hq / hkv, qb = G >= ROWS ? 1 : ROWS / G;
    start[0] = 0;
    double total = 0; /* work ~ query positions x visible keys: one thread below 1e5 */
    int64_t max_kv = 1;
    for (int64_t s = 0; s < nseq; s++) {
        if (q_len[s] < 1 || kv_len[s] < q_len[s] || kv_len[s] > width * bs) {
            free(start);
            return -3;
        }
        start[s + 1] = start[s] + hkv * ((q_len[s] + qb - 1) / qb);
        if (kv_len[s] > max_kv) max_kv = kv_len[s];
        total += (double)q_len[s] * (kv_len[s] - q_len[s] / 2.0) * hkv;
    }
    _Alignas(64) int64_t next = 0; /* a line apart from j: each claim writes it, the threads read j */
    _Alignas(64) job_t j = {q, k, v, out, tables, q_start, q_len, kv_len, start, width, nseq, hq, hkv, d, bs,
                            num_blocks, k_strides[0], k_strides[1], k_strides[2], v_strides[0], v_strides[1],
                            v_strides[2], qb, round_up(d, GC), round_up(max_kv, GC), round_up(max_kv, GC) + 16,
                            scale, kv_dtype, &next};
    const int n = total < 1e5 ? 1 : thread_count(nthreads, start[nseq]);
    int64_t bounds[MAX_THREADS + 1]; /* one range a thread; each claims items until none is left */
    for (int i = 0; i <= n; i++) bounds[i] = i;
    const int rc = run_ranges(items, &j, bounds, n);
    free(start);
    return rc;
}
