/*
 * device.c: a worker's device work (dataplane.h). A COPY or FILL that touches CUDA memory is
 * queued by the session's own worker on a stream of its own per device, through the driver
 * (cuda.h): no GIL, no event loop. The segments it touches are counted busy until it is done,
 * so a free waits for that segment's work only. Before completions are pushed, and before any
 * host work that follows it in the ring, the worker records an event per device used and waits
 * for it: a completion means the work is done, not merely queued. A driver error fails the
 * requests whose work was queued since the last wait (DeviceFault, the CUDA error in `result`),
 * never the daemon; a sticky one fails every later device request the same way.
 */
#include "dataplane.h"

#include <sched.h>
#include <time.h>

/* Status of a completion whose device work failed (transfer.errors.DeviceFault). */
#define TDP_DEVICE_FAULT 601

static void tdp_nap(uint64_t ns)
{
    struct timespec ts = {0, (long)ns};
    nanosleep(&ts, NULL);
}

/* Keep `b` busy until its flight is settled (the caller holds the table's read lock). */
static int tdp_hold(tdp_flight_t *f, tdp_busy_t *b)
{
    if (f->nheld == f->held_cap) {
        uint32_t c = f->held_cap ? 2 * f->held_cap : 64;
        void *p = realloc(f->held, (size_t)c * sizeof *f->held);
        if (!p)
            return -1;
        f->held = p;
        f->held_cap = c;
    }
    atomic_fetch_add_explicit(&b->inflight, 1, memory_order_acq_rel);
    f->held[f->nheld++] = b;
    return 0;
}

/* Page-lock a host segment, unless the cap is reached: its copies are then DMA from the
 * producer's pages. The keeper does it when the segment is registered; a worker whose copy
 * comes first does it itself. Either does it off the table's lock (the segment is held). A
 * segment that is not pinned is copied correctly, through the driver's staging. */
static void tdp_pin(tdp_table_t *t, tdp_busy_t *b)
{
    int none = TDP_PIN_NONE;
    if (atomic_load_explicit(&b->pin, memory_order_acquire) != TDP_PIN_NONE ||
        !atomic_compare_exchange_strong(&b->pin, &none, TDP_PIN_BUSY))
        return;
    uint64_t cap = atomic_load_explicit(&t->pin_cap, memory_order_relaxed);
    uint64_t now = atomic_fetch_add_explicit(&t->pinned_bytes, b->nbytes, memory_order_acq_rel);
    if (cap && now + b->nbytes > cap) {
        atomic_fetch_sub_explicit(&t->pinned_bytes, b->nbytes, memory_order_acq_rel);
        atomic_store_explicit(&b->pin, TDP_PIN_NONE, memory_order_release); /* (a later free may make room) */
        return;
    }
    CUresult r = tdp_cuda_use(0);
    if (r == 0)
        r = tdp_cu.MemHostRegister(b->base, b->nbytes, TDP_CUDA_HOST_REGISTER_PORTABLE);
    if (r != 0)
        atomic_fetch_sub_explicit(&t->pinned_bytes, b->nbytes, memory_order_acq_rel);
    atomic_store_explicit(&b->pin, r == 0 ? TDP_PIN_OURS : r == TDP_CUDA_ALREADY_REGISTERED ? TDP_PIN_OTHERS : TDP_PIN_REFUSED,
                          memory_order_release);
}

/* The worker's stream on `ordinal`, and each flight's event there (created on first use): 0, or
 * a CUresult. */
static CUresult tdp_stream(tdp_worker_t *w, int ordinal)
{
    CUresult r = tdp_cuda_use(ordinal);
    if (r == 0 && !w->fl[0].ev[ordinal]) {
        int least, greatest;
        if (!w->dstream[ordinal] && w->high && tdp_cu.StreamCreateWithPriority && tdp_cu.CtxGetStreamPriorityRange &&
            tdp_cu.CtxGetStreamPriorityRange(&least, &greatest) == 0)
            r = tdp_cu.StreamCreateWithPriority(&w->dstream[ordinal], TDP_CUDA_STREAM_NON_BLOCKING, greatest);
        else if (!w->dstream[ordinal])
            r = tdp_cu.StreamCreate(&w->dstream[ordinal], TDP_CUDA_STREAM_NON_BLOCKING);
        for (int k = 0; k < 2 && r == 0; k++) { /* (timed: the pair measures the flight's device time) */
            r = tdp_cu.EventCreate(&w->fl[k].ev[ordinal], 0);
            r = r ? r : tdp_cu.EventCreate(&w->fl[k].evs[ordinal], 0);
        }
        if (r != 0) {
            for (int k = 0; k < 2; k++) {
                if (w->fl[k].ev[ordinal])
                    tdp_cu.EventDestroy(w->fl[k].ev[ordinal]);
                if (w->fl[k].evs[ordinal])
                    tdp_cu.EventDestroy(w->fl[k].evs[ordinal]);
                w->fl[k].ev[ordinal] = w->fl[k].evs[ordinal] = NULL;
            }
            if (w->dstream[ordinal] && !(w->dext & (1u << ordinal))) {
                tdp_cu.StreamDestroy(w->dstream[ordinal]);
                w->dstream[ordinal] = NULL;
            }
        }
    }
    return r;
}

/* The flight's first work on `ordinal`: its start event goes on the stream first. */
static CUresult tdp_flight_start(tdp_worker_t *w, int ordinal)
{
    tdp_flight_t *f = &w->fl[w->cf];
    uint32_t bit = 1u << ordinal;
    if (f->started & bit)
        return 0;
    CUresult r = tdp_cu.EventRecord(f->evs[ordinal], w->dstream[ordinal]);
    if (r == 0)
        f->started |= bit;
    return r;
}

static CUresult tdp_event_wait(tdp_worker_t *w, CUevent e);

/* The queue bound (`queue_bytes`): once that many bytes were queued on the device since the
 * last mark, mark the stream with an event, after waiting for the mark before it. 0, or a
 * CUresult. */
static CUresult tdp_dev_throttle(tdp_worker_t *w, int ordinal, uint64_t len)
{
    if (!w->queue_bytes || (w->qsince[ordinal] += len) < w->queue_bytes)
        return 0;
    w->qsince[ordinal] = 0;
    CUresult r = 0;
    for (int k = 0; k < 2 && r == 0; k++)
        if (!w->qev[ordinal][k])
            r = tdp_cu.EventCreate(&w->qev[ordinal][k], TDP_CUDA_EVENT_DISABLE_TIMING);
    uint8_t cur = w->qcur[ordinal], older = cur ^ 1;
    if (r == 0 && (w->qlive[ordinal] & (1u << older))) {
        atomic_fetch_add_explicit(&w->n_qwaits, 1, memory_order_relaxed);
        r = tdp_event_wait(w, w->qev[ordinal][older]);
    }
    r = r ? r : tdp_cu.EventRecord(w->qev[ordinal][cur], w->dstream[ordinal]);
    if (r == 0) {
        w->qlive[ordinal] |= 1u << cur;
        w->qcur[ordinal] = older;
    }
    return r;
}

/* Queue a copy or fill on `ordinal`'s stream, in pieces of TDP_DEV_CHUNK: 0, or a CUresult. */
static CUresult tdp_dev_issue(tdp_worker_t *w, int op, uint64_t dptr, uint64_t sptr, uint64_t n, uint8_t value, int ordinal)
{
    CUresult r = 0;
    for (uint64_t off = 0; off < n && r == 0; off += TDP_DEV_CHUNK) {
        uint64_t len = n - off < TDP_DEV_CHUNK ? n - off : TDP_DEV_CHUNK;
        r = op == TDP_COPY ? tdp_cu.MemcpyAsync(dptr + off, sptr + off, len, w->dstream[ordinal])
                           : tdp_cu.MemsetD8Async(dptr + off, value, len, w->dstream[ordinal]);
        r = r ? r : tdp_dev_throttle(w, ordinal, len);
    }
    return r;
}

/* Queue the copy being merged: 0, or a CUresult. */
static CUresult tdp_dev_flush(tdp_worker_t *w)
{
    uint64_t n = w->mg.n;
    w->mg.n = 0;
    return tdp_dev_issue(w, TDP_COPY, w->mg.dst, w->mg.src, n, 0, w->mg.ordinal);
}

/* Queue the copy held for merging, if any, in its own device's context (before an event or a
 * graph run goes on the stream behind it); a failure is the current flight's. 0, or a CUresult. */
static CUresult tdp_dev_flush_held(tdp_worker_t *w)
{
    tdp_flight_t *f = &w->fl[w->cf];
    if (!w->mg.n)
        return 0;
    CUresult r = w->sticky ? w->sticky : f->fault ? f->fault : tdp_cuda_use(w->mg.ordinal);
    r = r ? r : tdp_dev_flush(w);
    w->mg.n = 0;
    if (r != 0 && !f->fault)
        f->fault = r;
    return r;
}

/* A graph run's device work (the runner's, on this worker's thread): the worker's stream on
 * `ordinal` for it to queue on, the device marked used by the run being served. 0, or a CUresult. */
CUresult tdp_dev_run_stream(tdp_worker_t *w, int ordinal, CUstream *out)
{
    if (ordinal < 0 || ordinal >= tdp_cuda_devices())
        return 101;
    CUresult r = w->sticky ? w->sticky : w->fl[w->cf].fault;
    r = r ? r : tdp_dev_flush_held(w); /* (a copy before the run goes first) */
    r = r ? r : tdp_stream(w, ordinal);
    r = r ? r : tdp_flight_start(w, ordinal);
    if (r == 0) {
        *out = w->dstream[ordinal];
        w->run_dev |= 1u << ordinal;
    }
    return r;
}

/* Keep segment `sid` busy (its memory not released) until the current flight settles: a graph
 * run's operands. 0, or -1 (no such segment, or no memory). */
int tdp_dev_run_hold(tdp_worker_t *w, uint32_t sid)
{
    pthread_rwlock_rdlock(&w->table->lock);
    tdp_busy_t *b = tdp_table_busy(w->table, sid);
    int rc = b ? tdp_hold(&w->fl[w->cf], b) : -1;
    pthread_rwlock_unlock(&w->table->lock);
    return rc;
}

/* The run just served queued device work: its devices are the flight's, its completion fails
 * with the flight's driver error. */
void tdp_dev_run_done(tdp_worker_t *w, int served)
{
    tdp_flight_t *f = &w->fl[w->cf];
    if (served && w->run_dev) {
        f->dused |= w->run_dev;
        if (f->ndevc == 0 || f->devc[f->ndevc - 1] != w->cur)
            f->devc[f->ndevc++] = w->cur;
    }
    w->run_dev = 0;
}

int tdp_dev_op(tdp_worker_t *w, int op, uint64_t dva, uint64_t sva, uint64_t n, uint8_t value, int sum)
{
    if (!tdp_cuda_loaded())
        return TDP_NOT_DEVICE;
    tdp_flight_t *f = &w->fl[w->cf];
    uint64_t doff = 0, soff = 0;
    pthread_rwlock_rdlock(&w->table->lock);
    const tdp_seg_t *de = op != TDP_CHECKSUM ? tdp_lookup(w->table, w->session, dva, n, &doff) : NULL;
    const tdp_seg_t *se = op != TDP_FILL ? tdp_lookup(w->table, w->session, sva, n, &soff) : NULL;
    if (!(de && de->cuda) && !(se && se->cuda)) {
        pthread_rwlock_unlock(&w->table->lock);
        return TDP_NOT_DEVICE; /* host memory on both sides: the caller's */
    }
    int why = 0;
    if (op == TDP_CHECKSUM || sum)
        why = TDP_WHY_DEVICE;  /* (summing device memory: the Python pass's kernel) */
    else if (!de || (op == TDP_COPY && !se))
        why = TDP_WHY_ADDRESS;
    else if (se && de->device >= 0 && se->device >= 0 && de->device != se->device)
        why = TDP_WHY_DEVICES; /* (peer copies: the Python pass) */
    else if (se && de == se && doff < soff + n && soff < doff + n)
        why = TDP_WHY_DEVICE;  /* an overlapping device copy (cuMemcpyAsync leaves it undefined) */
    if (why) {
        pthread_rwlock_unlock(&w->table->lock);
        return why;
    }
    int ordinal = de->cuda ? de->ordinal : se->ordinal;
    uint64_t dptr = (uint64_t)(uintptr_t)de->base + doff;
    uint64_t sptr = se ? (uint64_t)(uintptr_t)se->base + soff : 0;
    tdp_busy_t *hosts[2] = {de->cuda ? NULL : de->busy, se && !se->cuda ? se->busy : NULL};
    if (tdp_hold(f, de->busy) < 0 || (se && se != de && tdp_hold(f, se->busy) < 0)) {
        pthread_rwlock_unlock(&w->table->lock);
        return TDP_WHY_DEVICE; /* (no memory for the record: Python serves it) */
    }
    pthread_rwlock_unlock(&w->table->lock); /* held: neither segment goes until the flight settles */
    if (!de->cuda)
        w->nmemo = 0; /* (a copy into host memory: no sum kept from this batch's copies may stand) */
    if (f->ndevc == 0 || f->devc[f->ndevc - 1] != w->cur)
        f->devc[f->ndevc++] = w->cur;
    CUresult r = w->sticky ? w->sticky : f->fault ? f->fault : tdp_stream(w, ordinal);
    r = r ? r : tdp_flight_start(w, ordinal);
    for (int k = 0; k < 2 && r == 0; k++) {
        if (hosts[k]) {
            tdp_pin(w->table, hosts[k]);
            int pin = atomic_load_explicit(&hosts[k]->pin, memory_order_acquire);
            if (pin != TDP_PIN_OURS && pin != TDP_PIN_OTHERS)
                atomic_fetch_add_explicit(&w->n_unpinned, 1, memory_order_relaxed);
        }
    }
    if (r == 0 && op == TDP_COPY && w->mg.n && w->mg.ordinal == ordinal && w->mg.dst + w->mg.n == dptr &&
        w->mg.src + w->mg.n == sptr)
        w->mg.n += n; /* it continues the copy before it: one async copy */
    else if (r == 0) {
        if (w->mg.n && w->mg.ordinal != ordinal) { /* (queued in its own device's context) */
            r = tdp_cuda_use(w->mg.ordinal);
            r = r ? r : tdp_dev_flush(w);
            r = r ? r : tdp_cuda_use(ordinal);
        }
        r = r ? r : tdp_dev_flush(w);
        if (r == 0 && op == TDP_COPY)
            w->mg.dst = dptr, w->mg.src = sptr, w->mg.n = n, w->mg.ordinal = ordinal;
        else if (r == 0)
            r = tdp_dev_issue(w, TDP_FILL, dptr, 0, n, value, ordinal);
    }
    if (r != 0 && !f->fault)
        f->fault = r;
    if (r == 0)
        f->dused |= 1u << ordinal;
    w->dsince += n;
    atomic_fetch_add_explicit(op == TDP_COPY ? &w->n_dcopy : &w->n_dfill, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&w->n_dbytes, n, memory_order_relaxed);
    return 0;
}

/* Wait for one event: poll briefly, then poll yielding the core (to the client, or to whatever
 * else this core runs), then nap: a small copy's event passes within microseconds, a large
 * one's after milliseconds. (Not the driver's blocking wait: its spin mode depends on the
 * context's flags, which the process's CUDA runtime set.) */
#define TDP_EVENT_SPIN_NS 2000ull
#define TDP_EVENT_YIELD_NS 1000000ull
static CUresult tdp_event_wait(tdp_worker_t *w, CUevent e)
{
    uint64_t t0 = trq_now_ns();
    for (;;) {
        CUresult r = tdp_cu.EventQuery(e);
        if (r != TDP_CUDA_NOT_READY)
            return r;
        uint64_t dt = trq_now_ns() - t0;
        if (dt < TDP_EVENT_SPIN_NS)
            continue;
        if (dt < TDP_EVENT_YIELD_NS)
            sched_yield();
        else
            tdp_nap(20000);
    }
}

/* Record the flight's events on the streams it used (those not recorded yet). */
static void tdp_flight_record(tdp_worker_t *w, tdp_flight_t *f)
{
    if (f == &w->fl[w->cf])
        tdp_dev_flush_held(w); /* (the merged copy is the current flight's) */
    for (int d = 0; d < TDP_CUDA_MAX_DEVICES; d++) {
        uint32_t bit = 1u << d;
        if (!(f->dused & bit) || (f->recorded & bit))
            continue;
        CUresult r = w->sticky ? w->sticky : f->fault ? f->fault : tdp_cuda_use(d);
        if (r == 0)
            r = tdp_cu.EventRecord(f->ev[d], w->dstream[d]);
        if (r != 0 && !f->fault)
            f->fault = r;
        f->recorded |= bit;
    }
}

/* Wait for a flight's work, release what it held, and fail its requests' completions in
 * `comps` if the driver failed. */
static void tdp_flight_settle(tdp_worker_t *w, tdp_flight_t *f, tdp_comp_t *comps)
{
    tdp_flight_record(w, f);
    for (int d = 0; d < TDP_CUDA_MAX_DEVICES && f->dused; d++) {
        uint32_t bit = 1u << d;
        if (!(f->dused & bit))
            continue;
        f->dused &= ~bit;
        CUresult r = w->sticky ? w->sticky : f->fault ? f->fault : tdp_event_wait(w, f->ev[d]);
        if (r != 0 && !f->fault)
            f->fault = r;
        float ms = 0;
        if (r == 0 && (f->started & bit) && tdp_cu.EventElapsedTime(&ms, f->evs[d], f->ev[d]) == 0 && ms > 0)
            atomic_fetch_add_explicit(&w->n_dev_ns, (uint64_t)((double)ms * 1e6), memory_order_relaxed);
    }
    f->recorded = f->started = 0;
    atomic_fetch_add_explicit(&w->n_dwaits, 1, memory_order_relaxed);
    for (uint32_t k = 0; k < f->nheld; k++)
        atomic_fetch_sub_explicit(&f->held[k]->inflight, 1, memory_order_acq_rel);
    f->nheld = 0;
    if (f->fault) {
        for (uint32_t k = 0; k < f->ndevc; k++) {
            tdp_comp_t *c = &comps[f->devc[k]];
            c->status = TDP_DEVICE_FAULT;
            c->result = (uint64_t)(uint32_t)f->fault;
        }
        atomic_fetch_add_explicit(&w->n_dfaults, f->ndevc, memory_order_relaxed);
        /* A sticky error (700 and up: the context is lost) stays, and every later device
         * request fails the same way; another fails this batch's requests only. */
        if (f->fault >= 700 && !w->sticky)
            w->sticky = f->fault;
        f->fault = 0;
    }
    f->ndevc = 0;
}

int tdp_dev_record(tdp_worker_t *w)
{
    tdp_flight_t *f = &w->fl[w->cf];
    if (!f->dused || f->fault || w->sticky)
        return -1;
    tdp_flight_record(w, f);
    return f->fault ? -1 : 0;
}

void tdp_dev_settle(tdp_worker_t *w)
{
    tdp_flight_settle(w, &w->fl[w->cf], w->comps);
}

void tdp_dev_settle_parked(tdp_worker_t *w, tdp_comp_t *comps)
{
    tdp_flight_settle(w, &w->fl[w->cf ^ 1], comps);
}

void tdp_dev_swap(tdp_worker_t *w)
{
    w->cf ^= 1;
}

void tdp_dev_close(tdp_worker_t *w)
{
    for (int d = 0; d < TDP_CUDA_MAX_DEVICES; d++) {
        if (w->fl[0].ev[d] && tdp_cuda_use(d) == 0) {
            for (int k = 0; k < 2; k++) {
                tdp_cu.EventDestroy(w->fl[k].ev[d]);
                tdp_cu.EventDestroy(w->fl[k].evs[d]);
                if (w->qev[d][k])
                    tdp_cu.EventDestroy(w->qev[d][k]);
                w->qev[d][k] = NULL;
            }
            if (!(w->dext & (1u << d)))
                tdp_cu.StreamDestroy(w->dstream[d]);
        }
        w->fl[0].ev[d] = w->fl[1].ev[d] = w->fl[0].evs[d] = w->fl[1].evs[d] = NULL;
        w->dstream[d] = NULL;
    }
    for (int k = 0; k < 2; k++) {
        free(w->fl[k].held);
        free(w->fl[k].devc);
        w->fl[k].held = NULL;
        w->fl[k].devc = NULL;
        w->fl[k].held_cap = 0;
    }
}

/* Wait until no device work touches a removed segment, then unpin it (the keeper's thread,
 * or a table's end). */
static void tdp_busy_settle(tdp_table_t *t, tdp_busy_t *b)
{
    for (uint64_t k = 0; atomic_load_explicit(&b->inflight, memory_order_acquire) ||
                         atomic_load_explicit(&b->pin, memory_order_acquire) == TDP_PIN_BUSY; k++) {
        if (k < 64)
            sched_yield();
        else
            tdp_nap(50000);
    }
    if (atomic_load_explicit(&b->pin, memory_order_acquire) == TDP_PIN_OURS && tdp_cuda_use(0) == 0) {
        tdp_cu.MemHostUnregister(b->base);
        atomic_fetch_sub_explicit(&t->pinned_bytes, b->nbytes, memory_order_acq_rel);
    }
}

void tdp_busy_retire(tdp_table_t *t, tdp_busy_t *b)
{
    if (b) {
        tdp_busy_settle(t, b);
        free(b);
    }
}

/* ---- the keeper -----------------------------------------------------------------------------
 * One thread per process that page-locks host segments as they are registered and lets removed
 * segments go once their device work is done, so that neither waits on the event loop. */
enum { TDP_KEEP_PIN, TDP_KEEP_RETIRE };
typedef struct tdp_keep_item {
    int kind;
    tdp_table_t *t;
    tdp_busy_t *b;
    void (*release)(void *);
    void *keep;
    struct tdp_keep_item *next;
} tdp_keep_item_t;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_cond_t idle;
    tdp_keep_item_t *head, *tail;
    int started, busy;
} tdp_keeper = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, 0, 0};

static void *tdp_keeper_run(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&tdp_keeper.mu);
    for (;;) {
        while (!tdp_keeper.head) {
            tdp_keeper.busy = 0;
            pthread_cond_broadcast(&tdp_keeper.idle);
            pthread_cond_wait(&tdp_keeper.cv, &tdp_keeper.mu);
        }
        tdp_keeper.busy = 1;
        tdp_keep_item_t *it = tdp_keeper.head;
        tdp_keeper.head = it->next;
        if (!tdp_keeper.head)
            tdp_keeper.tail = NULL;
        pthread_mutex_unlock(&tdp_keeper.mu);
        if (it->kind == TDP_KEEP_PIN) {
            tdp_pin(it->t, it->b);
            atomic_fetch_sub_explicit(&it->b->inflight, 1, memory_order_acq_rel);
        } else {
            tdp_busy_retire(it->t, it->b);
            it->release(it->keep);
        }
        free(it);
        pthread_mutex_lock(&tdp_keeper.mu);
    }
    return NULL;
}

static void tdp_keeper_after_fork(void)
{
    pthread_mutex_init(&tdp_keeper.mu, NULL);
    pthread_cond_init(&tdp_keeper.cv, NULL);
    pthread_cond_init(&tdp_keeper.idle, NULL);
    tdp_keeper.head = tdp_keeper.tail = NULL; /* (the parent's items are the parent's) */
    tdp_keeper.started = tdp_keeper.busy = 0;
}

/* Queue an item; -1 when there is no keeper (no memory, no thread): the caller does it itself. */
static int tdp_keeper_push(tdp_keep_item_t it)
{
    tdp_keep_item_t *p = malloc(sizeof *p);
    if (!p)
        return -1;
    *p = it;
    p->next = NULL;
    pthread_mutex_lock(&tdp_keeper.mu);
    if (!tdp_keeper.started) {
        pthread_t th;
        if (pthread_create(&th, NULL, tdp_keeper_run, NULL) != 0) {
            pthread_mutex_unlock(&tdp_keeper.mu);
            free(p);
            return -1;
        }
        pthread_detach(th);
        if (tdp_keeper.started == 0)
            pthread_atfork(NULL, NULL, tdp_keeper_after_fork);
        tdp_keeper.started = 1;
    }
    if (tdp_keeper.tail)
        tdp_keeper.tail->next = p;
    else
        tdp_keeper.head = p;
    tdp_keeper.tail = p;
    tdp_keeper.busy = 1;
    pthread_cond_signal(&tdp_keeper.cv);
    pthread_mutex_unlock(&tdp_keeper.mu);
    return 0;
}

void tdp_keeper_drain(void)
{
    pthread_mutex_lock(&tdp_keeper.mu);
    while (tdp_keeper.started && tdp_keeper.busy)
        pthread_cond_wait(&tdp_keeper.idle, &tdp_keeper.mu);
    pthread_mutex_unlock(&tdp_keeper.mu);
}

void tdp_keeper_pin(tdp_table_t *t, tdp_busy_t *b)
{
    if (!tdp_cuda_loaded())
        return;
    atomic_fetch_add_explicit(&b->inflight, 1, memory_order_acq_rel); /* (a removal waits for the pin) */
    if (tdp_keeper_push((tdp_keep_item_t){TDP_KEEP_PIN, t, b, NULL, NULL, NULL}) < 0)
        atomic_fetch_sub_explicit(&b->inflight, 1, memory_order_acq_rel); /* (a worker pins it on its first copy) */
}

int tdp_keeper_retire(tdp_table_t *t, tdp_busy_t *b, void (*release)(void *), void *keep)
{
    int idle = !atomic_load_explicit(&b->inflight, memory_order_acquire) &&
               atomic_load_explicit(&b->pin, memory_order_acquire) != TDP_PIN_BUSY &&
               atomic_load_explicit(&b->pin, memory_order_acquire) != TDP_PIN_OURS;
    if (idle || tdp_keeper_push((tdp_keep_item_t){TDP_KEEP_RETIRE, t, b, release, keep, NULL}) < 0) {
        tdp_busy_retire(t, b); /* (nothing to wait for; or no keeper: wait here) */
        return 0;
    }
    return 1;
}
