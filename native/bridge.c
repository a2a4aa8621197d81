/*
 * bridge.c: transfer._native.Bridge, a ring carried over a stream socket (docs/ring.md,
 * "Remote rings"). A remote session has a ring on each host, each in its own process's
 * memory, and one TCP connection between them: on the client, the bridge consumes the
 * request queue and produces the completion queue (the daemon's part); on the daemon, it
 * consumes the completion queue and produces the request queue (the client's part). So the
 * client's submission, the daemon's worker and the Python pass see a ring as they see a
 * local one, and the daemon's ring lags the client's by the channel.
 *
 * Two threads, one per direction, neither holds the GIL:
 *   tx: wait for slots in `out` (the futex, armed with TDP_ARMED: a push only wakes it),
 *       pop a batch, send it whole;
 *   rx: recv what the peer sent, push the whole slots into `in` (waiting for room, so a
 *       slow consumer slows the peer through TCP), wake the consumer (its futex, or the
 *       bell fd of a queue whose consumer sleeps in an event loop: ring_peer).
 * The stream carries the slots as the ring holds them, nothing else: the daemon's worker
 * and pass check every descriptor as they check a local client's, and the client checks
 * completions as it does a local daemon's. A slot cut across two recvs waits for its rest.
 *
 * The channel ends when either direction fails (EOF, a socket error, a queue whose peer
 * index is impossible) or when stop() is called: the first end writes `reason` into this
 * end's closed word of the ring (what Ring.close writes), wakes every sleeper of both
 * queues, and shuts the socket down, so the other thread leaves too.
 */
#include "binding.h"

#include <sys/socket.h>

/* Slots one send carries at most (64 KiB of descriptors). */
#define TBR_BATCH 1024u

typedef struct {
    PyObject_HEAD
    QueueObject *out;            /* consumed: its slots go to the socket */
    QueueObject *in;             /* produced: slots from the socket */
    int fd;                      /* the connected socket (ours: closed by stop) */
    _Atomic uint32_t *closed;    /* this end's closed word in the ring's header */
    uint32_t reason;
    uint64_t spin_ns;
    atomic_int interrupt;
    _Atomic int ended;
    _Atomic int why;             /* 0 while open; else an errno, or -1 EOF, -2 a corrupt queue, -3 stopped */
    _Atomic uint64_t n_sent, n_recv, n_sends, n_recvs;
    pthread_t tx, rx;
    int started;
} BridgeObject;

/* The first end: the reason into the closed word, every sleeper woken, the socket shut. */
static void bridge_end(BridgeObject *b, int why)
{
    int expect = 0;
    if (!atomic_compare_exchange_strong(&b->ended, &expect, 1))
        return;
    atomic_store(&b->why, why);
    atomic_store_explicit(b->closed, b->reason, memory_order_seq_cst);
    atomic_store(&b->interrupt, 1);
    trq_force_wake(b->in->q.data_waiter);   /* the consumer of what we produce */
    trq_force_wake(b->out->q.space_waiter); /* the producer of what we consume */
    trq_force_wake(b->out->q.data_waiter);  /* our sender, if it sleeps for slots */
    trq_force_wake(b->in->q.space_waiter);  /* our receiver, if it sleeps for room */
    if (b->in->bell >= 0) {
        ssize_t r = write(b->in->bell, "", 1);
        (void)r;
    }
    shutdown(b->fd, SHUT_RDWR);
}

static int send_all(int fd, const uint8_t *p, size_t n)
{
    while (n) {
        ssize_t r = send(fd, p, n, MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static void *bridge_tx(void *arg)
{
    BridgeObject *b = arg;
    trq_t *q = &b->out->q;
    size_t ss = q->slot_size;
    uint8_t *buf = malloc(TBR_BATCH * ss);
    int why = buf ? 0 : ENOMEM;
    while (!why && !atomic_load(&b->ended)) {
        int64_t n = trq_wait_armed(q, TRQ_WAIT_DATA, 1, UINT64_MAX, b->spin_ns, &b->interrupt, TDP_ARMED);
        if (n < 0) {
            why = -2;
            break;
        }
        if (n == 0) {
            if (atomic_load_explicit(q->peer_closed, memory_order_acquire))
                why = -3;
            continue; /* interrupted: the loop's condition says whether to go on */
        }
        int64_t k = trq_pop_into(q, buf, n < TBR_BATCH ? (uint64_t)n : TBR_BATCH, 1);
        if (k < 0) {
            why = -2;
            break;
        }
        why = send_all(b->fd, buf, (size_t)k * ss);
        atomic_fetch_add_explicit(&b->n_sent, (uint64_t)k, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->n_sends, 1, memory_order_relaxed);
    }
    bridge_end(b, why ? why : -3);
    free(buf);
    return NULL;
}

/* Push n whole slots into `in`, waiting for room; 0, or the reason to end. */
static int push_all(BridgeObject *b, const uint8_t *p, uint64_t n)
{
    trq_t *q = &b->in->q;
    while (n) {
        int64_t k = trq_push_from(q, p, n, 0);
        if (k < 0)
            return -2;
        if (k == 0) {
            ring_peer(b->in); /* what is in goes now: the consumer frees room */
            int64_t f = trq_wait_armed(q, TRQ_WAIT_SPACE, 1, UINT64_MAX, b->spin_ns, &b->interrupt, TDP_ARMED);
            if (f < 0)
                return -2;
            if (f == 0 && (atomic_load(&b->ended) || atomic_load_explicit(q->peer_closed, memory_order_acquire)))
                return -3;
            continue;
        }
        p += (uint64_t)k * q->slot_size;
        n -= (uint64_t)k;
    }
    return 0;
}

static void *bridge_rx(void *arg)
{
    BridgeObject *b = arg;
    trq_t *q = &b->in->q;
    size_t ss = q->slot_size, cap = TBR_BATCH * ss, have = 0;
    uint8_t *buf = malloc(cap);
    int why = buf ? 0 : ENOMEM;
    while (!why && !atomic_load(&b->ended)) {
        ssize_t r = recv(b->fd, buf + have, cap - have, 0);
        if (r <= 0) {
            if (r < 0 && errno == EINTR)
                continue;
            why = r == 0 ? -1 : errno;
            break;
        }
        have += (size_t)r;
        uint64_t n = have / ss;
        if (!n)
            continue;
        why = push_all(b, buf, n);
        if (why)
            break;
        ring_peer(b->in);
        atomic_fetch_add_explicit(&b->n_recv, n, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->n_recvs, 1, memory_order_relaxed);
        have -= n * ss;
        memmove(buf, buf + n * ss, have);
    }
    bridge_end(b, why);
    free(buf);
    return NULL;
}

/* ---- the Python type ---------------------------------------------------------------- */

static void bridge_join(BridgeObject *self)
{
    if (!self->started)
        return;
    bridge_end(self, -3);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(self->tx, NULL);
    pthread_join(self->rx, NULL);
    Py_END_ALLOW_THREADS
    self->started = 0;
    self->out->lent = self->in->lent = 0;
    close(self->fd);
    self->fd = -1;
}

static int Bridge_init(BridgeObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"out", "into", "fd", "closed", "reason", "spin", NULL};
    QueueObject *out, *in;
    int fd;
    Py_ssize_t closed;
    unsigned int reason;
    double spin = 0.0;
    if (self->started) {
        PyErr_SetString(PyExc_RuntimeError, "this bridge is running");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!inI|d", kwlist, &QueueType, &out, &QueueType, &in, &fd, &closed,
                                     &reason, &spin))
        return -1;
    if (check_role(out, 0) < 0 || check_role(in, 1) < 0)
        return -1;
    if (out->lent || in->lent) {
        PyErr_SetString(PyExc_ValueError, "a queue is already served by a worker or a bridge");
        return -1;
    }
    if (out->view.buf != in->view.buf) {
        PyErr_SetString(PyExc_ValueError, "the two queues are not one ring's");
        return -1;
    }
    if (closed < 0 || closed % 4 || closed + 4 > out->view.len) {
        PyErr_SetString(PyExc_ValueError, "closed: not a word of the ring's mapping");
        return -1;
    }
    if (reason == 0) {
        PyErr_SetString(PyExc_ValueError, "reason: must not be 0 (the word of an open end)");
        return -1;
    }
    if (fd < 0 || !(spin >= 0.0 && spin <= 1.0)) {
        PyErr_SetString(PyExc_ValueError, "fd must be an open socket and spin within 0..1 s");
        return -1;
    }
    Py_INCREF(out);
    Py_INCREF(in);
    self->out = out;
    self->in = in;
    self->fd = fd;
    self->closed = (_Atomic uint32_t *)((uint8_t *)out->view.buf + closed);
    self->reason = reason;
    self->spin_ns = (uint64_t)(spin * 1e9);
    out->lent = in->lent = 1;
    int rc = pthread_create(&self->tx, NULL, bridge_tx, self);
    if (rc == 0) {
        rc = pthread_create(&self->rx, NULL, bridge_rx, self);
        if (rc != 0) {
            bridge_end(self, rc);
            pthread_join(self->tx, NULL);
        }
    }
    if (rc != 0) {
        out->lent = in->lent = 0;
        self->fd = -1; /* the caller still owns it */
        errno = rc;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->started = 1;
    return 0;
}

static void Bridge_dealloc(BridgeObject *self)
{
    bridge_join(self);
    Py_XDECREF(self->out);
    Py_XDECREF(self->in);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Bridge_stop(BridgeObject *self, PyObject *unused)
{
    bridge_join(self);
    Py_RETURN_NONE;
}

static PyObject *Bridge_counters(BridgeObject *self, PyObject *unused)
{
    return Py_BuildValue("{sKsKsKsK}", "sent", (unsigned long long)atomic_load(&self->n_sent), "received",
                         (unsigned long long)atomic_load(&self->n_recv), "sends",
                         (unsigned long long)atomic_load(&self->n_sends), "recvs",
                         (unsigned long long)atomic_load(&self->n_recvs));
}

static PyObject *Bridge_get_ended(BridgeObject *self, void *c)
{
    return PyBool_FromLong(atomic_load(&self->ended));
}

static PyObject *Bridge_get_why(BridgeObject *self, void *c)
{
    return PyLong_FromLong(atomic_load(&self->why));
}

static PyMethodDef Bridge_methods[] = {
    {"stop", (PyCFunction)Bridge_stop, METH_NOARGS,
     "end the channel (if it has not ended), join both threads, close the socket"},
    {"counters", (PyCFunction)Bridge_counters, METH_NOARGS,
     "counters() -> {sent, received, sends, recvs}: slots each way, and the syscalls that moved them"},
    {NULL}};

static PyGetSetDef Bridge_getset[] = {
    {"ended", (getter)Bridge_get_ended, NULL, "the channel has ended (its closed word is written)", NULL},
    {"why", (getter)Bridge_get_why, NULL,
     "0 while open; an errno, -1 the peer closed the stream, -2 a queue's peer index was impossible, -3 stopped",
     NULL},
    {NULL}};

PyTypeObject BridgeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transfer._native.Bridge",
    .tp_doc = "Bridge(out, into, fd, closed, reason, spin=0.0): a ring's queues carried over a connected stream socket",
    .tp_basicsize = sizeof(BridgeObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Bridge_init,
    .tp_dealloc = (destructor)Bridge_dealloc,
    .tp_methods = Bridge_methods,
    .tp_getset = Bridge_getset,
};
