/* Causal prefill attention over the paged KV cache on the CPU: fp32 activations, caches in fp32 or
 * bf16 (kv_dtype 1, kv_cache_dtype bfloat16: widened exactly when K^T and V are packed).
 *
 * Why: torch's CPU flash SDPA needs a gathered copy of K/V and ran prompt-sized sequences
 * (L = 64-350, head_dim 64) at 10-46 GFLOP/s on a Zen 3. Here both products run on the GEMM's
 * register tiles (cpu_tile.h: 6 x 64 on AVX-512, 6 x 16 on AVX2) over packed operands, a whole
 * chunk of up to KCH keys at a time, so the softmax is folded in once per chunk rather than once
 * per 16-key panel as before (3 x 684-token prompts: 12.3 ms against 14.8 per layer on a Zen 4;
 * 1.5-2.1x SDPA at 64-2048 tokens there). The products then run near the FMA peak; the rest is
 * the softmax passes (~16%) and packing K^T / V (~10%), single-thread breakdown.
 *
 * Work item: (sequence, kv head, qb consecutive query positions). Its R = qb * G rows (the G query
 * heads sharing the kv head; row r = position r / G, head r % G) are copied once (pre-scaled Q);
 * the sequence's K^T and V are packed into panels once per (sequence, kv head), read from the
 * cache in place, and kept across that pair's items (a thread's items are consecutive). Per chunk
 * of keys: S = Q K^T, softmax folded into a running max m and sum l per row, O += P V.
 * Each output row depends on its own position only: chunks start at absolute key positions, a
 * row's softmax runs over exactly the keys it sees, and masked keys enter P V as exact zeros, so
 * results do not depend on the batch, the chunking of the prompt or the threads.
 * Sequence i's query rows q_start[i] .. + q_len[i] are its last q_len[i] of kv_len[i] positions,
 * whose K/V are already in the cache. q, out: [T, Hq, D] contiguous; caches [blocks, bs, Hkv, D]
 * with a contiguous last dim. Returns 0, or -1 out of memory, -2 block id out of range, -3 bad
 * lengths, -4 unsupported shape.
 */
#include "cpu_common.h"
#include "cpu_tile.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ROWS: query rows an item aims at (8 tiles of 6); KCH: keys per chunk, so that one chunk's
 * scores, packed P and K/V panels stay in L2 (~0.5 MB at D = 64). GC: columns of one tile call. */
enum { ROWS = 48, KCH = 512, GC = PANEL_COLS * PANEL_GROUP };

typedef struct {
    const float *q;
    const void *k, *v; /* fp32, or bf16 with kv_dtype 1 (widened exactly while packing) */
    float *out;
    const int32_t *tables, *q_start, *q_len, *kv_len;
    const int64_t *item_start; /* first item of each sequence, nseq + 1 entries */
    int64_t width, nseq, hq, hkv, d, bs, num_blocks;
    int64_t k_sb, k_ss, k_sh, v_sb, v_ss, v_sh;
    int64_t qb, dpad, lmax; /* query positions per item; D and the longest sequence rounded up to GC */
    float scale;
    int kv_dtype;
} job_t;

/* Element i of a cache row at element offset off: fp32, or bf16 widened (exact). */
static inline float kv_at(const job_t *j, const void *base, int64_t off) {
    return j->kv_dtype ? bf16_f32(((const uint16_t *)base)[off]) : ((const float *)base)[off];
}

typedef struct {
    float *qr, *s, *o, *m, *l; /* rows padded to whole tiles: Q [R][D], S then P [R][KCH], O [R][dpad]; [R], [R] */
    float *kt, *vp;                 /* K^T panels [lmax / PC][D][PC]; V panels [dpad / PC][lmax][PC] */
    int64_t seq, h, done;           /* whose keys kt / vp hold, and how many are packed */
} scratch_t;

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }
static inline int64_t tile_height(int64_t R, int64_t i) { return R - i * TILE_ROWS < TILE_ROWS ? R - i * TILE_ROWS : TILE_ROWS; }

/* Keys [w->done, upto) of (sq, h) into the K^T and V panels; keys past kv_len as zeros. */
static int pack_kv(const job_t *j, scratch_t *w, int64_t sq, int64_t h, int64_t upto) {
    const int64_t D = j->d, PC = PANEL_COLS, kl = j->kv_len[sq];
    const int32_t *tab = j->tables + sq * j->width;
    if (w->seq != sq || w->h != h) w->seq = sq, w->h = h, w->done = 0;
    for (int64_t t = w->done; t < upto; t++) {
        float *kt = w->kt + (t / PC) * D * PC + t % PC, *vp = w->vp + t * PC;
        int64_t kr = -1, vr = -1; /* element offsets of the key's K and V rows, or none */
        if (t < kl) {
            const int64_t blk = tab[t / j->bs], off = t % j->bs;
            if (blk < 0 || blk >= j->num_blocks) return -2;
            kr = blk * j->k_sb + off * j->k_ss + h * j->k_sh;
            vr = blk * j->v_sb + off * j->v_ss + h * j->v_sh;
        }
        for (int64_t c = 0; c < D; c++) kt[c * PC] = kr >= 0 ? kv_at(j, j->k, kr + c) : 0.f;
        for (int64_t c0 = 0; c0 < j->dpad; c0 += PC, vp += j->lmax * PC) /* one panel's PC columns */
#pragma omp simd
            for (int64_t c = 0; c < PC; c++) vp[c] = vr >= 0 && c0 + c < D ? kv_at(j, j->v, vr + c0 + c) : 0.f;
    }
    if (upto > w->done) w->done = upto;
    return 0;
}

/* The item's rows of Q, scaled; rows past R (up to a whole tile) zero. */
static void copy_q(const job_t *j, scratch_t *w, int64_t sq, int64_t h, int64_t q0, int64_t R) {
    const int64_t G = j->hq / j->hkv, D = j->d;
    for (int64_t r = 0; r < round_up(R, TILE_ROWS); r++) {
        float *dst = w->qr + r * D;
        const float *src = r < R ? j->q + ((j->q_start[sq] + q0 + r / G) * j->hq + h * G + r % G) * D : 0;
#pragma omp simd
        for (int64_t c = 0; c < D; c++) dst[c] = src ? src[c] * j->scale : 0.f;
    }
}

/* Fold the chunk's scores (keys c0 .. c0 + n - 1, row r sees up to position first_pos + r / G)
 * into the running softmax: S becomes P (exp, masked entries exactly 0), O's rows are rescaled. */
static void softmax_chunk(const job_t *j, scratch_t *w, int64_t R, int64_t first_pos, int64_t c0, int64_t n) {
    const int64_t G = j->hq / j->hkv;
    for (int64_t r = 0; r < R; r++) {
        float *s = w->s + r * KCH;
        int64_t vis = first_pos + r / G - c0 + 1; /* keys of the chunk this row sees */
        vis = vis < 0 ? 0 : vis > n ? n : vis;
        if (vis > 0) {
            float mx = w->m[r];
#pragma omp simd reduction(max : mx)
            for (int64_t t = 0; t < vis; t++) mx = s[t] > mx ? s[t] : mx;
            const float corr = expf(w->m[r] - mx); /* 0 on the first chunk (m = -inf) */
            w->m[r] = mx;
            w->l[r] = w->l[r] * corr + exp_shift_sum(s, vis, mx);
            if (corr != 1.f)
                for (int64_t c = 0; c < j->dpad; c++) w->o[r * j->dpad + c] *= corr;
        }
#pragma omp simd
        for (int64_t t = vis; t < n; t++) s[t] = 0.f;
    }
}

/* Keys of the chunk [c0, c0 + n) that tile i's rows see (its last row's position bounds them), <= 0
 * when none: a tile's products stop there, not at the item's last position (an item's first tiles
 * skip up to qb - 1 diagonal keys, and the Q K^T of the last columns needs only one panel). */
static inline int64_t tile_keys(const job_t *j, int64_t R, int64_t i, int64_t first_pos, int64_t c0, int64_t n) {
    const int64_t last_row = i * TILE_ROWS + tile_height(R, i) - 1, seen = first_pos + last_row / (j->hq / j->hkv) + 1 - c0;
    return seen < n ? seen : n;
}

/* One chunk: S = Q K^T for keys [c0, c0 + n), softmax, O += P V. Each tile's rows only as far as
 * they see: their scores past that are masked (softmax_chunk), their P there exact zeros. */
static void chunk(const job_t *j, scratch_t *w, int64_t R, int64_t first_pos, int64_t c0, int64_t n) {
    const int64_t D = j->d, PC = PANEL_COLS, tiles = tile_count(R);
    for (int64_t i = 0; i < tiles; i++) {
        const int64_t mr = tile_height(R, i), ni = tile_keys(j, R, i, first_pos, c0, n);
        for (int64_t c = 0; c < ni; c += GC) { /* columns past ni: zero-padded or later keys, masked */
            const float *kt = w->kt + (c0 + c) / PC * D * PC;
            float *s = w->s + i * TILE_ROWS * KCH + c;
            if (PANEL_GROUP > 1 && ni - c <= PC) /* the last keys fit one panel */
                tile_rows(w->qr + i * TILE_ROWS * D, D, 1, kt, 0, 1, D, s, KCH, 0, 0, 0, mr);
            else
                tile_rows(w->qr + i * TILE_ROWS * D, D, 1, kt, kt + D * PC, PANEL_GROUP, D, s, KCH, 0, 0, 0, mr);
        }
    }
    softmax_chunk(j, w, R, first_pos, c0, n);
    for (int64_t i = 0; i < tiles; i++) {
        const int64_t mr = tile_height(R, i), ni = tile_keys(j, R, i, first_pos, c0, n);
        for (int64_t c = 0; ni > 0 && c < j->dpad; c += GC) { /* ni keys only: V past them may be unwritten */
            const float *vp = w->vp + (c / PC * j->lmax + c0) * PC;
            tile_rows(w->s + i * TILE_ROWS * KCH, KCH, 1, vp, vp + j->lmax * PC, PANEL_GROUP, ni,
                      w->o + i * TILE_ROWS * j->dpad + c, j->dpad, 1, 0, 0, mr);
        }
    }
}

/* One work item: positions q0 .. q0 + nq - 1 of sequence `sq`, kv head h. */
static int item(const job_t *j, int64_t sq, int64_t h, int64_t q0, scratch_t *w) {
    const int64_t G = j->hq / j->hkv, D = j->d, ql = j->q_len[sq], kl = j->kv_len[sq];
    const int64_t nq = ql - q0 < j->qb ? ql - q0 : j->qb, R = nq * G;
    const int64_t first_pos = kl - ql + q0, last_pos = first_pos + nq - 1;
    const int rc = pack_kv(j, w, sq, h, round_up(last_pos + 1, GC));
    if (rc) return rc;
    copy_q(j, w, sq, h, q0, R);
    memset(w->o, 0, sizeof(float) * round_up(R, TILE_ROWS) * j->dpad);
    for (int64_t r = 0; r < R; r++) w->m[r] = -INFINITY, w->l[r] = 0.f;
    for (int64_t c0 = 0; c0 <= last_pos; c0 += KCH)
        chunk(j, w, R, first_pos, c0, last_pos + 1 - c0 < KCH ? last_pos + 1 - c0 : KCH);
    for (int64_t r = 0; r < R; r++) {
        float *dst = j->out + ((j->q_start[sq] + q0 + r / G) * j->hq + h * G + r % G) * D;
        const float inv = 1.f / w->l[r];
        for (int64_t c = 0; c < D; c++) dst[c] = w->o[r * j->dpad + c] * inv;
    }
    return 0;
}

/* Items [lo, hi) in (sequence, kv head, query block) order. Scratch per thread: the packed K^T
 * and V of the batch's longest sequence, (D + dpad) x lmax floats (2 x 4 MB at 16K tokens, D 64),
 * plus ~0.2 MB of rows. */
static int items(const void *arg, int64_t lo, int64_t hi) {
    const job_t *j = (const job_t *)arg;
    const int64_t R = round_up(j->qb * (j->hq / j->hkv), TILE_ROWS), D = j->d, dp = j->dpad, L = j->lmax;
    const int64_t sizes[7] = {R * D, R * KCH, R * dp, R, R, L * D, dp * L};
    int64_t total = 0;
    for (int i = 0; i < 7; i++) total += sizes[i];
    float *buf = malloc(sizeof(float) * total);
    if (!buf) return -1;
    float *part[7];
    for (int64_t i = 0, off = 0; i < 7; off += sizes[i], i++) part[i] = buf + off;
    scratch_t w = {part[0], part[1], part[2], part[3], part[4], part[5], part[6], -1, -1, 0};
    int status = 0;
    int64_t sq = 0;
    for (int64_t it = lo; it < hi && status == 0; it++) {
        while (j->item_start[sq + 1] <= it) sq++;
        const int64_t local = it - j->item_start[sq], nqb = (j->q_len[sq] + j->qb - 1) / j->qb;
        status = item(j, sq, local / nqb, (local % nqb) * j->qb, &w);
    }
    free(buf);
    return status;
}

/* Item boundaries for n threads with ~equal work (query positions x keys seen). */
static void split_items(const job_t *j, const int64_t *start, double total, int n, int64_t *bounds) {
    double acc = 0;
    int b = 1;
    bounds[0] = 0;
    for (int64_t s = 0; s < j->nseq && b < n; s++)
        for (int64_t it = start[s]; it < start[s + 1] && b < n; it++) {
            const int64_t ql = j->q_len[s], q0 = ((it - start[s]) % ((ql + j->qb - 1) / j->qb)) * j->qb;
            acc += (double)j->qb * (j->kv_len[s] - ql + q0 + j->qb / 2);
            if (acc >= total * b / n) bounds[b++] = it + 1;
        }
    for (; b <= n; b++) bounds[b] = start[j->nseq];
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
    double total = 0; /* work ~ query positions x visible keys */
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
    job_t j = {q, k, v, out, tables, q_start, q_len, kv_len, start, width, nseq, hq, hkv, d, bs, num_blocks,
               k_strides[0], k_strides[1], k_strides[2], v_strides[0], v_strides[1], v_strides[2],
               qb, round_up(d, GC), round_up(max_kv, GC), scale, kv_dtype};
    const int n = total < 1e5 ? 1 : thread_count(nthreads, start[nseq]);
    int64_t bounds[MAX_THREADS + 1];
    split_items(&j, start, total, n, bounds);
    const int rc = run_ranges(items, &j, bounds, n);
    free(start);
    return rc;
}
