/* The integer dot products cpu_qgemm_vnni.c is written on, for a 16-lane int32 / fp32 vector:
 * one zmm on AVX512-VNNI, two ymm halves (columns 0-7, 8-15) on AVX2.
 *
 * QDOT_BITS says which packed weight widths run on them (bit 8: int8, bit 4: int4; 0: none).
 * AVX2 has no vpdpbusd: vpmaddubsw multiplies unsigned weight bytes by signed activation bytes
 * into 16-bit pair sums and vpmaddwd by ones adds pairs of those into each 32-bit lane, the same
 * four-byte lane sum. The 16-bit pair sum saturates past 32767: int4 weights (<= 15, so
 * <= 2 * 15 * 127 = 3810) are exact; int8's shifted bytes (<= 255) are not, so AVX2 runs int4
 * only and int8 weights keep the widening kernel there. */
#ifndef GENPOOL_CPU_QDOT_H
#define GENPOOL_CPU_QDOT_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QDOT_BITS (8 | 4)
typedef __m512i vi_t;
typedef __m512 vf_t;
static inline vi_t vi_load(const void *p) { return _mm512_loadu_si512(p); }
static inline vi_t vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi_t vi_set1_32(int32_t v) { return _mm512_set1_epi32(v); }
static inline vi_t vi_set1_8(char v) { return _mm512_set1_epi8(v); }
static inline vi_t vi_and(vi_t a, vi_t b) { return _mm512_and_si512(a, b); }
static inline vi_t vi_srli16_4(vi_t a) { return _mm512_srli_epi16(a, 4); }
static inline vi_t vi_dpbusd(vi_t acc, vi_t u, vi_t s) { return _mm512_dpbusd_epi32(acc, u, s); }
static inline vf_t vi_to_f(vi_t a) { return _mm512_cvtepi32_ps(a); }
/* int4 weights: acc += lo * xl + hi * xh per 4-byte lane; vi_nibble_sums finishes a block's acc */
static inline vi_t vi_dp_nibbles(vi_t acc, vi_t lo, vi_t xl, vi_t hi, vi_t xh) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, lo, xl), hi, xh);
}
static inline vi_t vi_nibble_sums(vi_t acc) { return acc; }
static inline vf_t vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf_t vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf_t v) { _mm512_storeu_ps(p, v); }
static inline vf_t vf_set1(float v) { return _mm512_set1_ps(v); }
static inline vf_t vf_mul(vf_t a, vf_t b) { return _mm512_mul_ps(a, b); }
static inline vf_t vf_fmadd(vf_t a, vf_t b, vf_t c) { return _mm512_fmadd_ps(a, b, c); }

#elif defined(__AVX2__) && defined(__FMA__)
#define QDOT_BITS 4
typedef struct { __m256i lo, hi; } vi_t;
typedef struct { __m256 lo, hi; } vf_t;
static inline vi_t vi_load(const void *p) {
    return (vi_t){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1)};
}
static inline vi_t vi_zero(void) { return (vi_t){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline vi_t vi_set1_32(int32_t v) { return (vi_t){_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
static inline vi_t vi_set1_8(char v) { return (vi_t){_mm256_set1_epi8(v), _mm256_set1_epi8(v)}; }
static inline vi_t vi_and(vi_t a, vi_t b) { return (vi_t){_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
static inline vi_t vi_srli16_4(vi_t a) { return (vi_t){_mm256_srli_epi16(a.lo, 4), _mm256_srli_epi16(a.hi, 4)}; }
static inline __m256i dp4(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
static inline vi_t vi_dpbusd(vi_t acc, vi_t u, vi_t s) { return (vi_t){dp4(acc.lo, u.lo, s.lo), dp4(acc.hi, u.hi, s.hi)}; }
static inline vf_t vi_to_f(vi_t a) { return (vf_t){_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
/* int4 weights: a block's pair sums stay 16-bit until vi_nibble_sums widens them (one vpmaddwd per
 * block instead of one per vpmaddubsw: Zen 1 issues both on one pipe). A block adds 8 pair sums of
 * at most 2 * 15 * 127 into each 16-bit lane: 30,480 < 32,767. */
static inline __m256i nib2(__m256i acc, __m256i lo, __m256i xl, __m256i hi, __m256i xh) {
    return _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
}
static inline vi_t vi_dp_nibbles(vi_t acc, vi_t lo, vi_t xl, vi_t hi, vi_t xh) {
    return (vi_t){nib2(acc.lo, lo.lo, xl.lo, hi.lo, xh.lo), nib2(acc.hi, lo.hi, xl.hi, hi.hi, xh.hi)};
}
static inline vi_t vi_nibble_sums(vi_t acc) {
    const __m256i one = _mm256_set1_epi16(1);
    return (vi_t){_mm256_madd_epi16(acc.lo, one), _mm256_madd_epi16(acc.hi, one)};
}
static inline vf_t vf_zero(void) { return (vf_t){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf_t vf_load(const float *p) { return (vf_t){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vf_store(float *p, vf_t v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
static inline vf_t vf_set1(float v) { return (vf_t){_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
static inline vf_t vf_mul(vf_t a, vf_t b) { return (vf_t){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline vf_t vf_fmadd(vf_t a, vf_t b, vf_t c) {
    return (vf_t){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}

#else
#define QDOT_BITS 0
#endif
#endif
