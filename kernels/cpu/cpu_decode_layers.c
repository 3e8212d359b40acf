/* A pure-decode step's whole decoder stack (fp32 Llama layers) in one call.
 *
 * Why: a decode step runs 30 layers x ~10 kernels, each a small product or a pass over a few
 * dozen rows. Launched one by one from Python, the launchers' checks, allocations and ctypes
 * calls cost ~280 us per layer on the 2-core Zen 4 here: 1.58 of a benchmark run's 11.26 s of
 * decode steps were spent outside the kernels. Here the same kernels (linked into this library
 * from their own files) run in the same order, on the same shapes and strides, as
 * engine/models/llama.py's modules, so the result is the same bits; only the Python between them
 * is gone.
 *
 * Per layer: h, res = rmsnorm(x + res); qkv = h @ Wqkv (+ b); q, k = rotary(q, k);
 * write k, v to the paged caches; a = attention(q); o = a @ Wo; h, res = rmsnorm(o + res);
 * x = swiglu(h @ Wgate_up) @ Wdown. Then hidden = rmsnorm(x + res) with the final norm.
 * Returns 0, or the first failing kernel's code (DL_ERR_* + its own code, see the launcher). */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_gemm.h"
#include "cpu_kernels.h"
#include "cpu_qgemm.h"

/* Which kernel failed: added to that kernel's own (negative) code. */
enum { DL_ERR_OOM = -1, DL_ERR_REDUCE = -2, DL_ERR_GEMM = -100, DL_ERR_ROTARY = -200, DL_ERR_KV = -300,
       DL_ERR_ATTN = -400 };

/* Tensor parallelism: sums x [n] over the ranks in place (0 = done), called after each layer's o_proj
 * and down products, which are row-parallel partial sums there; NULL on one rank. */
typedef int (*reduce_fn)(float *x, int64_t n);

/* One layer's weights and caches (kernels/cpu/decode_layers.py fills these from the model). */
typedef struct {
    const float *ln1, *ln2;            /* RMSNorm weights [H] */
    const float *qkv, *qkv_bias;       /* packed [H, (nh + 2 nkv) hd] panels; bias or NULL */
    const float *o, *gate_up, *down;   /* packed panels: [nh hd, H], [H, 2I] (SwiGLU-fusable), [I, H] */
    void *k_cache, *v_cache;           /* contiguous [blocks, bs, nkv, kv_int8_row(hd) for int8, else hd] (dims_t.kv_dtype) */
    /* quantized weights (kernels/cpu/cpu_qgemm.c) in place of the fp32 panels above, or NULL */
    const qweight_t *qqkv, *qo, *qgate_up, *qdown;
} layer_t;

typedef struct {
    int64_t layers, hidden, inter, nh, nkv, hd, block_size, num_blocks, max_pos;
    int64_t kv_dtype; /* the caches: 0 fp32, 1 bf16 (written rounded, read widened), 2 int8 (kernels/kvq.py) */
    float eps, scale;
} dims_t;

/* y = x @ W (+ bias): W's fp32 panels wp, or its quantized form qw where the layer has one; `next`
 * (the fp32 GEMM's prefetch of the next product) only where that product has fp32 panels. */
static int linear(const float *x, const float *wp, const qweight_t *qw, const float *bias, float *y, int64_t m,
                  int64_t k, int64_t n, const gemm_next_t *next, int nt) {
    if (qw) return qgemm_packed(x, qw, bias, y, m, k, n, k, n, nt);
    return gemm_packed_then(x, wp, bias, y, m, k, n, k, n, next && next->wp ? next : 0, nt);
}

static int swiglu(const float *x, const float *wp, const qweight_t *qw, float *y, int64_t m, int64_t k,
                  int64_t inter, const gemm_next_t *next, int nt) {
    if (qw) return qgemm_packed_swiglu(x, qw, y, m, k, inter, k, inter, nt);
    return gemm_packed_swiglu_then(x, wp, y, m, k, inter, k, inter, next && next->wp ? next : 0, nt);
}

/* Columns of the fused q | k | v product. */
static inline int64_t qkv_cols(const dims_t *d) { return (d->nh + 2 * d->nkv) * d->hd; }

/* The step's activations: one allocation, rows of each buffer contiguous. */
typedef struct {
    float *res[2], *h, *qkv, *q, *k, *attn, *act, *x; /* res: ping-pong (rms_norm reads one, writes the other) */
} bufs_t;

static float *carve(float **p, int64_t n) {
    float *r = *p;
    *p += (n + 15) & ~(int64_t)15; /* 64-byte aligned starts */
    return r;
}

static int attention_block(const dims_t *d, const layer_t *l, bufs_t *b, int64_t m, const int64_t *pos,
                           const float *rope, const int64_t *slots, const int32_t *tables, int64_t width,
                           const int32_t *lens, int nt) {
    const int64_t qkv_n = qkv_cols(d), qn = d->nh * d->hd, kn = d->nkv * d->hd;
    const gemm_next_t o = {l->o, qn, d->hidden, 0};
    int rc = linear(b->h, l->qkv, l->qqkv, l->qkv_bias, b->qkv, m, d->hidden, qkv_n, &o, nt);
    if (rc) return DL_ERR_GEMM + rc;
    rc = rotary(b->qkv, b->qkv + qn, b->q, b->k, pos, rope, m, d->nh, d->nkv, d->hd, qkv_n, qkv_n, d->max_pos, 0, nt);
    if (rc) return DL_ERR_ROTARY + rc;
    rc = write_kv(b->k, b->qkv + qn + kn, l->k_cache, l->v_cache, slots, m, kn, kn, qkv_n,
                  d->num_blocks * d->block_size, kv_esize((int)d->kv_dtype), (int)d->kv_dtype, d->hd);
    if (rc) return DL_ERR_KV + rc;
    const int64_t vec = d->kv_dtype == 2 ? kv_int8_row(d->hd) : d->hd; /* an int8 vector's scales follow it */
    const int64_t strides[3] = {d->block_size * d->nkv * vec, d->nkv * vec, vec}; /* contiguous [blocks, bs, nkv, vec] */
    rc = paged_decode_attention(b->q, l->k_cache, l->v_cache, b->attn, tables, lens, m, d->nh, d->nkv, d->hd,
                                d->block_size, width, d->num_blocks, strides, strides, d->scale, 0,
                                (int)d->kv_dtype, nt);
    if (rc) return DL_ERR_ATTN + rc;
    const gemm_next_t gate_up = {l->gate_up, d->hidden, d->inter, 1};
    rc = linear(b->attn, l->o, l->qo, 0, b->x, m, qn, d->hidden, &gate_up, nt);
    return rc ? DL_ERR_GEMM + rc : 0;
}

/* `next`: the following layer, or NULL after the last one. */
static int mlp_block(const dims_t *d, const layer_t *l, const layer_t *next, bufs_t *b, int64_t m, int nt) {
    const int64_t H = d->hidden, qkv_n = qkv_cols(d);
    const gemm_next_t down = {l->down, d->inter, H, 0}, qkv = {next ? next->qkv : 0, H, qkv_n, 0};
    int rc = swiglu(b->h, l->gate_up, l->qgate_up, b->act, m, H, d->inter, &down, nt);
    if (rc) return DL_ERR_GEMM + rc;
    rc = linear(b->act, l->down, l->qdown, 0, b->x, m, d->inter, H, next ? &qkv : 0, nt);
    return rc ? DL_ERR_GEMM + rc : 0;
}

/* x [m, H]: the step's embeddings; out [m, H]: its final-normed hidden states. */
int decode_layers(const dims_t *d, const layer_t *layers, const float *final_norm, const float *x, float *out,
                  int64_t m, const int64_t *pos, const float *rope, const int64_t *slots, const int32_t *tables,
                  int64_t width, const int32_t *lens, int nt, reduce_fn reduce) {
    const int64_t H = d->hidden, qkv_n = qkv_cols(d);
    const int64_t sizes[] = {H, H, H, qkv_n, d->nh * d->hd, d->nkv * d->hd, d->nh * d->hd, d->inter, H};
    enum { NBUF = sizeof(sizes) / sizeof(sizes[0]) };
    int64_t total = 0;
    for (int i = 0; i < NBUF; i++) total += (m * sizes[i] + 15) & ~(int64_t)15;
    float *mem = aligned_alloc(64, sizeof(float) * total), *p = mem;
    if (!mem) return DL_ERR_OOM;
    bufs_t b;
    float **bufs[NBUF] = {&b.res[0], &b.res[1], &b.h, &b.qkv, &b.q, &b.k, &b.attn, &b.act, &b.x};
    for (int i = 0; i < NBUF; i++) *bufs[i] = carve(&p, m * sizes[i]);
    int rc = 0, r = 0; /* b.res[r]: the residual stream so far */
    const float *in = x; /* layer 0 reads the embeddings; every later one its predecessor's output */
    for (int64_t i = 0; i < d->layers && !rc; i++, in = b.x) {
        const layer_t *l = layers + i;
        /* layer 0 has no residual yet: its residual sum is x itself (as RMSNorm(x, None)) */
        rms_norm(in, i ? b.res[r] : 0, l->ln1, b.h, b.res[!r], m, H, H, H, H, H, d->eps, 0, nt);
        r = !r;
        rc = attention_block(d, l, &b, m, pos, rope, slots, tables, width, lens, nt);
        if (!rc && reduce && reduce(b.x, m * H)) rc = DL_ERR_REDUCE;
        if (rc) break;
        rms_norm(b.x, b.res[r], l->ln2, b.h, b.res[!r], m, H, H, H, H, H, d->eps, 0, nt);
        r = !r;
        rc = mlp_block(d, l, i + 1 < d->layers ? l + 1 : 0, &b, m, nt);
        if (!rc && reduce && reduce(b.x, m * H)) rc = DL_ERR_REDUCE;
    }
    if (!rc)
        rms_norm(d->layers ? b.x : x, d->layers ? b.res[r] : 0, final_norm, out, b.res[!r], m, H, H, H, H, H,
                 d->eps, 0, nt);
    free(mem);
    return rc;
}
