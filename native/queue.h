/*
 * queue.h: one single-producer / single-consumer queue of fixed-size slots in
 * shared memory, with a futex doorbell. Publishing and consuming
 * are inline here (every push and pop); waiting is queue.c's.
 *
 * The shared layout (where the indices, waiter words and slots live) is
 * decided by transfer/ring/_layout.py and documented in docs/ring.md; this file
 * only sees pointers into the mapping.
 *
 * Indices are free-running 64-bit counters (never wrapped; slot = index &
 * mask). `tail` is written only by the producer, `head` only by the
 * consumer, each on its own cache line. Each side also keeps a *private*
 * copy of its own index and never re-reads it from shared memory, so a
 * peer that scribbles over our index cannot make us misbehave; the peer's
 * index is validated on every load (0 <= tail - head <= capacity), and a
 * violation is reported as TRQ_CORRUPT rather than trusted.
 *
 * MEMORY ORDERING (C11 atomics; correct on x86-64 and ARM64)
 * --------------------------------------------------------
 * (1) Publication. The producer writes slot bytes with plain stores, then
 *     stores `tail` with memory_order_release. The consumer loads `tail`
 *     with memory_order_acquire, and only then reads the slots below it.
 *     Release/acquire on the same location gives "synchronizes-with": every
 *     slot byte written before the release store is visible to reads after
 *     the acquire load. On x86-64 (TSO) both compile to plain movs, the
 *     ordering coming from the hardware plus the compiler barrier; on ARM64
 *     they become stlr / ldar. A consumer therefore never sees a
 *     half-written descriptor: a producer killed mid-write has not yet
 *     published the slot, and the consumer sees a consistent prefix.
 * (2) Recycling. The consumer copies slots out and then stores `head` with
 *     release; the producer loads `head` with acquire before overwriting
 *     those slots. Without it, on ARM64 the consumer's loads of a slot
 *     could be satisfied after the producer's new stores to it (load->store
 *     reordering), i.e. the consumer could read the next lap's bytes.
 * (3) Doorbell (missed-wakeup freedom). A waiter and a waker each do
 *     "store my word; full fence; load the other's word" (Dekker):
 *
 *        consumer (waiter)                    producer (waker)
 *        C1 waiter = 1          (relaxed)     P1 tail = t+n     (release)
 *        C2 fence(seq_cst)                    P2 fence(seq_cst)
 *        C3 load tail           (acquire)     P3 load waiter    (relaxed)
 *        C4 if empty: futex_wait(&waiter, 1)  P4 if waiter: waiter = 0; futex_wake
 *
 *     The two seq_cst fences are totally ordered. If P2 comes first, C3
 *     must observe P1 (C11 [atomics.fences]: a load sequenced after a
 *     seq_cst fence sees every store sequenced before an earlier seq_cst
 *     fence), so the consumer finds the data and does not sleep. If C2
 *     comes first, P3 observes C1 (or later), so the producer clears the
 *     word and issues FUTEX_WAKE. FUTEX_WAIT itself re-checks "*word == 1"
 *     atomically with queueing the waiter (under the kernel's hash-bucket
 *     lock), so if the clear happened before C4 the wait returns EAGAIN at
 *     once, and if it happens after C4 the wake finds the waiter queued.
 *     Either way nobody sleeps on published data. Without the fences,
 *     x86's store buffer alone allows both loads to read the old values
 *     (store->load reordering is the one reordering TSO permits), which is
 *     exactly the lost wakeup. The fence is an mfence (x86) / dmb ish
 *     (ARM64), paid once per publish, not once per descriptor.
 *     The producer-waits-for-space direction is the mirror image with
 *     (head, space_waiter), and "peer closed" is a third word checked in
 *     the same C3 position, so a closing peer wakes sleepers the same way.
 *
 *     The futex words live in a MAP_SHARED mapping and are used *without*
 *     FUTEX_PRIVATE_FLAG, so the kernel keys them by (inode, offset) and a
 *     wake in one process reaches a waiter in the other.
 */
#ifndef TRANSFER_QUEUE_H
#define TRANSFER_QUEUE_H

#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/syscall.h>

#include "layout.h"

#define TRQ_OK 0
#define TRQ_CORRUPT (-1)

typedef struct {
    _Atomic uint64_t *tail;          /* written by the producer only */
    _Atomic uint64_t *head;          /* written by the consumer only */
    _Atomic uint32_t *data_waiter;   /* 1 while the consumer sleeps (or is about to) on "empty" */
    _Atomic uint32_t *space_waiter;  /* 1 while the producer sleeps (or is about to) on "full" */
    _Atomic uint32_t *peer_closed;   /* set by the other endpoint when it closes */
    uint8_t *slots;
    uint64_t cap;                    /* power of two */
    uint64_t mask;
    uint32_t slot_size;
    uint64_t mine;                   /* private copy of my index: tail (producer) or head (consumer) */
    uint64_t seen;                   /* last value of the peer's index I loaded */
} trq_t;

static inline void trq_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    atomic_signal_fence(memory_order_seq_cst);
#endif
}

static inline uint64_t trq_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Non-private futex: the word is in a shared mapping, the peer is another process. */
static inline long trq_futex_wait(_Atomic uint32_t *w, uint32_t expect, uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    return syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, expect, &ts, NULL, 0);
}

static inline long trq_futex_wake(_Atomic uint32_t *w)
{
    return syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Waker half of the doorbell (P2..P4 above); called after a release store of an index.
 * Returns the word it cleared: 0 (nobody slept), 1 (a sleeper that also wants its event-loop
 * bell rung: the caller writes it) or TDP_ARMED (a native data-plane worker: the futex is all). */
static inline uint32_t trq_ring_doorbell(_Atomic uint32_t *w)
{
    atomic_thread_fence(memory_order_seq_cst);                       /* P2 */
    uint32_t was = 0;
    if (atomic_load_explicit(w, memory_order_relaxed) != 0 &&        /* P3 */
        (was = atomic_exchange_explicit(w, 0, memory_order_relaxed)) != 0)
        trq_futex_wake(w);                                           /* P4 */
    return was;
}

/* Unconditional: clear the word and wake whoever sleeps on it (close, interrupt). */
static inline void trq_force_wake(_Atomic uint32_t *w)
{
    atomic_store_explicit(w, 0, memory_order_seq_cst);
    trq_futex_wake(w);
}

/* ---- consumer side ---------------------------------------------------- */

/* Published, not yet consumed slots; TRQ_CORRUPT if the producer's tail is impossible. */
static inline int64_t trq_available(trq_t *q)
{
    uint64_t t = atomic_load_explicit(q->tail, memory_order_acquire);   /* (1) acquire */
    uint64_t n = t - q->mine;
    if (n > q->cap)
        return TRQ_CORRUPT;
    q->seen = t;
    return (int64_t)n;
}

/* Copy n slots between `buf` and the ring, from this side's cursor on (`mine`), the ring's wrap
 * taken care of: out of the ring (`to_ring` 0: a consumer's peek), or into it (a producer). */
static inline void trq_copy(trq_t *q, void *buf, uint64_t n, int to_ring)
{
    uint64_t start = q->mine & q->mask;
    uint64_t first = q->cap - start;
    if (first > n)
        first = n;
    size_t ss = q->slot_size;
    uint8_t *b = buf;
    if (to_ring) {
        memcpy(q->slots + start * ss, b, first * ss);
        memcpy(q->slots, b + first * ss, (n - first) * ss);
    } else {
        memcpy(b, q->slots + start * ss, first * ss);
        memcpy(b + first * ss, q->slots, (n - first) * ss);
    }
}

/* Copy up to max slots into out (max * slot_size bytes); one release store of head. */
static inline int64_t trq_pop_into(trq_t *q, void *out, uint64_t max, int wake)
{
    uint64_t n = q->seen - q->mine;
    if (n < max) {
        int64_t a = trq_available(q);
        if (a < 0)
            return a;
        n = (uint64_t)a;
    }
    if (n > max)
        n = max;
    if (n == 0)
        return 0;
    trq_copy(q, out, n, 0);
    q->mine += n;
    atomic_store_explicit(q->head, q->mine, memory_order_release);      /* (2) release */
    if (wake)
        trq_ring_doorbell(q->space_waiter);
    return (int64_t)n;
}

/* ---- producer side ---------------------------------------------------- */

/* Free slots; TRQ_CORRUPT if the consumer's head is impossible. */
static inline int64_t trq_free(trq_t *q)
{
    uint64_t h = atomic_load_explicit(q->head, memory_order_acquire);   /* (2) acquire */
    uint64_t used = q->mine - h;
    if (used > q->cap)
        return TRQ_CORRUPT;
    q->seen = h;
    return (int64_t)(q->cap - used);
}

/* Copy up to n slots from src and publish them with ONE release store of tail. */
static inline int64_t trq_push_from(trq_t *q, const void *src, uint64_t n, int wake)
{
    uint64_t free_ = q->cap - (q->mine - q->seen);   /* from the cached head: no shared load */
    if (free_ < n) {
        int64_t f = trq_free(q);
        if (f < 0)
            return f;
        free_ = (uint64_t)f;
    }
    if (n > free_)
        n = free_;
    if (n == 0)
        return 0;
    trq_copy(q, (void *)src, n, 1);
    q->mine += n;
    atomic_store_explicit(q->tail, q->mine, memory_order_release);      /* (1) release, P1 */
    if (wake)
        trq_ring_doorbell(q->data_waiter);
    return (int64_t)n;
}

/* ---- waiting ------------------------------------------------------------ */

#define TRQ_WAIT_DATA 0   /* consumer: until available() >= need */
#define TRQ_WAIT_SPACE 1  /* producer: until free() >= need */

/* Longest single futex sleep. The protocol above needs no timeout; the slice
 * only bounds the damage of a peer that does not follow it (a hostile client,
 * a dead one) and is ~20 wakeups/s when idle. */
#define TRQ_SLICE_NS 50000000ull

/* While spinning, sched_yield() at most this often (see trq_wait). */
#define TRQ_YIELD_NS 5000ull

/* Futex sleeps of this thread's waits, so far: a native worker adds its own to its counters
 * (each is a wake-up its next submission paid for). */
extern _Thread_local uint64_t trq_sleeps;

/* Wait until the condition holds, the peer closes, *interrupt becomes non-zero, or
 * timeout_ns passes (UINT64_MAX: forever); the word armed with `armed`. queue.c. */
int64_t trq_wait_armed(trq_t *q, int what, uint64_t need, uint64_t timeout_ns, uint64_t spin_ns,
                       atomic_int *interrupt, uint32_t armed);
int64_t trq_wait(trq_t *q, int what, uint64_t need, uint64_t timeout_ns, uint64_t spin_ns, atomic_int *interrupt);
/* The first half of a sleep elsewhere (an event loop's), and its undoing. queue.c. */
int64_t trq_arm(trq_t *q, int what);
void trq_disarm(trq_t *q, int what);

#endif /* TRANSFER_QUEUE_H */
