/*
 * The kernels' thread pool, and the library's version.
 *
 * zs_parallel(n, grain, ...) runs task(ctx, begin, end) over [0, n) in chunks of
 * `grain`, on the calling thread and the pool's workers. Chunks are claimed one at a
 * time from a counter tagged with the job's epoch, so a worker that wakes late finds
 * nothing left (or a newer job) and claims nothing; the caller then waits only for
 * chunks that were claimed and are still running. So a parallel loop never waits for
 * a thread that has not started on it: a worker the OS descheduled costs its share of
 * speed, not a stall. The caller spins briefly for the running chunks and then sleeps,
 * which frees its core for a descheduled worker to finish on. Workers spin ZS_SPIN_NS
 * for the next job, then sleep on a futex instead of burning the core that the API
 * server and the load generator share with the engine. One job runs at a time (the
 * mutex); jobs do not nest.
 *
 * The workers' spin is short. Served on 2 cores at 128 streams, a worker met 37 % of
 * its jobs within 5 us of its last, 9 % within 5-50 us and 54 % after more (the caller
 * descheduled, or in Python between kernels): a 50-us spin held a core the API server
 * and the load generator were waiting for, for nothing, about half the time. 10 us
 * served 4-8 % more there, the engine alone level; 5 us or less served a little more
 * again, but the load generator's TTFT p99 at 32 streams went from ~45 to 60-150 ms:
 * the server's first chunks left in time (a packet capture), the tool's own loop ran
 * late beside an engine that wakes that much more often (BENCHMARKS.md §2, "The pool's
 * short spin").
 *
 * A job's epochs are even; while the caller writes a new job's fields the claim word
 * holds the odd epoch before it, with no chunk left to claim. Without that step a
 * worker late for the last job could claim one past its end against the new job's
 * chunk count, run it with a mix of both jobs' fields, and count it done for the new
 * job, whose caller then returned while a chunk of its job still ran.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "kernels.h"

/* The interface version cpu_kernels.py expects (its ABI), and which build this is. */
int zs_abi(void) { return 10; }
int zs_has_avx512(void) { return ZS_AVX512; }

#define ZS_MAX_THREADS 256
#define ZS_SPIN_NS 10000 /* a worker's wait for the next job */
#define ZS_CALLER_SPIN_NS 10000 /* the caller's wait for chunks still running */

static struct {
    pthread_mutex_t lock;   /* one job at a time; held by the caller throughout */
    _Atomic uint64_t claim; /* epoch << 32 | next chunk */
    _Atomic int64_t done;   /* chunks finished in the current epoch */
    _Atomic uint32_t wake;  /* futex: bumped when a job starts and sleepers wait */
    _Atomic uint32_t finished; /* futex: bumped when a sleeping caller must look */
    _Atomic int sleepers, caller_sleeps;
    _Atomic(zs_task) fn;
    const void *_Atomic ctx;
    _Atomic int64_t n, grain, chunks;
    uint32_t epoch;
    int workers; /* started so far */
    _Atomic int active; /* threads a job may use, the caller included */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .active = 1};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void futex_wait(_Atomic uint32_t *word, uint32_t seen) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, 1 << 30, NULL, NULL, 0);
}

/* Claim and run chunks of job `epoch` until none is left. */
static void run_chunks(uint32_t epoch) {
    for (;;) {
        uint64_t c = atomic_load(&pool.claim);
        if ((uint32_t)(c >> 32) != epoch || (int64_t)(uint32_t)c >= atomic_load(&pool.chunks))
            return;
        if (!atomic_compare_exchange_weak(&pool.claim, &c, c + 1)) continue;
        /* A claimed chunk keeps its job current until it is counted done, so the
         * job's fields below are still this epoch's. */
        const int64_t i = (int64_t)(uint32_t)c, g = atomic_load(&pool.grain), n = atomic_load(&pool.n);
        atomic_load(&pool.fn)(atomic_load(&pool.ctx), i * g, (i + 1) * g < n ? (i + 1) * g : n);
        if (atomic_fetch_add(&pool.done, 1) + 1 == atomic_load(&pool.chunks) &&
            atomic_load(&pool.caller_sleeps)) {
            atomic_fetch_add(&pool.finished, 1);
            futex_wake(&pool.finished);
        }
    }
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg; /* 1.. (0 is the caller) */
    uint32_t seen = (uint32_t)(atomic_load(&pool.claim) >> 32);
    for (;;) {
        int64_t spin_until = now_ns() + ZS_SPIN_NS;
        for (int i = 0;; i++) {
            const uint32_t e = (uint32_t)(atomic_load(&pool.claim) >> 32);
            if (e & 1) { /* a job being set up: look again */
                cpu_relax();
                continue;
            }
            if (e != seen && index < atomic_load(&pool.active)) {
                seen = e;
                run_chunks(e);
                spin_until = now_ns() + ZS_SPIN_NS;
                continue;
            }
            seen = e;
            if (i % 64 || now_ns() < spin_until) {
                cpu_relax();
                continue;
            }
            const uint32_t w = atomic_load(&pool.wake);
            atomic_fetch_add(&pool.sleepers, 1);
            if ((uint32_t)(atomic_load(&pool.claim) >> 32) == seen) futex_wait(&pool.wake, w);
            atomic_fetch_sub(&pool.sleepers, 1);
            spin_until = now_ns() + ZS_SPIN_NS;
        }
    }
    return NULL;
}

/* Threads the kernels use, the caller included (1: no workers). Workers start on
 * first need and stay; a smaller count leaves the extra ones asleep. */
int zs_set_threads(int threads) {
    if (threads < 1) threads = 1;
    if (threads > ZS_MAX_THREADS) threads = ZS_MAX_THREADS;
    pthread_mutex_lock(&pool.lock);
    int ok = 1;
    while (pool.workers < threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)(pool.workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            ok = 0;
            break;
        }
        pool.workers++;
    }
    const int in_effect = ok ? threads : pool.workers + 1;
    atomic_store(&pool.active, in_effect);
    pthread_mutex_unlock(&pool.lock);
    return in_effect;
}

void zs_parallel(int64_t n, int64_t grain, int parallel, zs_task fn, const void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (!parallel || atomic_load(&pool.active) < 2 || n <= grain) {
        fn(ctx, 0, n);
        return;
    }
    pthread_mutex_lock(&pool.lock);
    const int64_t chunks = (n + grain - 1) / grain;
    const uint32_t epoch = pool.epoch += 2;
    atomic_store(&pool.claim, (uint64_t)(epoch - 1) << 32 | UINT32_MAX); /* closed */
    atomic_store(&pool.fn, fn);
    atomic_store(&pool.ctx, ctx);
    atomic_store(&pool.n, n);
    atomic_store(&pool.grain, grain);
    atomic_store(&pool.chunks, chunks);
    atomic_store(&pool.done, 0);
    atomic_store(&pool.claim, (uint64_t)epoch << 32); /* open */
    if (atomic_load(&pool.sleepers)) {
        atomic_fetch_add(&pool.wake, 1);
        futex_wake(&pool.wake);
    }
    run_chunks(epoch);
    /* Only chunks other threads claimed can still be running. */
    const int64_t spin_until = now_ns() + ZS_CALLER_SPIN_NS;
    for (int i = 0; atomic_load(&pool.done) < chunks; i++) {
        if (i % 64 || now_ns() < spin_until) {
            cpu_relax();
            continue;
        }
        const uint32_t f = atomic_load(&pool.finished);
        atomic_store(&pool.caller_sleeps, 1);
        if (atomic_load(&pool.done) < chunks) futex_wait(&pool.finished, f);
        atomic_store(&pool.caller_sleeps, 0);
    }
    pthread_mutex_unlock(&pool.lock);
}

int zs_active_threads(void) { return atomic_load(&pool.active); }

void *zs_scratch(size_t bytes) {
    static _Thread_local void *buf;
    static _Thread_local size_t size;
    if (bytes > size) {
        free(buf);
        buf = malloc(bytes);
        size = buf ? bytes : 0;
    }
    return buf;
}
