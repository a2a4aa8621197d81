/*
 * dataplane.h: the native data plane. Each same-host session's request ring
 * gets one worker thread that pops descriptors, checks them against a native
 * copy of the mapping table and executes copy, fill, checksum and fence
 * itself, without the GIL and without the event loop (docs/ring.md, "Native
 * workers"). Anything else (an opcode it does not serve, a VA it cannot
 * translate, memory that is not plain host memory, a malformed chain) it
 * hands back to the daemon's Python pass, which owns every error message.
 * No Python in here: the binding is dataplane_type.c.
 *
 * OWNERSHIP OF THE RING. A ring has one consumer and one completion
 * producer at any time: the worker (mode NATIVE) or the Python pass (mode
 * PYTHON). Only the worker moves NATIVE -> PYTHON (after its last ring access,
 * with a release store of `mode`); only Python moves PYTHON -> NATIVE (after
 * its last ring access, with a release store; then it wakes the worker on
 * `ctl`). Each side loads `mode` with acquire before touching the ring, so
 * the trq_t cursors (private indices) pass between threads with a
 * happens-before edge and are never used by both at once.
 *
 * THE TABLE. Segment id -> (host pointer, size, owner, guests, device), a
 * sorted array under a writer-preferring rwlock. A worker holds the read
 * lock while it touches a segment's bytes, at most TDP_CHUNK bytes at a time,
 * and re-translates between chunks; Python takes the write lock (without the
 * GIL) before it removes a segment, and unmaps it only afterwards. So no
 * worker ever touches unmapped memory, and a free waits for at most one
 * chunk of someone else's copy.
 *
 * WAKING. A worker that finds its ring empty spins for `spin_ns`, then
 * sleeps on the request queue's data futex, armed with TDP_ARMED (2): a
 * client's push clears the word and wakes it with FUTEX_WAKE only. The value
 * 1 means "the Python loop armed this and sleeps on the daemon's doorbell
 * pipe": only then does a client also write the doorbell (transfer/ring,
 * Ring.notify). A worker tells the Python loop about a handover, a broken
 * ring or a watched index by writing one byte to that pipe itself.
 */
#ifndef TRANSFER_DATAPLANE_H
#define TRANSFER_DATAPLANE_H

#include <pthread.h>
#include <stdlib.h>

#include "cuda.h"
#include "layout.h"
#include "queue.h"

/* Bytes touched under one hold of the table's read lock. */
#define TDP_CHUNK (4ull << 20)
/* Copies whose source or destination a CHECKSUM later in the same batch names are summed as
 * they are copied (a verified copy reads its bytes once): at most this many sums are kept per
 * batch, ... */
#define TDP_MEMO 16
/* Completions are pushed early once this many bytes were moved since the last push. */
#define TDP_FLUSH_BYTES (1ull << 20)
#define TDP_ARMED 2u
/* Latency histogram: per kind of request, counts per bucket (bounds given by Python). */
#define TDP_HMAX 32
enum { TDP_K_COPY = 0, TDP_K_COPYV, TDP_K_FILL, TDP_K_CHECKSUM, TDP_KINDS };

enum { TDP_NATIVE = 0, TDP_PYTHON = 1, TDP_BROKEN = 2 };

/* Why a worker handed its ring to Python (counters, and the `why` a test reads). */
enum {
    TDP_WHY_NONE = 0,
    TDP_WHY_OPCODE,     /* an opcode the worker does not serve */
    TDP_WHY_FIELDS,     /* id 0, unknown flags, a fill value that is not a byte */
    TDP_WHY_ADDRESS,    /* a VA not in the native table, not the session's, or out of bounds */
    TDP_WHY_DEVICES,    /* operands on two devices */
    TDP_WHY_CHAIN,      /* a chain that mixes ops/ids/streams or outgrows the ring */
    TDP_WHY_AFTER,      /* a descriptor that waits for socket frames (TDP_FLAG_AFTER) */
    TDP_WHY_DEVICE,     /* device work the worker leaves to Python (a checksum of device memory, an
                           overlapping device copy, a verified chain that touches a device) */
    TDP_WHY_COUNT
};

/* ---- the table ----------------------------------------------------------- */

/* A segment's device work in flight and its page-locking (device.c). It outlives the segment's
 * table entry: a removal takes the entry out under the write lock, then waits, without the
 * lock, until no queued device work touches the memory (`inflight` 0) before it goes. */
enum { TDP_PIN_NONE = 0, TDP_PIN_BUSY, TDP_PIN_OURS, TDP_PIN_OTHERS, TDP_PIN_REFUSED };
typedef struct {
    _Atomic uint64_t inflight;
    _Atomic int pin;       /* TDP_PIN_*: a host segment is page-locked on its first device copy */
    uint8_t *base;
    uint64_t nbytes;
} tdp_busy_t;

typedef struct {
    uint32_t sid;
    int32_t device;        /* -1: host shared memory; else the device whose memory it is */
    uint8_t *base;         /* host memory, or (cuda) a CUDA device pointer never dereferenced here */
    uint64_t nbytes;
    uint64_t owner;
    uint64_t *guests;
    uint32_t nguests, guest_cap;
    void *keep;            /* the binding's handle on the memory (released after removal) */
    int32_t ordinal;       /* cuda: the CUDA device (the driver's ordinal) */
    uint8_t cuda;          /* the memory is CUDA device memory: only the driver touches it */
    tdp_busy_t *busy;
} tdp_seg_t;

typedef struct {
    pthread_rwlock_t lock;
    tdp_seg_t *segs;       /* sorted by sid */
    uint32_t n, cap;
    _Atomic uint64_t pinned_bytes, pin_cap; /* host bytes the workers page-locked; at most (0: any) */
} tdp_table_t;

/* ---- the worker -------------------------------------------------------------- */

/* One batch's device work (device.c): an event per CUDA device it used, the segments it keeps
 * busy, and the completions (indices into its batch's completions) of the requests that
 * queued it. */
typedef struct {
    CUevent ev[TDP_CUDA_MAX_DEVICES];
    CUevent evs[TDP_CUDA_MAX_DEVICES]; /* recorded before the flight's first work on a device: its device time */
    uint32_t started;           /* devices whose start event is recorded (bits) */
    uint32_t dused;             /* devices with work queued (bits) */
    uint32_t recorded;          /* of those, devices whose event is recorded (bits) */
    tdp_busy_t **held;
    uint32_t nheld, held_cap;
    uint32_t *devc, ndevc;
    CUresult fault;             /* the first driver error of this batch */
} tdp_flight_t;

typedef struct {
    trq_t *rq;                 /* the request queue, as consumer (the binding's Queue object's) */
    trq_t *cq;                 /* the completion queue, as producer */
    tdp_table_t *table;
    uint64_t session;
    int bell_fd;               /* the daemon's doorbell FIFO: wakes the Python loop */
    int cbell_fd;              /* the session's completion pipe (trio clients), or -1 */
    _Atomic uint64_t spin_ns;  /* how long an idle worker polls before it sleeps (set while it runs) */
    uint32_t batch_cap;        /* descriptors peeked at once (>= a whole chain when the ring allows) */
    tdp_desc_t *batch;
    tdp_comp_t *comps;
    _Atomic int mode;
    _Atomic int stop;
    atomic_int interrupt;      /* trq_wait's: set by stop */
    _Atomic uint32_t ctl;      /* futex word: bumped by Python to wake a parked worker */
    _Atomic uint64_t done;     /* request index below which everything is executed and completed */
    _Atomic uint64_t watch;    /* ring the bell once done >= watch (0: nobody watches) */
    _Atomic uint64_t limit;    /* serve descriptors below this request index only (a drain's cut) */
    _Atomic int signalled;     /* the bell was rung for Python; it clears this when it looks */
    /* counters (read by Python at any time; relaxed) */
    _Atomic uint64_t n_copy, n_fill, n_checksum, n_fence, n_bytes, n_batches, n_wakes;
    _Atomic uint64_t n_sleeps;  /* waits for descriptors or completion room that slept on the futex */
    _Atomic uint64_t n_rouses;  /* completions pushed to a client asleep on them: a FUTEX_WAKE each */
    _Atomic uint64_t handovers[TDP_WHY_COUNT];
    _Atomic int why;
    /* Latency from the peek that took a request to the push of its completion. */
    uint64_t hbounds_ns[TDP_HMAX];
    uint32_t nbounds;
    _Atomic uint64_t hist[TDP_KINDS][TDP_HMAX + 1];
    _Atomic uint64_t hsum_ns[TDP_KINDS];
    uint64_t kinds[TDP_KINDS];  /* requests of each kind since the last commit (worker-private) */
    /* This batch's CHECKSUM ranges (src VA, bytes), and the sums of copies that read or wrote
     * them: (pointer, bytes, word sum), dropped when a later write overlaps the range. */
    struct { uint64_t va, n; } want[TDP_MEMO];
    struct { const uint8_t *p; uint64_t n, sum; } memo[TDP_MEMO];
    uint32_t nwant, nmemo;
    uint64_t cneed; /* completion slots the next serve needs (a verified chain's), 0: one */
    _Atomic uint64_t n_fused;   /* checksums answered from a copy's sum */
    _Atomic uint64_t n_shared;  /* copies a copy helper took part in (tdp_copy_shared) */
    uint64_t t0;                /* when the current batch was peeked */
    /* Device work (device.c): one stream per CUDA device this worker used, and two flights:
     * the batch being served, and the one before it, whose work is queued and whose
     * completions are held ("parked") until its events pass, so that the copy engine has the
     * next batch while the worker waits for the last. */
    CUstream dstream[TDP_CUDA_MAX_DEVICES];
    uint32_t dext;              /* streams given by the daemon (its lanes' streams: CuPy's), not ours to destroy */
    int high;                   /* a latency tenant's: the streams it makes get the device's greatest priority */
    /* The bound on copies queued ahead (`queue_bytes`, 0: none): every `queue_bytes` issued on a
     * device an event is recorded, and the worker waits for the one before it first, so at most
     * about twice that is queued on the stream at any time. */
    uint64_t queue_bytes;
    uint64_t qsince[TDP_CUDA_MAX_DEVICES];
    CUevent qev[TDP_CUDA_MAX_DEVICES][2];
    uint8_t qcur[TDP_CUDA_MAX_DEVICES], qlive[TDP_CUDA_MAX_DEVICES];
    _Atomic uint64_t n_qwaits;  /* waits for the older half of the queue */
    tdp_flight_t fl[2];
    int cf;                     /* the current flight (the batch being served) */
    uint32_t cur;               /* the completion slot of the request being served */
    /* A copy not queued yet: the next copy that continues it in both ranges, on the same
     * device, joins it (contiguous pieces of a batch are one async copy). */
    struct { uint64_t dst, src, n; int ordinal; } mg;
    CUresult sticky;            /* a driver error that lost the context: every later device request fails */
    uint64_t dsince;            /* device bytes queued since the last commit */
    /* The parked batch: its completions, the request index `done` becomes once they are
     * pushed, and its latency accounting. */
    tdp_comp_t *pcomps;
    uint64_t pnc, pdone, pt0;
    uint64_t pkinds[TDP_KINDS];
    int parked;
    _Atomic uint64_t n_dcopy, n_dfill, n_dbytes, n_unpinned, n_dfaults, n_dwaits, n_dparks;
    _Atomic uint64_t n_dev_ns;  /* device time of its work: each flight's start to end event, per device */
    /* Graph runs the worker serves itself: the binding's runner (dataplane_type.c) runs a
     * RUN_GRAPH whose plan the daemon keeps, with the GIL, in this thread, and fills its
     * completion (1); 0: not one it keeps, handed over as any opcode the worker does not
     * serve. Called with no lock held, after the batch's device work so far is done. */
    int (*run)(void *ctx, const tdp_desc_t *d, tdp_comp_t *c);
    void (*run_end)(void *ctx); /* the thread's last act, if `run` was ever called */
    void *run_ctx;
    int ran;
    uint32_t run_dev;           /* devices the run being served queued work on (tdp_dev_run_stream) */
    _Atomic uint64_t n_runs;
    pthread_t thread;
    int started;
} tdp_worker_t;

/* ---- copy helpers ----------------------------------------------------------
 * One worker copies at one core's speed (about 10 GB/s on an EPYC VM, where two cores move
 * 13); a producer handing over 64 MiB batches leaves the other cores idle. So a copy of
 * TDP_SHARE_MIN bytes or more is shared, chunk by chunk (TDP_CHUNK, each translated under the
 * read lock as tdp_bytes does), with the process's copy helpers that are idle at that moment:
 * the worker offers the copy, takes chunks itself from the same counter, withdraws the offer
 * when none are left and waits for the helpers still inside it. Nobody waits for a helper: a
 * copy finds none idle and runs alone, and a helper that comes late finds no chunk left. Word
 * sums add, so a verified or memoised copy's sum is its chunks' sums added (every chunk starts
 * a multiple of TDP_CHUNK in: the range's own words). Only copies whose whole ranges translate
 * now, on one device, into memory that does not overlap (aliases of one mapping copy in order,
 * alone) are shared. Idle helpers sleep on a condition variable and use no CPU. */
#define TDP_SHARE_MIN (2 * TDP_CHUNK)
#define TDP_UNSHARED (-3)
#define TDP_HELPERS_MAX 8

typedef struct {
    tdp_table_t *table;
    uint64_t session, dva, sva, n, chunks;
    int stream, summed;
    _Atomic int *stop;         /* the worker's */
    _Atomic uint64_t next;     /* the next chunk to take */
    _Atomic uint64_t sum;      /* the taken chunks' sums (summed copies) */
    _Atomic int why;           /* the first chunk that failed: its TDP_WHY_* (then no chunk is taken after it) */
    int active, joined;        /* helpers inside now, and ever (under the pool's mutex) */
} tdp_job_t;

/* The table (under its rwlock; the binding holds no GIL across the write lock). */
int tdp_table_init(tdp_table_t *t);
int tdp_table_add(tdp_table_t *t, uint32_t sid, uint8_t *base, uint64_t nbytes, uint64_t owner, int32_t device, void *keep);
/* A segment of CUDA device memory (`ptr` on CUDA device `ordinal`). */
int tdp_table_add_cuda(tdp_table_t *t, uint32_t sid, uint64_t ptr, uint64_t nbytes, uint64_t owner, int32_t device,
                       int32_t ordinal, void *keep);
/* Take a segment out; its keep handle (NULL if absent), in *cuda whether it was device memory,
 * and in *busy what tdp_busy_retire must settle once the write lock is released. */
void *tdp_table_remove(tdp_table_t *t, uint32_t sid, tdp_busy_t **busy, int *cuda);
/* Wait until no queued device work touches the removed segment, unpin it, free the record
 * (without the table's lock, without the GIL). */
void tdp_busy_retire(tdp_table_t *t, tdp_busy_t *b);
/* The keeper thread (device.c): page-lock a newly registered host segment in the background
 * (with the driver loaded); and retire a removed segment: at once when no device work touches
 * it and it is not pinned (0: the caller releases `keep` now), else on the keeper's thread,
 * which then calls release(keep) (1). */
void tdp_keeper_pin(tdp_table_t *t, tdp_busy_t *b);
int tdp_keeper_retire(tdp_table_t *t, tdp_busy_t *b, void (*release)(void *), void *keep);
/* Wait until the keeper has done everything queued (a table's end). */
void tdp_keeper_drain(void);
/* A segment's busy record (under either lock), or NULL. */
tdp_busy_t *tdp_table_busy(tdp_table_t *t, uint32_t sid);
/* The entry [va, va + n) lies in, if `session` may use it (host or device memory); *off gets
 * the offset. Under the read lock. */
const tdp_seg_t *tdp_lookup(const tdp_table_t *t, uint64_t session, uint64_t va, uint64_t n, uint64_t *off);
int tdp_table_guest(tdp_table_t *t, uint32_t sid, uint64_t session, int allow);
uint8_t *tdp_translate(const tdp_table_t *t, uint64_t session, uint64_t va, uint64_t n, int32_t *device);
/* checksum64's word sum (without the length term) of n bytes at p. */
uint64_t tdp_sum64(const uint8_t *p, uint64_t n);
/* Wake a worker parked on its private word (`ctl`). */
void tdp_private_wake(_Atomic uint32_t *w);
/* Start a worker's thread (0, or an errno); stop and join it (call without the GIL). */
int tdp_worker_start(tdp_worker_t *w);
void tdp_worker_stop(tdp_worker_t *w);
/* Device work (device.c). A COPY, FILL or CHECKSUM (a piece of a verified copy: `sum`) that
 * touches CUDA memory: queued on the worker's stream (0), or a TDP_WHY_* to hand it over;
 * TDP_NOT_DEVICE when both sides are host memory (the caller's to do). Wait for what is
 * queued (before host work that follows it, and before completions are pushed); release the
 * streams when the worker ends. */
#define TDP_NOT_DEVICE (-4)
int tdp_dev_op(tdp_worker_t *w, int op, uint64_t dva, uint64_t sva, uint64_t n, uint8_t value, int sum);
void tdp_dev_wait(tdp_worker_t *w);   /* (dataplane.c: it pushes the parked batch's completions) */
void tdp_dev_close(tdp_worker_t *w);  /* (after tdp_dev_wait) */
/* The current flight's device work is queued: record its events (0), or -1 when it has none
 * or a driver error (then the caller waits for it instead of parking it). */
int tdp_dev_record(tdp_worker_t *w);
/* Wait for the current flight's work and settle it (faults onto its completions). */
void tdp_dev_settle(tdp_worker_t *w);
/* Wait for the parked flight's work and settle it onto `comps` (the parked completions). */
void tdp_dev_settle_parked(tdp_worker_t *w, tdp_comp_t *comps);
/* Make the parked flight the current one's successor: swap flights (after parking). */
void tdp_dev_swap(tdp_worker_t *w);
/* A graph run's device work, from the worker's runner on its thread (device.c). */
CUresult tdp_dev_run_stream(tdp_worker_t *w, int ordinal, CUstream *out);
int tdp_dev_run_hold(tdp_worker_t *w, uint32_t sid);
void tdp_dev_run_done(tdp_worker_t *w, int served);
/* Copies of device memory are queued in pieces of at most this many bytes, so that one tenant's
 * big copy never holds a copy engine for long. */
#define TDP_DEV_CHUNK (4ull << 20)
/* Completions of device work are pushed early once this many device bytes were queued. */
#define TDP_DEV_FLUSH_BYTES (16ull << 20)

/* Let `want` copy helpers (at most TDP_HELPERS_MAX) share large copies; how many may now. */
int tdp_copy_helpers(int want);

#endif /* TRANSFER_DATAPLANE_H */
