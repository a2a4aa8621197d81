/*
 * queue.c: waiting on a queue (spin, then the futex) and arming it for a sleep elsewhere.
 * The memory-ordering argument is queue.h's.
 */
#include "queue.h"

_Thread_local uint64_t trq_sleeps;

/*
 * Wait until the condition holds, the peer closes, *interrupt becomes
 * non-zero (local close from another thread), or timeout_ns passes
 * (UINT64_MAX: forever). Spins for spin_ns first (cheap while the peer is
 * busy), then sleeps on the futex, its word set to `armed` (1; the native
 * data plane's workers use 2, see trq_ring_doorbell); a wait whose spin covers
 * its whole timeout only spins, leaving the word alone. Returns the available
 * count (>= 0) or TRQ_CORRUPT. Call without the GIL.
 */
int64_t trq_wait_armed(trq_t *q, int what, uint64_t need, uint64_t timeout_ns, uint64_t spin_ns,
                       atomic_int *interrupt, uint32_t armed)
{
    _Atomic uint32_t *w = what == TRQ_WAIT_DATA ? q->data_waiter : q->space_waiter;
    int64_t a;
#define TRQ_CHECK()                                                             \
    do {                                                                        \
        a = what == TRQ_WAIT_DATA ? trq_available(q) : trq_free(q);             \
        if (a < 0 || (uint64_t)a >= need)                                       \
            return a;                                                           \
    } while (0)
    TRQ_CHECK();
    uint64_t start = trq_now_ns();
    uint64_t deadline = timeout_ns == UINT64_MAX ? UINT64_MAX : start + timeout_ns;
    if (spin_ns > timeout_ns)
        spin_ns = timeout_ns;
    uint64_t spin_until = start + spin_ns, last_yield = start;
    /* Hand the CPU over once before spinning: where the peer (a daemon's worker, or its
     * client) is runnable on this CPU, it answers now rather than after TRQ_YIELD_NS of our
     * spin and then its own. Two spinners sharing a CPU made a 64 B round trip ~18 us instead
     * of ~1.3 in about one run in ten on a 2-vCPU VM; with this yield, 3.5-5.6 us. Alone on
     * the CPU it returns at once (~0.3 us), while the peer works on its own. */
    if (spin_ns)
        sched_yield();
    for (unsigned i = 1;; i++) {
        TRQ_CHECK();
        if ((i & 63) == 0) {
            if (atomic_load_explicit(q->peer_closed, memory_order_acquire) ||
                atomic_load_explicit(interrupt, memory_order_relaxed))
                return a;
            uint64_t now = trq_now_ns();
            if (now >= spin_until)
                break;
            /* If the peer is runnable on *this* CPU (more runnable threads than
             * cores), spinning only delays it: hand the CPU over every few µs.
             * With an idle runqueue sched_yield returns at once (~0.3 µs). */
            if (now - last_yield >= TRQ_YIELD_NS) {
                sched_yield();
                last_yield = now;
            }
        }
        trq_cpu_relax();
    }
    /* A wait that was all spin never sleeps, so it never touches the waiter word: another
     * waiter of this consumer may have armed it to sleep elsewhere (an event loop's reaper
     * on the doorbell), and clearing it on the way out would lose that waiter's wakeup. */
    if (spin_until >= deadline)
        return a;
    for (;;) {
        atomic_store_explicit(w, armed, memory_order_relaxed);             /* C1 */
        atomic_thread_fence(memory_order_seq_cst);                         /* C2 */
        a = what == TRQ_WAIT_DATA ? trq_available(q) : trq_free(q);        /* C3 */
        if (a < 0 || (uint64_t)a >= need ||
            atomic_load_explicit(q->peer_closed, memory_order_acquire) ||
            atomic_load_explicit(interrupt, memory_order_relaxed))
            break;
        uint64_t now = trq_now_ns();
        if (now >= deadline)
            break;
        uint64_t ns = deadline - now;
        if (ns > TRQ_SLICE_NS)
            ns = TRQ_SLICE_NS;
        trq_sleeps++;
        trq_futex_wait(w, armed, ns);                                      /* C4 */
        /* woken, EAGAIN (word already cleared), EINTR or slice over: re-check */
    }
    /* Leaving: clear the word so a busy consumer does not make every publish a syscall. */
    atomic_store_explicit(w, 0, memory_order_relaxed);
    return a;
#undef TRQ_CHECK
}

int64_t trq_wait(trq_t *q, int what, uint64_t need, uint64_t timeout_ns, uint64_t spin_ns, atomic_int *interrupt)
{
    return trq_wait_armed(q, what, need, timeout_ns, spin_ns, interrupt, 1);
}

/*
 * The first half of a sleep, for a waiter that sleeps elsewhere (an event
 * loop polling a pipe): C1..C3 of trq_wait, leaving the word set. The caller
 * re-checks the returned count and only then sleeps; the waker (P2..P4)
 * clears the word and, besides its FUTEX_WAKE, rings whatever the waiter
 * sleeps on (transfer/_ring.py writes the daemon's doorbell pipe). The same
 * Dekker argument as in trq_wait applies: either this re-check sees the
 * waker's index, or the waker sees the word set.
 */
int64_t trq_arm(trq_t *q, int what)
{
    _Atomic uint32_t *w = what == TRQ_WAIT_DATA ? q->data_waiter : q->space_waiter;
    atomic_store_explicit(w, 1, memory_order_relaxed);                     /* C1 */
    atomic_thread_fence(memory_order_seq_cst);                             /* C2 */
    return what == TRQ_WAIT_DATA ? trq_available(q) : trq_free(q);         /* C3 */
}

/* Awake again (found work after arming): stop making the peer's publishes syscalls. */
void trq_disarm(trq_t *q, int what)
{
    atomic_store_explicit(what == TRQ_WAIT_DATA ? q->data_waiter : q->space_waiter, 0,
                          memory_order_relaxed);
}

