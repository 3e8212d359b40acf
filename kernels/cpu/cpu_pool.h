/* The kernels' one thread pool (cpu_pool.c, its own library that every kernel library links).
 * Work is given as n ranges; the calling thread runs ranges too, and returns when every range has
 * run: it never waits for a pool thread that has not started one (see cpu_pool.c for why). */
#ifndef GENPOOL_CPU_POOL_H
#define GENPOOL_CPU_POOL_H
#include <stdint.h>

enum { MAX_THREADS = 64 };

/* Work on rows [lo, hi): returns 0, or a negative error code of the kernel's own. */
typedef int (*range_fn)(const void *args, int64_t lo, int64_t hi);

/* fn over [bounds[i], bounds[i + 1]) for i < n, on n threads counting the caller (over
 * MAX_THREADS ranges: all on the caller). The first failing range's code (in range order) wins. */
int gp_pool_run(range_fn fn, const void *args, const int64_t *bounds, int n);

/* How long (microseconds) an idle pool thread polls for the next call before it sleeps. */
void gp_pool_set_spin_us(int64_t us);
#endif
