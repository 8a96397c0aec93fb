/* A thread pool whose workers spin while work keeps coming and sleep when it stops, for the
 * kernels that a decode step calls many times (quant_linear.c: ~120 calls a step on the bundled
 * model; attention, the weight matmuls, the norms and silu * up: every kernel but sampling.c's
 * batch-wide loops, so a decode step opens no OpenMP region).
 *
 * Why not OpenMP's pool: verispec runs it passive (verispec/cpu_threads.py: spinning workers
 * take the cores a busy neighbour and verispec's own main thread need), so every parallel
 * region waits for a sleeping worker to wake; on a 2-core VM a decode step of the quantised
 * bundled model ran ~1.4x slower passive than with spinning workers, and slower on two threads
 * than on one (docs/benchmarks.md, "GGUF quantised weights on the CPU"). Here a worker spins
 * for SPIN_NS after its last task (far longer than the gap between two kernels of a step), then
 * calls sched_yield while it waits up to YIELD_NS (a neighbour that wants the core gets it),
 * then sleeps on a futex until the next task: a running generation pays no wake-ups, an idle
 * engine holds no core (llama.cpp's thread pool waits the same way).
 *
 * pool_run(task, arg, n) calls task(arg, 0, n) on the calling thread and task(arg, i, n) on
 * each worker i (1 .. n - 1) that comes while the caller's own call runs, and returns when the
 * calls are done: a task must hand out its work to whoever calls it (the kernels take items
 * from a shared counter), so the caller does all of it where the workers are slow to come (a
 * busy machine) and a late worker does nothing. What an item computes never depends on the
 * thread that takes it. One pool_run at a time (a mutex); workers start on first use, and
 * again in a forked child.
 */
#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define POOL_MAX_THREADS 256
#define CLOSED (1ull << 31) /* in pool.entry: no worker may join any more */
#define SPIN_NS 200000L    /* 0.2 ms of pause-spinning after a task */
#define YIELD_NS 3000000L  /* then up to 3 ms of yielding spins, then a futex sleep */

typedef void (*pool_task)(void *arg, int thread, int num_threads);

static struct {
    pthread_mutex_t lock;         /* one pool_run at a time */
    int num_workers;              /* workers started (threads 1 .. num_workers) */
    _Atomic uint32_t generation;  /* bumped for each task: the futex word */
    /* the current task's generation << 32 | CLOSED | workers that joined it: a worker joins
     * only the open task it saw announced, so a late one never touches a finished task */
    _Atomic uint64_t entry;
    _Atomic int finished;         /* joined workers done with the current task */
    _Atomic int sleepers;         /* workers in (or entering) a futex sleep */
    pool_task task;
    void *arg;
    int num_threads;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Returns the new generation once it differs from `seen`. */
static uint32_t wait_for_task(uint32_t seen) {
    int64_t start = now_ns();
    for (uint32_t spins = 1;; spins++) {
        uint32_t g = atomic_load_explicit(&pool.generation, memory_order_acquire);
        if (g != seen) return g;
        if (spins % 256) {
            _mm_pause();
            continue;
        }
        int64_t waited = now_ns() - start;
        if (waited < SPIN_NS) continue;
        if (waited < YIELD_NS) {
            sched_yield();
            continue;
        }
        /* Sleep unless the generation moved: the sleepers count is raised before the
         * generation is read again, and pool_run bumps the generation before it reads the
         * count (both sequentially consistent), so one of the two sees the other. */
        atomic_fetch_add(&pool.sleepers, 1);
        if (atomic_load(&pool.generation) == seen)
            syscall(SYS_futex, &pool.generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        atomic_fetch_sub(&pool.sleepers, 1);
        start = now_ns();
    }
}

struct worker_start {
    int thread;
    uint32_t generation;
};
static struct worker_start starts[POOL_MAX_THREADS];

static void *worker(void *p) {
    const struct worker_start *start = p;
    int thread = start->thread;
    uint32_t seen = start->generation;
    for (;;) {
        seen = wait_for_task(seen);
        uint64_t e = atomic_load(&pool.entry);
        int joined = 0;
        while ((uint32_t)(e >> 32) == seen && !(e & CLOSED) &&
               !(joined = atomic_compare_exchange_weak(&pool.entry, &e, e + 1)))
            ;
        if (!joined) continue; /* too late: the caller did this task's work */
        if (thread < pool.num_threads) pool.task(pool.arg, thread, pool.num_threads);
        atomic_fetch_add_explicit(&pool.finished, 1, memory_order_release);
    }
    return NULL;
}

static void forget_workers(void) { /* in a forked child: the workers did not come along */
    pthread_mutex_init(&pool.lock, NULL);
    pool.num_workers = 0;
    atomic_store(&pool.sleepers, 0);
}

static void start_workers(int n) {
    static int registered;
    if (!registered) {
        pthread_atfork(NULL, NULL, forget_workers);
        registered = 1;
    }
    for (int i = pool.num_workers + 1; i < n; i++) {
        pthread_t t;
        pthread_attr_t attr;
        starts[i] = (struct worker_start){i, atomic_load(&pool.generation)};
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, worker, &starts[i]) != 0) break;
        pthread_attr_destroy(&attr);
        pool.num_workers = i;
    }
}

void pool_run(pool_task task, void *arg, int num_threads) {
    if (num_threads > POOL_MAX_THREADS) num_threads = POOL_MAX_THREADS;
    if (num_threads <= 1) {
        task(arg, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool.lock);
    if (pool.num_workers < num_threads - 1) start_workers(num_threads);
    if (num_threads > pool.num_workers + 1) num_threads = pool.num_workers + 1;
    pool.task = task, pool.arg = arg, pool.num_threads = num_threads;
    atomic_store(&pool.finished, 0);
    uint32_t g = atomic_load(&pool.generation) + 1;
    atomic_store(&pool.entry, (uint64_t)g << 32);
    atomic_store(&pool.generation, g);
    if (atomic_load(&pool.sleepers))
        syscall(SYS_futex, &pool.generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    /* the task hands out its work to whoever comes (the kernels take items from a shared
     * counter), so the caller alone may do all of it when the workers are slow to come */
    task(arg, 0, num_threads);
    int joined = (int)(atomic_fetch_or(&pool.entry, CLOSED) & (CLOSED - 1));
    for (uint32_t spins = 1;
         atomic_load_explicit(&pool.finished, memory_order_acquire) < joined; spins++) {
        if (spins % 256) _mm_pause();
        else sched_yield(); /* a joined worker was preempted: it may need this core */
    }
    pthread_mutex_unlock(&pool.lock);
}

struct for_job {
    void (*item)(void *arg, int64_t i);
    void *arg;
    int64_t num_items;
    _Atomic int64_t next;
};

static void for_part(void *p, int thread, int num_threads) {
    struct for_job *job = p;
    (void)thread, (void)num_threads;
    for (int64_t i; (i = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed)) <
                    job->num_items;)
        job->item(job->arg, i);
}

void pool_for(void (*item)(void *arg, int64_t i), void *arg, int64_t num_items,
              int num_threads) {
    struct for_job job = {item, arg, num_items, 0};
    if (num_threads <= 1 || num_items <= 1)
        for_part(&job, 0, 1);
    else
        pool_run(for_part, &job, num_threads);
}
