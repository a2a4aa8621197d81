/*
 * module.c: transfer._native, the package's one native core: the ring's queues
 * (queue_type.c), the data plane's table and workers (dataplane_type.c), the client's
 * submission (submission.c), the remote ring's bridge (bridge.c), CUDA graphs for the workers' graph runs (cudagraph.c) and
 * the utilities (util.c). It reports the layout it was
 * built with (`layout()`), which transfer/ring checks against its own at import.
 */
#include "binding.h"

#include <stddef.h>

PyObject *CorruptError; /* set by _set_corrupt_error(); RuntimeError until then */

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

/* cuda_load(path) -> devices: load the CUDA driver for the workers' device work (cuda.h). */
static PyObject *cuda_load_native(PyObject *mod, PyObject *arg)
{
    const char *path = PyUnicode_AsUTF8(arg);
    if (!path)
        return NULL;
    char err[512];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tdp_cuda_load(path, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_SetString(PyExc_OSError, err);
        return NULL;
    }
    return PyLong_FromLong(tdp_cuda_devices());
}

static PyObject *cuda_devices_native(PyObject *mod, PyObject *unused)
{
    return PyLong_FromLong(tdp_cuda_devices());
}

static PyObject *cuda_fail(const char *what, CUresult r)
{
    PyErr_Format(r == 2 ? PyExc_MemoryError : PyExc_OSError, "%s: %s (CUDA error %d)", what, tdp_cuda_describe(r), r);
    return NULL;
}

/* cuda_alloc(nbytes, ordinal) -> device pointer; cuda_free(ptr). Device memory through the
 * loaded driver (the simulated GPU's, over the fake driver in tests). */
static PyObject *cuda_alloc_native(PyObject *mod, PyObject *args)
{
    unsigned long long n;
    int ordinal;
    if (!PyArg_ParseTuple(args, "Ki", &n, &ordinal))
        return NULL;
    if (!tdp_cuda_loaded())
        return cuda_fail("cuda_alloc: no driver loaded", 3);
    CUdeviceptr p = 0;
    CUresult r = tdp_cuda_use(ordinal);
    if (r == 0)
        r = tdp_cu.MemAlloc(&p, n ? n : 1);
    if (r != 0)
        return cuda_fail("cuMemAlloc", r);
    return PyLong_FromUnsignedLongLong(p);
}

static PyObject *cuda_free_native(PyObject *mod, PyObject *args)
{
    unsigned long long p;
    int ordinal;
    if (!PyArg_ParseTuple(args, "Ki", &p, &ordinal))
        return NULL;
    CUresult r = tdp_cuda_loaded() ? tdp_cuda_use(ordinal) : 3;
    if (r == 0)
        r = tdp_cu.MemFree(p);
    if (r != 0)
        return cuda_fail("cuMemFree", r);
    Py_RETURN_NONE;
}

static PyObject *cuda_describe_native(PyObject *mod, PyObject *arg)
{
    long r = PyLong_AsLong(arg);
    if (r == -1 && PyErr_Occurred())
        return NULL;
    return PyUnicode_FromString(tdp_cuda_describe((CUresult)r));
}

/* layout() -> {name: int}: the C side of the ring's layout (layout.h), for transfer/ring to
 * check against its own declarations at import. */
static PyObject *layout_native(PyObject *mod, PyObject *unused)
{
#define F(t, f) "desc." #f, (long long)offsetof(t, f)
    PyObject *d = Py_BuildValue(
        "{sLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsLsL}",
        "desc_size", (long long)sizeof(tdp_desc_t), "comp_size", (long long)sizeof(tdp_comp_t),
        F(tdp_desc_t, op), F(tdp_desc_t, flags), F(tdp_desc_t, stream), F(tdp_desc_t, id), F(tdp_desc_t, dst),
        F(tdp_desc_t, src), F(tdp_desc_t, nbytes), F(tdp_desc_t, arg0), F(tdp_desc_t, arg1), F(tdp_desc_t, arg2),
        "comp.id", (long long)offsetof(tdp_comp_t, id), "comp.status", (long long)offsetof(tdp_comp_t, status),
        "comp.flags", (long long)offsetof(tdp_comp_t, flags), "comp.result", (long long)offsetof(tdp_comp_t, result),
        "comp.aux", (long long)offsetof(tdp_comp_t, aux),
        "op.NOP", (long long)TDP_NOP, "op.COPY", (long long)TDP_COPY, "op.FILL", (long long)TDP_FILL,
        "op.CHECKSUM", (long long)TDP_CHECKSUM, "op.FENCE", (long long)TDP_FENCE, "op.COMPUTE", (long long)TDP_COMPUTE,
        "op.RUN_GRAPH", (long long)TDP_RUN_GRAPH,
        "FLAG_CHAIN", (long long)TDP_FLAG_CHAIN, "FLAG_AFTER", (long long)TDP_FLAG_AFTER, "FLAG_SUM", (long long)TDP_FLAG_SUM,
        "MAX_CHAIN", (long long)TDP_MAX_CHAIN, "OFFSET_BITS", (long long)TDP_OFFSET_BITS,
        "GOLDEN", (long long)TDP_GOLDEN, "COMPLETION_DETAIL", (long long)TDP_COMPLETION_DETAIL,
        "kind.COUNT", (long long)K_COUNT);
    if (!d)
        return NULL;
    static const char *kinds[K_COUNT] = {"kind.WAIT", "kind.COPY", "kind.FILL", "kind.CHECKSUM", "kind.FENCE",
                                         "kind.RUN_GRAPH", "kind.COPYV", "kind.CHECKSUMV"};
    _Static_assert(K_WAIT == 0 && K_COPY == 1 && K_FILL == 2 && K_CHECKSUM == 3 && K_FENCE == 4 && K_RUN_GRAPH == 5 &&
                   K_COPYV == 6 && K_CHECKSUMV == 7, "the kinds' names above follow their values");
    for (int k = 0; k < K_COUNT; k++) {
        PyObject *v = PyLong_FromLong(k);
        if (!v || PyDict_SetItemString(d, kinds[k], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
#undef F
}

static PyMethodDef module_methods[] = {
    {"layout", layout_native, METH_NOARGS, "layout() -> {name: int}: the ring layout this extension was built with"},
    {"_set_corrupt_error", set_corrupt_error, METH_O, "exception class for a corrupted ring"},
    {"ints_within", (PyCFunction)(void (*)(void))ints_within, METH_FASTCALL,
     "ints_within(args, bounds) -> bool: every integer field an exact int within its bounds"},
    {"segment_stats", (PyCFunction)(void (*)(void))segment_stats, METH_FASTCALL,
     "segment_stats(vas, sizes, bits) -> [(segment, first va, lowest offset, highest end, largest size)]"},
    {"copy_helpers", copy_helpers_native, METH_O,
     "copy_helpers(n) -> int: let n threads (at most 8) share large copies with the workers; how many may now"},
    {"cuda_load", cuda_load_native, METH_O,
     "cuda_load(path) -> devices: load the CUDA driver (libcuda.so.1) for the workers' device work; OSError says why not"},
    {"cuda_devices", cuda_devices_native, METH_NOARGS, "cuda_devices() -> int: CUDA devices of the loaded driver (0: none loaded)"},
    {"cuda_alloc", cuda_alloc_native, METH_VARARGS, "cuda_alloc(nbytes, ordinal) -> int: device memory (cuMemAlloc)"},
    {"cuda_free", cuda_free_native, METH_VARARGS, "cuda_free(ptr, ordinal): cuMemFree"},
    {"cuda_describe", cuda_describe_native, METH_O, "cuda_describe(code) -> str: the driver's words for a CUDA error"},
    {"cuda_graphs", cuda_graphs_native, METH_NOARGS, "cuda_graphs() -> bool: the loaded driver captures and launches graphs"},
    {"cuda_capture_begin", cuda_capture_begin_native, METH_VARARGS, "cuda_capture_begin(stream, ordinal): record, not run"},
    {"cuda_capture_end", cuda_capture_end_native, METH_VARARGS,
     "cuda_capture_end(stream, ordinal) -> exec: the capture, instantiated"},
    {"cuda_graph_launch", cuda_graph_launch_native, METH_VARARGS, "cuda_graph_launch(exec, stream, ordinal): one run"},
    {"cuda_graph_free", cuda_graph_free_native, METH_VARARGS, "cuda_graph_free(exec, ordinal): cuGraphExecDestroy"},
    {"cuda_host_call", cuda_host_call_native, METH_VARARGS,
     "cuda_host_call(stream, ordinal, key): queue the dispatcher's call with key on the stream"},
    {"cuda_host_dispatcher", cuda_host_dispatcher_native, METH_O, "cuda_host_dispatcher(fn): what host calls call"},
    {"checksum64", checksum64_native, METH_O,
     "checksum64(buffer) -> int: checksum64 of a C-contiguous buffer (transfer/_checksum.py)"},
    {"bias_relu_f32", (PyCFunction)(void (*)(void))bias_relu_f32_native, METH_FASTCALL,
     "bias_relu_f32(out, bias): out = max(out + bias, 0) in place, one pass (float32, C-contiguous)"},
    {NULL}};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "transfer._native",
    "Native shared-memory SPSC ring (futex doorbell, C11 atomics).", -1, module_methods};

PyMODINIT_FUNC PyInit__native(void)
{
    if (PyType_Ready(&QueueType) < 0 || PyType_Ready(&TableType) < 0 || PyType_Ready(&WorkerType) < 0 ||
        PyType_Ready(&SubmissionType) < 0 || PyType_Ready(&BridgeType) < 0)
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
    Py_INCREF(&BridgeType);
    if (PyModule_AddObject(m, "Table", (PyObject *)&TableType) < 0 ||
        PyModule_AddObject(m, "Worker", (PyObject *)&WorkerType) < 0 ||
        PyModule_AddObject(m, "Submission", (PyObject *)&SubmissionType) < 0 ||
        PyModule_AddObject(m, "Bridge", (PyObject *)&BridgeType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "SLICE_NS", (long)TRQ_SLICE_NS);
    PyModule_AddIntConstant(m, "NATIVE", TDP_NATIVE);
    PyModule_AddIntConstant(m, "PYTHON", TDP_PYTHON);
    PyModule_AddIntConstant(m, "BROKEN", TDP_BROKEN);
    return m;
}
