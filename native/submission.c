/* A client's submission state (tests/oracles/submission.py is its Python oracle).
 *
 * The Python type is here, with the push that packs a call's requests into descriptors.
 *
 * What routing and credits read and write lives here, in one object the client's Python
 * code and this file's `submit` share: request ids, the socket frames sent, the ring's
 * credits, descriptors in flight, the last fence, and the pending and outstanding tables.
 * `route` (ring or socket, and the fence) and `push` (publish within the credits, count
 * what went out) are the rules, once. `submit` is one data request (a copy, fill,
 * checksum, copy_many or checksum_many) made, routed and pushed in one call, with the same
 * two rules; it declines (returns None) whenever anything else is due, and the client's
 * general path then does the same work in Python, through the same `route` and `push`. */

#include "binding.h"

#include <pthread.h>
#include <stddef.h>
#include <structmember.h>

/* ---- submission: a client's requests straight into its ring ------------------------ */

/* What push_requests knows of a request, by the kind code the client's table maps its type
 * to (transfer/client/_ringlink.py, _KINDS): which fields go where in the descriptor. */
static const uint16_t kind_op[K_COUNT] = {0, TDP_COPY, TDP_FILL, TDP_CHECKSUM, TDP_FENCE, TDP_RUN_GRAPH, TDP_COPY, TDP_CHECKSUM};
#define DESC_WORDS 8 /* REQUEST_DTYPE: 64 bytes */

static PyObject *s_id, *s_stream, *s_dst, *s_src, *s_nbytes, *s_value, *s_graph, *s_inputs, *s_outputs, *s_sums;

int intern_names(void)
{
#define N(v, t) if (!(v = PyUnicode_InternFromString(t))) return -1
    N(s_id, "id"); N(s_stream, "stream"); N(s_dst, "dst"); N(s_src, "src"); N(s_nbytes, "nbytes");
    N(s_value, "value"); N(s_graph, "graph"); N(s_inputs, "inputs"); N(s_outputs, "outputs"); N(s_sums, "sums");
    if (queue_intern_names() < 0)
        return -1;
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
PyObject *Queue_push_requests(QueueObject *self, PyObject *const *a, Py_ssize_t na)
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


/* Bumped in a forked child: a Submission made before the fork declines after it. */
static unsigned fork_generation;
void bump_fork_generation(void) { fork_generation++; }

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
    PyObject *elsewhere;   /* set: segment ids whose requests take the socket (remote segments), or NULL */
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
    self->shift = TDP_OFFSET_BITS; /* (until watch says) */
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
    Py_VISIT(self->elsewhere);
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
    Py_CLEAR(self->elsewhere);
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

/* Whether a plain request of `kind` names a segment `has(where, id)` finds (its dst, unless a
 * checksum; its src, unless a fill): 1, 0, -1 (error). The deferred buffers not defined yet
 * (a dict) and the segments whose requests take the socket (a set) are asked the same way. */
static int names_any(SubmissionObject *self, PyObject *where, int (*has)(PyObject *, PyObject *), long kind, uint64_t dst,
                     uint64_t src)
{
    uint64_t vas[2];
    int n = 0;
    if (kind != K_CHECKSUM)
        vas[n++] = dst;
    if (kind != K_FILL)
        vas[n++] = src;
    for (int i = 0; i < n; i++) {
        PyObject *sid = PyLong_FromUnsignedLongLong(vas[i] >> self->shift);
        if (!sid)
            return -1;
        int r = has(where, sid);
        Py_DECREF(sid);
        if (r)
            return r;
    }
    return 0;
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
 * it touches: for a vector, any not defined yet), a segment whose requests take the socket
 * (`elsewhere`; for a vector, while there is any), no ring, the socket's turn (route), or
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
    /* The definitions of deferred buffers it names go first, and a remote segment's
     * requests take the socket: the general path finds which (for a vector, while any). */
    int held = 0;
    if (self->buffers && PyDict_GET_SIZE(self->buffers))
        held = vector ? 1 : names_any(self, self->buffers, PyDict_Contains, kind, dst, src);
    if (!held && self->elsewhere && PySet_GET_SIZE(self->elsewhere))
        held = vector ? 1 : names_any(self, self->elsewhere, PySet_Contains, kind, dst, src);
    if (held < 0)
        goto done;
    if (held)
        goto decline;
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

static PyObject *Submission_get_elsewhere(SubmissionObject *self, void *c)
{
    return Py_NewRef(self->elsewhere ? self->elsewhere : Py_None);
}

static int Submission_set_elsewhere(SubmissionObject *self, PyObject *v, void *c)
{
    if (v && v != Py_None && !PySet_CheckExact(v)) {
        PyErr_SetString(PyExc_TypeError, "elsewhere: a set of segment ids, or None");
        return -1;
    }
    Py_XSETREF(self->elsewhere, v && v != Py_None ? Py_NewRef(v) : NULL);
    return 0;
}

static PyGetSetDef Submission_getset[] = {
    {"templated", (getter)Submission_get_templated, NULL, "submit makes a Pending without calling its class", NULL},
    {"elsewhere", (getter)Submission_get_elsewhere, (setter)Submission_set_elsewhere,
     "segment ids whose requests take the socket, not the ring (remote segments: a set), or None", NULL},
    {NULL}};

PyTypeObject SubmissionType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transfer._native.Submission",
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
