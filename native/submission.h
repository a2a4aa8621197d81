/* A client's submission state (transfer/client/_submission.py is its pure-Python twin).
 *
 * Included by _ring_native.c after the Queue type and push_requests, which it uses.
 *
 * What routing and credits read and write lives here, in one object the client's Python
 * code and this file's `submit` share: request ids, the socket frames sent, the ring's
 * credits, descriptors in flight, the last fence, and the pending and outstanding tables.
 * `route` (ring or socket, and the fence) and `push` (publish within the credits, count
 * what went out) are the rules, once. `submit` is one data request (a copy, fill,
 * checksum, copy_many or checksum_many) made, routed and pushed in one call, with the same
 * two rules; it declines (returns None) whenever anything else is due, and the client's
 * general path then does the same work in Python, through the same `route` and `push`. */

#include <pthread.h>
#include <stddef.h>
#include <structmember.h>

/* Bumped in a forked child: a Submission made before the fork declines after it. */
static unsigned fork_generation;
static void bump_fork_generation(void) { fork_generation++; }

typedef struct {
    PyObject_HEAD
    PyObject *pending;     /* dict: id -> Pending, the client's pending table */
    PyObject *pending_cls; /* what a request's Pending is made with: pending_cls(id, waiter) */
    PyObject *waiter;
    PyObject *outbox;      /* the ring's request queue (NULL: no ring) */
    PyObject *push_fn;     /* its push_requests (native, or the pure-Python twin's partial) */
    PyObject *outstanding; /* dict: id -> (pending, answers, descriptors) */
    PyObject *kinds;       /* request type -> kind code (_ringlink._KINDS) */
    PyObject *sums;        /* what gathers a vector's answers (_ringlink._Sums) */
    PyObject *buffers;     /* dict: segment id -> a deferred buffer not defined yet (or NULL) */
    PyObject *holds;       /* tuple of containers: submit declines while any is not empty */
    PyObject *kick;        /* called after submit publishes (an event loop's reaper), or None */
    PyObject *acquire, *release; /* the client's lock (bound methods), or NULL: none to take */
    /* A Pending made without running its __init__ (pending_template): the fields its class
     * sets the same for every request, copied from one made by the class, then the two it is
     * given. ntemplate < 0: no template; the class is called. */
    struct { Py_ssize_t offset; PyObject *value; } template[12];
    Py_ssize_t ntemplate, id_offset, waiter_offset;
    unsigned long long next_id, frames, fenced, pushed;
    long long in_flight, credits, chain; /* chain: the most ranges a copy_many may have here */
    char after, batching, broken; /* (T_BOOL members: one byte each) */
    int shift;
    unsigned fork;
} SubmissionObject;

static void template_clear(SubmissionObject *self)
{
    for (Py_ssize_t i = 0; i < self->ntemplate; i++)
        Py_CLEAR(self->template[i].value);
    self->ntemplate = -1;
}

/* Learn how pending_cls(id, waiter) fills a new object, so submit can make one without a
 * Python frame: a class with __slots__ only (no __dict__, object's __new__), whose every
 * field but `id` and `_waiter` holds, in one made by the class, nothing or an immutable
 * value (None, a bool, an int), the same for every request. Anything else: no template. */
static int template_learn(SubmissionObject *self, PyObject *cls)
{
    template_clear(self);
    if (!PyType_Check(cls))
        return 0;
    PyTypeObject *t = (PyTypeObject *)cls;
    if (t->tp_new != PyBaseObject_Type.tp_new || t->tp_dictoffset != 0 || t->tp_alloc != PyType_GenericAlloc)
        return 0;
    PyObject *zero = PyLong_FromLong(0), *made = NULL;
    if (!zero)
        return -1;
    PyObject *cargs[2] = {zero, self->waiter};
    made = PyObject_Vectorcall(cls, cargs, 2, NULL);
    Py_DECREF(zero);
    if (!made) {
        PyErr_Clear(); /* (a class that cannot be made this way: submit calls it, and says so) */
        return 0;
    }
    Py_ssize_t n = 0, id_off = -1, waiter_off = -1;
    int ok = 1;
    PyObject *mro = t->tp_mro;
    for (Py_ssize_t k = 0; ok && mro && k < PyTuple_GET_SIZE(mro); k++) {
        PyTypeObject *base = (PyTypeObject *)PyTuple_GET_ITEM(mro, k);
        if (base == &PyBaseObject_Type || !base->tp_dict)
            continue;
        if (!(base->tp_flags & Py_TPFLAGS_HEAPTYPE)) { /* a C base: fields we cannot see */
            ok = 0;
            break;
        }
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (ok && PyDict_Next(base->tp_dict, &pos, &key, &value)) {
            if (Py_TYPE(value) != &PyMemberDescr_Type)
                continue;
            PyMemberDef *m = ((PyMemberDescrObject *)value)->d_member;
            if (m->type != T_OBJECT_EX || (m->flags & READONLY) || m->offset <= 0 || m->offset >= t->tp_basicsize) {
                ok = 0;
                break;
            }
            PyObject *v = *(PyObject **)((char *)made + m->offset);
            if (PyUnicode_CompareWithASCIIString(key, "id") == 0) {
                id_off = m->offset;
            } else if (PyUnicode_CompareWithASCIIString(key, "_waiter") == 0) {
                waiter_off = m->offset;
            } else if (v && v != Py_None && !PyBool_Check(v) && !PyLong_CheckExact(v)) {
                ok = 0; /* a mutable field: each request needs its own */
            } else if (n == (Py_ssize_t)(sizeof self->template / sizeof self->template[0])) {
                ok = 0;
            } else {
                self->template[n].offset = m->offset;
                self->template[n].value = Py_XNewRef(v);
                self->ntemplate = ++n;
            }
        }
    }
    Py_DECREF(made);
    if (!ok || id_off < 0 || waiter_off < 0) {
        template_clear(self);
        return 0;
    }
    self->ntemplate = n;
    self->id_offset = id_off;
    self->waiter_offset = waiter_off;
    return 0;
}

/* A new Pending for request `id`: from the template, or by calling the class. */
static PyObject *new_pending(SubmissionObject *self, PyObject *id)
{
    if (self->ntemplate < 0) {
        PyObject *cargs[2] = {id, self->waiter};
        return PyObject_Vectorcall(self->pending_cls, cargs, 2, NULL);
    }
    PyTypeObject *t = (PyTypeObject *)self->pending_cls;
    PyObject *p = t->tp_alloc(t, 0);
    if (!p)
        return NULL;
    for (Py_ssize_t i = 0; i < self->ntemplate; i++)
        *(PyObject **)((char *)p + self->template[i].offset) = Py_XNewRef(self->template[i].value);
    *(PyObject **)((char *)p + self->id_offset) = Py_NewRef(id);
    *(PyObject **)((char *)p + self->waiter_offset) = Py_NewRef(self->waiter);
    return p;
}

static int Submission_init(SubmissionObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"pending", "pending_cls", "waiter", NULL};
    PyObject *pending, *cls, *waiter;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OO", kwlist, &PyDict_Type, &pending, &cls, &waiter))
        return -1;
    Py_XSETREF(self->pending, Py_NewRef(pending));
    Py_XSETREF(self->pending_cls, Py_NewRef(cls));
    Py_XSETREF(self->waiter, Py_NewRef(waiter));
    Py_XSETREF(self->holds, PyTuple_New(0));
    Py_XSETREF(self->kick, Py_NewRef(Py_None));
    self->next_id = 1;
    self->fork = fork_generation;
    if (!self->holds)
        return -1;
    return template_learn(self, cls);
}

static int Submission_traverse(SubmissionObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->pending);
    Py_VISIT(self->pending_cls);
    Py_VISIT(self->waiter);
    Py_VISIT(self->outbox);
    Py_VISIT(self->push_fn);
    Py_VISIT(self->outstanding);
    Py_VISIT(self->kinds);
    Py_VISIT(self->sums);
    Py_VISIT(self->buffers);
    Py_VISIT(self->holds);
    Py_VISIT(self->kick);
    Py_VISIT(self->acquire);
    Py_VISIT(self->release);
    for (Py_ssize_t i = 0; i < self->ntemplate; i++)
        Py_VISIT(self->template[i].value);
    return 0;
}

static int Submission_clear(SubmissionObject *self)
{
    Py_CLEAR(self->pending);
    Py_CLEAR(self->pending_cls);
    Py_CLEAR(self->waiter);
    Py_CLEAR(self->outbox);
    Py_CLEAR(self->push_fn);
    Py_CLEAR(self->outstanding);
    Py_CLEAR(self->kinds);
    Py_CLEAR(self->sums);
    Py_CLEAR(self->buffers);
    Py_CLEAR(self->holds);
    Py_CLEAR(self->kick);
    Py_CLEAR(self->acquire);
    Py_CLEAR(self->release);
    template_clear(self);
    return 0;
}

static void Submission_dealloc(SubmissionObject *self)
{
    PyObject_GC_UnTrack(self);
    Submission_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int submission_ok(SubmissionObject *self)
{
    if (!self->pending) {
        PyErr_SetString(PyExc_ValueError, "Submission not initialised");
        return 0;
    }
    return 1;
}

/* attach(outbox, push_requests, outstanding, credits, chain, after, kinds, sums): the ring is
 * open; `chain` is the longest copy_many it carries. */
static PyObject *Submission_attach(SubmissionObject *self, PyObject *args)
{
    PyObject *outbox, *push, *outstanding, *kinds, *sums;
    long long credits, chain;
    int after;
    if (!submission_ok(self) || !PyArg_ParseTuple(args, "OOO!LLpO!O", &outbox, &push, &PyDict_Type, &outstanding, &credits,
                                                   &chain, &after, &PyDict_Type, &kinds, &sums))
        return NULL;
    if (credits < 1 || chain < 1 || chain > credits) {
        PyErr_SetString(PyExc_ValueError, "attach: credits must be at least 1, and chain within 1..credits");
        return NULL;
    }
    self->chain = chain;
    Py_XSETREF(self->outbox, Py_NewRef(outbox));
    Py_XSETREF(self->push_fn, Py_NewRef(push));
    Py_XSETREF(self->outstanding, Py_NewRef(outstanding));
    Py_XSETREF(self->kinds, Py_NewRef(kinds));
    Py_XSETREF(self->sums, Py_NewRef(sums));
    self->credits = credits;
    self->after = (char)after;
    self->in_flight = 0;
    self->fenced = 0;
    self->pushed = 0;
    Py_RETURN_NONE;
}

/* detach(): the ring is closed; everything takes the socket. */
static PyObject *Submission_detach(SubmissionObject *self, PyObject *unused)
{
    Py_CLEAR(self->outbox);
    Py_CLEAR(self->push_fn);
    Py_RETURN_NONE;
}

/* watch(buffers, shift, holds): submit declines for a VA whose segment id (va >> shift) is in
 * `buffers` (a deferred buffer its definition must precede), and while any of `holds` (a
 * tuple of containers: frees to send, an event loop's held requests) is not empty. */
static PyObject *Submission_watch(SubmissionObject *self, PyObject *args)
{
    PyObject *buffers, *holds;
    int shift;
    if (!PyArg_ParseTuple(args, "OiO!", &buffers, &shift, &PyTuple_Type, &holds))
        return NULL;
    if (buffers != Py_None && !PyDict_Check(buffers)) {
        PyErr_SetString(PyExc_TypeError, "watch: buffers must be a dict or None");
        return NULL;
    }
    if (shift < 1 || shift > 63) {
        PyErr_SetString(PyExc_ValueError, "watch: shift must be 1..63");
        return NULL;
    }
    Py_XSETREF(self->buffers, buffers == Py_None ? NULL : Py_NewRef(buffers));
    Py_XSETREF(self->holds, Py_NewRef(holds));
    self->shift = shift;
    Py_RETURN_NONE;
}

/* The routing rule: -1 for the socket, else the frame count the descriptors wait for (0:
 * none). `unsent`: requests in the pending table not handed to any transport yet.
 *
 * The ring keeps order only with itself: while a request sent on the socket is pending, the
 * daemon must read the frames sent so far before what is pushed now (FLAG_AFTER). A daemon
 * that cannot (`after` false) gets ring requests only when nothing sent on the socket is
 * pending. */
static long long route_of(SubmissionObject *self, Py_ssize_t unsent)
{
    if (!self->outbox)
        return -1;
    if (PyDict_GET_SIZE(self->pending) - PyDict_GET_SIZE(self->outstanding) == unsent)
        return 0;
    return self->after ? (long long)self->frames : -1;
}

static PyObject *Submission_route(SubmissionObject *self, PyObject *arg)
{
    Py_ssize_t unsent = PyLong_AsSsize_t(arg);
    if (unsent == -1 && PyErr_Occurred())
        return NULL;
    if (!submission_ok(self))
        return NULL;
    long long r = route_of(self, unsent);
    if (r < 0)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(r);
}

/* What a push sent: the credits it used, counted, and its fence noted once out. */
static void pushed_out(SubmissionObject *self, long long published, unsigned long long fence)
{
    self->in_flight += published;
    self->pushed += (unsigned long long)published;
    if (published && fence)
        self->fenced = fence;
}

/* push(reqs, start, after) -> (taken, used, published): push_requests from reqs[start] within
 * the credits left, the fence on the first descriptor unless an earlier push carried it
 * (`after`: the frame count route() gave), and what went out counted. */
static PyObject *Submission_push(SubmissionObject *self, PyObject *const *a, Py_ssize_t na)
{
    unsigned long long after;
    if (na != 3) {
        PyErr_SetString(PyExc_TypeError, "push(reqs, start, after)");
        return NULL;
    }
    if ((after = PyLong_AsUnsignedLongLong(a[2])) == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (!submission_ok(self))
        return NULL;
    if (!self->push_fn) {
        PyErr_SetString(PyExc_ValueError, "push: no ring attached");
        return NULL;
    }
    unsigned long long fence = after > self->fenced ? after : 0;
    PyObject *room = PyLong_FromLongLong(self->credits - self->in_flight), *fo = PyLong_FromUnsignedLongLong(fence);
    PyObject *res = NULL;
    if (room && fo) {
        PyObject *args[8] = {a[0], a[1], self->kinds, room, fo, self->pending, self->outstanding, self->sums};
        res = PyObject_Vectorcall(self->push_fn, args, 8, NULL);
    }
    Py_XDECREF(room);
    Py_XDECREF(fo);
    if (!res)
        return NULL;
    long long published;
    if (!PyTuple_Check(res) || PyTuple_GET_SIZE(res) != 3 ||
        ((published = PyLong_AsLongLong(PyTuple_GET_ITEM(res, 2))) == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "push_requests answered something other than (taken, used, published)");
        Py_DECREF(res);
        return NULL;
    }
    pushed_out(self, published, fence);
    return res;
}

/* An exact int (not a bool, not a NumPy integer) of at most `max`, else 0 (no error set). */
static int plain_u64(PyObject *o, uint64_t max, uint64_t *out)
{
    if (!PyLong_CheckExact(o))
        return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(o); /* (OverflowError for a negative one too) */
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (v > max)
        return 0;
    *out = v;
    return 1;
}

/* Whether segment (va >> shift) holds a deferred buffer not defined yet: 1, 0, -1 (error). */
static int undefined_at(SubmissionObject *self, uint64_t va)
{
    PyObject *sid = PyLong_FromUnsignedLongLong(va >> self->shift);
    if (!sid)
        return -1;
    int r = PyDict_Contains(self->buffers, sid);
    Py_DECREF(sid);
    return r;
}

/* A vector operand of submit: a 1-D uint64 array of `*k` ranges (the first sets *k); 1,
 * or 0 with nothing held and no error set when it is anything else (the general path says
 * what is wrong). */
static int range_array(PyObject *o, Py_ssize_t *k, vec_arg_t *v)
{
    if (PyLong_Check(o) || !PyObject_CheckBuffer(o))
        return 0;
    if (vec_arg(o, "", k, v) < 0) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* submit(cls, args) -> Pending | None: one copy, fill or checksum (args: its fields after the
 * id, every one given), or one copy_many or checksum_many (its uint64 arrays, the stream, a
 * copy_many's `sums`), made and pushed, when nothing else is due; None when the general
 * path must take it: another kind, a field that is not an exact int in range or an array
 * that is not 1-D uint64 of one length (the general path converts or names what is wrong),
 * a vector longer than the ring carries, the session broken or forked, a batch open,
 * something held or owed first (frees, held requests, the definition of a deferred buffer
 * it touches: for a vector, any not defined yet), no ring, the socket's turn (route), or
 * not enough credits (the general path waits for them). */
static PyObject *submit_locked(SubmissionObject *self, PyObject *const *a)
{
    if (!self->outbox || Py_TYPE(self->outbox) != &QueueType || self->broken || self->batching ||
        self->fork != fork_generation || self->in_flight >= self->credits)
        Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->holds); i++) {
        Py_ssize_t n = PyObject_Length(PyTuple_GET_ITEM(self->holds, i));
        if (n != 0) {
            if (n < 0)
                return NULL;
            Py_RETURN_NONE;
        }
    }
    PyObject *ko = PyDict_GetItemWithError(self->kinds, a[0]);
    if (!ko) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    long kind = PyLong_AsLong(ko);
    PyObject *args = a[1];
    Py_ssize_t nargs = PyTuple_GET_SIZE(args), k = 1;
    uint64_t one[DESC_WORDS], *w = one, stream = 0, dst = 0, src = 0, nbytes = 0, arg0 = 0;
    vec_arg_t d = {0}, sv = {0}, nb = {0};
    int ok, summed = 0, vector = kind == K_COPYV || kind == K_CHECKSUMV;
    switch (kind) {
    case K_COPY: /* dst, src, nbytes, stream */
        ok = nargs == 4 && plain_u64(PyTuple_GET_ITEM(args, 0), UINT64_MAX, &dst) &&
             plain_u64(PyTuple_GET_ITEM(args, 1), UINT64_MAX, &src) && plain_u64(PyTuple_GET_ITEM(args, 2), UINT64_MAX, &nbytes) &&
             plain_u64(PyTuple_GET_ITEM(args, 3), UINT32_MAX, &stream);
        break;
    case K_FILL: /* dst, nbytes, value, stream */
        ok = nargs == 4 && plain_u64(PyTuple_GET_ITEM(args, 0), UINT64_MAX, &dst) &&
             plain_u64(PyTuple_GET_ITEM(args, 1), UINT64_MAX, &nbytes) && plain_u64(PyTuple_GET_ITEM(args, 2), 255, &arg0) &&
             plain_u64(PyTuple_GET_ITEM(args, 3), UINT32_MAX, &stream);
        break;
    case K_CHECKSUM: /* src, nbytes, stream */
        ok = nargs == 3 && plain_u64(PyTuple_GET_ITEM(args, 0), UINT64_MAX, &src) &&
             plain_u64(PyTuple_GET_ITEM(args, 1), UINT64_MAX, &nbytes) && plain_u64(PyTuple_GET_ITEM(args, 2), UINT32_MAX, &stream);
        break;
    case K_COPYV: /* dst[], src[], nbytes[], stream, sums (a bool, or left out) */
        k = -1;
        ok = (nargs == 4 || (nargs == 5 && PyBool_Check(PyTuple_GET_ITEM(args, 4)))) &&
             plain_u64(PyTuple_GET_ITEM(args, 3), UINT32_MAX, &stream) && range_array(PyTuple_GET_ITEM(args, 2), &k, &nb) &&
             range_array(PyTuple_GET_ITEM(args, 0), &k, &d) && range_array(PyTuple_GET_ITEM(args, 1), &k, &sv) &&
             k >= 1 && k <= self->chain;
        summed = ok && nargs == 5 && PyTuple_GET_ITEM(args, 4) == Py_True;
        break;
    case K_CHECKSUMV: /* src[], nbytes[], stream */
        k = -1;
        ok = nargs == 3 && plain_u64(PyTuple_GET_ITEM(args, 2), UINT32_MAX, &stream) &&
             range_array(PyTuple_GET_ITEM(args, 1), &k, &nb) && range_array(PyTuple_GET_ITEM(args, 0), &k, &sv) &&
             k >= 1 && k <= self->credits;
        break;
    default:
        ok = 0;
    }
    PyObject *out = NULL, *id = NULL, *p = NULL;
    if (!ok || k > self->credits - self->in_flight)
        goto decline;
    if (self->buffers && PyDict_GET_SIZE(self->buffers)) {
        if (vector)
            goto decline; /* (its definitions go first: the general path finds which) */
        int u = 0;
        if (kind != K_CHECKSUM)
            u = undefined_at(self, dst);
        if (u == 0 && kind != K_FILL)
            u = undefined_at(self, src);
        if (u < 0)
            goto done;
        if (u)
            goto decline;
    }
    long long route = route_of(self, 0); /* (before this request is in the pending table) */
    if (route < 0)
        goto decline;
    QueueObject *q = (QueueObject *)self->outbox;
    if (check_role(q, 1) < 0) {
        PyErr_Clear(); /* (the general path says what is wrong) */
        goto decline;
    }
    unsigned long long fence = (unsigned long long)route > self->fenced ? (unsigned long long)route : 0;
    uint64_t rid = self->next_id;
    uint64_t head = desc_head(kind, stream, summed);
    if (vector) {
        if (k > 1 && !(w = PyMem_Malloc((size_t)k * DESC_WORDS * 8))) {
            w = one;
            PyErr_NoMemory();
            goto done;
        }
        pack_ranges(head, rid, kind == K_COPYV, k, &d, &sv, &nb, w);
    } else {
        pack_one(head, rid, dst, src, nbytes, arg0, w);
    }
    if (fence)
        put_fence(w, fence);
    /* Noted first (what can fail, fails before anything is published), then published. */
    if (!(id = PyLong_FromUnsignedLongLong(rid)) || !(p = new_pending(self, id)) || PyDict_SetItem(self->pending, id, p) < 0)
        goto done;
    if (note_outstanding(self->outstanding, self->sums, id, p, kind, summed, k) < 0)
        goto unnote;
    int64_t published = trq_push_from(&q->q, w, (uint64_t)k, 0);
    if (published != k) {
        if (published > 0) { /* part of a chain out: nothing to take back */
            pushed_out(self, published, fence);
            self->next_id = rid + 1;
            PyErr_SetString(CorruptError ? CorruptError : PyExc_RuntimeError,
                            "ring corrupted: the daemon took fewer descriptors than its free slots");
            goto done;
        }
        if (PyDict_DelItem(self->outstanding, id) < 0)
            PyErr_Clear();
        if (published < 0) {
            corrupt(q);
            goto unnote;
        }
        /* Full within the credits: the daemon broke the ring. The general path says so. */
        if (PyDict_DelItem(self->pending, id) < 0)
            PyErr_Clear();
        goto decline;
    }
    ring_peer(q);
    self->next_id = rid + 1;
    pushed_out(self, k, fence);
    if (self->kick && self->kick != Py_None) {
        PyObject *r = PyObject_CallNoArgs(self->kick);
        if (!r)
            goto done;
        Py_DECREF(r);
    }
    out = Py_NewRef(p);
    goto done;
unnote:
    {
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        if (PyDict_DelItem(self->pending, id) < 0)
            PyErr_Clear();
        PyErr_Restore(t, v, tb);
    }
    goto done;
decline:
    out = Py_NewRef(Py_None);
done:
    if (w != one)
        PyMem_Free(w);
    vec_release(&d);
    vec_release(&sv);
    vec_release(&nb);
    Py_XDECREF(p);
    Py_XDECREF(id);
    return out;
}

static PyObject *Submission_submit(SubmissionObject *self, PyObject *const *a, Py_ssize_t na)
{
    if (na != 2 || !PyTuple_CheckExact(a[1])) {
        PyErr_SetString(PyExc_TypeError, "submit(cls, args: tuple)");
        return NULL;
    }
    if (!submission_ok(self))
        return NULL;
    if (!self->acquire)
        return submit_locked(self, a);
    /* The client's lock, without waiting: held by another thread, the general path waits. */
    PyObject *got = PyObject_CallOneArg(self->acquire, Py_False);
    if (!got)
        return NULL;
    int held = PyObject_IsTrue(got);
    Py_DECREF(got);
    if (held <= 0) {
        if (held < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *out = submit_locked(self, a);
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyObject *r = PyObject_CallNoArgs(self->release);
    if (!r) {
        Py_XDECREF(out);
        Py_XDECREF(t);
        Py_XDECREF(v);
        Py_XDECREF(tb);
        return NULL;
    }
    Py_DECREF(r);
    PyErr_Restore(t, v, tb);
    return out;
}

/* guard(lock): submit takes `lock` (the client's RLock) while it works, without waiting. */
static PyObject *Submission_guard(SubmissionObject *self, PyObject *lock)
{
    PyObject *acq = PyObject_GetAttrString(lock, "acquire"), *rel = acq ? PyObject_GetAttrString(lock, "release") : NULL;
    if (!rel) {
        Py_XDECREF(acq);
        return NULL;
    }
    Py_XSETREF(self->acquire, acq);
    Py_XSETREF(self->release, rel);
    Py_RETURN_NONE;
}

static PyMethodDef Submission_methods[] = {
    {"guard", (PyCFunction)Submission_guard, METH_O, "guard(lock): submit holds the client's lock while it works"},
    {"attach", (PyCFunction)Submission_attach, METH_VARARGS,
     "attach(outbox, push_requests, outstanding, credits, chain, after, kinds, sums): the ring is open"},
    {"detach", (PyCFunction)Submission_detach, METH_NOARGS, "detach(): the ring is closed"},
    {"watch", (PyCFunction)Submission_watch, METH_VARARGS,
     "watch(buffers, shift, holds): what submit must leave to the general path"},
    {"route", (PyCFunction)Submission_route, METH_O,
     "route(unsent) -> int | None: the socket (None), or the ring and the frame count its descriptors wait for"},
    {"push", (PyCFunction)(void (*)(void))Submission_push, METH_FASTCALL,
     "push(reqs, start, after) -> (taken, used, published): push_requests within the credits, counted"},
    {"submit", (PyCFunction)(void (*)(void))Submission_submit, METH_FASTCALL,
     "submit(cls, args) -> Pending | None: one plain request made and pushed, or None for the general path"},
    {NULL}};

static PyMemberDef Submission_members[] = {
    {"next_id", T_ULONGLONG, offsetof(SubmissionObject, next_id), 0, "the next request's id"},
    {"frames", T_ULONGLONG, offsetof(SubmissionObject, frames), 0, "socket frames this client has sent"},
    {"fenced", T_ULONGLONG, offsetof(SubmissionObject, fenced), 0, "the last fence pushed"},
    {"pushed", T_ULONGLONG, offsetof(SubmissionObject, pushed), 0, "descriptors pushed"},
    {"in_flight", T_LONGLONG, offsetof(SubmissionObject, in_flight), 0, "descriptors of the outstanding requests"},
    {"credits", T_LONGLONG, offsetof(SubmissionObject, credits), 0, "descriptors that may be in flight"},
    {"after", T_BOOL, offsetof(SubmissionObject, after), 0, "the daemon orders descriptors after socket frames"},
    {"batching", T_BOOL, offsetof(SubmissionObject, batching), 0, "a batch() block is open"},
    {"broken", T_BOOL, offsetof(SubmissionObject, broken), 0, "the session failed"},
    {"kick", T_OBJECT, offsetof(SubmissionObject, kick), 0, "called after submit publishes, or None"},
    {NULL}};

static PyObject *Submission_get_templated(SubmissionObject *self, void *c)
{
    return PyBool_FromLong(self->ntemplate >= 0);
}

static PyGetSetDef Submission_getset[] = {
    {"templated", (getter)Submission_get_templated, NULL, "submit makes a Pending without calling its class", NULL},
    {NULL}};

static PyTypeObject SubmissionType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transfer._ring_native.Submission",
    .tp_basicsize = sizeof(SubmissionObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A client's submission state: ids, credits, the routing rule and the push",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Submission_init,
    .tp_traverse = (traverseproc)Submission_traverse,
    .tp_clear = (inquiry)Submission_clear,
    .tp_dealloc = (destructor)Submission_dealloc,
    .tp_methods = Submission_methods,
    .tp_members = Submission_members,
    .tp_getset = Submission_getset,
};
