/* Helpers shared by the CPU kernels: bf16 <-> fp32 as torch rounds, a vectorisable exp, and a
 * row-parallel loop for the element-wise kernels.
 *
 * parallel_rows splits [0, rows) into one contiguous range per thread. Threads are created per
 * call: more than one is used only for >= 256K elements of work, where the ~20-40 us per thread
 * is noise. */
#ifndef GENPOOL_CPU_COMMON_H
#define GENPOOL_CPU_COMMON_H
#include <math.h>
#include <pthread.h>
#include <stdint.h>

typedef void (*rows_fn)(const void *args, int64_t lo, int64_t hi);

typedef struct {
    rows_fn fn;
    const void *args;
    int64_t lo, hi;
} rows_job;

static void *rows_run(void *p) {
    rows_job *j = (rows_job *)p;
    j->fn(j->args, j->lo, j->hi);
    return 0;
}

static void parallel_rows(rows_fn fn, const void *args, int64_t rows, int64_t work_per_row, int nthreads) {
    enum { MAX_THREADS = 64 };
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if (nthreads > rows) nthreads = (int)rows;
    if (rows * work_per_row < (1 << 18) || nthreads < 2) {
        fn(args, 0, rows);
        return;
    }
    rows_job jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int n = 0; n < nthreads; n++) {
        jobs[n] = (rows_job){fn, args, rows * n / nthreads, rows * (n + 1) / nthreads};
        if (n > 0) started[n] = pthread_create(&tids[n], 0, rows_run, &jobs[n]) == 0;
    }
    rows_run(&jobs[0]);
    for (int n = 1; n < nthreads; n++) {
        if (started[n]) pthread_join(tids[n], 0);
        else rows_run(&jobs[n]); /* no thread: do its share here */
    }
}

/* bf16 <-> fp32 as torch converts: widening is exact, narrowing rounds to nearest even. */
static inline float bf16_f32(uint16_t h) {
    union { uint32_t u; float f; } c = {(uint32_t)h << 16};
    return c.f;
}

static inline uint16_t f32_bf16(float f) {
    union { float f; uint32_t u; } c = {f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}
/* In-place exp over an array, in loops GCC vectorises (glibc's vector expf needs -ffast-math,
 * which would also license reorderings the exact kernels must not have; a scalar expf call per
 * element made SwiGLU 3x slower than torch). Cephes' polynomial: within 2 ulp of expf; inputs
 * are clamped to [-87.3, 88.37] (underflow to ~1e-38, no inf). The 2^n scale is built as integer
 * bits in one loop and read back as floats in the next (-fno-strict-aliasing). finite-math-only:
 * GCC vectorises fminf/fmaxf only when it may ignore NaN (inputs here are finite scores). */
__attribute__((optimize("finite-math-only"))) static void vexpf_inplace(float *x, int64_t len) {
    enum { CHUNK = 256 };
    int32_t bits[CHUNK];
    const float *scale = (const float *)bits;
    for (int64_t c = 0; c < len; c += CHUNK) {
        const int64_t n = len - c < CHUNK ? len - c : CHUNK;
        float *v = x + c;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const float y = fminf(fmaxf(v[i], -87.3f), 88.37f);
            const float t = y * 1.44269504088896341f + 0.5f;
            int32_t ki = (int32_t)t; /* floor(t) without floorf, which GCC will not vectorise */
            ki -= (float)ki > t;
            const float k = (float)ki;
            const float r = (y - k * 0.693359375f) + k * 2.12194440e-4f;
            float p = 1.9875691500e-4f;
            p = p * r + 1.3981999507e-3f;
            p = p * r + 8.3334519073e-3f;
            p = p * r + 4.1665795894e-2f;
            p = p * r + 1.6666665459e-1f;
            p = p * r + 5.0000001201e-1f;
            v[i] = p * r * r + r + 1.0f;
            bits[i] = (ki + 127) << 23;
        }
#pragma omp simd
        for (int64_t i = 0; i < n; i++) v[i] *= scale[i];
    }
}
#endif
