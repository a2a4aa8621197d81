/*
 * binding.h: what the extension's Python types share (module.c, queue_type.c,
 * dataplane_type.c, submission.c, util.c). Internal to the extension.
 */
#ifndef TRANSFER_BINDING_H
#define TRANSFER_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "dataplane.h"
#include "layout.h"
#include "queue.h"

#define MAX_FIELDS 16

/* The exception for a corrupted ring (module.c: set by _set_corrupt_error). */
extern PyObject *CorruptError;
extern PyTypeObject QueueType, TableType, WorkerType, SubmissionType, BridgeType;

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

/* queue_type.c */
uint32_t ring_peer(QueueObject *self);
int check_open(QueueObject *self);
int check_role(QueueObject *self, int producer);
PyObject *corrupt(QueueObject *self);
int queue_intern_names(void);

#include "submission.h"
#include "util.h"

#if PY_VERSION_HEX >= 0x030D0000
#define IS_FINALIZING() Py_IsFinalizing()
#else
#define IS_FINALIZING() _Py_IsFinalizing()
#endif

/* cudagraph.c: CUDA graphs and host functions for the graph runs the workers serve. */
PyObject *cuda_graphs_native(PyObject *mod, PyObject *unused);
PyObject *cuda_capture_begin_native(PyObject *mod, PyObject *args);
PyObject *cuda_capture_end_native(PyObject *mod, PyObject *args);
PyObject *cuda_graph_launch_native(PyObject *mod, PyObject *args);
PyObject *cuda_graph_free_native(PyObject *mod, PyObject *args);
PyObject *cuda_host_call_native(PyObject *mod, PyObject *args);
PyObject *cuda_host_dispatcher_native(PyObject *mod, PyObject *fn);

#endif /* TRANSFER_BINDING_H */
