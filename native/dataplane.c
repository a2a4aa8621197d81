/*
 * dataplane.c: the native data plane (dataplane.h says what it does and how the ring
 * passes between a worker and the Python pass).
 */
#include "dataplane.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static struct {
    pthread_mutex_t mu;
    pthread_cond_t work, left;  /* helpers wait on work; a worker on left, for its job's helpers */
    tdp_job_t *job;             /* offered, or NULL */
    _Atomic int idle;           /* helpers waiting for work (changed under mu; looked at without it) */
    _Atomic int want;           /* helpers that may share a copy (tdp_copy_helpers; none until asked) */
    int started;                /* threads running (they never exit) */
} tdp_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0, 0, 0};


/* checksum64's word sum (transfer/_checksum.py): little-endian u64 words, the tail zero-padded.
 * Unaligned loads through a may_alias type (segments' offsets are arbitrary), four sums so the
 * adds pipeline and vectorise. */
typedef uint64_t tdp_u64u __attribute__((aligned(1), may_alias));

uint64_t tdp_sum64(const uint8_t *p, uint64_t n)
{
    const tdp_u64u *q = (const tdp_u64u *)p;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, w = n / 8, i = 0;
    for (; i + 4 <= w; i += 4) {
        s0 += q[i];
        s1 += q[i + 1];
        s2 += q[i + 2];
        s3 += q[i + 3];
    }
    for (; i < w; i++)
        s0 += q[i];
    if (n % 8) {
        uint64_t v = 0;
        memcpy(&v, p + 8 * w, n % 8);
        s0 += v;
    }
    return s0 + s1 + s2 + s3;
}

#if defined(__SSE2__)
/* One 64-byte block of the source, as four unaligned 16-byte loads (the copy loops' unit). */
typedef struct {
    __m128i v[4];
} tdp_block_t;

static inline tdp_block_t tdp_load_block(const uint8_t *s)
{
    tdp_block_t b;
    for (int k = 0; k < 4; k++)
        b.v[k] = _mm_loadu_si128((const __m128i *)(s + 16 * k));
    return b;
}
#endif

/* The worker's copy of two ranges that do not overlap, answering the checksum64 word sum of the
 * bytes it copies in the same pass: each 16-byte load is stored and added, so a verified copy
 * runs at the speed of a plain one (standalone: 28-31 GB/s against 19-21 for copying 16 KiB
 * steps, then summing them from L1), and a plain copy ignores the sum (the adds are free beside
 * the memory traffic; the compiler drops them). The words are the range's own: every block
 * starts a multiple of 64 bytes in.
 *
 * `stream` (a copy of TDP_STREAM_MIN or more) stores past the cache: non-temporal stores, then
 * a store fence before its completion is published. Such a copy would only evict the working
 * set, and skipping each destination line's read-for-ownership makes it faster (standalone on
 * the same VM: 14.2 against 9.5 GB/s at 64 MiB, 22.3 against 18.0 at 4 MiB; slower below 2 MiB;
 * summed in the same pass, 8.6 GB/s at 64 MiB where streaming 16 KiB steps and summing them
 * from L1 gave 7.3, and glibc's memcpy 9.5). Streaming stores need 16-byte alignment, so the
 * first (16 - d % 16) % 16 bytes are copied apart, and the blocks start there: the sum is the
 * range's own only when that prologue is whole words, when d is 8-byte aligned (tdp_bytes asks
 * for a streamed sum only then). The flag is one loop's: -O3 unswitches it (measured: no cost).
 *
 * Plain vector moves, not a memcpy call: glibc copies 2 KiB-512 KiB with `rep movsb`, which on
 * AMD Zen runs at a third of its speed or less when source and destination share their offset
 * within a page and the lines were touched recently -- and page-aligned segments and slots
 * always share it (measured in a daemon on an EPYC VM: 24 us against 8.3 per 64 KiB copy, and
 * 450 against 53 per verified 1 MiB copy; docs/ring.md "Copies"). */
#define TDP_STREAM_MIN (4ull << 20)

static inline uint64_t tdp_copy_sum(uint8_t *restrict d, const uint8_t *restrict s, uint64_t n, int stream)
{
    uint64_t o = 0, t = 0;
#if defined(__SSE2__)
    if (stream) {
        o = (16 - ((uintptr_t)d & 15)) & 15;
        if (o > n)
            o = n;
        memcpy(d, s, o);
        t = tdp_sum64(s, o);
    }
    __m128i a[4] = {_mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128()};
    for (; o + 64 <= n; o += 64) {
        tdp_block_t b = tdp_load_block(s + o);
        for (int k = 0; k < 4; k++) {
            if (stream)
                _mm_stream_si128((__m128i *)(d + o + 16 * k), b.v[k]);
            else
                _mm_storeu_si128((__m128i *)(d + o + 16 * k), b.v[k]);
            a[k] = _mm_add_epi64(a[k], b.v[k]);
        }
    }
    uint64_t lanes[2];
    _mm_storeu_si128((__m128i *)lanes, _mm_add_epi64(_mm_add_epi64(a[0], a[1]), _mm_add_epi64(a[2], a[3])));
    t += lanes[0] + lanes[1];
#else
    (void)stream;
#endif
    for (; o + 64 <= n; o += 64) {
        memcpy(d + o, s + o, 64);
        t += tdp_sum64(d + o, 64);
    }
    if (o < n) {
        memcpy(d + o, s + o, n - o);
        t += tdp_sum64(d + o, n - o);
    }
#if defined(__SSE2__)
    if (stream)
        _mm_sfence();
#endif
    return t;
}


static inline void tdp_private_wait(_Atomic uint32_t *w, uint32_t expect, uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT_PRIVATE, expect, &ts, NULL, 0);
}

void tdp_private_wake(_Atomic uint32_t *w)
{
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* Tell the Python loop to look at this worker (one byte on the FIFO; a full FIFO already rings). */
static inline void tdp_signal(tdp_worker_t *w)
{
    atomic_store_explicit(&w->signalled, 1, memory_order_seq_cst);
    if (w->bell_fd >= 0) {
        ssize_t r = write(w->bell_fd, "", 1);
        (void)r;
    }
}

/* Consume `n` peeked descriptors (their slots are the client's again). */
static inline void tdp_consume(tdp_worker_t *w, uint64_t n)
{
    if (n) {
        w->rq->mine += n;
        atomic_store_explicit(w->rq->head, w->rq->mine, memory_order_release);
        trq_ring_doorbell(w->rq->space_waiter);
    }
}

/* Push `nc` completions, account their latency (from `t0`, by `kinds`, zeroed), then publish
 * `done`. 0, or TRQ_CORRUPT. */
static inline int tdp_push(tdp_worker_t *w, const tdp_comp_t *comps, uint64_t nc, uint64_t done, uint64_t t0,
                           uint64_t *kinds)
{
    if (nc) {
        int64_t pushed = trq_push_from(w->cq, comps, nc, 0);
        if (pushed != (int64_t)nc)
            return TRQ_CORRUPT;  /* the slots were free when counted: only a hostile client gets here */
        uint32_t slept = trq_ring_doorbell(w->cq->data_waiter);
        if (slept)
            atomic_fetch_add_explicit(&w->n_rouses, 1, memory_order_relaxed);
        if (slept == 1 && w->cbell_fd >= 0) {
            ssize_t r = write(w->cbell_fd, "", 1);
            (void)r;
        }
    }
    uint64_t dt = trq_now_ns() - t0, b = 0;
    while (b < w->nbounds && w->hbounds_ns[b] < dt)
        b++;
    for (int k = 0; k < TDP_KINDS; k++) {
        if (kinds[k]) {
            atomic_fetch_add_explicit(&w->hist[k][b], kinds[k], memory_order_relaxed);
            atomic_fetch_add_explicit(&w->hsum_ns[k], dt * kinds[k], memory_order_relaxed);
            kinds[k] = 0;
        }
    }
    atomic_store_explicit(&w->done, done, memory_order_seq_cst);
    uint64_t want = atomic_load_explicit(&w->watch, memory_order_seq_cst);
    if (want && done >= want) {
        atomic_store_explicit(&w->watch, 0, memory_order_relaxed);
        tdp_signal(w);
    }
    return 0;
}

/* The parked batch's device work is done: push its completions. 0, or -1 (a hostile client
 * broke the ring: the worker is BROKEN). */
static int tdp_unpark(tdp_worker_t *w)
{
    if (!w->parked)
        return 0;
    tdp_dev_settle_parked(w, w->pcomps);
    w->parked = 0;
    if (tdp_push(w, w->pcomps, w->pnc, w->pdone, w->pt0, w->pkinds) < 0) {
        atomic_store_explicit(&w->mode, TDP_BROKEN, memory_order_release);
        tdp_signal(w);
        return -1;
    }
    return 0;
}

void tdp_dev_wait(tdp_worker_t *w)
{
    tdp_unpark(w);
    tdp_dev_settle(w);
}

/* Consume `n` peeked descriptors and push `nc` completions; then publish `done`. 0, or
 * TRQ_CORRUPT. Completions are only for work that is done: a batch with device work queued
 * (`may_park`: not before a handover) is parked instead, its events recorded, and its
 * completions pushed once they have passed, after the next batch's work is queued behind it
 * (or as soon as there is no next batch): the copy engine never waits for the worker. */
static inline int tdp_commit(tdp_worker_t *w, uint64_t n, uint64_t nc, int may_park)
{
    w->dsince = 0;
    if (may_park && nc && tdp_dev_record(w) == 0) {
        if (tdp_unpark(w) < 0)
            return TRQ_CORRUPT;
        tdp_consume(w, n);
        memcpy(w->pcomps, w->comps, nc * sizeof *w->comps);
        memcpy(w->pkinds, w->kinds, sizeof w->kinds);
        memset(w->kinds, 0, sizeof w->kinds);
        w->pnc = nc;
        w->pdone = w->rq->mine;
        w->pt0 = w->t0;
        w->parked = 1;
        atomic_fetch_add_explicit(&w->n_dparks, 1, memory_order_relaxed);
        tdp_dev_swap(w);
        return 0;
    }
    tdp_dev_wait(w); /* (the parked batch first: completions go out in ring order) */
    if (atomic_load_explicit(&w->mode, memory_order_acquire) == TDP_BROKEN)
        return TRQ_CORRUPT;
    tdp_consume(w, n);
    return tdp_push(w, w->comps, nc, w->rq->mine, w->t0, w->kinds);
}

/* A write to [d, d + n) drops the sums of the ranges it overlaps. */
static inline void tdp_memo_drop(tdp_worker_t *w, const uint8_t *d, uint64_t n)
{
    for (uint32_t k = 0; k < w->nmemo;) {
        if (d < w->memo[k].p + w->memo[k].n && w->memo[k].p < d + n)
            w->memo[k] = w->memo[--w->nmemo];
        else
            k++;
    }
}

/* Which ranges of a copy [dva | sva, + n) a CHECKSUM later in this batch names exactly:
 * TDP_WANT_SRC and/or TDP_WANT_DST (0: none, the copy is not summed). */
enum { TDP_WANT_SRC = 1, TDP_WANT_DST = 2, TDP_WANT_SUM = 4 /* a verified piece: summed, kept by none */ };

static inline int tdp_wanted(const tdp_worker_t *w, uint64_t dva, uint64_t sva, uint64_t n)
{
    int r = 0;
    for (uint32_t k = 0; k < w->nwant && n; k++) {
        if (w->want[k].n == n)
            r |= (w->want[k].va == sva ? TDP_WANT_SRC : 0) | (w->want[k].va == dva ? TDP_WANT_DST : 0);
    }
    return r;
}

static inline void tdp_memo_add(tdp_worker_t *w, const uint8_t *p, uint64_t n, uint64_t sum)
{
    if (w->nmemo < TDP_MEMO) {
        w->memo[w->nmemo].p = p;
        w->memo[w->nmemo].n = n;
        w->memo[w->nmemo].sum = sum;
        w->nmemo++;
    }
}


/* Take chunks of `job` until none are left, one fails, or the worker stops. */
static inline void tdp_job_chunks(tdp_job_t *job)
{
    uint64_t sum = 0;
    for (;;) {
        uint64_t k = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);
        if (k >= job->chunks || atomic_load_explicit(job->stop, memory_order_relaxed))
            break;
        uint64_t off = k * TDP_CHUNK, len = job->n - off < TDP_CHUNK ? job->n - off : TDP_CHUNK;
        int32_t ddev = -1, sdev = -1;
        int why = 0;
        pthread_rwlock_rdlock(&job->table->lock);
        uint8_t *d = tdp_translate(job->table, job->session, job->dva + off, len, &ddev);
        uint8_t *s = tdp_translate(job->table, job->session, job->sva + off, len, &sdev);
        if (!d || !s)
            why = TDP_WHY_ADDRESS; /* freed since the offer */
        else if (ddev >= 0 && sdev >= 0 && ddev != sdev)
            why = TDP_WHY_DEVICES;
        else if (job->summed)
            sum += tdp_copy_sum(d, s, len, job->stream && !((uintptr_t)d & 7));
        else
            (void)tdp_copy_sum(d, s, len, job->stream);
        pthread_rwlock_unlock(&job->table->lock);
        if (why) {
            int none = 0;
            atomic_compare_exchange_strong(&job->why, &none, why);
            atomic_store_explicit(&job->next, job->chunks, memory_order_relaxed);
            break;
        }
    }
    atomic_fetch_add_explicit(&job->sum, sum, memory_order_relaxed);
}

static void *tdp_helper_run(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&tdp_pool.mu);
    for (;;) {
        while (!tdp_pool.job || tdp_pool.job->active >= tdp_pool.want) {
            tdp_pool.idle++;
            pthread_cond_wait(&tdp_pool.work, &tdp_pool.mu);
            tdp_pool.idle--;
        }
        tdp_job_t *job = tdp_pool.job;
        job->active++;
        job->joined++;
        pthread_mutex_unlock(&tdp_pool.mu);
        tdp_job_chunks(job);
        pthread_mutex_lock(&tdp_pool.mu);
        if (tdp_pool.job == job)
            tdp_pool.job = NULL; /* every chunk is taken: nobody else joins */
        if (--job->active == 0)
            pthread_cond_broadcast(&tdp_pool.left);
    }
    return NULL;
}

/* A forked child has none of the parent's helper threads (and maybe a mutex held by one). */
static void tdp_pool_after_fork(void)
{
    pthread_mutex_init(&tdp_pool.mu, NULL);
    pthread_cond_init(&tdp_pool.work, NULL);
    pthread_cond_init(&tdp_pool.left, NULL);
    tdp_pool.job = NULL;
    tdp_pool.idle = tdp_pool.started = 0;
}

/* How many copy helpers may share a copy (0..TDP_HELPERS_MAX; the daemon decides how many,
 * server/_dataplane.py); those not running yet start now. Fewer than are running stops none:
 * the rest stay asleep. Returns how many may share a copy now. */
int tdp_copy_helpers(int want)
{
    static int forks_hooked;
    pthread_mutex_lock(&tdp_pool.mu);
    if (!forks_hooked && pthread_atfork(NULL, NULL, tdp_pool_after_fork) == 0)
        forks_hooked = 1;
    tdp_pool.want = want < 0 ? 0 : want < TDP_HELPERS_MAX ? want : TDP_HELPERS_MAX;
    while (tdp_pool.started < tdp_pool.want) {
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &at, tdp_helper_run, NULL);
        pthread_attr_destroy(&at);
        if (rc)
            break; /* fewer helpers: copies run alone more often, nothing else changes */
        tdp_pool.started++;
    }
    int n = tdp_pool.started < tdp_pool.want ? tdp_pool.started : tdp_pool.want;
    pthread_mutex_unlock(&tdp_pool.mu);
    return n;
}

/* A forward copy of n >= TDP_SHARE_MIN bytes with the helpers idle now: 0 (done; a summed
 * copy's sum in *sum, its memory in *d0, *s0), a TDP_WHY_* (a chunk failed: a partial copy, as
 * tdp_bytes leaves one), -1 (stopping), or TDP_UNSHARED (none idle, or memory that is not
 * plainly copied in parallel: the caller copies it alone). */
static inline int tdp_copy_shared(tdp_worker_t *w, uint64_t dva, uint64_t sva, uint64_t n, int stream, int summed,
                                  uint64_t *sum, const uint8_t **d0, const uint8_t **s0)
{
    if (!tdp_pool.idle || !tdp_pool.want) /* (a racy look, to skip the lock when every helper is busy or none runs) */
        return TDP_UNSHARED;
    int32_t ddev = -1, sdev = -1;
    pthread_rwlock_rdlock(&w->table->lock);
    uint8_t *d = tdp_translate(w->table, w->session, dva, n, &ddev);
    uint8_t *s = tdp_translate(w->table, w->session, sva, n, &sdev);
    int plain = d && s && (ddev < 0 || sdev < 0 || ddev == sdev) && (d >= s + n || s >= d + n);
    pthread_rwlock_unlock(&w->table->lock);
    if (!plain)
        return TDP_UNSHARED;
    tdp_job_t job = {.table = w->table, .session = w->session, .dva = dva, .sva = sva, .n = n,
                     .chunks = (n + TDP_CHUNK - 1) / TDP_CHUNK, .stream = stream, .summed = summed, .stop = &w->stop};
    pthread_mutex_lock(&tdp_pool.mu);
    if (tdp_pool.job || !tdp_pool.idle) {
        pthread_mutex_unlock(&tdp_pool.mu);
        return TDP_UNSHARED;
    }
    tdp_pool.job = &job;
    pthread_cond_broadcast(&tdp_pool.work);
    pthread_mutex_unlock(&tdp_pool.mu);
    tdp_job_chunks(&job);
    pthread_mutex_lock(&tdp_pool.mu);
    if (tdp_pool.job == &job)
        tdp_pool.job = NULL;
    while (job.active) /* (job lives on this stack: no helper may still hold it) */
        pthread_cond_wait(&tdp_pool.left, &tdp_pool.mu);
    pthread_mutex_unlock(&tdp_pool.mu);
    if (job.joined)
        atomic_fetch_add_explicit(&w->n_shared, 1, memory_order_relaxed);
    if (atomic_load_explicit(&w->stop, memory_order_relaxed))
        return -1;
    int why = atomic_load_explicit(&job.why, memory_order_relaxed);
    if (why)
        return why;
    *sum = atomic_load_explicit(&job.sum, memory_order_relaxed);
    *d0 = d;
    *s0 = s;
    return 0;
}

/* Bytes of one copy/fill/checksum, chunk by chunk, each chunk translated under the read lock.
 * Returns 0, or the reason (TDP_WHY_*) the worker must hand this request to Python, or -1
 * when stopping. A failure after the first chunk leaves a partial copy: only a free that
 * races the request can cause it, and Python's retry then reports the freed segment.
 * A COPY with `want` (tdp_wanted) sums what it copies as it loads it, and keeps the sum for
 * the later CHECKSUM of its source or destination; unless the two overlap (then memmove, in
 * memmove's direction across chunks too, and no sum kept). A verified piece (TDP_WANT_SUM)
 * answers in *sum the sum of what it copied: as it loads it, or, overlapping, from each
 * destination chunk once written (no other chunk writes it). */
static inline int tdp_bytes(tdp_worker_t *w, int op, uint64_t dva, uint64_t sva, uint64_t n,
                            uint8_t value, uint64_t *sum, int want)
{
    /* A copy whose ranges overlap (one segment: VAs are segment << 40 | offset) is never
     * summed as it goes, and one onto a higher address goes chunk by chunk from the end, so
     * that no chunk reads bytes an earlier chunk already overwrote (memmove's rule). */
    int dev = tdp_dev_op(w, op, dva, sva, n, value, want & TDP_WANT_SUM);
    if (dev != TDP_NOT_DEVICE)
        return dev;
    if (w->parked || w->fl[w->cf].dused || w->fl[w->cf].ndevc)
        tdp_dev_wait(w); /* host work after queued device work: in ring order */
    int overlap = op == TDP_COPY && dva < sva + n && sva < dva + n;
    int back = overlap && dva > sva && n > TDP_CHUNK;
    uint64_t off = back ? (n - 1) / TDP_CHUNK * TDP_CHUNK : 0, fsum = 0;
    int stream = n >= TDP_STREAM_MIN;
    const uint8_t *d0 = NULL, *s0 = NULL;
    int fuse = op == TDP_COPY && want != 0 && !overlap;
    if (op == TDP_COPY && !overlap && n >= TDP_SHARE_MIN) {
        int r = tdp_copy_shared(w, dva, sva, n, stream, fuse, &fsum, &d0, &s0);
        if (r != TDP_UNSHARED) {
            if (r) {
                w->nmemo = 0; /* (which chunks were written is not known here: forget every sum) */
                return r;
            }
            if (w->nmemo)
                tdp_memo_drop(w, d0, n);
            goto copied;
        }
    }
    for (;;) {
        if (atomic_load_explicit(&w->stop, memory_order_relaxed))
            return -1;
        uint64_t len = n - off < TDP_CHUNK ? n - off : TDP_CHUNK;
        int32_t ddev = -1, sdev = -1;
        int why = 0;
        pthread_rwlock_rdlock(&w->table->lock);
        uint8_t *d = op == TDP_CHECKSUM ? NULL : tdp_translate(w->table, w->session, dva + off, len, &ddev);
        uint8_t *s = op == TDP_FILL ? NULL : tdp_translate(w->table, w->session, sva + off, len, &sdev);
        if ((op != TDP_CHECKSUM && !d) || (op != TDP_FILL && !s))
            why = TDP_WHY_ADDRESS;
        else if (op == TDP_COPY && ddev >= 0 && sdev >= 0 && ddev != sdev)
            why = TDP_WHY_DEVICES;
        else if (op == TDP_COPY) {
            if (off == 0) {
                d0 = d;
                s0 = s;
            }
            if (fuse && d < s + len && s < d + len)
                fuse = 0; /* (defensive: VAs that do not overlap name memory that does not) */
            if (fuse) /* streamed only where its sum is the range's own (tdp_copy_sum) */
                fsum += tdp_copy_sum(d, s, len, stream && !((uintptr_t)d & 7));
            else if (d < s + len && s < d + len)
                memmove(d, s, len);
            else
                (void)tdp_copy_sum(d, s, len, stream);
            if (!fuse && (want & TDP_WANT_SUM))
                fsum += tdp_sum64(d, len);
        } else if (op == TDP_FILL)
            memset(d, value, len);
        else
            *sum += tdp_sum64(s, len);
        if (d && w->nmemo)
            tdp_memo_drop(w, d, len);
        pthread_rwlock_unlock(&w->table->lock);
        if (why)
            return why;
        if (back) {
            if (!off)
                break;
            off -= TDP_CHUNK;
        } else if ((off += len) >= n)
            break;
    }
copied:
    if (op == TDP_COPY && (want & TDP_WANT_SUM))
        *sum = fsum;
    if (fuse) {
        if (want & TDP_WANT_SRC)
            tdp_memo_add(w, s0, n, fsum);
        if (want & TDP_WANT_DST)
            tdp_memo_add(w, d0, n, fsum);
    }
    return 0;
}

/* A CHECKSUM answered from the sum of a copy that read or wrote exactly its range earlier in
 * this batch, with no write to that range since: 1 (the sum in *sum), else 0. The range is still
 * translated (under the read lock), so a segment freed meanwhile is refused as before. */
static inline int tdp_memo_hit(tdp_worker_t *w, uint64_t sva, uint64_t n, uint64_t *sum)
{
    if (!w->nmemo || n == 0)
        return 0;
    int32_t dev = -1;
    pthread_rwlock_rdlock(&w->table->lock);
    const uint8_t *s = tdp_translate(w->table, w->session, sva, n, &dev);
    pthread_rwlock_unlock(&w->table->lock);
    if (!s)
        return 0;
    for (uint32_t k = 0; k < w->nmemo; k++) {
        if (w->memo[k].p == s && w->memo[k].n == n) {
            *sum = w->memo[k].sum;
            return 1;
        }
    }
    return 0;
}

/* A chain batch[i..] (COPY pieces, FLAG_CHAIN on all but the last): its length in *len.
 * 0: whole and valid (every piece translated, so it runs all or nothing); >0: a reason to
 * hand it over; -2: its end is not in the batch yet (re-peeked from its start later). */
static inline int tdp_chain(tdp_worker_t *w, uint64_t i, uint64_t n, uint64_t *len)
{
    const tdp_desc_t *a = &w->batch[i];
    uint64_t j = i;
    uint32_t sum = a->flags & TDP_FLAG_SUM;
    while (j < n && (w->batch[j].flags & TDP_FLAG_CHAIN))
        j++;
    if (j == n) /* its end is not in: wait for it, unless it could never fit one batch */
        return i == 0 && (n >= TDP_MAX_CHAIN || n >= w->batch_cap) ? TDP_WHY_CHAIN : -2;
    *len = j - i + 1;
    if (*len > TDP_MAX_CHAIN || (sum && *len > w->cq->cap)) /* (a verified chain: a completion per piece) */
        return TDP_WHY_CHAIN;
    if (a->id == 0)
        return TDP_WHY_FIELDS;
    int32_t home = -1;
    int why = 0;
    pthread_rwlock_rdlock(&w->table->lock);
    for (uint64_t k = i; k <= j && !why; k++) {
        const tdp_desc_t *d = &w->batch[k];
        if (d->op != TDP_COPY || d->id != a->id || d->stream != a->stream ||
            (d->flags & ~TDP_FLAG_CHAIN) != sum) {
            why = TDP_WHY_CHAIN;
            break;
        }
        uint64_t doff, soff;
        const tdp_seg_t *de = tdp_lookup(w->table, w->session, d->dst, d->nbytes, &doff);
        const tdp_seg_t *se = tdp_lookup(w->table, w->session, d->src, d->nbytes, &soff);
        if (!de || !se) {
            why = TDP_WHY_ADDRESS;
            break;
        }
        /* (what tdp_dev_op leaves to Python: decided here, before any piece runs) */
        if ((sum || (de == se && doff < soff + d->nbytes && soff < doff + d->nbytes)) && (de->cuda || se->cuda)) {
            why = TDP_WHY_DEVICE;
            break;
        }
        int32_t dd = de->device, sd = se->device;
        for (int z = 0; z < 2; z++) {
            int32_t dev = z ? sd : dd;
            if (dev >= 0) {
                if (home >= 0 && dev != home)
                    why = TDP_WHY_DEVICES;
                home = dev;
            }
        }
    }
    pthread_rwlock_unlock(&w->table->lock);
    return why;
}

/*
 * Serve what the ring holds: peek up to batch_cap descriptors, execute them in order,
 * commit. Returns how many more descriptors it needs before it can go on (0: none;
 * >0: a chain's end is not in yet), or -1 when it handed the ring to Python, broke, or stops.
 */
static inline int64_t tdp_serve(tdp_worker_t *w, uint64_t avail)
{
    uint64_t n = avail < w->batch_cap ? avail : w->batch_cap;
    trq_t *rq = w->rq;
    trq_copy(rq, w->batch, n, 0); /* copied out before read: the client may rewrite the slots under us (hostile) */
    int64_t cfree = trq_free(w->cq);
    if (cfree < 0)
        goto corrupt;
    cfree -= (int64_t)w->pnc * w->parked; /* (the parked batch's completions have their slots) */
    if (cfree <= 0)
        return 0;
    atomic_fetch_add_explicit(&w->n_batches, 1, memory_order_relaxed);
    w->t0 = trq_now_ns();
    w->nwant = w->nmemo = 0;
    for (uint64_t k = 0; k < n && w->nwant < TDP_MEMO; k++) {
        if (w->batch[k].op == TDP_CHECKSUM && w->batch[k].nbytes) {
            w->want[w->nwant].va = w->batch[k].src;
            w->want[w->nwant].n = w->batch[k].nbytes;
            w->nwant++;
        }
    }
    uint64_t i = 0, nc = 0, since = 0, need = 0;
    uint64_t consumed = 0; /* descriptors committed so far */
    int why = 0, flush = 0;
    while (i < n) {
        const tdp_desc_t *d = &w->batch[i];
        uint64_t len = 1;
        if ((uint64_t)nc >= (uint64_t)cfree)
            break; /* no completion slot: the client has not reaped yet */
        tdp_comp_t *c = &w->comps[nc];
        *c = (tdp_comp_t){d->id, 0, 0, 0, 0};
        w->cur = (uint32_t)nc;
        if (d->flags & TDP_FLAG_AFTER) {
            why = TDP_WHY_AFTER;
            break;
        } else if (d->flags & (TDP_FLAG_CHAIN | TDP_FLAG_SUM)) {
            int r = tdp_chain(w, i, n, &len);
            if (r == -2) {
                need = n - i + 1;
                break;
            }
            if (r) {
                why = r;
                break;
            }
            uint64_t moved = 0;
            if (d->flags & TDP_FLAG_SUM) { /* verified: piece by piece, each answered with its sum */
                if (nc + len > (uint64_t)cfree) {
                    w->cneed = len; /* its completions do not all fit yet: the client reaps first */
                    break;
                }
                for (uint64_t k = 0; k < len && !why; k++) {
                    const tdp_desc_t *p = &w->batch[i + k];
                    uint64_t sum = 0;
                    why = tdp_bytes(w, TDP_COPY, p->dst, p->src, p->nbytes, 0, &sum,
                                    tdp_wanted(w, p->dst, p->src, p->nbytes) | TDP_WANT_SUM);
                    w->comps[nc + k] = (tdp_comp_t){p->id, 0, 0, sum + p->nbytes * TDP_GOLDEN, 0};
                    moved += p->nbytes;
                }
                if (why)
                    break;
                nc += len - 1; /* (the loop's own nc++ counts the last) */
            } else {
                for (uint64_t k = 0; k < len && !why;) {
                    /* A run of pieces contiguous in both dst and src is one memmove, unless the
                     * run's ranges overlap (then piece by piece, as sequential copies would be). */
                    const tdp_desc_t *p = &w->batch[i + k];
                    uint64_t d0 = p->dst, s0 = p->src, n = p->nbytes, m = k + 1;
                    int want = tdp_wanted(w, d0, s0, n);
                    if (want) { /* a piece checksummed later in the batch: alone, and summed */
                        why = tdp_bytes(w, TDP_COPY, d0, s0, n, 0, NULL, want);
                        k = m;
                        moved += n;
                        continue;
                    }
                    while (m < len && w->batch[i + m].dst == d0 + n && w->batch[i + m].src == s0 + n &&
                           w->batch[i + m].nbytes <= TDP_OFFSET_MASK - n &&
                           !tdp_wanted(w, w->batch[i + m].dst, w->batch[i + m].src, w->batch[i + m].nbytes)) {
                        n += w->batch[i + m].nbytes;
                        m++;
                    }
                    if (m - k > 1 && d0 < s0 + n && s0 < d0 + n) {
                        for (; k < m && !why; k++) {
                            p = &w->batch[i + k];
                            why = tdp_bytes(w, TDP_COPY, p->dst, p->src, p->nbytes, 0, NULL, 0);
                        }
                    } else {
                        why = tdp_bytes(w, TDP_COPY, d0, s0, n, 0, NULL, 0);
                        k = m;
                    }
                    moved += n;
                }
            }
            if (why)
                break;
            atomic_fetch_add_explicit(&w->n_copy, 1, memory_order_relaxed);
            atomic_fetch_add_explicit(&w->n_bytes, moved, memory_order_relaxed);
            w->kinds[TDP_K_COPYV]++;
            since += moved;
        } else if (d->flags || d->id == 0) {
            why = TDP_WHY_FIELDS;
            break;
        } else if (d->op == TDP_FENCE || d->op == TDP_NOP) {
            atomic_fetch_add_explicit(&w->n_fence, 1, memory_order_relaxed);
        } else if (d->op == TDP_COPY || d->op == TDP_FILL || d->op == TDP_CHECKSUM) {
            if (d->op == TDP_FILL && d->arg0 > 255) {
                why = TDP_WHY_FIELDS;
                break;
            }
            uint64_t sum = 0;
            if (d->op == TDP_CHECKSUM && tdp_memo_hit(w, d->src, d->nbytes, &sum))
                atomic_fetch_add_explicit(&w->n_fused, 1, memory_order_relaxed);
            else
                why = tdp_bytes(w, d->op, d->dst, d->src, d->nbytes, (uint8_t)d->arg0, &sum,
                                d->op == TDP_COPY ? tdp_wanted(w, d->dst, d->src, d->nbytes) : 0);
            if (why)
                break;
            if (d->op == TDP_CHECKSUM)
                c->result = sum + d->nbytes * TDP_GOLDEN;
            atomic_fetch_add_explicit(d->op == TDP_COPY ? &w->n_copy : d->op == TDP_FILL ? &w->n_fill : &w->n_checksum,
                                      1, memory_order_relaxed);
            w->kinds[d->op == TDP_COPY ? TDP_K_COPY : d->op == TDP_FILL ? TDP_K_FILL : TDP_K_CHECKSUM]++;
            atomic_fetch_add_explicit(&w->n_bytes, d->nbytes, memory_order_relaxed);
            since += d->nbytes;
        } else if (d->op == TDP_RUN_GRAPH && w->run) {
            /* (host work in it waits for the device work before it: the runner asks, tdp_run_host_wait) */
            w->ran = 1;
            int served = !(d->nbytes || d->arg1 || d->arg2) && w->run(w->run_ctx, d, c); /* (Python refuses the former) */
            tdp_dev_run_done(w, served);
            if (!served) {
                why = TDP_WHY_OPCODE;
                break;
            }
            atomic_fetch_add_explicit(&w->n_runs, 1, memory_order_relaxed);
            flush = 1; /* (a run is long work: its producer may be waiting for it to reuse the slot) */
        } else {
            why = TDP_WHY_OPCODE;
            break;
        }
        i += len;
        nc++;
        if (flush || since >= TDP_FLUSH_BYTES + w->dsince || w->dsince >= TDP_DEV_FLUSH_BYTES) {
            /* long work: answer what is done before going on (device bytes count apart: each
             * early answer waits for the copy engine to drain) */
            if (tdp_commit(w, i - consumed, nc, 1) < 0)
                goto corrupt;
            cfree -= nc;
            consumed = i;
            nc = 0;
            since = 0;
            flush = 0;
        }
    }
    if (why < 0) {
        tdp_dev_wait(w); /* (the memory its queued work touches may go once the worker ends) */
        return -1; /* stopping: the session is going, the client fails what is outstanding */
    }
    if (tdp_commit(w, i - consumed, nc, why == 0) < 0)
        goto corrupt;
    if (why) {
        atomic_fetch_add_explicit(&w->handovers[why], 1, memory_order_relaxed);
        atomic_store_explicit(&w->why, why, memory_order_relaxed);
        atomic_store_explicit(&w->mode, TDP_PYTHON, memory_order_release);
        tdp_signal(w);
        return -1;
    }
    return (int64_t)need;
corrupt:
    atomic_store_explicit(&w->mode, TDP_BROKEN, memory_order_release);
    tdp_signal(w);
    return -1;
}

/* Sleep on `ctl` until Python bumps it or a slice passes, whatever the mode (a drain's cut). */
static inline void tdp_rest(tdp_worker_t *w)
{
    uint32_t c = atomic_load_explicit(&w->ctl, memory_order_acquire);
    if (!atomic_load_explicit(&w->stop, memory_order_acquire))
        tdp_private_wait(&w->ctl, c, TRQ_SLICE_NS);
}

/* Sleep on `ctl` until Python bumps it (resume, stop) or a slice passes. */
static inline void tdp_park(tdp_worker_t *w)
{
    uint32_t c = atomic_load_explicit(&w->ctl, memory_order_acquire);
    if (atomic_load_explicit(&w->mode, memory_order_acquire) == TDP_NATIVE &&
        !atomic_load_explicit(w->rq->peer_closed, memory_order_acquire))
        return;
    if (!atomic_load_explicit(&w->stop, memory_order_acquire))
        tdp_private_wait(&w->ctl, c, TRQ_SLICE_NS);
}

static void *tdp_run(void *arg)
{
    tdp_worker_t *w = arg;
    uint64_t need = 1;
    while (!atomic_load_explicit(&w->stop, memory_order_acquire)) {
        if (atomic_load_explicit(&w->mode, memory_order_acquire) != TDP_NATIVE) {
            tdp_park(w);
            need = 1;
            continue;
        }
        if (w->parked) {
            /* A batch's device work is in flight: serve what is already there behind it, or,
             * with nothing to serve at once, wait for it and answer it. */
            int64_t av = trq_available(w->rq), fr = trq_free(w->cq) - (int64_t)w->pnc;
            if (av < (int64_t)need || fr < (int64_t)(w->cneed ? w->cneed : 1) ||
                w->rq->mine >= atomic_load_explicit(&w->limit, memory_order_acquire)) {
                tdp_unpark(w);
                continue;
            }
        }
        /* A completion slot first (serving needs one; a verified chain, one per piece), then
         * descriptors. */
        uint64_t spin = atomic_load_explicit(&w->spin_ns, memory_order_relaxed);
        uint64_t cneed = w->cneed ? w->cneed : 1;
        w->cneed = 0;
        int64_t f = trq_free(w->cq);
        uint64_t slept = trq_sleeps;
        if (f >= 0 && (uint64_t)f < cneed)
            f = trq_wait(w->cq, TRQ_WAIT_SPACE, cneed, TRQ_SLICE_NS, spin, &w->interrupt);
        int64_t a = f > 0 ? trq_wait_armed(w->rq, TRQ_WAIT_DATA, need, TRQ_SLICE_NS, spin,
                                           &w->interrupt, TDP_ARMED)
                          : 0;
        if (trq_sleeps != slept)
            atomic_fetch_add_explicit(&w->n_sleeps, trq_sleeps - slept, memory_order_relaxed);
        if (f < 0 || a < 0) {
            atomic_store_explicit(&w->mode, TDP_BROKEN, memory_order_release);
            tdp_signal(w);
            continue;
        }
        uint64_t lim = atomic_load_explicit(&w->limit, memory_order_acquire), mine = w->rq->mine;
        if (mine >= lim) { /* the drain's cut: what came after it is answered by the session's end */
            tdp_rest(w);
            continue;
        }
        if (a > 0 && (uint64_t)a > lim - mine)
            a = (int64_t)(lim - mine); /* (the cut is a published tail: never inside a request) */
        if (f == 0 || (uint64_t)a < need) {
            /* A timeout slice, a stop, or the client closed its end (then nothing more comes:
             * sleep until the session ends instead of spinning on the closed flag). */
            tdp_park(w);
            continue;
        }
        atomic_fetch_add_explicit(&w->n_wakes, 1, memory_order_relaxed);
        int64_t r = tdp_serve(w, (uint64_t)a);
        need = r > 0 ? (uint64_t)r : 1;
    }
    tdp_dev_wait(w); /* (the parked batch and the current one: their memory may go once the worker ends) */
    tdp_dev_close(w);
    if (w->ran && w->run_end)
        w->run_end(w->run_ctx);
    return NULL;
}

/* Buffers sized for the ring; the thread starts in NATIVE mode. 0, or an errno. */
int tdp_worker_start(tdp_worker_t *w)
{
    w->batch_cap = w->rq->cap < TDP_MAX_CHAIN ? (uint32_t)w->rq->cap : TDP_MAX_CHAIN;
    w->batch = malloc((size_t)w->batch_cap * sizeof *w->batch);
    w->comps = malloc((size_t)w->batch_cap * sizeof *w->comps);
    w->pcomps = malloc((size_t)w->batch_cap * sizeof *w->pcomps);
    for (int k = 0; k < 2; k++)
        w->fl[k].devc = malloc((size_t)w->batch_cap * sizeof *w->fl[k].devc);
    if (!w->batch || !w->comps || !w->pcomps || !w->fl[0].devc || !w->fl[1].devc)
        return ENOMEM;
    atomic_store(&w->done, w->rq->mine);
    atomic_store(&w->limit, UINT64_MAX);
    int rc = pthread_create(&w->thread, NULL, tdp_run, w);
    if (rc == 0)
        w->started = 1;
    return rc;
}

/* Stop and join the thread (call without the GIL). The ring stays mapped: the caller closes it. */
void tdp_worker_stop(tdp_worker_t *w)
{
    if (w->started) {
        atomic_store_explicit(&w->stop, 1, memory_order_seq_cst);
        atomic_store_explicit(&w->interrupt, 1, memory_order_seq_cst);
        atomic_fetch_add_explicit(&w->ctl, 1, memory_order_seq_cst);
        tdp_private_wake(&w->ctl);
        trq_force_wake(w->rq->data_waiter);
        trq_force_wake(w->cq->space_waiter);
        pthread_join(w->thread, NULL);
        w->started = 0;
    }
    free(w->batch);
    free(w->comps);
    free(w->pcomps);
    w->batch = NULL;
    w->comps = NULL;
    w->pcomps = NULL;
    for (int k = 0; k < 2; k++) { /* (tdp_dev_close freed them when the thread ran) */
        free(w->fl[k].held);
        free(w->fl[k].devc);
        w->fl[k].held = NULL;
        w->fl[k].devc = NULL;
    }
}

