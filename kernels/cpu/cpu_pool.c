/* The kernels' thread pool: pthreads that poll briefly for work, then sleep on a futex.
 *
 * Why not OpenMP's team (decision 0007 used torch's libgomp pool, decision 0010 replaces it): an
 * OpenMP parallel region ends in a barrier, so every call waits for each of its threads to run
 * its share, and under CPU contention a thread that the scheduler has parked off its core holds
 * the call for a time slice (3-4 ms, against kernel calls of 50 us to a few ms). Here a call's
 * ranges are claimed one at a time by whichever thread gets there first, the caller included;
 * the caller returns as soon as every range has run, and a pool thread that wakes late finds the
 * call closed and goes back to waiting. Idle cores see the same sharing as before.
 *
 * Protocol: `state` holds a generation (high 32 bits) and the number of pool threads inside the
 * current call (low 32). An odd generation is an open call. A pool thread enters only by a CAS
 * that keeps the generation, so it can never enter a call that has been closed; the caller closes
 * it (generation + 1) by a CAS that expects no thread inside. Call fields live in one static
 * record written only while no call is open. One call at a time: a mutex serialises callers, and
 * a call made from inside a range (a pool thread, or the caller itself) runs inline. */
#define _GNU_SOURCE
#include "cpu_pool.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

typedef struct {
    range_fn fn;
    const void *args;
    int64_t bounds[MAX_THREADS + 1];
    int items;
    _Atomic int helpers;   /* pool threads allowed in: items - 1 */
    _Atomic int next, done;
    int status[MAX_THREADS];
} call_t;

static call_t call;
static _Atomic uint64_t state;       /* generation << 32 | threads inside */
static _Atomic uint32_t wake_word;   /* futex: bumped when a call opens */
static _Atomic int sleepers;
static _Atomic int64_t spin_ns = 50000;
static int started;                  /* pool threads created (under `lock`) */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local int in_range;   /* this thread is running a range: nested calls run inline */

void gp_pool_set_spin_us(int64_t us) { atomic_store(&spin_ns, us < 0 ? 0 : us * 1000); }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Claim and run ranges until none is left. */
static void run_items(call_t *c) {
    int i;
    in_range = 1;
    while ((i = atomic_fetch_add(&c->next, 1)) < c->items) {
        c->status[i] = c->fn(c->args, c->bounds[i], c->bounds[i + 1]);
        atomic_fetch_add(&c->done, 1);
    }
    in_range = 0;
}

/* Poll `state` for a generation other than `gen` for spin_ns, then sleep until a call opens. */
static void wait_past(uint32_t gen) {
    const int64_t until = now_ns() + atomic_load_explicit(&spin_ns, memory_order_relaxed);
    for (unsigned k = 1;; k++) {
        if ((uint32_t)(atomic_load(&state) >> 32) != gen) return;
        cpu_relax();
        if (k % 256 == 0 && now_ns() > until) break;
    }
    const uint32_t w = atomic_load(&wake_word);
    atomic_fetch_add(&sleepers, 1);
    if ((uint32_t)(atomic_load(&state) >> 32) == gen) /* else a call opened meanwhile: no sleep */
        syscall(SYS_futex, &wake_word, FUTEX_WAIT_PRIVATE, w, NULL, NULL, 0);
    atomic_fetch_sub(&sleepers, 1);
}

static void *pool_thread(void *arg) {
    const int id = (int)(intptr_t)arg; /* 0-based; the caller is not counted */
    uint32_t seen = 0;
    for (;;) {
        uint64_t s = atomic_load(&state);
        const uint32_t gen = (uint32_t)(s >> 32);
        if ((gen & 1) && gen != seen) {
            seen = gen; /* this call is looked at once, entered or not */
            if (id >= atomic_load(&call.helpers)) continue;
            /* a CAS that fails because another thread entered first is retried: only a closed
             * call (another generation) turns this thread away */
            while (!atomic_compare_exchange_weak(&state, &s, s + 1))
                if ((uint32_t)(s >> 32) != gen) break;
            if ((uint32_t)(s >> 32) == gen) {
                run_items(&call);
                atomic_fetch_sub(&state, 1);
            }
            continue;
        }
        wait_past(gen);
    }
    return NULL;
}

/* The pool's threads do not survive a fork: the child starts with none, no open call and a fresh
 * mutex (glibc allows re-initialising it; the child has one thread). */
static void after_fork_child(void) {
    started = 0;
    atomic_store(&state, (uint64_t)0);
    atomic_store(&sleepers, 0);
    pthread_mutex_init(&lock, NULL);
}

/* Grow the pool to `want` threads (under `lock`); fewer where creation fails. */
static void ensure_threads(int want) {
    static int atfork;
    if (!atfork) atfork = pthread_atfork(NULL, NULL, after_fork_child) == 0;
    for (; started < want; started++) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &attr, pool_thread, (void *)(intptr_t)started);
        pthread_attr_destroy(&attr);
        if (rc) break;
    }
}

static int run_inline(range_fn fn, const void *args, const int64_t *bounds, int items) {
    int first = 0;
    for (int i = 0; i < items; i++) {
        const int rc = fn(args, bounds[i], bounds[i + 1]);
        if (rc && !first) first = rc;
    }
    return first;
}

int gp_pool_run(range_fn fn, const void *args, const int64_t *bounds, int items) {
    if (items < 2 || items > MAX_THREADS || in_range) return run_inline(fn, args, bounds, items);
    pthread_mutex_lock(&lock);
    ensure_threads(items - 1);
    call.fn = fn, call.args = args, call.items = items;
    for (int i = 0; i <= items; i++) call.bounds[i] = bounds[i];
    atomic_store(&call.helpers, items - 1);
    atomic_store(&call.next, 0);
    atomic_store(&call.done, 0);
    const uint64_t open = ((atomic_load(&state) >> 32) + 1) << 32; /* odd generation, nobody inside */
    atomic_store(&state, open);
    atomic_fetch_add(&wake_word, 1);
    if (atomic_load(&sleepers) > 0) syscall(SYS_futex, &wake_word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    run_items(&call);
    /* Ranges still running belong to pool threads that are on them: wait for those only. */
    for (unsigned k = 1; atomic_load(&call.done) < items; k++) {
        cpu_relax();
        if (k % 1024 == 0) sched_yield(); /* a range's thread may be waiting for this core */
    }
    uint64_t s = open;
    for (unsigned k = 1; !atomic_compare_exchange_weak(&state, &s, open + ((uint64_t)1 << 32)); k++) {
        s = open; /* a late pool thread is inside: it finds nothing to claim and leaves */
        cpu_relax();
        if (k % 1024 == 0) sched_yield();
    }
    int first = 0;
    for (int i = 0; i < items && !first; i++) first = call.status[i];
    pthread_mutex_unlock(&lock);
    return first;
}
