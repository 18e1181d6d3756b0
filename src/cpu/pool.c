/* pool.c — a fixed pthread pool. wa_pool_run() hands out units [0, units) through an atomic
 * counter; the caller works too. Which worker runs a unit never changes what the unit computes
 * (each unit owns its outputs and its scratch is indexed by worker), so results are
 * bit-identical for any thread count.
 */
#define _GNU_SOURCE
#include "../internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

struct wa_pool {
    int threads;
    pthread_t *workers;
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

wa_pool *wa_pool_create(int threads) {
    wa_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->threads = threads < 1 ? 1 : threads;
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    if (pool->threads > 1) {
        pool->workers = calloc((size_t)pool->threads - 1, sizeof *pool->workers);
        if (!pool->workers) goto fail;
        for (int i = 1; i < pool->threads; i++) {
            worker_start *ws = malloc(sizeof *ws);
            if (!ws) goto fail_started;
            ws->pool = pool, ws->index = i;
            if (pthread_create(&pool->workers[i - 1], NULL, worker_main, ws) != 0) {
                free(ws);
                goto fail_started;
            }
            continue;
        fail_started:
            pool->threads = i; /* join the ones that started */
            wa_pool_destroy(pool);
            return NULL;
        }
    }
    return pool;
fail:
    pthread_cond_destroy(&pool->wake);
    pthread_cond_destroy(&pool->done);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
    return NULL;
}

void wa_pool_destroy(wa_pool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->lock);
    pool->quit = 1;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 1; i < pool->threads; i++) pthread_join(pool->workers[i - 1], NULL);
    free(pool->workers);
    pthread_cond_destroy(&pool->wake);
    pthread_cond_destroy(&pool->done);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
}

int wa_pool_threads(const wa_pool *pool) { return pool->threads; }

void wa_pool_run(wa_pool *pool, int64_t units, wa_unit_fn fn, void *arg) {
    if (units <= 0) return;
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
