/* pool.c — a fixed pthread pool. wa_pool_run() hands out units [0, units) through an atomic
 * counter; the caller works too. Which worker runs a unit never changes what the unit computes
 * (each unit owns its outputs and its scratch is indexed by worker), so results are
 * bit-identical for any thread count.
 *
 * fork(): the child gets a copy of the pool but none of its worker threads, and the copied lock
 * and condition variables may be in any state the parent's threads left them in. A
 * pthread_atfork handler counts forks in the child; a pool whose workers were started in an
 * earlier generation starts new ones (on fresh synchronisation objects) at its next run, and is
 * destroyed without joining threads that do not exist. If no new worker can be started, the
 * child's runs go single-threaded: the results are the same either way.
 */
#define _GNU_SOURCE
#include "../internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

struct wa_pool {
    int threads;
    pthread_t *workers;
    unsigned long born;       /* fork generation the workers were started in */
    pthread_mutex_t lock;
    pthread_cond_t wake, done;
    unsigned long generation; /* bumped per run, so workers know there is new work */
    int active;               /* workers still inside the current run */
    int quit;
    /* the current run */
    wa_unit_fn fn;
    void *arg;
    int64_t units;
    _Atomic int64_t next;
};

/* Bumped in the child after every fork(); read with no lock, since a pool is only run by the
 * one thread that holds its context. */
static _Atomic unsigned long fork_generation;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void count_fork_in_child(void) { atomic_fetch_add_explicit(&fork_generation, 1, memory_order_relaxed); }
static void install_atfork(void) { pthread_atfork(NULL, NULL, count_fork_in_child); }

typedef struct worker_start {
    wa_pool *pool;
    int index;
} worker_start;

static void drain(wa_pool *pool, int worker) {
    for (;;) {
        int64_t u = atomic_fetch_add_explicit(&pool->next, 1, memory_order_relaxed);
        if (u >= pool->units) return;
        pool->fn(pool->arg, u, worker);
    }
}

static void *worker_main(void *p) {
    worker_start *ws = p;
    wa_pool *pool = ws->pool;
    int index = ws->index;
    free(ws);
    unsigned long seen = 0;
    pthread_mutex_lock(&pool->lock);
    for (;;) {
        while (!pool->quit && pool->generation == seen) pthread_cond_wait(&pool->wake, &pool->lock);
        if (pool->quit) break;
        seen = pool->generation;
        pthread_mutex_unlock(&pool->lock);
        drain(pool, index);
        pthread_mutex_lock(&pool->lock);
        if (--pool->active == 0) pthread_cond_signal(&pool->done);
    }
    pthread_mutex_unlock(&pool->lock);
    return NULL;
}

static void init_sync(wa_pool *pool) {
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
}

static void destroy_sync(wa_pool *pool) {
    pthread_cond_destroy(&pool->wake);
    pthread_cond_destroy(&pool->done);
    pthread_mutex_destroy(&pool->lock);
}

/* Starts workers 1 .. threads-1 into pool->workers; returns how many threads (the caller
 * included) the pool then has. */
static int start_workers(wa_pool *pool) {
    pool->born = atomic_load_explicit(&fork_generation, memory_order_relaxed);
    for (int i = 1; i < pool->threads; i++) {
        worker_start *ws = malloc(sizeof *ws);
        if (!ws) return i;
        ws->pool = pool, ws->index = i;
        if (pthread_create(&pool->workers[i - 1], NULL, worker_main, ws) != 0) {
            free(ws);
            return i;
        }
    }
    return pool->threads;
}

/* Joins every worker and frees the pool's synchronisation objects (they are the live ones:
 * the workers were started in this process). */
static void stop_workers(wa_pool *pool) {
    pthread_mutex_lock(&pool->lock);
    pool->quit = 1;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 1; i < pool->threads; i++) pthread_join(pool->workers[i - 1], NULL);
    destroy_sync(pool);
}

static int started_here(const wa_pool *pool) {
    return pool->born == atomic_load_explicit(&fork_generation, memory_order_relaxed);
}

wa_pool *wa_pool_create(int threads) {
    pthread_once(&atfork_once, install_atfork);
    wa_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->threads = threads < 1 ? 1 : threads;
    init_sync(pool);
    if (pool->threads > 1) {
        pool->workers = calloc((size_t)pool->threads - 1, sizeof *pool->workers);
        int started = pool->workers ? start_workers(pool) : 0;
        if (started < pool->threads) {
            if (started > 0) {
                pool->threads = started; /* join the ones that started */
                wa_pool_destroy(pool);
                return NULL;
            }
            destroy_sync(pool);
            free(pool->workers);
            free(pool);
            return NULL;
        }
    }
    pool->born = atomic_load_explicit(&fork_generation, memory_order_relaxed);
    return pool;
}

/* In a forked child: the parent's workers are not here. Start new ones on fresh
 * synchronisation objects (the copies may be held by threads that do not exist here). */
static void restart_after_fork(wa_pool *pool) {
    memset(&pool->lock, 0, sizeof pool->lock);
    memset(&pool->wake, 0, sizeof pool->wake);
    memset(&pool->done, 0, sizeof pool->done);
    init_sync(pool);
    pool->generation = 0, pool->active = 0, pool->quit = 0;
    pool->threads = start_workers(pool);
}

void wa_pool_destroy(wa_pool *pool) {
    if (!pool) return;
    /* a pool copied by fork() and never run here has no workers to join, and its lock may be
     * a copy held by a thread that does not exist */
    if (started_here(pool)) stop_workers(pool);
    free(pool->workers);
    free(pool);
}

int wa_pool_threads(const wa_pool *pool) { return pool->threads; }

void wa_pool_run(wa_pool *pool, int64_t units, wa_unit_fn fn, void *arg) {
    if (units <= 0) return;
    if (pool->threads > 1 && !started_here(pool)) restart_after_fork(pool);
    if (pool->threads == 1 || units == 1) {
        for (int64_t u = 0; u < units; u++) fn(arg, u, 0);
        return;
    }
    pthread_mutex_lock(&pool->lock);
    pool->fn = fn, pool->arg = arg, pool->units = units;
    atomic_store(&pool->next, 0);
    pool->active = pool->threads - 1;
    pool->generation++;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    drain(pool, 0);
    pthread_mutex_lock(&pool->lock);
    while (pool->active > 0) pthread_cond_wait(&pool->done, &pool->lock);
    pthread_mutex_unlock(&pool->lock);
}
