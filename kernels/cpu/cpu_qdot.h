/* The integer dot products cpu_qgemm_vnni.c is written on, for a 16-lane int32 / fp32 vector:
 * one zmm on AVX512-VNNI (QDOT_512), two ymm halves (columns 0-7, 8-15) on AVX2.
 *
 * QDOT_BITS says which packed weight widths run on them (bit 8: int8, bit 4: int4; 0: none).
 * int8 weights are packed as u = q + 128 (vpdpbusd's unsigned operand). dots8 gives a block's
 * exact int32 sums of u * x on every build, so the results after it are the same bits.
 * AVX2 has no vpdpbusd: vpmaddubsw multiplies unsigned bytes by signed bytes into 16-bit pair sums
 * (saturating past 32767) and vpmaddwd by ones adds pairs of those into each 32-bit lane.
 * - int8: |q| times x carrying q's sign (vpsignb), as llama.cpp's AVX2 q8 dots: a pair sum is at
 *   most 2 * 128 * 127 = 32,512, exact for every int8 weight. u = 128 + q itself (<= 255) would
 *   saturate, so the sums start at 128 * sum(x) instead (QDOT_DP8_BASE).
 * - int4: nibbles (<= 15) times x, whose pair sums stay 16-bit for a whole block (dots4). */
#ifndef GENPOOL_CPU_QDOT_H
#define GENPOOL_CPU_QDOT_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline int32_t qd_load_i32(const int8_t *p) { /* 4 activation bytes, to broadcast */
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QDOT_BITS (8 | 4)
#define QDOT_512 1
#define QDOT_DP8_BASE 0
typedef __m512i vi_t;
typedef __m512 vf_t;
/* One block of 32 inputs: q = round(x / d) to nearest even (as cvtps under MXCSR's default),
 * d = max|x| / 127; returns sum(q). |x / d| <= 127, so no value saturates. */
static inline int32_t qd_quantize32(const float *x, int8_t *q, float *d) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float inv = mx > 0.f ? 127.f / mx : 0.f;
    *d = mx / 127.f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(q1));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
}
/* One block of 32 inputs, int8 weights: ia[r][c] = sum(u * xq) per lane, for R rows of xq (xb, row
 * stride ldx) against C panels whose block starts at wp[c] (8 steps of 64 bytes). vpdpbusd takes u
 * as it is; the sums start at zero (QDOT_DP8_BASE). */
static inline __attribute__((always_inline)) void dots8(vi_t ia[][2], const int R, const int C, const uint8_t *const *wp,
                                                        const int8_t *xb, int64_t ldx, const int32_t *xs, int64_t lds) {
    (void)xs, (void)lds;
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int c = 0; c < C; c++) ia[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 1 /* unrolled, GCC hoists every broadcast of the block and spills them */
    for (int t = 0; t < 8; t++) {
        __m512i wv[2];
#pragma GCC unroll 2
        for (int c = 0; c < C; c++) wv[c] = _mm512_loadu_si512(wp[c] + t * 64);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m512i xv = _mm512_set1_epi32(qd_load_i32(xb + r * ldx + 4 * t));
#pragma GCC unroll 2
            for (int c = 0; c < C; c++) ia[r][c] = _mm512_dpbusd_epi32(ia[r][c], wv[c], xv);
        }
    }
}
static inline vf_t vi_to_f(vi_t a) { return _mm512_cvtepi32_ps(a); }
static inline vf_t vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf_t vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf_t v) { _mm512_storeu_ps(p, v); }
static inline vf_t vf_set1(float v) { return _mm512_set1_ps(v); }
static inline vf_t vf_mul(vf_t a, vf_t b) { return _mm512_mul_ps(a, b); }
static inline vf_t vf_fmadd(vf_t a, vf_t b, vf_t c) { return _mm512_fmadd_ps(a, b, c); }

/* One block of 32 inputs, int4 weights: ia[r][c] = sum(q * xq) per lane; a 64-byte step holds 8
 * inputs, k = 8j + i in the low nibbles and 8j + 4 + i in the high ones (4 steps a block). */
static inline __attribute__((always_inline)) void dots4(vi_t ia[][2], const int R, const int C, const uint8_t *const *wp,
                                                        const int8_t *xb, int64_t ldx) {
    const __m512i nib = _mm512_set1_epi8(15);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int c = 0; c < C; c++) ia[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int t = 0; t < 4; t++) {
        __m512i lo[2], hi[2];
#pragma GCC unroll 2
        for (int c = 0; c < C; c++) {
            const __m512i v = _mm512_loadu_si512(wp[c] + t * 64);
            lo[c] = _mm512_and_si512(v, nib);
            hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m512i xl = _mm512_set1_epi32(qd_load_i32(xb + r * ldx + 8 * t));
            const __m512i xh = _mm512_set1_epi32(qd_load_i32(xb + r * ldx + 8 * t + 4));
#pragma GCC unroll 2
            for (int c = 0; c < C; c++)
                ia[r][c] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ia[r][c], lo[c], xl), hi[c], xh);
        }
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
#define QDOT_BITS (8 | 4)
#define QDOT_512 0
#define QDOT_DP8_BASE 128
typedef struct { __m256i lo, hi; } vi_t;
typedef struct { __m256 lo, hi; } vf_t;
/* qd_quantize32 on AVX2: the same values (vcvtps2dq rounds as on AVX-512; packs cannot saturate). */
static inline int32_t qd_quantize32(const float *x, int8_t *q, float *d) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + 8 * i), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
    const float inv = mx > 0.f ? 127.f / mx : 0.f;
    *d = mx / 127.f;
    __m256i qi[4];
    for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
}
static inline vf_t vi_to_f(vi_t a) { return (vf_t){_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
static inline vf_t vf_zero(void) { return (vf_t){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf_t vf_load(const float *p) { return (vf_t){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vf_store(float *p, vf_t v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
static inline vf_t vf_set1(float v) { return (vf_t){_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
static inline vf_t vf_mul(vf_t a, vf_t b) { return (vf_t){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline vf_t vf_fmadd(vf_t a, vf_t b, vf_t c) {
    return (vf_t){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}

/* One panel half (8 columns, h) of a block, for R rows: its int32 sums in s[]. Half by half, R rows
 * hold R sums, 2 weight registers and R broadcasts, within AVX2's 16 (a whole panel's 2R sums and
 * 4 weight registers spilled). BITS 8: per 4-input step q = u - 128 and |q| once, then per row |q|
 * times xq carrying q's sign, widened by vpmaddwd; the sums start at 128 * sum(xq) (xs[r * lds]),
 * so they end at sum(u * xq). BITS 4: a block's pair sums stay 16-bit and one vpmaddwd widens them
 * at its end: 8 pair sums of at most 2 * 15 * 127 a lane, 30,480 < 32,767. */
static inline __attribute__((always_inline)) void half_sums(__m256i *s, const int BITS, const int R, const uint8_t *w,
                                                            const int8_t *xb, int64_t ldx, const int32_t *xs,
                                                            int64_t lds) {
    const __m256i one = _mm256_set1_epi16(1);
    if (BITS == 8) {
        const __m256i flip = _mm256_set1_epi8((char)0x80);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) s[r] = _mm256_set1_epi32(QDOT_DP8_BASE * xs[r * lds]);
#pragma GCC unroll 2 /* 2 steps a loop: measured best on Zen 3 (1: -2%, 8: -13%) */
        for (int t = 0; t < 8; t++) {
            const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + t * 64)), flip);
            const __m256i aq = _mm256_abs_epi8(q);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256i xv = _mm256_set1_epi32(qd_load_i32(xb + r * ldx + 4 * t));
                const __m256i p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(xv, q));
                s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(p, one));
            }
        }
        return;
    }
    const __m256i nib = _mm256_set1_epi8(15);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) s[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int t = 0; t < 4; t++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + t * 64));
        const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256i xl = _mm256_set1_epi32(qd_load_i32(xb + r * ldx + 8 * t));
            const __m256i xh = _mm256_set1_epi32(qd_load_i32(xb + r * ldx + 8 * t + 4));
            s[r] = _mm256_add_epi16(s[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) s[r] = _mm256_madd_epi16(s[r], one);
}

/* dots8 / dots4 on AVX2 (the contracts are the AVX-512 ones'): panel by panel, half by half. */
static inline __attribute__((always_inline)) void dots_halves(vi_t ia[][2], const int BITS, const int R, const int C,
                                                              const uint8_t *const *wp, const int8_t *xb, int64_t ldx,
                                                              const int32_t *xs, int64_t lds) {
#pragma GCC unroll 2
    for (int c = 0; c < C; c++) {
        __m256i lo[4], hi[4];
        half_sums(lo, BITS, R, wp[c], xb, ldx, xs, lds);
        half_sums(hi, BITS, R, wp[c] + 32, xb, ldx, xs, lds);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) ia[r][c] = (vi_t){lo[r], hi[r]};
    }
}
static inline __attribute__((always_inline)) void dots8(vi_t ia[][2], const int R, const int C, const uint8_t *const *wp,
                                                        const int8_t *xb, int64_t ldx, const int32_t *xs, int64_t lds) {
    dots_halves(ia, 8, R, C, wp, xb, ldx, xs, lds);
}
static inline __attribute__((always_inline)) void dots4(vi_t ia[][2], const int R, const int C, const uint8_t *const *wp,
                                                        const int8_t *xb, int64_t ldx) {
    dots_halves(ia, 4, R, C, wp, xb, ldx, 0, 0);
}

#else
#define QDOT_BITS 0
#define QDOT_512 0
#define QDOT_DP8_BASE 0
#endif
#endif
