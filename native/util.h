/*
 * util.h: checksum64, the integer check, a vector's per-segment bounds, and the uint64
 * operand helpers (util.c).
 */
#ifndef TRANSFER_UTIL_H
#define TRANSFER_UTIL_H

/* An operand that is a scalar (the same for every range) or a 1-D uint64 array. */
typedef struct {
    uint64_t scalar;
    Py_buffer b;
    int is_buf;
} vec_arg_t;
void vec_release(vec_arg_t *a);
int u64_format(const Py_buffer *b);
int vec_arg(PyObject *o, const char *name, Py_ssize_t *k, vec_arg_t *a);
uint64_t vec_at(const vec_arg_t *a, Py_ssize_t i);
PyObject *checksum64_native(PyObject *mod, PyObject *obj);
PyObject *bias_relu_f32_native(PyObject *mod, PyObject *const *args, Py_ssize_t nargs);
PyObject *ints_within(PyObject *mod, PyObject *const *a, Py_ssize_t n);
PyObject *segment_stats(PyObject *mod, PyObject *const *a, Py_ssize_t n);

#endif /* TRANSFER_UTIL_H */
