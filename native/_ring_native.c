/*
 * transfer._ring_native: CPython binding of native/ring.h.
 *
 * One type, Queue: one endpoint (producer or consumer) of one SPSC queue in
 * a shared mapping. transfer/_ring.py owns the layout (offsets), the file,
 * the header and the NumPy dtypes; this module only moves slots and
 * indices. It takes a buffer (the mmap) and holds it exported until
 * close(), so the mapping cannot be unmapped under it.
 *
 * Threads: an endpoint is single-threaded (SPSC), except that close() may
 * be called from another thread while wait() sleeps: wait runs without the
 * GIL, counts itself in `waiting`, and close() interrupts it and waits for
 * it to leave before releasing the buffer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "dataplane.h"

#define MAX_FIELDS 16

static PyObject *CorruptError; /* set by _set_corrupt_error(); RuntimeError until then */

typedef struct {
    uint32_t offset, size, is_signed;
} field_t;

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    int producer;
    trq_t q;
    field_t fields[MAX_FIELDS];
    int nfields;
    atomic_int interrupt;
    int waiting;
    int lent;  /* a Worker uses this queue's cursors: it must be stopped before close() */
    int bell;  /* producer: an fd to write one byte to when a wake finds the peer armed with 1 */
} QueueObject;

/* Wake the peer for what this producer published: the futex if it sleeps there, and the
 * bell fd too when it armed with 1 (it sleeps in an event loop on that fd). The word it
 * cleared (0: nobody slept). */
static uint32_t ring_peer(QueueObject *self)
{
    uint32_t was = trq_ring_doorbell(self->producer ? self->q.data_waiter : self->q.space_waiter);
    if (was == 1 && self->producer && self->bell >= 0) {
        ssize_t r = write(self->bell, "", 1);
        (void)r; /* a full pipe rings already; a closed one has nobody to wake */
    }
    return was;
}

static int check_open(QueueObject *self)
{
    if (!self->has_view) {
        PyErr_SetString(PyExc_ValueError, "ring queue is closed");
        return -1;
    }
    return 0;
}

static int check_role(QueueObject *self, int producer)
{
    if (check_open(self) < 0)
        return -1;
    if (self->producer != producer) {
        PyErr_SetString(PyExc_TypeError,
                        producer ? "this endpoint consumes this queue; it cannot push"
                                 : "this endpoint produces into this queue; it cannot pop");
        return -1;
    }
    return 0;
}

static PyObject *corrupt(QueueObject *self)
{
    PyErr_SetString(CorruptError ? CorruptError : PyExc_RuntimeError,
                    self->producer ? "ring corrupted: the consumer's head index is impossible"
                                   : "ring corrupted: the producer's tail index is impossible");
    return NULL;
}

static int Queue_init(QueueObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "producer", "capacity", "slot_size", "slots",
                             "tail", "head", "data_waiter", "space_waiter", "peer_closed",
                             "fields", NULL};
    PyObject *buf, *fields;
    int producer;
    unsigned long long cap, slot_size, slots, tail, head, dw, sw, pc;
    self->bell = -1;
    if (self->has_view) {
        PyErr_SetString(PyExc_RuntimeError, "already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OpKKKKKKKKO", kwlist, &buf, &producer, &cap,
                                     &slot_size, &slots, &tail, &head, &dw, &sw, &pc, &fields))
        return -1;
    if (cap == 0 || (cap & (cap - 1)) || slot_size == 0 || slot_size > (1u << 20)) {
        PyErr_SetString(PyExc_ValueError, "capacity must be a power of two and slot_size sane");
        return -1;
    }
    if (!PyTuple_Check(fields) || PyTuple_GET_SIZE(fields) == 0 ||
        PyTuple_GET_SIZE(fields) > MAX_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "fields must be a tuple of (offset, size, signed)");
        return -1;
    }
    self->nfields = (int)PyTuple_GET_SIZE(fields);
    for (int i = 0; i < self->nfields; i++) {
        unsigned int off, size;
        int sgn;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(fields, i), "IIp", &off, &size, &sgn))
            return -1;
        if (!(size == 1 || size == 2 || size == 4 || size == 8) || off + size > slot_size) {
            PyErr_SetString(PyExc_ValueError, "bad field");
            return -1;
        }
        self->fields[i] = (field_t){off, size, (uint32_t)sgn};
    }
    if (PyObject_GetBuffer(buf, &self->view, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0)
        return -1;
    uint64_t len = (uint64_t)self->view.len;
    uint8_t *base = self->view.buf;
    int bad = slots + cap * slot_size > len || cap * slot_size / cap != slot_size;
    bad |= tail % 8 || head % 8 || dw % 4 || sw % 4 || pc % 4 || ((uintptr_t)base) % 64;
    bad |= tail + 8 > len || head + 8 > len || dw + 4 > len || sw + 4 > len || pc + 4 > len;
    if (bad) {
        PyBuffer_Release(&self->view);
        PyErr_SetString(PyExc_ValueError, "queue geometry does not fit the buffer");
        return -1;
    }
    self->has_view = 1;
    self->producer = producer;
    self->q.tail = (_Atomic uint64_t *)(base + tail);
    self->q.head = (_Atomic uint64_t *)(base + head);
    self->q.data_waiter = (_Atomic uint32_t *)(base + dw);
    self->q.space_waiter = (_Atomic uint32_t *)(base + sw);
    self->q.peer_closed = (_Atomic uint32_t *)(base + pc);
    self->q.slots = base + slots;
    self->q.cap = cap;
    self->q.mask = cap - 1;
    self->q.slot_size = (uint32_t)slot_size;
    /* Start from the current indices (an attach after the creator's init). */
    if (producer) {
        self->q.mine = atomic_load_explicit(self->q.tail, memory_order_acquire);
        self->q.seen = atomic_load_explicit(self->q.head, memory_order_acquire);
    } else {
        self->q.mine = atomic_load_explicit(self->q.head, memory_order_acquire);
        self->q.seen = atomic_load_explicit(self->q.tail, memory_order_acquire);
    }
    if ((producer ? self->q.mine - self->q.seen : self->q.seen - self->q.mine) > cap) {
        self->has_view = 0;
        PyBuffer_Release(&self->view);
        PyErr_SetString(CorruptError ? CorruptError : PyExc_RuntimeError,
                        "ring corrupted: indices are more than a capacity apart");
        return -1;
    }
    atomic_init(&self->interrupt, 0);
    return 0;
}

static int release(QueueObject *self)
{
    if (!self->has_view)
        return 0;
    if (self->lent) {
        PyErr_SetString(PyExc_RuntimeError, "a data-plane worker serves this queue: stop it first");
        return -1;
    }
    atomic_store(&self->interrupt, 1);
    trq_force_wake(self->producer ? self->q.space_waiter : self->q.data_waiter);
    while (self->waiting > 0) {
        Py_BEGIN_ALLOW_THREADS
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
        Py_END_ALLOW_THREADS
    }
    self->has_view = 0;
    PyBuffer_Release(&self->view);
    return 0;
}

static void Queue_dealloc(QueueObject *self)
{
    if (self->has_view) {
        /* No other thread can be in wait(): it would hold a reference. */
        self->has_view = 0;
        PyBuffer_Release(&self->view);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ---- tuple <-> slot --------------------------------------------------- */

static int pack(QueueObject *self, PyObject *tup, uint8_t *slot)
{
    if (!PyTuple_Check(tup)) {
        PyErr_SetString(PyExc_TypeError, "a descriptor is a tuple of integers");
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(tup);
    if (n < 1 || n > self->nfields) {
        PyErr_Format(PyExc_ValueError, "a descriptor has 1 to %d fields, got %zd",
                     self->nfields, n);
        return -1;
    }
    memset(slot, 0, self->q.slot_size);
    for (Py_ssize_t i = 0; i < n; i++) {
        field_t *f = &self->fields[i];
        PyObject *o = PyTuple_GET_ITEM(tup, i);
        uint64_t v;
        if (f->is_signed) {
            long long s = PyLong_AsLongLong(o);
            if (s == -1 && PyErr_Occurred())
                return -1;
            if (f->size < 8) {
                long long lim = 1ll << (8 * f->size - 1);
                if (s < -lim || s >= lim)
                    goto range;
            }
            v = (uint64_t)s;
        } else {
            unsigned long long u = PyLong_AsUnsignedLongLong(o);
            if (u == (unsigned long long)-1 && PyErr_Occurred())
                return -1;
            if (f->size < 8 && u >> (8 * f->size))
                goto range;
            v = u;
        }
        memcpy(slot + f->offset, &v, f->size); /* little-endian: low bytes first */
        continue;
    range:
        PyErr_Format(PyExc_OverflowError, "descriptor field %zd out of range", i);
        return -1;
    }
    return 0;
}

static PyObject *unpack(QueueObject *self, const uint8_t *slot)
{
    PyObject *t = PyTuple_New(self->nfields);
    if (!t)
        return NULL;
    for (int i = 0; i < self->nfields; i++) {
        field_t *f = &self->fields[i];
        uint64_t v = 0;
        memcpy(&v, slot + f->offset, f->size);
        PyObject *o;
        if (f->is_signed) {
            int sh = 64 - 8 * (int)f->size;
            o = PyLong_FromLongLong(((int64_t)(v << sh)) >> sh);
        } else {
            o = PyLong_FromUnsignedLongLong(v);
        }
        if (!o) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, o);
    }
    return t;
}

/* ---- methods ------------------------------------------------------------ */

static PyObject *Queue_push(QueueObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"desc", "wake", NULL};
    PyObject *tup;
    int wake = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|p", kwlist, &tup, &wake))
        return NULL;
    if (check_role(self, 1) < 0)
        return NULL;
    uint8_t slot[1024];
    if (self->q.slot_size > sizeof slot) {
        PyErr_SetString(PyExc_ValueError, "slot too large for push(); use push_many");
        return NULL;
    }
    if (pack(self, tup, slot) < 0)
        return NULL;
    int64_t n = trq_push_from(&self->q, slot, 1, 0);
    if (n < 0)
        return corrupt(self);
    if (n && wake)
        ring_peer(self);
    return PyBool_FromLong(n == 1);
}

static PyObject *Queue_push_buffer(QueueObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"data", "count", "wake", NULL};
    Py_buffer b;
    unsigned long long count;
    int wake = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*K|p", kwlist, &b, &count, &wake))
        return NULL;
    if (check_role(self, 1) < 0 || count > (uint64_t)b.len / self->q.slot_size) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "buffer shorter than count slots");
        PyBuffer_Release(&b);
        return NULL;
    }
    int64_t n = trq_push_from(&self->q, b.buf, count, 0);
    PyBuffer_Release(&b);
    if (n < 0)
        return corrupt(self);
    if (n && wake)
        ring_peer(self);
    return PyLong_FromLongLong(n);
}

static PyObject *Queue_pop(QueueObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"wake", NULL};
    int wake = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|p", kwlist, &wake))
        return NULL;
    if (check_role(self, 0) < 0)
        return NULL;
    uint8_t slot[1024];
    if (self->q.slot_size > sizeof slot) {
        PyErr_SetString(PyExc_ValueError, "slot too large for pop(); use pop_many");
        return NULL;
    }
    int64_t n = trq_pop_into(&self->q, slot, 1, wake);
    if (n < 0)
        return corrupt(self);
    if (n == 0)
        Py_RETURN_NONE;
    return unpack(self, slot);
}

/* Everything available (at most `max`) as a list of tuples, released with one head store:
 * a client reaping a few completions skips NumPy's fixed costs (pop_many + tolist). */
static PyObject *Queue_pop_list(QueueObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"max", "wake", NULL};
    unsigned long long max = UINT64_MAX;
    int wake = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|Kp", kwlist, &max, &wake))
        return NULL;
    if (check_role(self, 0) < 0)
        return NULL;
    int64_t avail = trq_available(&self->q);
    if (avail < 0)
        return corrupt(self);
    uint64_t n = (uint64_t)avail < max ? (uint64_t)avail : max;
    uint8_t small[64 * 32];
    uint8_t *buf = n * self->q.slot_size <= sizeof small ? small : PyMem_Malloc(n * self->q.slot_size);
    if (!buf)
        return PyErr_NoMemory();
    int64_t got = n ? trq_pop_into(&self->q, buf, n, wake) : 0;
    PyObject *list = got < 0 ? NULL : PyList_New(got);
    for (int64_t i = 0; list && i < got; i++) {
        PyObject *t = unpack(self, buf + i * self->q.slot_size);
        if (!t)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, i, t);
    }
    if (buf != small)
        PyMem_Free(buf);
    if (got < 0)
        return corrupt(self);
    return list;
}

/* A field's bits as stored (zero-extended): a key to compare, a word to pass on, a flag to test. */
static inline uint64_t field_bits(const QueueObject *self, const uint8_t *slot, int i)
{
    uint64_t v = 0;
    memcpy(&v, slot + self->fields[i].offset, self->fields[i].size);
    return v;
}

/* Where the run that starts at slot i of buf ends: consecutive slots sharing field `key`,
 * all with field `clean` zero (a slot with `clean` set is a run of its own). */
static int64_t run_end(const QueueObject *self, const uint8_t *buf, int64_t i, int64_t got, int key, int clean)
{
    uint64_t ss = self->q.slot_size;
    const uint8_t *first = buf + i * ss;
    int64_t j = i + 1;
    if (field_bits(self, first, clean) == 0) {
        uint64_t k = field_bits(self, first, key);
        while (j < got && field_bits(self, buf + j * ss, key) == k && field_bits(self, buf + j * ss, clean) == 0)
            j++;
    }
    return j;
}

/* The run of slots [i, j) as pop_runs hands it over: the first slot's fields, the run's
 * length, and field `value` of every slot as little-endian words (None for a run of one). */
static PyObject *run_item(QueueObject *self, const uint8_t *buf, int64_t i, int64_t j, int value)
{
    uint64_t ss = self->q.slot_size;
    PyObject *t = unpack(self, buf + i * ss), *item = t ? PyTuple_New(self->nfields + 2) : NULL;
    PyObject *count = item ? PyLong_FromLongLong(j - i) : NULL, *words = NULL;
    if (count) {
        if (j - i == 1) {
            words = Py_NewRef(Py_None);
        } else if ((words = PyBytes_FromStringAndSize(NULL, 8 * (j - i)))) {
            char *w = PyBytes_AS_STRING(words);
            for (int64_t r = i; r < j; r++) {
                uint64_t v = field_bits(self, buf + r * ss, value);
                memcpy(w + 8 * (r - i), &v, 8); /* little-endian, as the ring's words are */
            }
        }
    }
    if (!words) {
        Py_XDECREF(t);
        Py_XDECREF(item);
        Py_XDECREF(count);
        return NULL;
    }
    for (int f = 0; f < self->nfields; f++)
        PyTuple_SET_ITEM(item, f, Py_NewRef(PyTuple_GET_ITEM(t, f)));
    PyTuple_SET_ITEM(item, self->nfields, count);
    PyTuple_SET_ITEM(item, self->nfields + 1, words);
    Py_DECREF(t);
    return item;
}

/* The run [i, j) appended to `list` (run_item's tuple): 0, or -1 with an exception set. */
static int append_run(PyObject *list, QueueObject *self, const uint8_t *buf, int64_t i, int64_t j, int value)
{
    PyObject *item = run_item(self, buf, i, j, value);
    int rc = item ? PyList_Append(list, item) : -1;
    Py_XDECREF(item);
    return rc;
}

/* Every available slot into a private buffer (`small` when it fits, else a PyMem block the
 * caller frees); the count popped, or TRQ_CORRUPT (buf NULL on no memory). */
static int64_t pop_all(QueueObject *self, uint8_t *small, size_t small_size, uint8_t **buf, int wake)
{
    int64_t avail = trq_available(&self->q);
    *buf = small;
    if (avail <= 0)
        return avail;
    uint64_t n = (uint64_t)avail, ss = self->q.slot_size;
    if (n * ss > small_size && !(*buf = PyMem_Malloc(n * ss)))
        return 0;
    return trq_pop_into(&self->q, *buf, n, wake);
}

/* pop_list, with each run of consecutive slots that share field `key` and have field `clean`
 * zero handed over as ONE tuple: the run's first slot's fields, then its length, then field
 * `value` (8 bytes) of every slot of the run as packed little-endian words (None for a run of
 * one). A slot whose `clean` field is not zero is always a run of one. A checksum_many's
 * completions (one per range, under one id) come to the client as one tuple this way. */
static PyObject *Queue_pop_runs(QueueObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"key", "value", "clean", "wake", NULL};
    int key, value, clean, wake = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iii|p", kwlist, &key, &value, &clean, &wake))
        return NULL;
    if (check_role(self, 0) < 0)
        return NULL;
    if (key < 0 || key >= self->nfields || clean < 0 || clean >= self->nfields || value < 0 ||
        value >= self->nfields || self->fields[value].size != 8) {
        PyErr_SetString(PyExc_ValueError, "key, value and clean must be fields (value an 8-byte one)");
        return NULL;
    }
    uint8_t small[64 * 32], *buf;
    int64_t got = pop_all(self, small, sizeof small, &buf, wake);
    if (!buf)
        return PyErr_NoMemory();
    PyObject *list = got < 0 ? NULL : PyList_New(0);
    for (int64_t i = 0; list && i < got;) {
        int64_t j = run_end(self, buf, i, got, key, clean);
        if (append_run(list, self, buf, i, j, value) < 0)
            Py_CLEAR(list);
        i = j;
    }
    if (buf != small)
        PyMem_Free(buf);
    if (got < 0)
        return corrupt(self);
    return list;
}

/* pop_finished(outstanding, pending[, array]) -> (completions, freed, rest)
 *
 * The client's reap, its common cases in C: pops every completion and finishes, for a request
 * noted in `outstanding` as (pending, answers, descriptors):
 * - a lone success, when answers is a bool: the value is the completion's result when
 *   answers is True, else None;
 * - a run of successes that is the whole answer of a request that gathers one word per
 *   descriptor (answers a `_Sums` whose `values` is still empty: a checksum_many, a verified
 *   copy_many), when `array` is given: the value is array(n), a new writable buffer of n
 *   native uint64 words (a NumPy array), filled with the run's results.
 * Each is deleted there and from `pending`, and pending._finish(value, None) is called;
 * `freed` counts their descriptors. Every other run (a failure, part of an answer, one of an
 * id not outstanding), and every run after the first such, comes back in `rest`, in order,
 * as pop_runs gives it (key id, value result, clean status), for the caller's general path:
 * what is finished here never overtakes an earlier completion of the same id. */
static PyObject *s_finish, *s_values;

/* The run [i, j) of successes finished here: 1; not one for here: 0 (it goes to rest); an
 * error: -1. */
static int finish_run(QueueObject *self, const uint8_t *buf, int64_t i, int64_t j, PyObject *outstanding,
                      PyObject *pending, PyObject *array, Py_ssize_t *freed)
{
    uint64_t ss = self->q.slot_size;
    const uint8_t *first = buf + i * ss;
    PyObject *rid = PyLong_FromUnsignedLongLong(field_bits(self, first, 0));
    if (!rid)
        return -1;
    PyObject *entry = PyDict_GetItemWithError(outstanding, rid);
    if (!entry || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3) {
        Py_DECREF(rid);
        return PyErr_Occurred() ? -1 : 0;
    }
    Py_INCREF(entry); /* (array() runs Python code: the dict may change under a borrowed one) */
    PyObject *answers = PyTuple_GET_ITEM(entry, 1), *value = NULL;
    Py_ssize_t took = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 2));
    int mine = 0;
    if (took < 0) {
        mine = PyErr_Occurred() ? -1 : 0;
    } else if (PyBool_Check(answers)) {
        mine = j - i == 1;
        if (mine)
            value = answers == Py_True ? PyLong_FromUnsignedLongLong(field_bits(self, first, 2)) : Py_NewRef(Py_None);
    } else if (array && took == j - i) {
        PyObject *values = PyObject_GetAttr(answers, s_values);
        if (!values)
            PyErr_Clear(); /* not a gatherer: the general path will say what it is */
        mine = values && PyList_CheckExact(values) && PyList_GET_SIZE(values) == 0;
        Py_XDECREF(values);
        if (mine) {
            PyObject *n = PyLong_FromSsize_t(took);
            value = n ? PyObject_CallOneArg(array, n) : NULL;
            Py_XDECREF(n);
            Py_buffer b;
            if (value && PyObject_GetBuffer(value, &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) == 0) {
                if (b.len == 8 * took) {
                    for (int64_t r = i; r < j; r++) {
                        uint64_t v = field_bits(self, buf + r * ss, 2);
                        memcpy((char *)b.buf + 8 * (r - i), &v, 8); /* a native uint64 each */
                    }
                } else {
                    PyErr_SetString(PyExc_ValueError, "pop_finished: array(n) must give a writable buffer of n words");
                }
                PyBuffer_Release(&b);
            }
            if (PyErr_Occurred())
                Py_CLEAR(value);
        }
    }
    PyObject *r = NULL;
    if (mine > 0 && value && PyDict_DelItem(outstanding, rid) == 0) {
        /* (pending.pop(rid, None): a request failed locally may be gone already) */
        int has = PyDict_Contains(pending, rid);
        if (has >= 0 && (!has || PyDict_DelItem(pending, rid) == 0))
            r = PyObject_CallMethodObjArgs(PyTuple_GET_ITEM(entry, 0), s_finish, value, Py_None, NULL);
    }
    Py_XDECREF(r);
    Py_XDECREF(value);
    Py_DECREF(entry);
    Py_DECREF(rid);
    if (mine <= 0)
        return mine;
    if (!r)
        return -1;
    *freed += took;
    return 1;
}

static PyObject *Queue_pop_finished(QueueObject *self, PyObject *const *a, Py_ssize_t na)
{
    if (na < 2 || na > 3 || !PyDict_Check(a[0]) || !PyDict_Check(a[1]) || (na == 3 && a[2] != Py_None && !PyCallable_Check(a[2]))) {
        PyErr_SetString(PyExc_TypeError, "pop_finished(outstanding: dict, pending: dict, array: callable | None = None)");
        return NULL;
    }
    PyObject *array = na == 3 && a[2] != Py_None ? a[2] : NULL;
    if (check_role(self, 0) < 0)
        return NULL;
    if (self->nfields != 5 || self->q.slot_size != 32) {
        PyErr_SetString(PyExc_TypeError, "pop_finished: not a completion queue");
        return NULL;
    }
    uint8_t small[64 * 32], *buf;
    int64_t got = pop_all(self, small, sizeof small, &buf, 1);
    if (!buf)
        return PyErr_NoMemory();
    if (got < 0) {
        if (buf != small)
            PyMem_Free(buf);
        return corrupt(self);
    }
    Py_ssize_t freed = 0;
    PyObject *rest = PyList_New(0);
    for (int64_t i = 0; rest && i < got;) {
        const uint8_t *first = buf + i * self->q.slot_size;
        int64_t j = run_end(self, buf, i, got, 0, 1); /* successes sharing an id (or one slot) */
        if (field_bits(self, first, 1) == 0 && PyList_GET_SIZE(rest) == 0) {
            int done = finish_run(self, buf, i, j, a[0], a[1], array, &freed);
            if (done < 0) {
                Py_CLEAR(rest);
                break;
            }
            if (done) {
                i = j;
                continue;
            }
        }
        if (append_run(rest, self, buf, i, j, 2) < 0)
            Py_CLEAR(rest);
        i = j;
    }
    if (buf != small)
        PyMem_Free(buf);
    if (!rest)
        return NULL;
    return Py_BuildValue("(LnN)", (long long)got, freed, rest);
}

static PyObject *Queue_pop_into(QueueObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"out", "max", "wake", NULL};
    Py_buffer b;
    unsigned long long max;
    int wake = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "w*K|p", kwlist, &b, &max, &wake))
        return NULL;
    if (check_role(self, 0) < 0 || max > (uint64_t)b.len / self->q.slot_size) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "buffer shorter than max slots");
        PyBuffer_Release(&b);
        return NULL;
    }
    int64_t n = trq_pop_into(&self->q, b.buf, max, wake);
    PyBuffer_Release(&b);
    if (n < 0)
        return corrupt(self);
    return PyLong_FromLongLong(n);
}

static PyObject *Queue_available(QueueObject *self, PyObject *unused)
{
    if (check_role(self, 0) < 0)
        return NULL;
    int64_t n = trq_available(&self->q);
    return n < 0 ? corrupt(self) : PyLong_FromLongLong(n);
}

static PyObject *Queue_free(QueueObject *self, PyObject *unused)
{
    if (check_role(self, 1) < 0)
        return NULL;
    int64_t n = trq_free(&self->q);
    return n < 0 ? corrupt(self) : PyLong_FromLongLong(n);
}

static PyObject *Queue_wait(QueueObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"need", "timeout", "spin", NULL};
    unsigned long long need = 1;
    PyObject *timeout = Py_None;
    double spin = 50e-6;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|KOd", kwlist, &need, &timeout, &spin))
        return NULL;
    if (check_open(self) < 0)
        return NULL;
    if (need == 0 || need > self->q.cap) {
        PyErr_SetString(PyExc_ValueError, "need must be in 1..capacity");
        return NULL;
    }
    uint64_t tns = UINT64_MAX;
    if (timeout != Py_None) {
        double t = PyFloat_AsDouble(timeout);
        if (t == -1.0 && PyErr_Occurred())
            return NULL;
        tns = t <= 0 ? 0 : t >= 1e9 ? UINT64_MAX : (uint64_t)(t * 1e9);
    }
    uint64_t sns = spin <= 0 ? 0 : spin >= 10.0 ? 10000000000ull : (uint64_t)(spin * 1e9);
    int64_t n;
    int what = self->producer ? TRQ_WAIT_SPACE : TRQ_WAIT_DATA;
    self->waiting++;
    Py_BEGIN_ALLOW_THREADS
    n = trq_wait(&self->q, what, need, tns, sns, &self->interrupt);
    Py_END_ALLOW_THREADS
    self->waiting--;
    if (n < 0)
        return corrupt(self);
    return PyLong_FromLongLong(n);
}

static PyObject *Queue_arm(QueueObject *self, PyObject *unused)
{
    if (check_open(self) < 0)
        return NULL;
    int64_t n = trq_arm(&self->q, self->producer ? TRQ_WAIT_SPACE : TRQ_WAIT_DATA);
    return n < 0 ? corrupt(self) : PyLong_FromLongLong(n);
}

static PyObject *Queue_disarm(QueueObject *self, PyObject *unused)
{
    if (check_open(self) < 0)
        return NULL;
    trq_disarm(&self->q, self->producer ? TRQ_WAIT_SPACE : TRQ_WAIT_DATA);
    Py_RETURN_NONE;
}

static PyObject *Queue_notify(QueueObject *self, PyObject *unused)
{
    if (check_open(self) < 0)
        return NULL;
    return PyLong_FromUnsignedLong(ring_peer(self));
}

static PyObject *Queue_wake_peer(QueueObject *self, PyObject *unused)
{
    if (check_open(self) < 0)
        return NULL;
    trq_force_wake(self->producer ? self->q.data_waiter : self->q.space_waiter);
    Py_RETURN_NONE;
}

static PyObject *Queue_close(QueueObject *self, PyObject *unused)
{
    if (release(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Queue_get_index(QueueObject *self, void *c)
{
    return PyLong_FromUnsignedLongLong(self->q.mine);
}

static PyObject *Queue_get_capacity(QueueObject *self, void *c)
{
    return PyLong_FromUnsignedLongLong(self->q.cap);
}

static PyObject *Queue_get_closed(QueueObject *self, void *c)
{
    return PyBool_FromLong(!self->has_view);
}

static PyObject *Queue_push_requests(QueueObject *self, PyObject *const *a, Py_ssize_t na);
static PyObject *Queue_pop_finished(QueueObject *self, PyObject *const *a, Py_ssize_t na);

static PyMethodDef Queue_methods[] = {
    {"push", (PyCFunction)(void (*)(void))Queue_push, METH_VARARGS | METH_KEYWORDS,
     "push(desc, wake=True) -> bool: publish one descriptor tuple; False if full."},
    {"push_requests", (PyCFunction)(void (*)(void))Queue_push_requests, METH_FASTCALL,
     "push_requests(reqs, start, kinds, room, after, pending, outstanding, sums) -> (taken, used, published)"},
    {"pop_finished", (PyCFunction)(void (*)(void))Queue_pop_finished, METH_FASTCALL,
     "pop_finished(outstanding, pending, array=None) -> (completions, freed, rest): the client's reap, lone successes and whole gathered answers finished here"},
    {"push_buffer", (PyCFunction)(void (*)(void))Queue_push_buffer, METH_VARARGS | METH_KEYWORDS,
     "push_buffer(data, count, wake=True) -> int: publish up to count slots with one release store."},
    {"pop", (PyCFunction)(void (*)(void))Queue_pop, METH_VARARGS | METH_KEYWORDS,
     "pop(wake=True) -> tuple | None"},
    {"pop_list", (PyCFunction)(void (*)(void))Queue_pop_list, METH_VARARGS | METH_KEYWORDS,
     "pop_list(max=all, wake=True) -> list of tuples, released with one store"},
    {"pop_runs", (PyCFunction)(void (*)(void))Queue_pop_runs, METH_VARARGS | METH_KEYWORDS,
     "pop_runs(key, value, clean, wake=True) -> pop_list with each run of one key as one tuple (+ length, packed values)"},
    {"pop_into", (PyCFunction)(void (*)(void))Queue_pop_into, METH_VARARGS | METH_KEYWORDS,
     "pop_into(out, max, wake=True) -> int: copy up to max slots out, one release store."},
    {"available", (PyCFunction)Queue_available, METH_NOARGS, "published slots not yet popped"},
    {"free", (PyCFunction)Queue_free, METH_NOARGS, "slots a push can fill now"},
    {"wait", (PyCFunction)(void (*)(void))Queue_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(need=1, timeout=None, spin=50e-6) -> int: spin, then futex-sleep, until need "
     "slots are available (consumer) or free (producer), the peer closes, or timeout."},
    {"arm", (PyCFunction)Queue_arm, METH_NOARGS,
     "arm() -> int: set my waiter word (the peer's next publish will ring), fence, "
     "and return what is available (consumer) or free (producer)"},
    {"disarm", (PyCFunction)Queue_disarm, METH_NOARGS, "clear my waiter word"},
    {"notify", (PyCFunction)Queue_notify, METH_NOARGS,
     "ring the doorbell: wake the peer if it sleeps on this queue (and write `bell` if it armed "
     "with 1); the waiter word it cleared (0: nobody slept; 1: an event loop; 2: a native worker)"},
    {"wake_peer", (PyCFunction)Queue_wake_peer, METH_NOARGS, "wake the peer unconditionally"},
    {"close", (PyCFunction)Queue_close, METH_NOARGS,
     "interrupt a wait() in another thread, then release the mapping"},
    {NULL}};

static PyObject *Queue_get_bell(QueueObject *self, void *c)
{
    return PyLong_FromLong(self->bell);
}

static int Queue_set_bell(QueueObject *self, PyObject *value, void *c)
{
    long fd = value ? PyLong_AsLong(value) : -1;
    if (fd == -1 && PyErr_Occurred())
        return -1;
    self->bell = fd < 0 ? -1 : (int)fd;
    return 0;
}

static PyGetSetDef Queue_getset[] = {
    {"bell", (getter)Queue_get_bell, (setter)Queue_set_bell,
     "producer: fd written one byte when a wake finds the peer armed with 1 (-1: none)", NULL},
    {"index", (getter)Queue_get_index, NULL, "my free-running index (tail or head)", NULL},
    {"capacity", (getter)Queue_get_capacity, NULL, "slots", NULL},
    {"closed", (getter)Queue_get_closed, NULL, "released", NULL},
    {NULL}};

static PyTypeObject QueueType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transfer._ring_native.Queue",
    .tp_basicsize = sizeof(QueueObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One endpoint of one SPSC queue in a shared mapping (see native/ring.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Queue_init,
    .tp_dealloc = (destructor)Queue_dealloc,
    .tp_methods = Queue_methods,
    .tp_getset = Queue_getset,
};

/* ==== the native data plane (dataplane.h) ================================== */

/* Table: the native mapping table. Python mirrors every host-memory segment into it. */
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

static void Table_dealloc(TableObject *self)
{
    if (self->ok) {
        /* Workers hold a reference: none is running. */
        for (uint32_t i = 0; i < self->t.n; i++) {
            free(self->t.segs[i].guests);
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
    pthread_rwlock_unlock(&self->t.lock);
    if (rc < 0) {
        release_keep(view);
        if (rc == -2)
            PyErr_Format(PyExc_KeyError, "segment %u is already in the table", sid);
        else
            PyErr_NoMemory();
        return NULL;
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
    void *keep = tdp_table_remove(&self->t, (uint32_t)sid);
    pthread_rwlock_unlock(&self->t.lock);
    release_keep(keep); /* after the unlock: no worker can be inside these bytes now */
    return PyBool_FromLong(keep != NULL);
}

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
    {"remove", (PyCFunction)Table_remove, METH_O,
     "remove(sid) -> bool: drop a segment once no worker touches it (waits without the GIL)"},
    {"guest", (PyCFunction)Table_guest, METH_VARARGS,
     "guest(sid, session, allow): let another session use the segment (Attach), or stop it"},
    {"translate", (PyCFunction)Table_translate, METH_VARARGS,
     "translate(session, va, nbytes) -> address | None: what a worker would touch"},
    {NULL}};

static PySequenceMethods Table_as_sequence = {.sq_length = (lenfunc)Table_len};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transfer._ring_native.Table",
    .tp_basicsize = sizeof(TableObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The data plane's mapping table: segment id -> host memory, owner, guests (dataplane.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Table_init,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_methods = Table_methods,
    .tp_as_sequence = &Table_as_sequence,
};

/* Worker: one thread serving one session's ring (dataplane.h). */
typedef struct {
    PyObject_HEAD
    tdp_worker_t w;
    TableObject *table;
    QueueObject *requests, *completions;
} WorkerObject;

/* A worker's spin in nanoseconds: at most 10 ms (a worker polls between requests, it does
 * not own a core). */
static uint64_t spin_ns_of(double spin)
{
    return spin <= 0 ? 0 : spin >= 0.01 ? 10000000ull : (uint64_t)(spin * 1e9);
}

static int Worker_init(WorkerObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"table", "requests", "completions", "session", "bell_fd", "cbell_fd", "spin", "bounds", NULL};
    PyObject *table, *rq, *cq, *bounds = NULL;
    unsigned long long session;
    int bell = -1, cbell = -1;
    double spin = 20e-6;
    if (self->table) {
        PyErr_SetString(PyExc_RuntimeError, "already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!K|iidO", kwlist, &TableType, &table, &QueueType, &rq,
                                     &QueueType, &cq, &session, &bell, &cbell, &spin, &bounds))
        return -1;
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
}

static void Worker_dealloc(WorkerObject *self)
{
    worker_stop(self);
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
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsK}", "copy", C(n_copy), "fill", C(n_fill),
                         "checksum", C(n_checksum), "fused", C(n_fused), "shared", C(n_shared), "fence", C(n_fence),
                         "bytes", C(n_bytes),
                         "batches", C(n_batches), "wakes", C(n_wakes), "sleeps", C(n_sleeps),
                         "handover_opcode", C(handovers[TDP_WHY_OPCODE]),
                         "handover_fields", C(handovers[TDP_WHY_FIELDS]),
                         "handover_address", C(handovers[TDP_WHY_ADDRESS]),
                         "handover_devices", C(handovers[TDP_WHY_DEVICES]),
                         "handover_chain", C(handovers[TDP_WHY_CHAIN]),
                         "handover_after", C(handovers[TDP_WHY_AFTER]),
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
    static const char *names[TDP_WHY_COUNT] = {"", "opcode", "fields", "address", "devices", "chain", "after"};
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

static PyTypeObject WorkerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transfer._ring_native.Worker",
    .tp_basicsize = sizeof(WorkerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A data-plane thread serving one ring's copies, fills, checksums and fences (dataplane.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Worker_init,
    .tp_dealloc = (destructor)Worker_dealloc,
    .tp_methods = Worker_methods,
    .tp_getset = Worker_getset,
};

static PyObject *set_corrupt_error(PyObject *mod, PyObject *cls)
{
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)PyExc_Exception)) {
        PyErr_SetString(PyExc_TypeError, "expected an exception class");
        return NULL;
    }
    Py_INCREF(cls);
    Py_XSETREF(CorruptError, cls);
    Py_RETURN_NONE;
}

/* One operand of pack_vector: a scalar VA (the same for every range) or a 1-D uint64 array. */
typedef struct {
    uint64_t scalar;
    Py_buffer b;
    int is_buf;
} vec_arg_t;

/* Let go of what vec_arg took (nothing for a scalar, or one that failed). */
static inline void vec_release(vec_arg_t *a)
{
    if (a->is_buf) {
        PyBuffer_Release(&a->b);
        a->is_buf = 0;
    }
}

/* A buffer of native-order 64-bit unsigned integers (a uint64 NumPy array: "L" or "Q"). */
static int u64_format(const Py_buffer *b)
{
    const char *f = b->format ? b->format : "B";
    if (*f == '@' || *f == '=' || (*f == '<' && PY_LITTLE_ENDIAN) || (*f == '>' && !PY_LITTLE_ENDIAN))
        f++;
    return b->itemsize == 8 && (strcmp(f, "Q") == 0 || strcmp(f, "L") == 0);
}

static int vec_arg(PyObject *o, const char *name, Py_ssize_t *k, vec_arg_t *a)
{
    a->is_buf = 0;
    if (PyLong_Check(o)) {
        a->scalar = PyLong_AsUnsignedLongLong(o);
        return a->scalar == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
    }
    if (PyObject_GetBuffer(o, &a->b, PyBUF_STRIDES | PyBUF_FORMAT) < 0)
        return -1;
    a->is_buf = 1;
    if (a->b.ndim != 1 || !u64_format(&a->b)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a 1-D uint64 array", name);
        goto bad;
    }
    if (*k >= 0 && a->b.shape[0] != *k) {
        PyErr_Format(PyExc_ValueError, "%s: %zd ranges, expected %zd", name, a->b.shape[0], *k);
        goto bad;
    }
    *k = a->b.shape[0];
    return 0;
bad:
    vec_release(a);
    return -1;
}

static inline uint64_t vec_at(const vec_arg_t *a, Py_ssize_t i)
{
    uint64_t v;
    if (!a->is_buf)
        return a->scalar;
    memcpy(&v, (const char *)a->b.buf + i * a->b.strides[0], 8);
    return v;
}

/* ---- submission: a client's requests straight into its ring ------------------------ */

/* What push_requests knows of a request, by the kind code the client's table maps its type
 * to (transfer/client/_ringlink.py, _KINDS): which fields go where in the descriptor. */
enum { K_WAIT = 0, K_COPY, K_FILL, K_CHECKSUM, K_FENCE, K_RUN_GRAPH, K_COPYV, K_CHECKSUMV, K_COUNT };
static const uint16_t kind_op[K_COUNT] = {0, TDP_COPY, TDP_FILL, TDP_CHECKSUM, TDP_FENCE, 6, TDP_COPY, TDP_CHECKSUM};
#define DESC_WORDS 8 /* REQUEST_DTYPE: 64 bytes */

static PyObject *s_id, *s_stream, *s_dst, *s_src, *s_nbytes, *s_value, *s_graph, *s_inputs, *s_outputs, *s_sums;

static int intern_names(void)
{
#define N(v, t) if (!(v = PyUnicode_InternFromString(t))) return -1
    N(s_id, "id"); N(s_stream, "stream"); N(s_dst, "dst"); N(s_src, "src"); N(s_nbytes, "nbytes");
    N(s_value, "value"); N(s_graph, "graph"); N(s_inputs, "inputs"); N(s_outputs, "outputs"); N(s_sums, "sums");
    N(s_finish, "_finish"); N(s_values, "values");
#undef N
    return 0;
}

/* An unsigned field of at most `max`: an int or anything with __index__ (a NumPy integer),
 * as struct's "Q" takes it. OverflowError or TypeError otherwise. */
static int u64_of(PyObject *o, uint64_t max, uint64_t *out)
{
    if (!o)
        return -1;
    PyObject *i = PyLong_CheckExact(o) ? (Py_INCREF(o), o) : PyNumber_Index(o);
    Py_DECREF(o);
    if (!i)
        return -1;
    uint64_t v = PyLong_AsUnsignedLongLong(i);
    Py_DECREF(i);
    if (v == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    if (v > max) {
        PyErr_SetString(PyExc_OverflowError, "request field out of range");
        return -1;
    }
    *out = v;
    return 0;
}

static int attr_u64(PyObject *r, PyObject *name, uint64_t max, uint64_t *out)
{
    return u64_of(PyObject_GetAttr(r, name), max, out);
}

/* Whether a request's boolean field is set: 1, 0, or -1 (an error set). */
static int attr_true(PyObject *r, PyObject *name)
{
    PyObject *o = PyObject_GetAttr(r, name);
    if (!o)
        return -1;
    int t = PyObject_IsTrue(o);
    Py_DECREF(o);
    return t;
}

/* The first VA of a RunGraph's inputs or outputs. */
static int first_u64(PyObject *r, PyObject *name, uint64_t *out)
{
    PyObject *seq = PyObject_GetAttr(r, name);
    if (!seq)
        return -1;
    PyObject *o = PySequence_GetItem(seq, 0);
    Py_DECREF(seq);
    return u64_of(o, UINT64_MAX, out);
}

/* How many descriptors a request of `kind` takes: a vector's ranges, else 1 (a Wait: 0). */
static Py_ssize_t descriptors_for(PyObject *r, int kind)
{
    if (kind == K_WAIT)
        return 0;
    if (kind != K_COPYV && kind != K_CHECKSUMV)
        return 1;
    PyObject *nb = PyObject_GetAttr(r, s_nbytes);
    if (!nb)
        return -1;
    Py_ssize_t k = PyObject_Length(nb);
    Py_DECREF(nb);
    return k;
}

/* A descriptor's first word: its op, its stream, and FLAG_SUM on a verified copy_many's pieces. */
static inline uint64_t desc_head(int kind, uint64_t stream, int summed)
{
    return (uint64_t)kind_op[kind] | stream << 32 | (summed ? (uint64_t)TDP_FLAG_SUM << 16 : 0);
}

/* One descriptor into w: the words of REQUEST_DTYPE (op and flags, id, dst, src, nbytes, arg0). */
static inline void pack_one(uint64_t head, uint64_t rid, uint64_t dst, uint64_t src, uint64_t nbytes, uint64_t arg0,
                            uint64_t *w)
{
    w[0] = head;
    w[1] = rid;
    w[2] = dst;
    w[3] = src;
    w[4] = nbytes;
    w[5] = arg0;
    w[6] = w[7] = 0;
}

/* The fence on a push's first descriptor: FLAG_AFTER, and the frame count in arg2. */
static inline void put_fence(uint64_t *w, uint64_t fence)
{
    w[0] |= (uint64_t)TDP_FLAG_AFTER << 16;
    w[7] = fence;
}

/* outstanding[id] = (p, what it answers, its k descriptors): a new sums() for a
 * checksum_many, sums(True) for a verified copy_many, True for a checksum, else False. */
static int note_outstanding(PyObject *outstanding, PyObject *sums, PyObject *id, PyObject *p, int kind, int summed,
                            Py_ssize_t k)
{
    PyObject *answers = kind == K_CHECKSUMV ? PyObject_CallNoArgs(sums)
                        : summed            ? PyObject_CallOneArg(sums, Py_True)
                                            : Py_NewRef(kind == K_CHECKSUM ? Py_True : Py_False);
    PyObject *entry = answers ? Py_BuildValue("(ONn)", p, answers, k) : NULL;
    int rc = entry ? PyDict_SetItem(outstanding, id, entry) : -1;
    Py_XDECREF(entry);
    return rc;
}

/* A vector request's k descriptors into w, one per range: `chain` sets FLAG_CHAIN on all
 * but the last (a copy_many's pieces, done as one). */
static void pack_ranges(uint64_t head, uint64_t rid, int chain, Py_ssize_t k, const vec_arg_t *d, const vec_arg_t *sv,
                        const vec_arg_t *nb, uint64_t *w)
{
    for (Py_ssize_t i = 0; i < k; i++, w += DESC_WORDS) {
        w[0] = head | (chain && i + 1 < k ? (uint64_t)TDP_FLAG_CHAIN << 16 : 0);
        w[1] = rid;
        w[2] = vec_at(d, i);
        w[3] = vec_at(sv, i);
        w[4] = vec_at(nb, i);
        w[5] = w[6] = w[7] = 0;
    }
}

/* One request's descriptors into w (room for all of them): the words of REQUEST_DTYPE.
 * `summed`: a verified copy_many (FLAG_SUM on every piece). */
static int pack_request(PyObject *r, int kind, Py_ssize_t k, int summed, uint64_t *w)
{
    uint64_t rid, stream, dst = 0, src = 0, nbytes = 0, arg0 = 0;
    if (attr_u64(r, s_id, UINT64_MAX, &rid) < 0 || attr_u64(r, s_stream, UINT32_MAX, &stream) < 0)
        return -1;
    uint64_t head = desc_head(kind, stream, summed);
    if (kind == K_COPYV || kind == K_CHECKSUMV) {
        PyObject *nbo = PyObject_GetAttr(r, s_nbytes), *so = PyObject_GetAttr(r, s_src);
        PyObject *dso = kind == K_COPYV ? PyObject_GetAttr(r, s_dst) : PyLong_FromLong(0);
        vec_arg_t nb = {0}, d = {0}, sv = {0};
        Py_ssize_t n = k;
        int rc = -1;
        if (nbo && so && dso && vec_arg(nbo, "nbytes", &n, &nb) == 0 && vec_arg(dso, "dst", &n, &d) == 0 &&
            vec_arg(so, "src", &n, &sv) == 0) {
            pack_ranges(head, rid, kind == K_COPYV, k, &d, &sv, &nb, w);
            rc = 0;
        }
        vec_release(&nb);
        vec_release(&d);
        vec_release(&sv);
        Py_XDECREF(nbo);
        Py_XDECREF(so);
        Py_XDECREF(dso);
        return rc;
    }
    int bad = 0;
    switch (kind) {
    case K_COPY:
        bad = attr_u64(r, s_dst, UINT64_MAX, &dst) < 0 || attr_u64(r, s_src, UINT64_MAX, &src) < 0 ||
              attr_u64(r, s_nbytes, UINT64_MAX, &nbytes) < 0;
        break;
    case K_FILL:
        bad = attr_u64(r, s_dst, UINT64_MAX, &dst) < 0 || attr_u64(r, s_nbytes, UINT64_MAX, &nbytes) < 0 ||
              attr_u64(r, s_value, UINT64_MAX, &arg0) < 0;
        break;
    case K_CHECKSUM:
        bad = attr_u64(r, s_src, UINT64_MAX, &src) < 0 || attr_u64(r, s_nbytes, UINT64_MAX, &nbytes) < 0;
        break;
    case K_RUN_GRAPH:
        bad = first_u64(r, s_outputs, &dst) < 0 || first_u64(r, s_inputs, &src) < 0 ||
              attr_u64(r, s_graph, UINT64_MAX, &arg0) < 0;
        break;
    }
    if (bad)
        return -1;
    pack_one(head, rid, dst, src, nbytes, arg0, w);
    return 0;
}

/* push_requests(reqs, start, kinds, room, after, pending, outstanding, sums) -> (taken, used, published)
 *
 * The client's submission in one call: from reqs[start], the longest run of whole requests
 * whose descriptors fit in `room`, packed, published with one release store and one wake,
 * and each noted as outstanding[id] = (pending[id], answers, descriptors), where answers is
 * True for a checksum, a new sums() for a checksum_many, else False. `kinds` maps a request
 * type to its kind code; `after` (> 0) puts FLAG_AFTER and the frame count on the first
 * descriptor. A field that does not fit fails the call before anything is published. */
static PyObject *Queue_push_requests(QueueObject *self, PyObject *const *a, Py_ssize_t na)
{
    Py_ssize_t start, room;
    unsigned long long after;
    if (na != 8 || !PyList_Check(a[0]) || !PyDict_Check(a[2]) || !PyDict_Check(a[5]) || !PyDict_Check(a[6])) {
        PyErr_SetString(PyExc_TypeError, "push_requests(reqs: list, start, kinds: dict, room, after, pending: dict, outstanding: dict, sums)");
        return NULL;
    }
    if ((start = PyLong_AsSsize_t(a[1])) == -1 && PyErr_Occurred())
        return NULL;
    if ((room = PyLong_AsSsize_t(a[3])) == -1 && PyErr_Occurred())
        return NULL;
    if ((after = PyLong_AsUnsignedLongLong(a[4])) == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (check_role(self, 1) < 0)
        return NULL;
    PyObject *reqs = a[0], *kinds = a[2], *pending = a[5], *outstanding = a[6], *sums = a[7];
    Py_ssize_t n = PyList_GET_SIZE(reqs);
    if (start < 0 || start > n) {
        PyErr_SetString(PyExc_IndexError, "push_requests: start out of range");
        return NULL;
    }
    /* Pass 1: what fits, each request's kind and descriptors noted once. */
    struct { int kind, summed; Py_ssize_t k; } small[64], *info = small;
    if (n - start > 64 && !(info = PyMem_Malloc((size_t)(n - start) * sizeof *info)))
        return PyErr_NoMemory();
    uint64_t stackbuf[16 * DESC_WORDS], *buf = stackbuf;
    PyObject *out = NULL;
    Py_ssize_t end = start, used = 0;
    for (; end < n; end++) {
        PyObject *r = PyList_GET_ITEM(reqs, end);
        PyObject *ko = PyDict_GetItemWithError(kinds, (PyObject *)Py_TYPE(r));
        if (!ko) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "a %s cannot take the ring", Py_TYPE(r)->tp_name);
            goto done;
        }
        long kind = PyLong_AsLong(ko);
        if (kind < 0 || kind >= K_COUNT) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "push_requests: unknown kind code");
            goto done;
        }
        Py_ssize_t k = descriptors_for(r, (int)kind);
        if (k < 0)
            goto done;
        if (used + k > room)
            break;
        int summed = kind == K_COPYV ? attr_true(r, s_sums) : 0;
        if (summed < 0)
            goto done;
        info[end - start].summed = summed;
        info[end - start].kind = (int)kind;
        info[end - start].k = k;
        used += k;
    }
    /* Pass 2: pack (nothing is published if a field does not fit). */
    if (used > 16 && !(buf = PyMem_Malloc((size_t)used * DESC_WORDS * 8))) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *w = buf;
    for (Py_ssize_t i = start; i < end; i++) {
        Py_ssize_t k = info[i - start].k;
        if (k && pack_request(PyList_GET_ITEM(reqs, i), info[i - start].kind, k, info[i - start].summed, w) < 0)
            goto done;
        w += k * DESC_WORDS;
    }
    if (after && used)
        put_fence(buf, after);
    int64_t published = used ? trq_push_from(&self->q, buf, (uint64_t)used, 0) : 0;
    if (published < 0) {
        corrupt(self);
        goto done;
    }
    if (published)
        ring_peer(self);
    /* Note what each answers. */
    for (Py_ssize_t i = start; i < end; i++) {
        int kind = info[i - start].kind;
        if (kind == K_WAIT)
            continue;
        PyObject *rid = PyObject_GetAttr(PyList_GET_ITEM(reqs, i), s_id);
        if (!rid)
            goto done;
        PyObject *p = PyDict_GetItemWithError(pending, rid);
        if (!p) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, rid);
            Py_DECREF(rid);
            goto done;
        }
        int rc = note_outstanding(outstanding, sums, rid, p, kind, info[i - start].summed, info[i - start].k);
        Py_DECREF(rid);
        if (rc < 0)
            goto done;
    }
    out = Py_BuildValue("(nnL)", end - start, used, (long long)published);
done:
    if (buf != stackbuf)
        PyMem_Free(buf);
    if (info != small)
        PyMem_Free(info);
    return out;
}

/* checksum64 (transfer/_checksum.py) of a C-contiguous buffer: the word sum the workers use
 * (tdp_sum64), with the length mixed in. About four times NumPy's sum; the GIL is released
 * over long ranges. A buffer that is not C-contiguous is refused (BufferError, or NumPy's
 * ValueError): the caller copies it first. */
#define CHECKSUM_GOLDEN 0x9E3779B97F4A7C15ULL
#define CHECKSUM_NOGIL_BYTES (64u << 10)

static PyObject *checksum64_native(PyObject *mod, PyObject *obj)
{
    Py_buffer b;
    if (PyObject_GetBuffer(obj, &b, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    const uint8_t *p = (const uint8_t *)b.buf;
    uint64_t n = (uint64_t)b.len, s;
    if (n >= CHECKSUM_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        s = tdp_sum64(p, n);
        Py_END_ALLOW_THREADS
    } else {
        s = tdp_sum64(p, n);
    }
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(s + n * CHECKSUM_GOLDEN); /* wraps mod 2**64, as defined */
}

/* ints_within(args, bounds) -> bool: P.check_ints's common case in one call (a request's
 * submission checks its integer fields each time). bounds: ((position, name, lo, hi), ...).
 * False as soon as a field is not an exact int or is out of range: the Python check then
 * accepts it (a NumPy integer) or names what is wrong, in the decoder's words. */
static PyObject *ints_within(PyObject *mod, PyObject *const *a, Py_ssize_t n)
{
    if (n != 2 || !PyTuple_CheckExact(a[0]) || !PyTuple_CheckExact(a[1])) {
        PyErr_SetString(PyExc_TypeError, "ints_within(args: tuple, bounds: tuple)");
        return NULL;
    }
    Py_ssize_t na = PyTuple_GET_SIZE(a[0]), nb = PyTuple_GET_SIZE(a[1]);
    for (Py_ssize_t j = 0; j < nb; j++) {
        PyObject *b = PyTuple_GET_ITEM(a[1], j);
        if (!PyTuple_CheckExact(b) || PyTuple_GET_SIZE(b) != 4) {
            PyErr_SetString(PyExc_TypeError, "ints_within: a bound is (position, name, lo, hi)");
            return NULL;
        }
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(b, 0));
        if (i == -1 && PyErr_Occurred())
            return NULL;
        if (i < 0 || i >= na)
            break; /* trailing defaults left out */
        PyObject *v = PyTuple_GET_ITEM(a[0], i);
        if (!PyLong_CheckExact(v))
            Py_RETURN_FALSE;
        int r = PyObject_RichCompareBool(PyTuple_GET_ITEM(b, 2), v, Py_LE);
        if (r > 0)
            r = PyObject_RichCompareBool(v, PyTuple_GET_ITEM(b, 3), Py_LE);
        if (r < 0)
            return NULL;
        if (!r)
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* segment_stats(vas, sizes, bits) -> [(segment id, first VA, lowest offset, highest end,
 * largest size), ...]: one pass over two equal-length uint64 buffers, one tuple per segment
 * the VAs name (id = va >> bits), in order of first appearance. An end that overflows 64
 * bits counts as 2**64 - 1. MappingTable.translate_many's arithmetic, which took seven NumPy
 * calls (each a few microseconds, whatever the length) and a Python loop over every range. */
static PyObject *segment_stats(PyObject *mod, PyObject *const *a, Py_ssize_t n)
{
    if (n != 3) {
        PyErr_SetString(PyExc_TypeError, "segment_stats(vas, sizes, bits)");
        return NULL;
    }
    long bits = PyLong_AsLong(a[2]);
    if (bits == -1 && PyErr_Occurred())
        return NULL;
    if (bits < 1 || bits > 63) {
        PyErr_SetString(PyExc_ValueError, "segment_stats: bits must be 1..63");
        return NULL;
    }
    Py_buffer v, z;
    if (PyObject_GetBuffer(a[0], &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(a[1], &z, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&v);
        return NULL;
    }
    PyObject *out = NULL;
    if (v.len != z.len || !u64_format(&v) || !u64_format(&z)) {
        PyErr_SetString(PyExc_ValueError, "segment_stats: two uint64 buffers of equal length");
        goto done;
    }
    Py_ssize_t count = v.len / 8;
    const uint64_t mask = (1ull << bits) - 1;
    /* Few segments per vector: a short array, searched from the last one found. */
    struct seg_stat { uint64_t sid, first, lo, hi, big; } small[8], *st = small;
    Py_ssize_t nst = 0, cap = 8, last = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t va, size, end;
        memcpy(&va, (const char *)v.buf + 8 * i, 8);
        memcpy(&size, (const char *)z.buf + 8 * i, 8);
        uint64_t sid = va >> bits, off = va & mask;
        if (__builtin_add_overflow(off, size, &end))
            end = UINT64_MAX;
        Py_ssize_t k = last;
        if (k >= nst || st[k].sid != sid) {
            for (k = 0; k < nst && st[k].sid != sid; k++)
                ;
        }
        if (k == nst) {
            if (nst == cap) {
                struct seg_stat *bigger = PyMem_Malloc(2 * cap * sizeof *st);
                if (!bigger) {
                    PyErr_NoMemory();
                    goto freeing;
                }
                memcpy(bigger, st, nst * sizeof *st);
                if (st != small)
                    PyMem_Free(st);
                st = bigger;
                cap *= 2;
            }
            st[nst++] = (struct seg_stat){sid, va, off, end, size};
        } else {
            if (off < st[k].lo)
                st[k].lo = off;
            if (end > st[k].hi)
                st[k].hi = end;
            if (size > st[k].big)
                st[k].big = size;
        }
        last = k;
    }
    out = PyList_New(nst);
    for (Py_ssize_t k = 0; out && k < nst; k++) {
        PyObject *t = Py_BuildValue("(KKKKK)", (unsigned long long)st[k].sid, (unsigned long long)st[k].first,
                                    (unsigned long long)st[k].lo, (unsigned long long)st[k].hi, (unsigned long long)st[k].big);
        if (!t)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, k, t);
    }
freeing:
    if (st != small)
        PyMem_Free(st);
done:
    PyBuffer_Release(&v);
    PyBuffer_Release(&z);
    return out;
}

/* copy_helpers(n): how many copy helpers may share large copies (dataplane.h; none until
 * this is called); those not running start now. Returns how many may share a copy now. */
static PyObject *copy_helpers_native(PyObject *mod, PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0 || n > TDP_HELPERS_MAX) {
        PyErr_Format(PyExc_ValueError, "copy_helpers: expected 0..%d, got %ld", TDP_HELPERS_MAX, n);
        return NULL;
    }
    int running;
    Py_BEGIN_ALLOW_THREADS
    running = tdp_copy_helpers((int)n);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(running);
}

#include "submission.h" /* (the client's submission state: uses the Queue and push_requests above) */

static PyMethodDef module_methods[] = {
    {"_set_corrupt_error", set_corrupt_error, METH_O, "exception class for a corrupted ring"},
    {"ints_within", (PyCFunction)(void (*)(void))ints_within, METH_FASTCALL,
     "ints_within(args, bounds) -> bool: every integer field an exact int within its bounds"},
    {"segment_stats", (PyCFunction)(void (*)(void))segment_stats, METH_FASTCALL,
     "segment_stats(vas, sizes, bits) -> [(segment, first va, lowest offset, highest end, largest size)]"},
    {"copy_helpers", copy_helpers_native, METH_O,
     "copy_helpers(n) -> int: let n threads (at most 8) share large copies with the workers; how many may now"},
    {"checksum64", checksum64_native, METH_O,
     "checksum64(buffer) -> int: checksum64 of a C-contiguous buffer (transfer/_checksum.py)"},
    {NULL}};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "transfer._ring_native",
    "Native shared-memory SPSC ring (futex doorbell, C11 atomics).", -1, module_methods};

PyMODINIT_FUNC PyInit__ring_native(void)
{
    if (PyType_Ready(&QueueType) < 0 || PyType_Ready(&TableType) < 0 || PyType_Ready(&WorkerType) < 0 ||
        PyType_Ready(&SubmissionType) < 0)
        return NULL;
    if (pthread_atfork(NULL, NULL, bump_fork_generation) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "pthread_atfork failed");
        return NULL;
    }
    if (intern_names() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m)
        return NULL;
    Py_INCREF(&QueueType);
    if (PyModule_AddObject(m, "Queue", (PyObject *)&QueueType) < 0) {
        Py_DECREF(&QueueType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&TableType);
    Py_INCREF(&WorkerType);
    Py_INCREF(&SubmissionType);
    if (PyModule_AddObject(m, "Table", (PyObject *)&TableType) < 0 ||
        PyModule_AddObject(m, "Worker", (PyObject *)&WorkerType) < 0 ||
        PyModule_AddObject(m, "Submission", (PyObject *)&SubmissionType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "SLICE_NS", (long)TRQ_SLICE_NS);
    PyModule_AddIntConstant(m, "NATIVE", TDP_NATIVE);
    PyModule_AddIntConstant(m, "PYTHON", TDP_PYTHON);
    PyModule_AddIntConstant(m, "BROKEN", TDP_BROKEN);
    return m;
}
