/*
 * dataplane_type.c: transfer._native.Table (the native mirror of the mapping table) and
 * transfer._native.Worker (one ring's data-plane thread), over dataplane.h.
 */
#include "binding.h"

typedef struct {
    PyObject_HEAD
    tdp_table_t t;
    int ok;
} TableObject;

static int Table_init(TableObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "", kwlist))
        return -1;
    if (self->ok) {
        PyErr_SetString(PyExc_RuntimeError, "already initialised");
        return -1;
    }
    if (tdp_table_init(&self->t) != 0) {
        PyErr_SetString(PyExc_OSError, "cannot create the table's lock");
        return -1;
    }
    self->ok = 1;
    return 0;
}

static void release_keep(void *keep)
{
    if (keep) {
        PyBuffer_Release((Py_buffer *)keep);
        PyMem_Free(keep);
    }
}

/* What a removed segment's entry held: a buffer export (host memory) or an object reference
 * (device memory). Released with the GIL, after its device work. */
typedef struct {
    void *keep;
    int cuda;
} kept_t;

static void release_now(void *keep, int cuda)
{
    if (cuda)
        Py_XDECREF((PyObject *)keep);
    else
        release_keep(keep);
}

static int release_pending(void *arg)
{
    kept_t *k = arg;
    release_now(k->keep, k->cuda);
    PyMem_RawFree(k);
    return 0;
}

/* On the keeper's thread: hand the release to the interpreter's main thread. */
static void release_later(void *arg)
{
    while (Py_AddPendingCall(release_pending, arg) != 0) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL); /* (its queue of pending calls is full: the main thread drains it) */
    }
}

static void Table_dealloc(TableObject *self)
{
    if (self->ok) {
        Py_BEGIN_ALLOW_THREADS
        tdp_keeper_drain(); /* (its items point at this table) */
        Py_END_ALLOW_THREADS
        /* Workers hold a reference: none is running. */
        for (uint32_t i = 0; i < self->t.n; i++) {
            free(self->t.segs[i].guests);
            tdp_busy_retire(&self->t, self->t.segs[i].busy);
            if (self->t.segs[i].cuda)
                Py_XDECREF((PyObject *)self->t.segs[i].keep);
            else
                release_keep(self->t.segs[i].keep);
        }
        free(self->t.segs);
        pthread_rwlock_destroy(&self->t.lock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int table_ok(TableObject *self)
{
    if (!self->ok) {
        PyErr_SetString(PyExc_ValueError, "table not initialised");
        return 0;
    }
    return 1;
}

/* The write lock, waited for without the GIL (a worker may hold the read lock for a chunk). */
static void write_lock(TableObject *self)
{
    if (pthread_rwlock_trywrlock(&self->t.lock) != 0) {
        Py_BEGIN_ALLOW_THREADS
        pthread_rwlock_wrlock(&self->t.lock);
        Py_END_ALLOW_THREADS
    }
}

/* A table insert that failed (tdp_table_add's -1 or -2), as the exception it is. */
static PyObject *add_failed(int rc, unsigned int sid)
{
    if (rc == -2)
        return PyErr_Format(PyExc_KeyError, "segment %u is already in the table", sid);
    return PyErr_NoMemory();
}

static PyObject *Table_add(TableObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"sid", "buffer", "owner", "device", NULL};
    unsigned int sid;
    PyObject *obj;
    unsigned long long owner;
    int device = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "IOK|i", kwlist, &sid, &obj, &owner, &device))
        return NULL;
    if (!table_ok(self))
        return NULL;
    if (sid == 0 || sid >= (1u << 24)) {
        PyErr_SetString(PyExc_ValueError, "segment id out of range");
        return NULL;
    }
    Py_buffer *view = PyMem_Malloc(sizeof *view);
    if (!view)
        return PyErr_NoMemory();
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0) {
        PyMem_Free(view);
        return NULL;
    }
    write_lock(self);
    int rc = tdp_table_add(&self->t, sid, view->buf, (uint64_t)view->len, owner, device, view);
    if (rc == 0 && device < 0) /* shared memory: page-locked in the background for device copies */
        tdp_keeper_pin(&self->t, tdp_table_busy(&self->t, sid));
    pthread_rwlock_unlock(&self->t.lock);
    if (rc < 0) {
        release_keep(view);
        return add_failed(rc, sid);
    }
    Py_RETURN_NONE;
}

/* add_cuda(sid, ptr, nbytes, owner, device, ordinal, keep): CUDA device memory. `keep` is
 * referenced until the segment is removed (the allocation's owner). */
static PyObject *Table_add_cuda(TableObject *self, PyObject *args)
{
    unsigned int sid;
    unsigned long long ptr, nbytes, owner;
    int device, ordinal;
    PyObject *keep;
    if (!PyArg_ParseTuple(args, "IKKKiiO", &sid, &ptr, &nbytes, &owner, &device, &ordinal, &keep) || !table_ok(self))
        return NULL;
    if (sid == 0 || sid >= (1u << 24)) {
        PyErr_SetString(PyExc_ValueError, "segment id out of range");
        return NULL;
    }
    if (!tdp_cuda_loaded() || ordinal < 0 || ordinal >= tdp_cuda_devices() || device < 0 || !ptr ||
        nbytes > TDP_OFFSET_MASK || ptr + nbytes < ptr) {
        PyErr_Format(PyExc_ValueError, "add_cuda: no CUDA device %d loaded, or a bad range", ordinal);
        return NULL;
    }
    Py_INCREF(keep);
    write_lock(self);
    int rc = tdp_table_add_cuda(&self->t, sid, ptr, nbytes, owner, device, ordinal, keep);
    pthread_rwlock_unlock(&self->t.lock);
    if (rc < 0) {
        Py_DECREF(keep);
        return add_failed(rc, sid);
    }
    Py_RETURN_NONE;
}

static PyObject *Table_remove(TableObject *self, PyObject *arg)
{
    unsigned long sid = PyLong_AsUnsignedLong(arg);
    if (sid == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    if (!table_ok(self))
        return NULL;
    write_lock(self);
    tdp_busy_t *busy;
    int cuda = 0;
    void *keep = tdp_table_remove(&self->t, (uint32_t)sid, &busy, &cuda);
    pthread_rwlock_unlock(&self->t.lock); /* no worker is inside these bytes now */
    if (!busy)
        Py_RETURN_FALSE;
    /* Device work queued on it, or its page-locking, is settled by the keeper, which holds the
     * memory (the exported buffer or the device allocation) until then: the loop never waits. */
    kept_t *k = PyMem_RawMalloc(sizeof *k);
    if (k) {
        k->keep = keep;
        k->cuda = cuda;
    }
    if (!k || tdp_keeper_retire(&self->t, busy, release_later, k) == 0) {
        if (!k) {
            Py_BEGIN_ALLOW_THREADS
            tdp_busy_retire(&self->t, busy);
            Py_END_ALLOW_THREADS
        }
        PyMem_RawFree(k);
        release_now(keep, cuda);
    }
    Py_RETURN_TRUE;
}

static PyObject *Table_get_pin_cap(TableObject *self, void *c)
{
    return PyLong_FromUnsignedLongLong(atomic_load(&self->t.pin_cap));
}

static int Table_set_pin_cap(TableObject *self, PyObject *v, void *c)
{
    unsigned long long cap = v ? PyLong_AsUnsignedLongLong(v) : (unsigned long long)-1;
    if (!v || (cap == (unsigned long long)-1 && PyErr_Occurred())) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "pin_cap: bytes (0: no cap)");
        return -1;
    }
    atomic_store(&self->t.pin_cap, cap);
    return 0;
}

static PyObject *Table_get_pinned(TableObject *self, void *c)
{
    return PyLong_FromUnsignedLongLong(atomic_load(&self->t.pinned_bytes));
}

static PyGetSetDef Table_getset[] = {
    {"pin_cap", (getter)Table_get_pin_cap, (setter)Table_set_pin_cap,
     "host bytes the workers may page-lock for device copies (0: no cap)", NULL},
    {"pinned_bytes", (getter)Table_get_pinned, NULL, "host bytes the workers page-locked", NULL},
    {NULL}};

static PyObject *Table_guest(TableObject *self, PyObject *args)
{
    unsigned int sid;
    unsigned long long session;
    int allow;
    if (!PyArg_ParseTuple(args, "IKp", &sid, &session, &allow) || !table_ok(self))
        return NULL;
    write_lock(self);
    int rc = tdp_table_guest(&self->t, sid, session, allow);
    pthread_rwlock_unlock(&self->t.lock);
    if (rc < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *Table_translate(TableObject *self, PyObject *args)
{
    unsigned long long session, va, n;
    if (!PyArg_ParseTuple(args, "KKK", &session, &va, &n) || !table_ok(self))
        return NULL;
    int32_t dev;
    pthread_rwlock_rdlock(&self->t.lock);
    uint8_t *p = tdp_translate(&self->t, session, va, n, &dev);
    pthread_rwlock_unlock(&self->t.lock);
    if (!p)
        Py_RETURN_NONE;
    return PyLong_FromVoidPtr(p);
}

static Py_ssize_t Table_len(TableObject *self)
{
    return self->ok ? (Py_ssize_t)self->t.n : 0;
}

static PyMethodDef Table_methods[] = {
    {"add", (PyCFunction)(void (*)(void))Table_add, METH_VARARGS | METH_KEYWORDS,
     "add(sid, buffer, owner, device=-1): mirror a segment (holds the buffer exported until removed)"},
    {"add_cuda", (PyCFunction)Table_add_cuda, METH_VARARGS,
     "add_cuda(sid, ptr, nbytes, owner, device, ordinal, keep): mirror a segment of CUDA device memory"},
    {"remove", (PyCFunction)Table_remove, METH_O,
     "remove(sid) -> bool: drop a segment once no worker touches it (waits without the GIL)"},
    {"guest", (PyCFunction)Table_guest, METH_VARARGS,
     "guest(sid, session, allow): let another session use the segment (Attach), or stop it"},
    {"translate", (PyCFunction)Table_translate, METH_VARARGS,
     "translate(session, va, nbytes) -> address | None: what a worker would touch"},
    {NULL}};

static PySequenceMethods Table_as_sequence = {.sq_length = (lenfunc)Table_len};

PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transfer._native.Table",
    .tp_basicsize = sizeof(TableObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The data plane's mapping table: segment id -> host memory, owner, guests (dataplane.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Table_init,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_methods = Table_methods,
    .tp_getset = Table_getset,
    .tp_as_sequence = &Table_as_sequence,
};

/* Worker: one thread serving one session's ring (dataplane.h). */
typedef struct {
    PyObject_HEAD
    tdp_worker_t w;
    TableObject *table;
    QueueObject *requests, *completions;
    PyObject *runner; /* runner(id, graph, src, dst, stream) -> status, or None: not kept (hand over) */
    /* The worker thread's Python thread state, made at its first run and kept until it ends
     * (a state made and destroyed per call, as a bare PyGILState_Ensure does, costs more than
     * a small graph's whole run). */
    PyThreadState *ts;
    PyGILState_STATE gs;
} WorkerObject;

/* The worker's tdp_worker_t.run: a RUN_GRAPH served by the daemon's runner, on the worker's
 * thread, with the GIL. A status other than 0 is an error whose message the runner sent on
 * the control socket (COMPLETION_DETAIL); an exception in the runner is a bug: reported, and
 * the descriptor handed over (the Python pass answers it). */
static int worker_run(void *ctx, const tdp_desc_t *d, tdp_comp_t *c)
{
    WorkerObject *self = ctx;
    int served = 0;
    if (IS_FINALIZING())
        return 0; /* (a thread must not take the GIL then: the interpreter is going) */
    if (!self->ts) {
        self->gs = PyGILState_Ensure();
        self->ts = PyThreadState_Get();
    } else {
        PyEval_RestoreThread(self->ts);
    }
    PyObject *r = PyObject_CallFunction(self->runner, "KKKKI", (unsigned long long)d->id, (unsigned long long)d->arg0,
                                        (unsigned long long)d->src, (unsigned long long)d->dst, (unsigned int)d->stream);
    if (!r) {
        PyErr_WriteUnraisable(self->runner);
    } else if (r != Py_None) {
        long status = PyLong_AsLong(r);
        if (status == -1 && PyErr_Occurred()) {
            PyErr_WriteUnraisable(self->runner);
        } else {
            c->status = (int32_t)status;
            c->flags = status ? TDP_COMPLETION_DETAIL : 0;
            served = 1;
        }
    }
    Py_XDECREF(r);
    PyEval_SaveThread();
    return served;
}

/* The worker thread ends: its thread state goes (unless the interpreter is going first). */
static void worker_run_end(void *ctx)
{
    WorkerObject *self = ctx;
    if (!self->ts || IS_FINALIZING())
        return;
    PyEval_RestoreThread(self->ts);
    self->ts = NULL;
    PyGILState_Release(self->gs);
}

/* A worker's spin in nanoseconds: at most 10 ms (a worker polls between requests, it does
 * not own a core). */
static uint64_t spin_ns_of(double spin)
{
    return spin <= 0 ? 0 : spin >= 0.01 ? 10000000ull : (uint64_t)(spin * 1e9);
}

static int Worker_init(WorkerObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"table", "requests", "completions", "session", "bell_fd", "cbell_fd", "spin", "bounds", "streams",
                             "runner", "high_priority", "queue_bytes", NULL};
    PyObject *table, *rq, *cq, *bounds = NULL, *streams = NULL, *runner = NULL;
    int high = 0;
    unsigned long long queue_bytes = 0;
    unsigned long long session;
    int bell = -1, cbell = -1;
    double spin = 20e-6;
    if (self->table) {
        PyErr_SetString(PyExc_RuntimeError, "already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!K|iidOOOpK", kwlist, &TableType, &table, &QueueType, &rq,
                                     &QueueType, &cq, &session, &bell, &cbell, &spin, &bounds, &streams, &runner, &high,
                                     &queue_bytes))
        return -1;
    if (runner == Py_None)
        runner = NULL;
    if (runner && !PyCallable_Check(runner)) {
        PyErr_SetString(PyExc_TypeError, "runner: a callable (id, graph, src, dst, stream) -> status or None");
        return -1;
    }
    /* streams: {CUDA ordinal: a CUstream of the caller's} the worker queues its device work on
     * (the daemon's lane streams: one stream model with CuPy); it never destroys them. */
    CUstream ext[TDP_CUDA_MAX_DEVICES] = {0};
    if (streams && streams != Py_None) {
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        if (!PyDict_Check(streams)) {
            PyErr_SetString(PyExc_TypeError, "streams: a dict {CUDA ordinal: stream handle}");
            return -1;
        }
        while (PyDict_Next(streams, &pos, &key, &value)) {
            long ordinal = PyLong_AsLong(key);
            unsigned long long ptr = PyLong_AsUnsignedLongLong(value);
            if (PyErr_Occurred())
                return -1;
            if (ordinal < 0 || ordinal >= tdp_cuda_devices() || !ptr) {
                PyErr_Format(PyExc_ValueError, "streams: no CUDA device %ld loaded, or a null stream", ordinal);
                return -1;
            }
            ext[ordinal] = (CUstream)(uintptr_t)ptr;
        }
    }
    uint64_t hb[TDP_HMAX];
    uint32_t nb = 0;
    if (bounds && bounds != Py_None) {
        PyObject *seq = PySequence_Fast(bounds, "bounds must be a sequence of seconds");
        if (!seq)
            return -1;
        Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
        for (Py_ssize_t i = 0; i < k && nb < TDP_HMAX; i++) {
            double v = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
            if (v == -1.0 && PyErr_Occurred()) {
                Py_DECREF(seq);
                return -1;
            }
            if (v != v || v > 1e9) /* inf (the +Inf bucket) and nan end the finite bounds */
                break;
            hb[nb++] = v <= 0 ? 0 : (uint64_t)(v * 1e9);
        }
        Py_DECREF(seq);
    }
    QueueObject *r = (QueueObject *)rq, *c = (QueueObject *)cq;
    if (!table_ok((TableObject *)table) || check_role(r, 0) < 0 || check_role(c, 1) < 0)
        return -1;
    if (r->q.slot_size != sizeof(tdp_desc_t) || c->q.slot_size != sizeof(tdp_comp_t)) {
        PyErr_SetString(PyExc_ValueError, "not a request ring: slot sizes differ from the descriptor layout");
        return -1;
    }
    if (r->lent || c->lent) {
        PyErr_SetString(PyExc_RuntimeError, "another worker serves this ring");
        return -1;
    }
    tdp_worker_t *w = &self->w;
    memset(w, 0, sizeof *w);
    w->rq = &r->q;
    w->cq = &c->q;
    w->table = &((TableObject *)table)->t;
    w->session = session;
    w->bell_fd = bell;
    w->cbell_fd = cbell;
    atomic_store(&w->spin_ns, spin_ns_of(spin));
    memcpy(w->hbounds_ns, hb, nb * sizeof *hb);
    w->nbounds = nb;
    w->high = high;
    w->queue_bytes = queue_bytes;
    if (runner) {
        Py_INCREF(runner);
        self->runner = runner;
        w->run = worker_run;
        w->run_end = worker_run_end;
        w->run_ctx = self;
    }
    for (int d = 0; d < TDP_CUDA_MAX_DEVICES; d++) {
        if (ext[d]) {
            w->dstream[d] = ext[d];
            w->dext |= 1u << d;
        }
    }
    int rc = tdp_worker_start(w);
    if (rc != 0) {
        tdp_worker_stop(w);
        errno = rc;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    Py_INCREF(table);
    Py_INCREF(rq);
    Py_INCREF(cq);
    self->table = (TableObject *)table;
    self->requests = r;
    self->completions = c;
    r->lent = c->lent = 1;
    return 0;
}

static void worker_stop(WorkerObject *self)
{
    if (!self->table || !self->requests)
        return;
    Py_BEGIN_ALLOW_THREADS
    tdp_worker_stop(&self->w);
    Py_END_ALLOW_THREADS
    self->requests->lent = self->completions->lent = 0;
    Py_CLEAR(self->requests);
    Py_CLEAR(self->completions);
    Py_CLEAR(self->runner); /* (the thread is joined: it calls it no more) */
}

static void Worker_dealloc(WorkerObject *self)
{
    worker_stop(self);
    Py_CLEAR(self->runner);
    Py_CLEAR(self->table);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int worker_ok(WorkerObject *self)
{
    if (!self->table || !self->requests) {
        PyErr_SetString(PyExc_ValueError, "the worker is stopped");
        return 0;
    }
    return 1;
}

static PyObject *Worker_stop(WorkerObject *self, PyObject *unused)
{
    worker_stop(self);
    Py_RETURN_NONE;
}

static PyObject *Worker_resume(WorkerObject *self, PyObject *unused)
{
    if (!worker_ok(self))
        return NULL;
    if (atomic_load_explicit(&self->w.mode, memory_order_acquire) != TDP_PYTHON) {
        PyErr_SetString(PyExc_RuntimeError, "resume: the worker does not stand aside (mode is not PYTHON)");
        return NULL;
    }
    atomic_store_explicit(&self->w.why, TDP_WHY_NONE, memory_order_relaxed);
    atomic_store_explicit(&self->w.done, self->w.rq->mine, memory_order_seq_cst);
    atomic_store_explicit(&self->w.mode, TDP_NATIVE, memory_order_release);
    atomic_fetch_add_explicit(&self->w.ctl, 1, memory_order_release);
    tdp_private_wake(&self->w.ctl);
    Py_RETURN_NONE;
}

static PyObject *Worker_watch(WorkerObject *self, PyObject *arg)
{
    unsigned long long index = PyLong_AsUnsignedLongLong(arg);
    if ((index == (unsigned long long)-1 && PyErr_Occurred()) || !worker_ok(self))
        return NULL;
    atomic_store_explicit(&self->w.watch, index, memory_order_seq_cst);
    return PyLong_FromUnsignedLongLong(atomic_load_explicit(&self->w.done, memory_order_seq_cst));
}

/* The runner's calls, on the worker's own thread only (where the worker is inside the run). */
static int on_worker_thread(WorkerObject *self)
{
    if (!self->w.started || !pthread_equal(pthread_self(), self->w.thread)) {
        PyErr_SetString(PyExc_RuntimeError, "only a graph run on the worker's thread may call this");
        return 0;
    }
    return 1;
}

static PyObject *Worker_device_stream(WorkerObject *self, PyObject *arg)
{
    long ordinal = PyLong_AsLong(arg);
    if ((ordinal == -1 && PyErr_Occurred()) || !on_worker_thread(self))
        return NULL;
    CUstream s = NULL;
    CUresult r = tdp_dev_run_stream(&self->w, (int)ordinal, &s);
    if (r != 0)
        return PyErr_Format(PyExc_OSError, "the worker's stream on CUDA device %ld: %s (CUDA error %d)", ordinal,
                            tdp_cuda_describe(r), r);
    return PyLong_FromVoidPtr(s);
}

static PyObject *Worker_hold(WorkerObject *self, PyObject *arg)
{
    unsigned long sid = PyLong_AsUnsignedLong(arg);
    if ((sid == (unsigned long)-1 && PyErr_Occurred()) || !on_worker_thread(self))
        return NULL;
    return PyBool_FromLong(sid <= UINT32_MAX && tdp_dev_run_hold(&self->w, (uint32_t)sid) == 0);
}

static PyObject *Worker_device_wait(WorkerObject *self, PyObject *unused)
{
    if (!on_worker_thread(self))
        return NULL;
    tdp_worker_t *w = &self->w;
    if (w->parked || w->fl[w->cf].dused || w->fl[w->cf].ndevc || w->mg.n) {
        Py_BEGIN_ALLOW_THREADS
        tdp_dev_wait(w);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *Worker_take_signal(WorkerObject *self, PyObject *unused)
{
    return PyBool_FromLong(atomic_exchange_explicit(&self->w.signalled, 0, memory_order_seq_cst));
}

static PyObject *Worker_tail(WorkerObject *self, PyObject *unused)
{
    if (!worker_ok(self))
        return NULL;
    return PyLong_FromUnsignedLongLong(atomic_load_explicit(self->w.rq->tail, memory_order_acquire));
}

static PyObject *Worker_counters(WorkerObject *self, PyObject *unused)
{
    tdp_worker_t *w = &self->w;
#define C(x) (unsigned long long)atomic_load_explicit(&w->x, memory_order_relaxed)
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsK}", "copy", C(n_copy), "fill", C(n_fill),
                         "checksum", C(n_checksum), "fused", C(n_fused), "shared", C(n_shared), "fence", C(n_fence),
                         "bytes", C(n_bytes),
                         "batches", C(n_batches), "wakes", C(n_wakes), "sleeps", C(n_sleeps), "rouses", C(n_rouses),
                         "handover_opcode", C(handovers[TDP_WHY_OPCODE]),
                         "handover_fields", C(handovers[TDP_WHY_FIELDS]),
                         "handover_address", C(handovers[TDP_WHY_ADDRESS]),
                         "handover_devices", C(handovers[TDP_WHY_DEVICES]),
                         "handover_chain", C(handovers[TDP_WHY_CHAIN]),
                         "handover_after", C(handovers[TDP_WHY_AFTER]),
                         "handover_device", C(handovers[TDP_WHY_DEVICE]),
                         "device_copy", C(n_dcopy), "device_fill", C(n_dfill), "device_bytes", C(n_dbytes),
                         "device_unpinned", C(n_unpinned), "device_faults", C(n_dfaults), "device_waits", C(n_dwaits), "device_parked", C(n_dparks),
                         "graph", C(n_runs), "device_ns", C(n_dev_ns), "device_queue_waits", C(n_qwaits),
                         "done", C(done));
#undef C
}

static PyObject *Worker_latency(WorkerObject *self, PyObject *unused)
{
    /* {kind: (counts per bucket (len(bounds) + 1), sum of seconds)} */
    static const char *names[TDP_KINDS] = {"copy", "copyv", "fill", "checksum"};
    PyObject *out = PyDict_New();
    if (!out)
        return NULL;
    for (int k = 0; k < TDP_KINDS; k++) {
        PyObject *counts = PyList_New(self->w.nbounds + 1);
        if (!counts)
            goto fail;
        for (uint32_t b = 0; b <= self->w.nbounds; b++)
            PyList_SET_ITEM(counts, b, PyLong_FromUnsignedLongLong(
                atomic_load_explicit(&self->w.hist[k][b], memory_order_relaxed)));
        double sum = atomic_load_explicit(&self->w.hsum_ns[k], memory_order_relaxed) / 1e9;
        PyObject *v = Py_BuildValue("(Nd)", counts, sum);
        if (!v || PyDict_SetItemString(out, names[k], v) < 0) {
            Py_XDECREF(v);
            goto fail;
        }
        Py_DECREF(v);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *Worker_get_mode(WorkerObject *self, void *c)
{
    return PyLong_FromLong(atomic_load_explicit(&self->w.mode, memory_order_acquire));
}

static PyObject *Worker_get_why(WorkerObject *self, void *c)
{
    static const char *names[TDP_WHY_COUNT] = {"", "opcode", "fields", "address", "devices", "chain", "after", "device"};
    int why = atomic_load_explicit(&self->w.why, memory_order_relaxed);
    return PyUnicode_FromString(why >= 0 && why < TDP_WHY_COUNT ? names[why] : "?");
}

static PyObject *Worker_get_spin(WorkerObject *self, void *c)
{
    return PyFloat_FromDouble(atomic_load_explicit(&self->w.spin_ns, memory_order_relaxed) / 1e9);
}

static int Worker_set_spin(WorkerObject *self, PyObject *v, void *c)
{
    double spin = v ? PyFloat_AsDouble(v) : -1.0;
    if (!v || (spin == -1.0 && PyErr_Occurred())) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "spin: seconds, a number");
        return -1;
    }
    atomic_store_explicit(&self->w.spin_ns, spin_ns_of(spin), memory_order_relaxed); /* read at its next wait */
    return 0;
}

static PyObject *Worker_get_done(WorkerObject *self, void *c)
{
    return PyLong_FromUnsignedLongLong(atomic_load_explicit(&self->w.done, memory_order_seq_cst));
}

static PyObject *Worker_get_limit(WorkerObject *self, void *c)
{
    return PyLong_FromUnsignedLongLong(atomic_load_explicit(&self->w.limit, memory_order_acquire));
}

static int Worker_set_limit(WorkerObject *self, PyObject *v, void *c)
{
    unsigned long long limit = v ? PyLong_AsUnsignedLongLong(v) : (unsigned long long)-1;
    if (!v || (limit == (unsigned long long)-1 && PyErr_Occurred())) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "limit: a request index");
        return -1;
    }
    atomic_store_explicit(&self->w.limit, limit, memory_order_release);
    atomic_fetch_add_explicit(&self->w.ctl, 1, memory_order_release);
    tdp_private_wake(&self->w.ctl);
    return 0;
}

static PyMethodDef Worker_methods[] = {
    {"stop", (PyCFunction)Worker_stop, METH_NOARGS, "stop and join the thread (idempotent)"},
    {"device_stream", (PyCFunction)Worker_device_stream, METH_O,
     "device_stream(ordinal) -> CUstream: (a graph run, on the worker's thread) the stream to queue its device work on"},
    {"hold", (PyCFunction)Worker_hold, METH_O,
     "hold(segment id) -> bool: (a graph run) keep the segment's memory until the run's device work is done"},
    {"device_wait", (PyCFunction)Worker_device_wait, METH_NOARGS,
     "device_wait(): (a graph run on the host) wait for the device work queued before it"},
    {"resume", (PyCFunction)Worker_resume, METH_NOARGS,
     "hand the ring back to the worker (Python has stopped touching it)"},
    {"watch", (PyCFunction)Worker_watch, METH_O,
     "watch(index) -> done: ring the bell once `done` reaches index; returns `done` now"},
    {"take_signal", (PyCFunction)Worker_take_signal, METH_NOARGS,
     "whether the worker rang the bell since the last call (and clear it)"},
    {"tail", (PyCFunction)Worker_tail, METH_NOARGS, "the client's published request index (unvalidated)"},
    {"counters", (PyCFunction)Worker_counters, METH_NOARGS, "requests, bytes, wakes and handovers so far"},
    {"latency", (PyCFunction)Worker_latency, METH_NOARGS,
     "{kind: (counts per latency bucket, total seconds)} so far (peek to completion)"},
    {NULL}};

static PyGetSetDef Worker_getset[] = {
    {"mode", (getter)Worker_get_mode, NULL, "0 native (the worker owns the ring), 1 python, 2 broken", NULL},
    {"why", (getter)Worker_get_why, NULL, "why it last handed the ring to Python", NULL},
    {"done", (getter)Worker_get_done, NULL, "request index below which all is executed and completed", NULL},
    {"limit", (getter)Worker_get_limit, (setter)Worker_set_limit,
     "serve descriptors below this request index only (a drain's cut; 2**64-1: all)", NULL},
    {"spin", (getter)Worker_get_spin, (setter)Worker_set_spin, "seconds it polls an empty ring before it sleeps (at most 0.01)", NULL},
    {NULL}};

PyTypeObject WorkerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transfer._native.Worker",
    .tp_basicsize = sizeof(WorkerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A data-plane thread serving one ring's copies, fills, checksums and fences (dataplane.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Worker_init,
    .tp_dealloc = (destructor)Worker_dealloc,
    .tp_methods = Worker_methods,
    .tp_getset = Worker_getset,
};

