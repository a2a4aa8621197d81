/*
 * queue_type.c: transfer._native.Queue, one endpoint (producer or consumer) of one SPSC
 * queue in a shared mapping (queue.h). transfer/ring owns the layout (offsets), the file,
 * the header and the NumPy dtypes; this type only moves slots and indices. It takes a
 * buffer (the mmap) and holds it exported until close(), so the mapping cannot be
 * unmapped under it.
 *
 * Threads: an endpoint is single-threaded (SPSC), except that close() may be called from
 * another thread while wait() sleeps: wait runs without the GIL, counts itself in
 * `waiting`, and close() interrupts it and waits for it to leave before releasing the
 * buffer.
 */
#include "binding.h"

/* Wake the peer for what this producer published: the futex if it sleeps there, and the
 * bell fd too when it armed with 1 (it sleeps in an event loop on that fd). The word it
 * cleared (0: nobody slept). */
uint32_t ring_peer(QueueObject *self)
{
    uint32_t was = trq_ring_doorbell(self->producer ? self->q.data_waiter : self->q.space_waiter);
    if (was == 1 && self->producer && self->bell >= 0) {
        ssize_t r = write(self->bell, "", 1);
        (void)r; /* a full pipe rings already; a closed one has nobody to wake */
    }
    return was;
}

int check_open(QueueObject *self)
{
    if (!self->has_view) {
        PyErr_SetString(PyExc_ValueError, "ring queue is closed");
        return -1;
    }
    return 0;
}

int check_role(QueueObject *self, int producer)
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

PyObject *corrupt(QueueObject *self)
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

int queue_intern_names(void)
{
    if (!(s_finish = PyUnicode_InternFromString("_finish")) || !(s_values = PyUnicode_InternFromString("values")))
        return -1;
    return 0;
}

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

PyTypeObject QueueType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transfer._native.Queue",
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
