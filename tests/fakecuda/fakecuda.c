/*
 * fakecuda.c: a fake CUDA driver for tests on machines without a GPU. It implements, on host
 * memory, the driver calls the daemon's native device work makes (native/cuda.h), with CUDA's
 * ordering, so that what the data plane gets wrong shows up on a CPU:
 *
 *  - Device memory is host memory handed out by cuMemAlloc (filled with 0xCD: not zeroed).
 *  - Streams are FIFO queues run by one engine thread, in order within a stream and in a
 *    seeded random order across streams (FAKECUDA_SEED), except that a stream of a higher
 *    priority (cuStreamCreateWithPriority: lower is higher; the range is 0..-1) with work
 *    always goes before the others; the engine polls for work for
 *    FAKECUDA_SPIN_US (200) before it sleeps. Nothing queued has run when the call returns;
 *    an event is not ready until the work recorded before it has run.
 *  - The destination of a copy into host memory is poisoned (0xDB) when it is queued, so a
 *    reader that does not wait sees garbage (unless queued work not yet done writes those
 *    bytes, or what a queued reader of them reads: in stream order that reader must see what
 *    the earlier work leaves). A pageable (unregistered) host source is read when
 *    the copy is queued, and a copy into pageable memory returns once it has run, as the driver
 *    does.
 *  - Misuse is counted as a violation (and written to FAKECUDA_REPORT at once): a range that
 *    straddles an allocation or registration, a free or unregister of memory that queued work
 *    still uses, work that finds its memory gone when it runs, an overlapping registration, a
 *    call without a current context.
 *  - FAKECUDA_FAULT_AT=N makes the N-th copy fault: from then on every call fails with
 *    CUDA_ERROR_ILLEGAL_ADDRESS (sticky, as a lost context), and queued work is dropped.
 *  - Host functions (cuLaunchHostFunc) run on the engine thread, in their stream's order: the
 *    tests' stand-in for kernels.
 *  - Stream capture: between cuStreamBeginCapture and cuStreamEndCapture, the copies, fills and
 *    host functions queued on the stream are recorded into a graph, not run; an event record,
 *    a synchronize of the capturing stream, or a cuMemAlloc/cuMemFree while any stream captures
 *    is a violation (CUDA refuses them: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED). A graph is
 *    instantiated, and each cuGraphLaunch queues its recorded work on a stream, checked as if
 *    queued then. fakecuda_launches() counts launches; fakecuda_captures() captures.
 *    FAKECUDA_NO_CAPTURE=1: cuStreamBeginCapture fails, as on a driver or stream that cannot.
 *  - The report gives the most bytes of copies and fills ever queued on one stream at once
 *    (max_stream_bytes), and the streams created at a priority above the default.
 *
 * Built by the test suite (tests/fakecuda/__init__.py); the daemon loads it through
 * TRANSFER_CUDA_DRIVER. Its counts: fakecuda_executed(), fakecuda_violations(), and the report.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, INVALID_DEVICE = 101,
       INVALID_CONTEXT = 201, INVALID_HANDLE = 400, NOT_READY = 600, ILLEGAL_ADDRESS = 700,
       ALREADY_REGISTERED = 712, NOT_REGISTERED = 713, CAPTURE_UNSUPPORTED = 900, CAPTURE_INVALIDATED = 901 };
enum { DEV, PINNED, PAGEABLE };
enum { K_COPY, K_SET, K_EVENT, K_HOST };

typedef struct { _Atomic uint64_t recorded, passed, passed_ns; } event_t;
typedef struct op {
    int kind, dclass, sclass;
    uint8_t *dst, *src, val;
    uint64_t n, gen;
    uint8_t *snap;
    event_t *ev;
    void (*fn)(void *);
    void *arg;
    struct op *next;
} op_t;
/* A captured graph (and an instantiated one: a copy of its ops): what to queue per launch. */
typedef struct graph { op_t *head, *tail; int broken; } graph_t;
typedef struct stream {
    op_t *head, *tail;
    int running, dead;
    graph_t *capture; /* capturing into this graph, or NULL */
    int priority;     /* lower runs first (cuStreamCreateWithPriority; 0 is the default) */
    uint64_t qbytes;  /* bytes of copies and fills queued on it, not yet run */
    struct stream *next;
} stream_t;
typedef struct { uint8_t *base; uint64_t n; int dev; } range_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_cv = PTHREAD_COND_INITIALIZER, done_cv = PTHREAD_COND_INITIALIZER;
static stream_t *streams;
static range_t *allocs, *regs;
static int nallocs, nregs, callocs, cregs;
static _Atomic uint64_t queued, executed, violations, copies, launches, captures, priority_streams, max_stream_bytes;
static int capturing; /* streams capturing now (under mu) */
static _Atomic int sticky;
static uint64_t fault_at, rng = 88172645463325252ull, spin_ns = 200000;
static int ndevices = 1, started, report_fd = -1, no_capture;
static __thread int current = -1;
static op_t *running_op; /* the op the engine is running (under mu) */

static _Atomic int paused; /* fakecuda_pause(1): the engine takes no work until fakecuda_pause(0) */

uint64_t fakecuda_executed(void) { return atomic_load(&executed); }
uint64_t fakecuda_launches(void) { return atomic_load(&launches); }
uint64_t fakecuda_captures(void) { return atomic_load(&captures); }
uint64_t fakecuda_violations(void) { return atomic_load(&violations); }

/* Tests: hold the engine (queued work stays queued, whatever the scheduler does), or let it go. */
void fakecuda_pause(int on)
{
    pthread_mutex_lock(&mu);
    atomic_store(&paused, on);
    pthread_cond_broadcast(&work_cv);
    pthread_mutex_unlock(&mu);
}

static void violation(const char *fmt, ...)
{
    atomic_fetch_add(&violations, 1);
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(buf, sizeof buf - 2, fmt, ap);
    va_end(ap);
    if (k < 0)
        return;
    if (k > (int)sizeof buf - 2)
        k = sizeof buf - 2;
    buf[k++] = '\n';
    fprintf(stderr, "fakecuda violation: %.*s", k, buf);
    if (report_fd >= 0 && write(report_fd, "violation: ", 11) > 0 && write(report_fd, buf, (size_t)k) > 0) {
    }
}

__attribute__((destructor)) static void fake_report(void)
{
    if (report_fd >= 0) {
        char buf[256];
        int k = snprintf(buf, sizeof buf, "executed %llu\nviolations %llu\nlaunches %llu\ncaptures %llu\npriority_streams %llu\n"
                         "max_stream_bytes %llu\n",
                         (unsigned long long)atomic_load(&executed), (unsigned long long)atomic_load(&violations),
                         (unsigned long long)atomic_load(&launches), (unsigned long long)atomic_load(&captures),
                         (unsigned long long)atomic_load(&priority_streams), (unsigned long long)atomic_load(&max_stream_bytes));
        if (write(report_fd, buf, (size_t)k) < 0) {
        }
    }
}

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* Which memory [p, p + n) is (under mu): DEV, PINNED or PAGEABLE; -1 if it straddles a range. */
static int classify(const uint8_t *p, uint64_t n, int *dev)
{
    for (int pass = 0; pass < 2; pass++) {
        range_t *r = pass ? regs : allocs;
        int m = pass ? nregs : nallocs;
        for (int i = 0; i < m; i++) {
            if (p >= r[i].base && p + n <= r[i].base + r[i].n && p + n >= p) {
                if (dev)
                    *dev = r[i].dev;
                return pass ? PINNED : DEV;
            }
            if (p < r[i].base + r[i].n && r[i].base < p + n)
                return -1;
        }
    }
    return PAGEABLE;
}

static int uses(const op_t *o, const uint8_t *base, uint64_t n)
{
    if (o->kind == K_EVENT || o->kind == K_HOST)
        return 0;
    int hit = o->dst < base + n && base < o->dst + o->n;
    if (o->kind == K_COPY && !o->snap)
        hit |= o->src < base + n && base < o->src + o->n;
    return hit;
}

/* Run one op; `gone`: its memory was freed or unregistered since it was queued (looked at
 * under mu when it was taken off its stream). */
static void run_op(op_t *o, int gone)
{
    if (atomic_load(&sticky))
        return; /* (the context is lost: queued work is dropped) */
    if (o->kind == K_EVENT) {
        atomic_store(&o->ev->passed_ns, now_ns());
        atomic_store(&o->ev->passed, o->gen);
        return;
    }
    if (o->kind == K_HOST) {
        o->fn(o->arg);
        atomic_fetch_add(&executed, 1);
        return;
    }
    if (gone) {
        violation("queued work ran on memory freed or unregistered after it was queued (%p <- %p, %llu bytes)",
                  (void *)o->dst, (void *)o->src, (unsigned long long)o->n);
        return;
    }
    if (o->kind == K_COPY) {
        uint64_t k = atomic_fetch_add(&copies, 1) + 1;
        if (fault_at && k == fault_at) {
            atomic_store(&sticky, 1);
            return;
        }
        memmove(o->dst, o->snap ? o->snap : o->src, o->n);
    } else
        memset(o->dst, o->val, o->n);
    atomic_fetch_add(&executed, 1);
}

static void *engine(void *arg)
{
    (void)arg;
    for (;;) {
        uint64_t t0 = now_ns();
        while (!atomic_load_explicit(&queued, memory_order_acquire) && now_ns() - t0 < spin_ns) {
        }
        pthread_mutex_lock(&mu);
        stream_t *pick[256];
        int m = 0, best = 1 << 30;
        for (stream_t *s = streams; s && !atomic_load(&paused); s = s->next)
            if (s->head && s->priority < best)
                best = s->priority; /* (the highest priority with work: only its streams may go next) */
        for (stream_t *s = streams; s && m < 256 && !atomic_load(&paused); s = s->next)
            if (s->head && s->priority == best)
                pick[m++] = s;
        if (!m) {
            if (!atomic_load(&queued) || atomic_load(&paused))
                pthread_cond_wait(&work_cv, &mu);
            pthread_mutex_unlock(&mu);
            continue;
        }
        stream_t *s = pick[next_rand() % (uint64_t)m];
        op_t *o = s->head;
        s->head = o->next;
        if (!s->head)
            s->tail = NULL;
        s->running = 1;
        if (o->kind == K_COPY || o->kind == K_SET)
            s->qbytes -= o->n;
        running_op = o;
        int gone = o->kind != K_EVENT && o->kind != K_HOST &&
                   (classify(o->dst, o->n, NULL) != o->dclass ||
                    (o->kind == K_COPY && !o->snap && classify(o->src, o->n, NULL) != o->sclass));
        pthread_mutex_unlock(&mu);
        run_op(o, gone);
        pthread_mutex_lock(&mu);
        s->running = 0;
        running_op = NULL;
        atomic_fetch_sub(&queued, 1);
        pthread_cond_broadcast(&done_cv);
        pthread_mutex_unlock(&mu);
        free(o->snap);
        free(o);
    }
    return NULL;
}

#define CTX() do { if (atomic_load(&sticky)) return ILLEGAL_ADDRESS; if (current < 0) { violation("a call without a current context"); return INVALID_CONTEXT; } } while (0)

CUresult cuInit(unsigned flags)
{
    pthread_mutex_lock(&mu);
    if (!started) {
        const char *e;
        if ((e = getenv("FAKECUDA_DEVICES")))
            ndevices = atoi(e) > 0 ? atoi(e) : 1;
        if ((e = getenv("FAKECUDA_SEED")))
            rng = strtoull(e, NULL, 10) * 2654435761u + 1;
        if ((e = getenv("FAKECUDA_FAULT_AT")))
            fault_at = strtoull(e, NULL, 10);
        if ((e = getenv("FAKECUDA_SPIN_US")))
            spin_ns = strtoull(e, NULL, 10) * 1000;
        if ((e = getenv("FAKECUDA_NO_CAPTURE")))
            no_capture = atoi(e) != 0;
        if ((e = getenv("FAKECUDA_REPORT")))
            report_fd = open(e, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
        pthread_t t;
        if (pthread_create(&t, NULL, engine, NULL) != 0) {
            pthread_mutex_unlock(&mu);
            return OUT_OF_MEMORY;
        }
        pthread_setname_np(t, "fakecuda-engine"); /* (a benchmark leaves its CPU out of the daemon's) */
        pthread_detach(t);
        started = 1;
    }
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }
CUresult cuDeviceGetCount(int *n) { *n = ndevices; return started ? OK : NOT_INITIALIZED; }
CUresult cuDeviceGet(int *d, int ordinal) { if (ordinal < 0 || ordinal >= ndevices) return INVALID_DEVICE; *d = ordinal; return OK; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev)
{
    if (dev < 0 || dev >= ndevices)
        return INVALID_DEVICE;
    *ctx = (void *)(intptr_t)(dev + 1);
    return OK;
}
CUresult cuCtxSetCurrent(void *ctx)
{
    current = ctx ? (int)(intptr_t)ctx - 1 : -1;
    return OK;
}

CUresult cuGetErrorString(CUresult r, const char **s)
{
    switch (r) {
    case OK: *s = "no error"; break;
    case INVALID_VALUE: *s = "invalid argument"; break;
    case OUT_OF_MEMORY: *s = "out of memory"; break;
    case INVALID_CONTEXT: *s = "invalid device context"; break;
    case NOT_READY: *s = "device not ready"; break;
    case ILLEGAL_ADDRESS: *s = "an illegal memory access was encountered (fake driver: injected)"; break;
    case ALREADY_REGISTERED: *s = "part or all of the requested memory range is already mapped"; break;
    case NOT_REGISTERED: *s = "memory range not registered"; break;
    case CAPTURE_UNSUPPORTED: *s = "operation not permitted when stream is capturing"; break;
    case CAPTURE_INVALIDATED: *s = "operation failed due to a previous error during capture"; break;
    default: *s = "unknown error"; return INVALID_VALUE;
    }
    return OK;
}

CUresult cuStreamCreate(void **out, unsigned flags)
{
    CTX();
    stream_t *s = calloc(1, sizeof *s);
    if (!s)
        return OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    s->next = streams;
    streams = s;
    pthread_mutex_unlock(&mu);
    *out = s;
    return OK;
}

CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest)
{
    CTX();
    *least = 0;
    *greatest = -1;
    return OK;
}

CUresult cuStreamCreateWithPriority(void **out, unsigned flags, int priority)
{
    if (priority < -1 || priority > 0) {
        violation("a stream priority outside the range the context gives (%d)", priority);
        return INVALID_VALUE;
    }
    CUresult r = cuStreamCreate(out, flags);
    if (r == OK) {
        ((stream_t *)*out)->priority = priority;
        if (priority < 0)
            atomic_fetch_add(&priority_streams, 1);
    }
    return r;
}

static void wait_idle(stream_t *s) /* under mu */
{
    while (s->head || s->running)
        pthread_cond_wait(&done_cv, &mu);
}

CUresult cuStreamSynchronize(void *h)
{
    CTX();
    pthread_mutex_lock(&mu);
    if (((stream_t *)h)->capture) {
        ((stream_t *)h)->capture->broken = 1;
        pthread_mutex_unlock(&mu);
        violation("cuStreamSynchronize of a stream that is capturing");
        return CAPTURE_UNSUPPORTED;
    }
    wait_idle(h);
    pthread_mutex_unlock(&mu);
    return atomic_load(&sticky) ? ILLEGAL_ADDRESS : OK;
}

CUresult cuStreamDestroy_v2(void *h)
{
    CTX();
    stream_t *s = h;
    pthread_mutex_lock(&mu);
    wait_idle(s); /* (the driver finishes a destroyed stream's work first) */
    for (stream_t **p = &streams; *p; p = &(*p)->next) {
        if (*p == s) {
            *p = s->next;
            break;
        }
    }
    pthread_mutex_unlock(&mu);
    free(s);
    return OK;
}

static void append(op_t **head, op_t **tail, op_t *o)
{
    o->next = NULL;
    if (*tail)
        (*tail)->next = o;
    else
        *head = o;
    *tail = o;
}

static void push(stream_t *s, op_t *o) /* under mu */
{
    if (s->capture) { /* recorded, not run */
        append(&s->capture->head, &s->capture->tail, o);
        return;
    }
    if (s->tail)
        s->tail->next = o;
    else
        s->head = o;
    s->tail = o;
    if (o->kind == K_COPY || o->kind == K_SET) {
        s->qbytes += o->n;
        if (s->qbytes > atomic_load(&max_stream_bytes))
            atomic_store(&max_stream_bytes, s->qbytes);
    }
    atomic_fetch_add_explicit(&queued, 1, memory_order_release);
    pthread_cond_signal(&work_cv);
}

CUresult cuEventCreate(void **out, unsigned flags)
{
    CTX();
    event_t *e = calloc(1, sizeof *e);
    if (!e)
        return OUT_OF_MEMORY;
    *out = e;
    return OK;
}
CUresult cuEventDestroy_v2(void *e) { CTX(); free(e); return OK; }

CUresult cuEventRecord(void *h, void *s)
{
    CTX();
    event_t *e = h;
    op_t *o = calloc(1, sizeof *o);
    if (!o)
        return OUT_OF_MEMORY;
    o->kind = K_EVENT;
    o->ev = e;
    pthread_mutex_lock(&mu);
    if (((stream_t *)s)->capture) {
        ((stream_t *)s)->capture->broken = 1;
        pthread_mutex_unlock(&mu);
        free(o);
        violation("cuEventRecord on a stream that is capturing (this fake does not record event nodes)");
        return CAPTURE_UNSUPPORTED;
    }
    o->gen = atomic_fetch_add(&e->recorded, 1) + 1;
    push(s, o);
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuEventQuery(void *h)
{
    event_t *e = h;
    if (atomic_load(&sticky))
        return ILLEGAL_ADDRESS;
    return atomic_load(&e->passed) >= atomic_load(&e->recorded) ? OK : NOT_READY;
}

/* Milliseconds between two events that have passed (the engine's clock when each ran). */
CUresult cuEventElapsedTime(float *ms, void *a, void *b)
{
    event_t *s = a, *e = b;
    if (atomic_load(&sticky))
        return ILLEGAL_ADDRESS;
    if (!atomic_load(&s->recorded) || !atomic_load(&e->recorded))
        return INVALID_HANDLE;
    if (atomic_load(&s->passed) < atomic_load(&s->recorded) || atomic_load(&e->passed) < atomic_load(&e->recorded))
        return NOT_READY;
    *ms = (float)((double)(int64_t)(atomic_load(&e->passed_ns) - atomic_load(&s->passed_ns)) / 1e6);
    return OK;
}

CUresult cuEventSynchronize(void *h)
{
    event_t *e = h;
    pthread_mutex_lock(&mu);
    while (!atomic_load(&sticky) && atomic_load(&e->passed) < atomic_load(&e->recorded))
        pthread_cond_wait(&done_cv, &mu);
    pthread_mutex_unlock(&mu);
    return atomic_load(&sticky) ? ILLEGAL_ADDRESS : OK;
}

/* Whether a copy queued (or running) and not yet done writes any of [p, p + n) (under mu). */
static int queued_write(const uint8_t *p, uint64_t n)
{
    if (running_op && running_op->kind == K_COPY && running_op->dst < p + n && p < running_op->dst + running_op->n)
        return 1;
    for (stream_t *t = streams; t; t = t->next)
        for (op_t *q = t->head; q; q = q->next)
            if (q->kind == K_COPY && q->dst < p + n && p < q->dst + q->n)
                return 1;
    return 0;
}

/* Whether a copy into host bytes [p, p + n) may poison them when queued (under mu): not when
 * work not yet done writes them, or writes what a queued reader of them reads. Such readers
 * must see, in stream order, what that work leaves, not what the bytes hold now (the snapshot
 * the poison gives them); the earlier write's own poison already stands for a host that reads
 * early. */
static int poisonable(const uint8_t *p, uint64_t n)
{
    if (queued_write(p, n))
        return 0;
    for (stream_t *t = streams; t; t = t->next)
        for (op_t *q = t->head; q; q = q->next)
            if (q->kind == K_COPY && !q->snap && q->src < p + n && p < q->src + q->n && queued_write(q->src, q->n))
                return 0;
    return 1;
}

/* Queue `o` on `s` (under mu), as the driver queues an async copy or fill: its memory
 * classified, a pageable source read now, a host destination poisoned until it runs.
 * 0, or a CUresult (o freed). */
static CUresult queue_locked(op_t *o, stream_t *s)
{
    int kind = o->kind;
    uint64_t n = o->n;
    if (kind == K_HOST) {
        push(s, o);
        return OK;
    }
    o->dclass = classify(o->dst, n, NULL);
    o->sclass = kind == K_COPY ? classify(o->src, n, NULL) : DEV;
    if (o->dclass < 0 || o->sclass < 0 || (kind == K_SET && o->dclass != DEV) ||
        (kind == K_COPY && o->dclass != DEV && o->sclass != DEV)) {
        pthread_mutex_unlock(&mu);
        violation("a %s of %llu bytes at %p <- %p outside device memory or straddling a range", kind == K_COPY ? "copy" : "fill",
                  (unsigned long long)n, (void *)o->dst, (void *)o->src);
        pthread_mutex_lock(&mu);
        free(o);
        return INVALID_VALUE;
    }
    if (s->capture) { /* recorded: classified, poisoned and staged when a launch queues it */
        push(s, o);
        return OK;
    }
    if (kind == K_COPY && o->sclass == PAGEABLE) { /* read now, as the driver stages it */
        o->snap = malloc(n);
        if (!o->snap) {
            free(o);
            return OUT_OF_MEMORY;
        }
        memcpy(o->snap, o->src, n);
    }
    if (o->dclass != DEV && poisonable(o->dst, n)) {
        /* Poisoned until the copy runs. Work queued before it that reads these bytes runs first
         * (in stream order) and must see them as they are now: it reads a copy taken here, and
         * one running now finishes first. */
        while (running_op && running_op->kind == K_COPY && running_op->src < o->dst + n && o->dst < running_op->src + running_op->n)
            pthread_cond_wait(&done_cv, &mu);
        for (stream_t *t = streams; t; t = t->next)
            for (op_t *q = t->head; q; q = q->next)
                if (q->kind == K_COPY && !q->snap && q->src < o->dst + n && o->dst < q->src + q->n) {
                    q->snap = malloc(q->n);
                    if (q->snap)
                        memcpy(q->snap, q->src, q->n);
                }
        memset(o->dst, 0xDB, n);
    }
    int pageable = o->dclass == PAGEABLE;
    push(s, o);
    if (pageable) /* into pageable memory: the call returns once it is done */
        wait_idle(s);
    return OK;
}

static CUresult enqueue(int kind, CUdeviceptr dst, CUdeviceptr src, size_t n, unsigned char val, void *h)
{
    CTX();
    if (!n)
        return OK;
    op_t *o = calloc(1, sizeof *o);
    if (!o)
        return OUT_OF_MEMORY;
    o->kind = kind;
    o->dst = (uint8_t *)(uintptr_t)dst;
    o->src = (uint8_t *)(uintptr_t)src;
    o->n = n;
    o->val = val;
    pthread_mutex_lock(&mu);
    CUresult r = queue_locked(o, h);
    pthread_mutex_unlock(&mu);
    return r;
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void *s) { return enqueue(K_COPY, dst, src, n, 0, s); }
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void *s) { return enqueue(K_SET, dst, 0, n, v, s); }

CUresult cuLaunchHostFunc(void *h, void (*fn)(void *), void *arg)
{
    CTX();
    op_t *o = calloc(1, sizeof *o);
    if (!o)
        return OUT_OF_MEMORY;
    o->kind = K_HOST;
    o->fn = fn;
    o->arg = arg;
    pthread_mutex_lock(&mu);
    push(h, o);
    pthread_mutex_unlock(&mu);
    return OK;
}

/* ---- stream capture and graphs ---------------------------------------------------------- */
CUresult cuStreamBeginCapture_v2(void *h, int mode)
{
    CTX();
    if (no_capture)
        return CAPTURE_UNSUPPORTED;
    stream_t *s = h;
    pthread_mutex_lock(&mu);
    if (s->capture) {
        pthread_mutex_unlock(&mu);
        violation("cuStreamBeginCapture of a stream that is capturing already");
        return INVALID_VALUE;
    }
    s->capture = calloc(1, sizeof *s->capture);
    if (s->capture)
        capturing++;
    pthread_mutex_unlock(&mu);
    return s->capture ? OK : OUT_OF_MEMORY;
}

static void free_ops(op_t *o)
{
    while (o) {
        op_t *next = o->next;
        free(o->snap);
        free(o);
        o = next;
    }
}

CUresult cuStreamEndCapture(void *h, void **out)
{
    CTX();
    stream_t *s = h;
    pthread_mutex_lock(&mu);
    graph_t *g = s->capture;
    if (!g) {
        pthread_mutex_unlock(&mu);
        violation("cuStreamEndCapture of a stream that is not capturing");
        return INVALID_VALUE;
    }
    s->capture = NULL;
    capturing--;
    pthread_mutex_unlock(&mu);
    if (g->broken) {
        free_ops(g->head);
        free(g);
        *out = NULL;
        return CAPTURE_INVALIDATED;
    }
    atomic_fetch_add(&captures, 1);
    *out = g;
    return OK;
}

CUresult cuGraphInstantiateWithFlags(void **out, void *graph, unsigned long long flags)
{
    CTX();
    graph_t *g = graph, *x = calloc(1, sizeof *x);
    if (!x)
        return OUT_OF_MEMORY;
    for (op_t *o = g->head; o; o = o->next) {
        op_t *c = malloc(sizeof *c);
        if (!c) {
            free_ops(x->head);
            free(x);
            return OUT_OF_MEMORY;
        }
        *c = *o;
        c->snap = NULL;
        append(&x->head, &x->tail, c);
    }
    *out = x;
    return OK;
}

CUresult cuGraphLaunch(void *exec, void *h)
{
    CTX();
    graph_t *x = exec;
    stream_t *s = h;
    pthread_mutex_lock(&mu);
    if (s->capture) {
        pthread_mutex_unlock(&mu);
        violation("cuGraphLaunch into a capturing stream (not modelled)");
        return CAPTURE_UNSUPPORTED;
    }
    CUresult r = OK;
    for (op_t *o = x->head; o && r == OK; o = o->next) {
        op_t *c = malloc(sizeof *c);
        if (!c) {
            r = OUT_OF_MEMORY;
            break;
        }
        *c = *o;
        c->snap = NULL;
        c->next = NULL;
        r = queue_locked(c, s);
    }
    pthread_mutex_unlock(&mu);
    if (r == OK)
        atomic_fetch_add(&launches, 1);
    return r;
}

/* (Work a launch queued is a copy of the graph's: destroying either while it runs is fine, as
 * the driver frees an executable graph in flight once it completes.) */
CUresult cuGraphExecDestroy(void *exec)
{
    CTX();
    graph_t *x = exec;
    free_ops(x->head);
    free(x);
    return OK;
}

CUresult cuGraphDestroy(void *graph) { return cuGraphExecDestroy(graph); }

static int grow(range_t **a, int n, int *cap)
{
    if (n < *cap)
        return 0;
    int c = *cap ? 2 * *cap : 64;
    void *p = realloc(*a, (size_t)c * sizeof **a);
    if (!p)
        return -1;
    *a = p;
    *cap = c;
    return 0;
}

static int in_use(const uint8_t *base, uint64_t n) /* under mu: queued work touches the range */
{
    for (stream_t *s = streams; s; s = s->next)
        for (op_t *o = s->head; o; o = o->next)
            if (uses(o, base, n))
                return 1;
    return 0;
}

static int capture_refuses(const char *what)
{
    pthread_mutex_lock(&mu);
    int c = capturing;
    pthread_mutex_unlock(&mu);
    if (c)
        violation("%s while a stream captures (an allocator that refuses allocation during capture was not used)", what);
    return c;
}

CUresult cuMemAlloc_v2(CUdeviceptr *out, size_t n)
{
    CTX();
    if (capture_refuses("cuMemAlloc"))
        return CAPTURE_UNSUPPORTED;
    uint8_t *p = aligned_alloc(256, (n + 255) / 256 * 256);
    if (!p)
        return OUT_OF_MEMORY;
    memset(p, 0xCD, n);
    pthread_mutex_lock(&mu);
    if (grow(&allocs, nallocs, &callocs) < 0) {
        pthread_mutex_unlock(&mu);
        free(p);
        return OUT_OF_MEMORY;
    }
    allocs[nallocs++] = (range_t){p, n, current};
    pthread_mutex_unlock(&mu);
    *out = (CUdeviceptr)(uintptr_t)p;
    return OK;
}

static CUresult drop_range(range_t *a, int *n, void *p, const char *what)
{
    pthread_mutex_lock(&mu);
    for (int i = 0; i < *n; i++) {
        if (a[i].base == p) {
            if (in_use(a[i].base, a[i].n))
                violation("%s of memory that queued work still uses (%p, %llu bytes)", what, p, (unsigned long long)a[i].n);
            a[i] = a[--*n];
            pthread_mutex_unlock(&mu);
            return OK;
        }
    }
    pthread_mutex_unlock(&mu);
    return INVALID_VALUE;
}

CUresult cuMemFree_v2(CUdeviceptr p)
{
    CTX();
    if (capture_refuses("cuMemFree"))
        return CAPTURE_UNSUPPORTED;
    CUresult r = drop_range(allocs, &nallocs, (void *)(uintptr_t)p, "cuMemFree");
    if (r == OK)
        free((void *)(uintptr_t)p);
    else
        violation("cuMemFree of %p, which cuMemAlloc did not give", (void *)(uintptr_t)p);
    return r;
}

CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags)
{
    CTX();
    pthread_mutex_lock(&mu);
    for (int i = 0; i < nregs; i++) {
        if ((uint8_t *)p < regs[i].base + regs[i].n && regs[i].base < (uint8_t *)p + n) {
            pthread_mutex_unlock(&mu);
            violation("cuMemHostRegister of %p (%zu bytes) overlaps a registration", p, n);
            return ALREADY_REGISTERED;
        }
    }
    if (grow(&regs, nregs, &cregs) < 0) {
        pthread_mutex_unlock(&mu);
        return OUT_OF_MEMORY;
    }
    regs[nregs++] = (range_t){p, n, -1};
    pthread_mutex_unlock(&mu);
    return OK;
}

CUresult cuMemHostUnregister(void *p)
{
    CTX();
    CUresult r = drop_range(regs, &nregs, p, "cuMemHostUnregister");
    if (r != OK) {
        violation("cuMemHostUnregister of %p, which is not registered", p);
        return NOT_REGISTERED;
    }
    return OK;
}
