/*
 * poolloader ring: a bounded single-producer / single-consumer queue of int64
 * values that lives in a caller-given shared buffer (a shared-memory
 * mapping), usable by two processes (fork, spawn or forkserver).
 *
 * No Python.h here: Cython declares these with `cdef extern` (poolloader/shm/_ring.pyx).
 *
 * Buffer layout, keep in sync with RING_HEADER_BYTES in poolloader/shm/_ring.pyx.
 * Every field sits on its own 64-byte cache line so producer and consumer never
 * write the same line:
 *
 *   line 0  magic     u64  PL_RING_MAGIC once initialised (written last, release)
 *           capacity  u64  number of int64 cells (any value >= 1, not only powers of 2)
 *           closed    u32  0 open, 1 closed: every waiter wakes and fails
 *   line 1  head      u64  count of values popped so far (written by the consumer only)
 *   line 2  tail      u64  count of values pushed so far (written by the producer only)
 *   line 3  items     sem_t (pshared=1): values ready to pop
 *   line 4  spaces    sem_t (pshared=1): free cells to push into
 *   line 5… cells     int64[capacity], cell i holds value number i % capacity
 *
 * The two semaphores are unnamed and live inside the buffer, so there is no
 * kernel object to leak. sem_post/sem_wait are full barriers; head and tail are
 * atomics with acquire/release so a racy len() from either side is still sane.
 *
 * Untrusted bytes: any process that maps the buffer can write any of it (a stray
 * pointer in user code run by a worker). So after initialisation nothing here
 * reads a layout value from the buffer: every operation takes the capacity from
 * the caller's process-local copy (the creator's argument, or the value the
 * attaching side validated once against its buffer's size), and every cell index
 * is a counter modulo that copy, so no write or read can leave the cells. Each
 * put and take also checks what it reads: the magic and capacity fields must still
 * hold what was initialised (they share line 0 with `closed`, which every call
 * reads anyway), and with a token of `spaces` held 0 <= tail - head < capacity,
 * with a token of `items` 0 < tail - head <= capacity. Anything else is PL_CORRUPT
 * (nothing moved), never a division by zero or a write past the ring. (A corrupt semaphore can only wake a waiter early or late: every wait
 * is bounded and every take re-checks the counters.)
 */
#ifndef POOLLOADER_RING_H
#define POOLLOADER_RING_H

#include <errno.h>
#include <sched.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/*
 * The timed wait (pl_sem_wait_for). glibc >= 2.30 has sem_clockwait, which takes a
 * CLOCK_MONOTONIC deadline. Older C libraries (glibc 2.28 on RHEL/Rocky/Alma 8, the
 * manylinux_2_17 and manylinux_2_28 build images, musl) have only sem_timedwait, whose
 * deadline is CLOCK_REALTIME: a wall clock that NTP or an admin may step. There the
 * wait is cut into slices of at most PL_REALTIME_SLICE_NS, each with a realtime
 * deadline computed afresh from "now", while the bound itself is kept on
 * CLOCK_MONOTONIC: a forward step only ends a slice early (the loop waits the rest),
 * and a backward step of D while a slice sleeps lengthens that one slice by D — it
 * never turns a bounded wait into an unbounded one. The build picks the path from the
 * C library's version; defining PL_FORCE_SEM_TIMEDWAIT (setup.py does when
 * POOLLOADER_FORCE_SEM_TIMEDWAIT=1) picks the fallback anywhere. PL_TIMED_WAIT names
 * the path compiled (poolloader.shm._ring.TIMED_WAIT).
 */
#if !defined(PL_FORCE_SEM_TIMEDWAIT) && defined(__GLIBC__) \
    && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
#define PL_USE_SEM_CLOCKWAIT 1
#define PL_TIMED_WAIT "sem_clockwait"
#else
#define PL_USE_SEM_CLOCKWAIT 0
#define PL_TIMED_WAIT "sem_timedwait"
#endif
#pragma message("poolloader ring: timed waits use " PL_TIMED_WAIT)

#define PL_RING_MAGIC 0x676e69724c50ULL /* "PLring" */
#define PL_LINE 64
#define PL_RING_HEADER_BYTES (5 * PL_LINE)

enum { PL_OK = 0, PL_EMPTY = 1, PL_FULL = 1, PL_TIMEOUT = 2, PL_CLOSED = 3, PL_INTR = 4, PL_CORRUPT = 5 };

typedef struct {
    uint64_t magic;
    uint64_t capacity;
    _Atomic uint32_t closed;
} pl_ring_meta;

_Static_assert(sizeof(sem_t) <= PL_LINE, "sem_t must fit one cache line");

static inline pl_ring_meta *pl_meta(void *b) { return (pl_ring_meta *)b; }
static inline _Atomic uint64_t *pl_head(void *b) { return (_Atomic uint64_t *)((char *)b + 1 * PL_LINE); }
static inline _Atomic uint64_t *pl_tail(void *b) { return (_Atomic uint64_t *)((char *)b + 2 * PL_LINE); }
static inline sem_t *pl_items(void *b) { return (sem_t *)((char *)b + 3 * PL_LINE); }
static inline sem_t *pl_spaces(void *b) { return (sem_t *)((char *)b + 4 * PL_LINE); }
static inline int64_t *pl_cells(void *b) { return (int64_t *)((char *)b + PL_RING_HEADER_BYTES); }

static inline uint64_t pl_ring_nbytes(uint64_t capacity) {
    return PL_RING_HEADER_BYTES + capacity * sizeof(int64_t);
}

/* Initialise a zeroed or reused buffer. Call once, before any other process attaches. */
static inline int pl_ring_init(void *b, uint64_t capacity) {
    if (capacity < 1 || capacity > (uint64_t)SEM_VALUE_MAX) return EINVAL;
    memset(b, 0, PL_RING_HEADER_BYTES);
    pl_meta(b)->capacity = capacity;
    if (sem_init(pl_items(b), 1, 0) != 0) return errno;
    if (sem_init(pl_spaces(b), 1, (unsigned)capacity) != 0) return errno;
    atomic_store_explicit(pl_head(b), 0, memory_order_relaxed);
    atomic_store_explicit(pl_tail(b), 0, memory_order_relaxed);
    atomic_store_explicit(&pl_meta(b)->closed, 0, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    pl_meta(b)->magic = PL_RING_MAGIC;
    return 0;
}

/* Largest capacity whose cells fit `nbytes` bytes of buffer (0: not even the header). */
static inline uint64_t pl_ring_max_capacity(uint64_t nbytes) {
    if (nbytes < PL_RING_HEADER_BYTES) return 0;
    uint64_t cells = (nbytes - PL_RING_HEADER_BYTES) / sizeof(int64_t);
    return cells < (uint64_t)SEM_VALUE_MAX ? cells : (uint64_t)SEM_VALUE_MAX;
}

/* For the attaching side, once: the capacity an initialised ring records, or 0 when
 * the magic is missing or the capacity is 0 or larger than `nbytes` of buffer can hold.
 * The caller keeps the returned value and passes it to every later call. */
static inline uint64_t pl_ring_attach(void *b, uint64_t nbytes) {
    atomic_thread_fence(memory_order_acquire);
    if (nbytes < PL_RING_HEADER_BYTES || pl_meta(b)->magic != PL_RING_MAGIC) return 0;
    uint64_t capacity = pl_meta(b)->capacity;
    return capacity >= 1 && capacity <= pl_ring_max_capacity(nbytes) ? capacity : 0;
}

/* The shared capacity field, for error messages only. */
static inline uint64_t pl_ring_recorded_capacity(void *b) {
    return __atomic_load_n(&pl_meta(b)->capacity, __ATOMIC_RELAXED);
}

/* 1 while line 0 still holds what init wrote for a ring of `capacity` cells. */
static inline int pl_ring_meta_intact(void *b, uint64_t capacity) {
    return __atomic_load_n(&pl_meta(b)->capacity, __ATOMIC_RELAXED) == capacity
        && __atomic_load_n(&pl_meta(b)->magic, __ATOMIC_RELAXED) == PL_RING_MAGIC;
}

static inline int pl_ring_closed(void *b) {
    return atomic_load_explicit(&pl_meta(b)->closed, memory_order_acquire) != 0;
}

/* Wake every waiter; from then on every operation reports PL_CLOSED. */
static inline void pl_ring_close(void *b) {
    atomic_store_explicit(&pl_meta(b)->closed, 1, memory_order_release);
    sem_post(pl_items(b));
    sem_post(pl_spaces(b));
}

static inline uint64_t pl_ring_head(void *b) { return atomic_load_explicit(pl_head(b), memory_order_acquire); }
static inline uint64_t pl_ring_tail(void *b) { return atomic_load_explicit(pl_tail(b), memory_order_acquire); }

/* Values queued, or UINT64_MAX when the counters are further apart than `capacity`
 * (corrupt). Read tail first: head only grows, so from any process a sane ring gives
 * tail - head <= capacity (or head just past tail, reported as 0). */
static inline uint64_t pl_ring_len(void *b, uint64_t capacity) {
    uint64_t tail = atomic_load_explicit(pl_tail(b), memory_order_acquire);
    uint64_t head = atomic_load_explicit(pl_head(b), memory_order_acquire);
    if (tail < head) return 0;
    return tail - head <= capacity ? tail - head : UINT64_MAX;
}

/* Producer side, after a token of `spaces` is held: PL_OK, or PL_CORRUPT (nothing written). */
static inline int pl_ring_put(void *b, uint64_t capacity, int64_t value) {
    uint64_t tail = atomic_load_explicit(pl_tail(b), memory_order_relaxed);
    uint64_t head = atomic_load_explicit(pl_head(b), memory_order_acquire);
    /* head > tail wraps to a huge difference, caught by the same test */
    if (tail - head >= capacity || !pl_ring_meta_intact(b, capacity)) return PL_CORRUPT;
    pl_cells(b)[tail % capacity] = value;
    atomic_store_explicit(pl_tail(b), tail + 1, memory_order_release);
    sem_post(pl_items(b));
    return PL_OK;
}

/* Consumer side, after a token of `items` is held: PL_OK, or PL_CORRUPT (nothing read). */
static inline int pl_ring_take(void *b, uint64_t capacity, int64_t *value) {
    uint64_t head = atomic_load_explicit(pl_head(b), memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(pl_tail(b), memory_order_acquire);
    if (tail - head - 1 >= capacity || !pl_ring_meta_intact(b, capacity)) return PL_CORRUPT;
    *value = pl_cells(b)[head % capacity];
    atomic_store_explicit(pl_head(b), head + 1, memory_order_release);
    sem_post(pl_spaces(b));
    return PL_OK;
}

/* Longest busy-wait before a blocking wait, in nanoseconds. */
#define PL_SPIN_NS 30000LL

static inline long long pl_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Longest sem_timedwait slice of the fallback path (see the top of this file). */
#define PL_REALTIME_SLICE_NS 50000000LL

static inline void pl_add_ns(struct timespec *t, long long ns) {
    t->tv_sec += ns / 1000000000LL;
    t->tv_nsec += ns % 1000000000LL;
    if (t->tv_nsec >= 1000000000L) { t->tv_sec += 1; t->tv_nsec -= 1000000000L; }
}

/* Take one token of `sem`, sleeping at most `seconds` (>= 0) of CLOCK_MONOTONIC time.
 * 0, or -1 with errno ETIMEDOUT, EINTR or another error of the sem_* call. */
static inline int pl_sem_wait_for(sem_t *sem, double seconds) {
    long long ns = (long long)(seconds * 1e9);
#if PL_USE_SEM_CLOCKWAIT
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    pl_add_ns(&deadline, ns);
    return sem_clockwait(sem, CLOCK_MONOTONIC, &deadline);
#else
    long long until = pl_now_ns() + ns;
    for (;;) {
        long long left = until - pl_now_ns();
        if (left <= 0) {
            /* a wait of 0 still takes a token that is there */
            if (sem_trywait(sem) == 0) return 0;
            if (errno == EAGAIN) errno = ETIMEDOUT;
            return -1;
        }
        struct timespec deadline;
        clock_gettime(CLOCK_REALTIME, &deadline);
        pl_add_ns(&deadline, left < PL_REALTIME_SLICE_NS ? left : PL_REALTIME_SLICE_NS);
        if (sem_timedwait(sem, &deadline) == 0) return 0;
        if (errno != ETIMEDOUT) return -1;
    }
#endif
}

/* 1 when a token of `sem` was taken within PL_SPIN_NS, else 0. */
static inline int pl_spin(sem_t *sem) {
    long long until = pl_now_ns() + PL_SPIN_NS;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (sem_trywait(sem) == 0) return 1;
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#elif defined(__aarch64__)
            __asm__ __volatile__("yield");
#endif
        }
        if (pl_now_ns() >= until) return 0;
        sched_yield(); /* on a busy machine, let the peer run */
    }
}

/* Take one token of `sem`, waiting at most `seconds` (< 0: do not wait).
 * Returns PL_OK, PL_EMPTY (nothing and no wait asked), PL_TIMEOUT, PL_INTR
 * (a signal arrived: the caller checks for Python signals and retries) or
 * PL_CLOSED. Safe to call without the GIL. */
static inline int pl_sem_take(void *b, sem_t *sem, double seconds) {
    if (pl_ring_closed(b)) return PL_CLOSED;
    if (seconds < 0) {
        while (sem_trywait(sem) != 0) {
            if (errno == EAGAIN) return PL_EMPTY;
            if (errno != EINTR) return -errno;
        }
    } else {
        /* Spin briefly before sleeping: waking a sleeping process costs tens of
         * microseconds, while the peer usually answers within a few. */
        if (pl_spin(sem)) goto taken;
        if (pl_sem_wait_for(sem, seconds) != 0) {
            if (errno == ETIMEDOUT) return pl_ring_closed(b) ? PL_CLOSED : PL_TIMEOUT;
            if (errno == EINTR) return PL_INTR;
            return -errno;
        }
    }
taken:
    if (pl_ring_closed(b)) {
        sem_post(sem); /* hand the token on so a later waiter wakes too */
        return PL_CLOSED;
    }
    return PL_OK;
}

/* `capacity`: the caller's process-local copy (see the top of this file). */
static inline int pl_ring_push(void *b, uint64_t capacity, int64_t value, double seconds) {
    int rc = pl_sem_take(b, pl_spaces(b), seconds);
    if (rc == PL_OK) rc = pl_ring_put(b, capacity, value);
    return rc;
}

static inline int pl_ring_pop(void *b, uint64_t capacity, int64_t *value, double seconds) {
    int rc = pl_sem_take(b, pl_items(b), seconds);
    if (rc == PL_OK) rc = pl_ring_take(b, capacity, value);
    return rc;
}

/*
 * Doorbell: one process-shared counting semaphore on its own cache line, rung
 * by any number of producers after they push to their own ring, waited on by
 * the single consumer that drains all those rings. It lets one process wait
 * for "any ring has something" without polling. Layout: magic u64 on line 0,
 * sem_t on line 1 (PL_DOORBELL_BYTES in all).
 */
#define PL_DOORBELL_MAGIC 0x6c6c6562726f6f64ULL /* "doorbell" */
#define PL_DOORBELL_BYTES (2 * PL_LINE)

static inline sem_t *pl_bell(void *b) { return (sem_t *)((char *)b + PL_LINE); }

static inline int pl_doorbell_init(void *b) {
    memset(b, 0, PL_DOORBELL_BYTES);
    if (sem_init(pl_bell(b), 1, 0) != 0) return errno;
    atomic_thread_fence(memory_order_release);
    *(uint64_t *)b = PL_DOORBELL_MAGIC;
    return 0;
}

static inline int pl_doorbell_is_valid(void *b) {
    atomic_thread_fence(memory_order_acquire);
    return *(uint64_t *)b == PL_DOORBELL_MAGIC;
}

static inline void pl_doorbell_ring(void *b) { sem_post(pl_bell(b)); }

/* PL_OK when rung, PL_TIMEOUT, PL_INTR; < 0 is -errno. */
static inline int pl_doorbell_wait(void *b, double seconds) {
    if (pl_sem_wait_for(pl_bell(b), seconds) == 0) return PL_OK;
    if (errno == ETIMEDOUT) return PL_TIMEOUT;
    if (errno == EINTR) return PL_INTR;
    return -errno;
}

/*
 * A request's claim: a u64 word in the request's slot (poolloader.wire.slot_format,
 * F_CLAIM) holds the ticket the request went out with (never 0). Whoever swaps it
 * from that ticket to 0 first has the request: the worker that popped it, or main
 * moving the not yet started request to another slot. 1 if this call did, else 0.
 */
static inline int pl_claim(void *word, uint64_t ticket) {
    uint64_t expected = ticket;
    return __atomic_compare_exchange_n((uint64_t *)word, &expected, 0, 0,
                                       __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

#endif
