/*
 * cudagraph.c: CUDA graphs for the graph runs a ring worker serves (server/_inline.py,
 * backends/_replay.py): a stream's work captured once into a graph, instantiated, then
 * launched with one call per run; and host functions queued on a stream (the fake driver's
 * kernels in the test suite). Through the driver loaded by cuda.c; every call that may wait
 * for the driver releases the GIL.
 *
 * A host function names a key, not an object: when it runs (on the driver's thread) the
 * dispatcher set by cuda_host_dispatcher is called with the key, so nothing here owns a
 * Python object that a launch in flight could outlive.
 */
#include "binding.h"

static PyObject *host_dispatcher; /* dispatcher(key) */

static PyObject *graph_fail(const char *what, CUresult r)
{
    PyErr_Format(r == 2 ? PyExc_MemoryError : PyExc_OSError, "%s: %s (CUDA error %d)", what, tdp_cuda_describe(r), r);
    return NULL;
}

static int graph_ready(int ordinal)
{
    if (!tdp_cuda_graphs()) {
        PyErr_SetString(PyExc_OSError, "the loaded CUDA driver cannot capture graphs (or none is loaded)");
        return 0;
    }
    CUresult r = tdp_cuda_use(ordinal);
    if (r != 0) {
        graph_fail("the device's context", r);
        return 0;
    }
    return 1;
}

PyObject *cuda_graphs_native(PyObject *mod, PyObject *unused)
{
    return PyBool_FromLong(tdp_cuda_graphs());
}

/* cuda_capture_begin(stream, ordinal): what this thread queues on the stream from now on is
 * recorded, not run. */
PyObject *cuda_capture_begin_native(PyObject *mod, PyObject *args)
{
    unsigned long long stream;
    int ordinal;
    if (!PyArg_ParseTuple(args, "Ki", &stream, &ordinal) || !graph_ready(ordinal))
        return NULL;
    CUresult r = tdp_cu.StreamBeginCapture((CUstream)(uintptr_t)stream, TDP_CUDA_CAPTURE_THREAD_LOCAL);
    return r ? graph_fail("cuStreamBeginCapture", r) : Py_NewRef(Py_None);
}

/* cuda_capture_end(stream, ordinal) -> executable graph (an int): the capture, instantiated. */
PyObject *cuda_capture_end_native(PyObject *mod, PyObject *args)
{
    unsigned long long stream;
    int ordinal;
    if (!PyArg_ParseTuple(args, "Ki", &stream, &ordinal) || !graph_ready(ordinal))
        return NULL;
    CUgraph g = NULL;
    CUgraphExec x = NULL;
    CUresult r = tdp_cu.StreamEndCapture((CUstream)(uintptr_t)stream, &g);
    if (r != 0)
        return graph_fail("cuStreamEndCapture", r);
    r = tdp_cu.GraphInstantiate(&x, g, 0);
    tdp_cu.GraphDestroy(g); /* (the executable graph is a copy) */
    if (r != 0)
        return graph_fail("cuGraphInstantiate", r);
    return PyLong_FromVoidPtr(x);
}

/* cuda_graph_launch(exec, stream, ordinal): queue one run of the graph. */
PyObject *cuda_graph_launch_native(PyObject *mod, PyObject *args)
{
    unsigned long long exec, stream;
    int ordinal;
    if (!PyArg_ParseTuple(args, "KKi", &exec, &stream, &ordinal) || !graph_ready(ordinal))
        return NULL;
    CUresult r;
    Py_BEGIN_ALLOW_THREADS
    r = tdp_cu.GraphLaunch((CUgraphExec)(uintptr_t)exec, (CUstream)(uintptr_t)stream);
    Py_END_ALLOW_THREADS
    return r ? graph_fail("cuGraphLaunch", r) : Py_NewRef(Py_None);
}

/* cuda_graph_free(exec, ordinal): an executable graph goes (one in flight finishes first). */
PyObject *cuda_graph_free_native(PyObject *mod, PyObject *args)
{
    unsigned long long exec;
    int ordinal;
    if (!PyArg_ParseTuple(args, "Ki", &exec, &ordinal) || !graph_ready(ordinal))
        return NULL;
    CUresult r = tdp_cu.GraphExecDestroy((CUgraphExec)(uintptr_t)exec);
    return r ? graph_fail("cuGraphExecDestroy", r) : Py_NewRef(Py_None);
}

static void host_call(void *arg)
{
    if (!host_dispatcher || IS_FINALIZING())
        return;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *r = PyObject_CallFunction(host_dispatcher, "K", (unsigned long long)(uintptr_t)arg);
    if (!r)
        PyErr_WriteUnraisable(host_dispatcher);
    Py_XDECREF(r);
    PyGILState_Release(g);
}

/* cuda_host_call(stream, ordinal, key): queue dispatcher(key) on the stream. */
PyObject *cuda_host_call_native(PyObject *mod, PyObject *args)
{
    unsigned long long stream, key;
    int ordinal;
    if (!PyArg_ParseTuple(args, "KiK", &stream, &ordinal, &key) || !graph_ready(ordinal))
        return NULL;
    if (!host_dispatcher) {
        PyErr_SetString(PyExc_RuntimeError, "cuda_host_call: no dispatcher (cuda_host_dispatcher)");
        return NULL;
    }
    CUresult r;
    Py_BEGIN_ALLOW_THREADS
    r = tdp_cu.LaunchHostFunc((CUstream)(uintptr_t)stream, host_call, (void *)(uintptr_t)key);
    Py_END_ALLOW_THREADS
    return r ? graph_fail("cuLaunchHostFunc", r) : Py_NewRef(Py_None);
}

/* cuda_host_dispatcher(fn): what host functions call, with their key. */
PyObject *cuda_host_dispatcher_native(PyObject *mod, PyObject *fn)
{
    if (!PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "cuda_host_dispatcher takes a callable");
        return NULL;
    }
    Py_XSETREF(host_dispatcher, Py_NewRef(fn));
    Py_RETURN_NONE;
}
