/*
 * util.c: what the rest of the package asks of the extension besides the ring: checksum64,
 * the submission's integer check, a vector's per-segment bounds, the uint64 operand
 * helpers the packing shares, and the one CPU kernel NumPy has no single pass for
 * (bias_relu_f32: a linear's bias and the relu after it).
 */
#include "binding.h"

/* Let go of what vec_arg took (nothing for a scalar, or one that failed). */
void vec_release(vec_arg_t *a)
{
    if (a->is_buf) {
        PyBuffer_Release(&a->b);
        a->is_buf = 0;
    }
}

/* A buffer of native-order 64-bit unsigned integers (a uint64 NumPy array: "L" or "Q"). */
int u64_format(const Py_buffer *b)
{
    const char *f = b->format ? b->format : "B";
    if (*f == '@' || *f == '=' || (*f == '<' && PY_LITTLE_ENDIAN) || (*f == '>' && !PY_LITTLE_ENDIAN))
        f++;
    return b->itemsize == 8 && (strcmp(f, "Q") == 0 || strcmp(f, "L") == 0);
}

int vec_arg(PyObject *o, const char *name, Py_ssize_t *k, vec_arg_t *a)
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

uint64_t vec_at(const vec_arg_t *a, Py_ssize_t i)
{
    uint64_t v;
    if (!a->is_buf)
        return a->scalar;
    memcpy(&v, (const char *)a->b.buf + i * a->b.strides[0], 8);
    return v;
}

#define CHECKSUM_GOLDEN 0x9E3779B97F4A7C15ULL
#define CHECKSUM_NOGIL_BYTES (64u << 10)

PyObject *checksum64_native(PyObject *mod, PyObject *obj)
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
PyObject *ints_within(PyObject *mod, PyObject *const *a, Py_ssize_t n)
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
PyObject *segment_stats(PyObject *mod, PyObject *const *a, Py_ssize_t n)
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


/* A writable (or read-only) C-contiguous float32 buffer: native-order "f". */
static int f32_buffer(PyObject *o, Py_buffer *b, int flags, const char *name)
{
    if (PyObject_GetBuffer(o, b, flags | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = b->format ? b->format : "B";
    if (*f == '@' || *f == '=' || (*f == '<' && PY_LITTLE_ENDIAN) || (*f == '>' && !PY_LITTLE_ENDIAN))
        f++;
    if (b->itemsize != 4 || strcmp(f, "f") != 0) {
        PyErr_Format(PyExc_TypeError, "bias_relu_f32: %s must be C-contiguous float32", name);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

#define BIAS_RELU_NOGIL_BYTES (64u << 10)

static void bias_relu_rows(float *restrict y, const float *restrict bias, size_t rows, size_t cols)
{
    for (size_t r = 0; r < rows; r++) {
        float *restrict row = y + r * cols;
        for (size_t c = 0; c < cols; c++) {
            float v = row[c] + bias[c];
            row[c] = (v > 0.0f || v != v) ? v : 0.0f; /* NumPy's maximum(v, 0): NaN stays, -0.0 is 0.0 */
        }
    }
}

/* bias_relu_f32(out, bias): out = max(out + bias, 0) in place, bias added to each row (the
 * last axis of out is bias's length): one pass where NumPy takes two (add, then maximum). */
PyObject *bias_relu_f32_native(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "bias_relu_f32(out, bias) takes 2 arguments");
        return NULL;
    }
    Py_buffer y, b;
    if (f32_buffer(args[0], &y, PyBUF_WRITABLE, "out") < 0)
        return NULL;
    if (f32_buffer(args[1], &b, PyBUF_SIMPLE, "bias") < 0) {
        PyBuffer_Release(&y);
        return NULL;
    }
    size_t cols = (size_t)b.len / 4, n = (size_t)y.len / 4;
    if (cols == 0 || y.ndim < 1 || (size_t)y.shape[y.ndim - 1] != cols) {
        PyErr_Format(PyExc_ValueError, "bias_relu_f32: out's last axis must be the bias's length (%zu)", cols);
        PyBuffer_Release(&y);
        PyBuffer_Release(&b);
        return NULL;
    }
    if ((size_t)y.len >= BIAS_RELU_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        bias_relu_rows((float *)y.buf, (const float *)b.buf, n / cols, cols);
        Py_END_ALLOW_THREADS
    } else {
        bias_relu_rows((float *)y.buf, (const float *)b.buf, n / cols, cols);
    }
    PyBuffer_Release(&y);
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}
