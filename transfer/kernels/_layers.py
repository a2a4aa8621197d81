"""Neural-network layers: matmul (N-D, broadcast), linear, relu, gelu, softmax, layer_norm, conv2d.

One implementation per operator, for NumPy and CuPy alike. Precision is the
dtype's, not the device's: 16-bit floats are computed in float32 and rounded
once into the output, int8 GEMMs accumulate in int32 (and wrap there, as the
hardware does), float64 stays float64. On a GPU the GEMMs of float32 and
float64 are cuBLAS's (`xp.matmul`), the others `_cuda.gemm`; the elementwise and
row-reduction steps of 16-bit and 32/64-bit floats are `_cuda` kernels.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .. import _native
from . import _cuda
from ._basic import register_both
from ._checks import fail, param_axis, param_choice, param_float, param_pair, same_shape
from ._registry import REGISTRY, Operator, Sig
from ._steps import Step
from ._tensors import FLOATS, TensorRef, acc_dtype, dtype_name

__all__ = ["MAX_SCRATCH_ELEMENTS", "broadcast_shapes", "fuse_steps"]

#: The most elements a kernel's temporary (conv2d's im2col matrix) may hold: a request
#: whose every tensor fits its segment could otherwise ask for kh*kw times its input.
MAX_SCRATCH_ELEMENTS = 1 << 28
_GEMM_SIGS: list[Sig] = [*[(d, d, d) for d in FLOATS], ("int8", "int8", "int32")]


def broadcast_shapes(op: str, a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """NumPy's broadcast of two batch shapes, or a clear error."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise fail(op, f"batch dimensions {a} and {b} do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(out)


def _sig(arrays: list[Any], sig: Sig | None) -> Sig:
    """The dtype signature: given on the GPU (CuPy arrays of bfloat16 are uint16 bits), else read."""
    return sig if sig is not None else tuple(dtype_name(a.dtype) for a in arrays)


def gemm(a: Any, b: Any, bias: Any, out: Any, xp: Any, sig: Sig) -> None:
    """out = a @ b (+ bias), batch dimensions broadcast; sig = (a, b, bias, out) dtypes.

    Computed in acc_dtype(a): 16-bit floats in float32, int8 in int32. Where the output has
    that dtype the product is written straight into it (outputs never overlap inputs): no
    temporary of the output's size, and no copy of one (in a graph, every layer's)."""
    if xp is np or sig[0] in ("float32", "float64"):
        acc = acc_dtype(sig[0])
        a, b = a.astype(acc, copy=False), b.astype(acc, copy=False)
        r = xp.matmul(a, b, out=out) if out.dtype == acc else xp.matmul(a, b)
        if bias is not None:
            xp.add(r, bias.astype(acc, copy=False), out=r)
        if r is not out:
            out[...] = r  # 16-bit outputs: rounded once, from float32
        return
    batch = out.shape[:-2]
    a = xp.broadcast_to(a, batch + a.shape[-2:])
    b = xp.broadcast_to(b, batch + b.shape[-2:])
    if bias is None:
        bias = xp.broadcast_to(xp.zeros(1, dtype=out.dtype), (out.shape[-1],))  # stride 0: one zero
    _cuda.gemm(a, b, bias, out, sig, xp)


# --- matmul -------------------------------------------------------------------------------------
def _check_matmul(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    a, b, c = i[0].shape, i[1].shape, o[0].shape
    if len(a) < 2 or len(b) < 2 or a[-1] != b[-2]:
        raise fail("matmul", f"needs (..., M, K) @ (..., K, N), got {a} @ {b}")
    want = broadcast_shapes("matmul", a[:-2], b[:-2]) + (a[-2], b[-1])
    if c != want:
        raise fail("matmul", f"output must have shape {want}, got {c}")


def _matmul(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any, sig: Sig | None = None) -> None:
    s = _sig([*x, *y], sig)
    gemm(x[0], x[1], None, y[0], xp, (s[0], s[1], s[2], s[2]))


REGISTRY.operator(Operator("matmul", 2, 1, check=_check_matmul, doc="out = a @ b: (..., M, K) @ (..., K, N), batch dims broadcast"))
register_both("matmul", _GEMM_SIGS, _matmul, _matmul)


# --- linear -------------------------------------------------------------------------------------
def _check_linear(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    x, w, b, y = i[0].shape, i[1].shape, i[2].shape, o[0].shape
    if len(x) < 1 or len(w) != 2 or w[1] != x[-1] or b != (w[0],):
        raise fail("linear", f"needs x (..., K), weight (N, K), bias (N,), got {x}, {w}, {b}")
    if y != x[:-1] + (w[0],):
        raise fail("linear", f"output must have shape {x[:-1] + (w[0],)}, got {y}")


def _linear(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any, sig: Sig | None = None) -> None:
    s = _sig([*x, *y], sig)
    a, out = x[0], y[0]
    if a.ndim == 1:  # one row: a (1, K) matrix, the output a (1, N) view
        a, out = a[None, :], out[None, :]
    gemm(a, x[1].T, x[2], out, xp, (s[0], s[1], s[2], s[3]))


_LINEAR_SIGS: list[Sig] = [*[(d, d, d, d) for d in FLOATS], ("int8", "int8", "int32", "int32")]
REGISTRY.operator(Operator("linear", 3, 1, check=_check_linear, doc="out = x @ weight.T + bias; weight (N, K) as in PyTorch"))
register_both("linear", _LINEAR_SIGS, _linear, _linear)


# --- activations --------------------------------------------------------------------------------
def _check_unary(op: str) -> Any:
    def check(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
        same_shape(op, i[0], o[0])
        if op == "gelu":
            param_choice(op, p, "approximate", ("none", "tanh"))

    return check


def _relu(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    xp.maximum(x[0], xp.zeros((), dtype=x[0].dtype), out=y[0])  # exact in any dtype; NaN stays NaN


def _relu_cuda(x: list[Any], y: list[Any], p: Mapping[str, Any], cp: Any, sig: Sig) -> None:
    _cuda.unary("relu", x[0], y[0], (sig[0], sig[1]), cp)


def erf(z: Any, xp: Any) -> Any:
    """erf to z's precision (NumPy has no erf). float32 and narrower: Numerical Recipes'
    erfc, a Chebyshev fit with relative error under 1.2e-7, one exp. float64: Cephes'
    rational approximations (erf below 1, erfc from 1 to 8 and beyond), error about 1e-16,
    as the GPU's `erf` gives."""
    if z.dtype == np.float64:
        return _erf64(z, xp)
    t = 1.0 / (1.0 + 0.5 * xp.abs(z))
    poly = -z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    erfc = t * xp.exp(poly)
    return xp.where(z >= 0, 1.0 - erfc, erfc - 1.0)


# Cephes (ndtr.c): erf(x) = x T(x^2) / U(x^2) for |x| < 1; erfc(x) = exp(-x^2) P(x) / Q(x)
# for 1 <= x < 8 and exp(-x^2) R(x) / S(x) from 8. Highest power first.
_ERF_T = (9.60497373987051638749e0, 9.00260197203842689217e1, 2.23200534594684319226e3,
          7.00332514112805075473e3, 5.55923013010394962768e4)
_ERF_U = (1.0, 3.35617141647503099647e1, 5.21357949780152679795e2, 4.59432382970980127987e3,
          2.26290000613890934246e4, 4.92673942608635921086e4)
_ERFC_P = (2.46196981473530512524e-10, 5.64189564831068821977e-1, 7.46321056442269912687e0,
           4.86371970985681366614e1, 1.96520832956077098242e2, 5.26445194995477358631e2,
           9.34528527171957607540e2, 1.02755188689515710272e3, 5.57535335369399327526e2)
_ERFC_Q = (1.0, 1.32281951154744992508e1, 8.67072140885989742329e1, 3.54937778887819891062e2,
           9.75708501743205489753e2, 1.82390916687909736289e3, 2.24633760818710981792e3,
           1.65666309194161350182e3, 5.57535340817727675546e2)
_ERFC_R = (5.64189583547755073984e-1, 1.27536670759978104416e0, 5.01905042251180477414e0,
           6.16021097993053585195e0, 7.40974269950448939160e0, 2.97886665372100240670e0)
_ERFC_S = (1.0, 2.26052863220117276590e0, 9.39603524938001434673e0, 1.20489539808096656605e1,
           1.70814450747565897222e1, 9.60896809063285878198e0, 3.36907645100081516050e0)


def _horner(x: Any, coeffs: tuple[float, ...]) -> Any:
    r = x * 0.0 + coeffs[0]
    for c in coeffs[1:]:
        r = r * x + c
    return r


def _erf64(z: Any, xp: Any) -> Any:
    a = xp.abs(z)
    s = xp.clip(z, -1.0, 1.0)  # each branch sees only its own range: no inf / inf to mask
    s2 = s * s
    small = s * _horner(s2, _ERF_T) / _horner(s2, _ERF_U)
    c = xp.clip(a, 1.0, 27.0)  # erfc(27) is below float64's smallest subnormal
    far = c >= 8.0
    erfc = xp.exp(-c * c) * xp.where(far, _horner(c, _ERFC_R), _horner(c, _ERFC_P)) / xp.where(far, _horner(c, _ERFC_S), _horner(c, _ERFC_Q))
    big = xp.where(a >= 27.0, 1.0, 1.0 - erfc)  # NaN: 1 - erfc(NaN), NaN
    return xp.where(a < 1.0, small, xp.where(z < 0, -big, big))


def _gelu(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    v = x[0].astype(acc_dtype(dtype_name(x[0].dtype)), copy=False)
    if p.get("approximate", "none") == "tanh":
        r = 0.5 * v * (1.0 + xp.tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))
    else:
        r = 0.5 * v * (1.0 + erf(v * 0.7071067811865476, xp))
    y[0][...] = r.astype(v.dtype, copy=False)


def _gelu_cuda(x: list[Any], y: list[Any], p: Mapping[str, Any], cp: Any, sig: Sig) -> None:
    name = "gelu_tanh" if p.get("approximate", "none") == "tanh" else "gelu"
    _cuda.unary(name, x[0], y[0], (sig[0], sig[1]), cp)


REGISTRY.operator(Operator("relu", 1, 1, in_place=True, check=_check_unary("relu"), doc="out = max(x, 0)"))
REGISTRY.operator(Operator("gelu", 1, 1, in_place=True, check=_check_unary("gelu"), doc="out = x * Phi(x); approximate: none (erf) | tanh"))
register_both("relu", [(d, d) for d in FLOATS], _relu, _relu_cuda)
register_both("gelu", [(d, d) for d in FLOATS], _gelu, _gelu_cuda)


# --- a linear and its relu, one pass over the output -------------------------------------------
class _LinearRelu:
    """A float32 linear on NumPy arrays whose output a relu then rectifies in place: the matmul,
    then the bias and the relu in one native pass (`_native.bias_relu_f32`) where NumPy's
    add and maximum take two. The bytes are the two kernels' (the same float32 add, and
    maximum's answers for NaN and -0.0)."""

    op, sig = "linear", ("float32",) * 4

    def run(self, ins: list[Any], outs: list[Any], params: Mapping[str, Any], xp: Any) -> None:
        np.matmul(ins[0], ins[1].T, out=outs[0])
        _native.bias_relu_f32(outs[0], ins[2])


class _RanBefore:
    """The relu of a `_LinearRelu`: done when the linear was."""

    op, sig = "relu", ("float32",) * 2

    def run(self, ins: list[Any], outs: list[Any], params: Mapping[str, Any], xp: Any) -> None:
        return None


_LINEAR_RELU, _RAN_BEFORE = _LinearRelu(), _RanBefore()


def _one_block(a: np.ndarray, b: np.ndarray) -> bool:
    return a.ctypes.data == b.ctypes.data and a.shape == b.shape and a.strides == b.strides


def fuse_steps(steps: Sequence[Step]) -> list[Step]:
    """`steps` (bound to NumPy arrays) with each float32 linear whose output only a relu reads,
    in place (a graph's in-place sharing: `parse_graph`), run as one step: the linear's step
    does both, the relu's reports done. Safe to run the relu early: no step between them
    touches that block (it is read by the relu alone, and written by the relu alone after)."""
    out = list(steps)
    where = {s[0]: k for k, s in enumerate(out)}
    for k, (j, kernel, ins, outs, params, deps, name) in enumerate(out):
        if kernel.op != "relu" or kernel.sig != _RAN_BEFORE.sig or len(deps) != 1 or deps[0] not in where:
            continue
        i, lin, lins, louts, lparams, ldeps, lname = out[where[deps[0]]]
        y = louts[0]
        if (lin.op == "linear" and lin.sig == _LINEAR_RELU.sig and y.ndim == 2 and lins[0].ndim == 2
                and y.flags.c_contiguous and lins[2].flags.c_contiguous
                and _one_block(y, ins[0]) and _one_block(y, outs[0])):
            out[where[i]] = (i, _LINEAR_RELU, lins, louts, lparams, ldeps, lname)
            out[k] = (j, _RAN_BEFORE, ins, outs, params, deps, name)
    return out


# --- softmax, layer norm ------------------------------------------------------------------------
def _check_softmax(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    same_shape("softmax", i[0], o[0])
    if not i[0].shape:
        raise fail("softmax", "needs at least one dimension")
    param_axis("softmax", p, len(i[0].shape), default=-1)


def _softmax(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    axis = p.get("axis", -1)
    v = x[0].astype(acc_dtype(dtype_name(x[0].dtype)), copy=False)
    if v.size == 0:
        return
    e = xp.exp(v - v.max(axis=axis, keepdims=True))
    y[0][...] = e / e.sum(axis=axis, keepdims=True)


def _softmax_cuda(x: list[Any], y: list[Any], p: Mapping[str, Any], cp: Any, sig: Sig) -> None:
    _cuda.softmax(x[0], y[0], p.get("axis", -1) % x[0].ndim, sig[0], cp)


def _check_layer_norm(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    x, g, b = i[0].shape, i[1].shape, i[2].shape
    same_shape("layer_norm", i[0], o[0])
    k = len(g)
    if k < 1 or k > len(x) or g != x[len(x) - k :] or b != g:
        raise fail("layer_norm", f"weight and bias must both have x's trailing shape, got x {x}, weight {g}, bias {b}")
    if param_float("layer_norm", p, "eps", 1e-5) < 0:
        raise fail("layer_norm", "eps must not be negative")


def _layer_norm(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    acc = acc_dtype(dtype_name(x[0].dtype))
    axes = tuple(range(x[0].ndim - x[1].ndim, x[0].ndim))
    v = x[0].astype(acc, copy=False)
    if v.size == 0:
        return
    m = v.mean(axis=axes, keepdims=True)
    d = v - m
    var = (d * d).mean(axis=axes, keepdims=True)
    eps = xp.asarray(p.get("eps", 1e-5), dtype=acc)
    y[0][...] = d / xp.sqrt(var + eps) * x[1].astype(acc, copy=False) + x[2].astype(acc, copy=False)


def _layer_norm_cuda(x: list[Any], y: list[Any], p: Mapping[str, Any], cp: Any, sig: Sig) -> None:
    axes = tuple(range(x[0].ndim - x[1].ndim, x[0].ndim))
    _cuda.layer_norm(x[0], x[1], x[2], y[0], axes, p.get("eps", 1e-5), sig[0], cp)


REGISTRY.operator(Operator("softmax", 1, 1, check=_check_softmax, doc="out = exp(x - max) / sum(exp(x - max)) along axis (default -1)"))
REGISTRY.operator(Operator("layer_norm", 3, 1, check=_check_layer_norm, doc="out = (x - mean) / sqrt(var + eps) * weight + bias over weight's trailing dims"))
register_both("softmax", [(d, d) for d in FLOATS], _softmax, _softmax_cuda)
register_both("layer_norm", [(d, d, d, d) for d in FLOATS], _layer_norm, _layer_norm_cuda)


# --- conv2d -------------------------------------------------------------------------------------
def conv2d_geometry(p: Mapping[str, Any]) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(stride, padding, dilation), each (height, width)."""
    return (param_pair("conv2d", p, "stride", 1, 1), param_pair("conv2d", p, "padding", 0, 0), param_pair("conv2d", p, "dilation", 1, 1))


def _check_conv2d(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    x, w, b, y = i[0].shape, i[1].shape, i[2].shape, o[0].shape
    if len(x) != 4 or len(w) != 4 or w[1] != x[1] or b != (w[0],):
        raise fail("conv2d", f"needs x (N, C, H, W), weight (O, C, kh, kw), bias (O,), got {x}, {w}, {b}")
    (sh, sw), (ph, pw), (dh, dw) = conv2d_geometry(p)
    ho = (x[2] + 2 * ph - dh * (w[2] - 1) - 1) // sh + 1
    wo = (x[3] + 2 * pw - dw * (w[3] - 1) - 1) // sw + 1
    if ho < 1 or wo < 1 or 0 in w:
        raise fail("conv2d", f"a {w[2]}x{w[3]} kernel (dilation {dh}, {dw}) does not fit {x[2]}x{x[3]} padded by {ph}, {pw}")
    if y != (x[0], w[0], ho, wo):
        raise fail("conv2d", f"output must have shape {(x[0], w[0], ho, wo)}, got {y}")
    cols = x[0] * ho * wo * w[1] * w[2] * w[3]
    if cols > MAX_SCRATCH_ELEMENTS:
        raise fail("conv2d", f"its im2col matrix would hold {cols} elements, over the limit {MAX_SCRATCH_ELEMENTS}: split the batch")


def _conv2d(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any, sig: Sig | None = None) -> None:
    """im2col + one GEMM: windows of the padded input as a (N, Ho, Wo, C*kh*kw) matrix, times
    the weight as (C*kh*kw, O), written through a (N, Ho, Wo, O) view of the output."""
    s = _sig([*x, *y], sig)
    img, w, bias, out = x[0], x[1], x[2], y[0]
    (sh, sw), (ph, pw), (dh, dw) = conv2d_geometry(p)
    n, c, h, wd = img.shape
    o, _, kh, kw = w.shape
    _, _, ho, wo = out.shape
    if out.size == 0:
        return
    padded = xp.zeros((n, c, h + 2 * ph, wd + 2 * pw), dtype=img.dtype)
    padded[:, :, ph : ph + h, pw : pw + wd] = img
    s0, s1, s2, s3 = padded.strides
    windows = xp.lib.stride_tricks.as_strided(
        padded, shape=(n, ho, wo, c, kh, kw), strides=(s0, s2 * sh, s3 * sw, s1, s2 * dh, s3 * dw)
    )
    cols = xp.ascontiguousarray(windows).reshape(n, ho, wo, c * kh * kw)
    weight = xp.ascontiguousarray(w).reshape(o, c * kh * kw).T
    gemm(cols, weight, bias, out.transpose(0, 2, 3, 1), xp, (s[0], s[1], s[2], s[3]))


REGISTRY.operator(Operator("conv2d", 3, 1, check=_check_conv2d, doc="2-D convolution (cross-correlation) of NCHW x with (O, C, kh, kw) weight, plus bias; stride, padding, dilation"))
register_both("conv2d", _LINEAR_SIGS, _conv2d, _conv2d)
