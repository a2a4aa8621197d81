"""The basic operators: fill, cast, scale_add, sum, mean, checksum.

Kernels are written against the array API NumPy and CuPy share (`xp`); where a
dtype needs its own code on the GPU (16-bit floats, which CuPy cannot compute in
float32 on its own, or bfloat16, which it does not have) a CUDA kernel from
`_cuda` serves those signatures.
"""

from __future__ import annotations

from itertools import product
from typing import Any, Iterable, Mapping

import numpy as np

from .._checksum import checksum64_xp
from . import _cuda
from ._checks import fail, param_axis, param_float
from ._registry import REGISTRY, CudaFn, KernelFn, Operator, Sig
from ._tensors import ALL, FLOATS, HALVES, INTS, SIGNED, TensorRef, dtype_name

__all__ = ["register_both", "LIGHT"]

#: Operators cheap enough that a GPU daemon may run them on a CPU device when its GPU
#: kernels lack the dtypes (operands in host memory only). GEMM-sized work is refused instead.
LIGHT: list[str] = []


def register_both(op: str, sigs: Iterable[Sig], fn: KernelFn, cuda: CudaFn | None = None, gpu: bool | None = None) -> None:
    """CPU kernels for `sigs`; GPU kernels for the same, except signatures naming bfloat16
    unless `cuda` computes them or `gpu` says the array-API kernel moves them as bits."""
    sigs = list(sigs)
    REGISTRY.register(op, sigs, "cpu", fn)
    as_bits = cuda is not None if gpu is None else gpu
    REGISTRY.register(op, [s for s in sigs if as_bits or "bfloat16" not in s], "gpu", fn, cuda)


def light(op: Operator) -> Operator:
    """Register an operator the GPU may hand to a CPU device (see LIGHT)."""
    REGISTRY.operator(op)
    REGISTRY.fallback(op.name, "gpu", "cpu")
    LIGHT.append(op.name)
    return op


def reduced_shape(shape: tuple[int, ...], axis: int | None) -> tuple[int, ...]:
    return () if axis is None else shape[:axis] + shape[axis + 1 :]


def acc_of(*dtypes: str) -> str:
    """float32 for 16-bit floats, else the widest of the float dtypes named (else the last)."""
    if "float64" in dtypes:
        return "float64"
    return "float32" if any(d in FLOATS for d in dtypes) else dtypes[-1]


# --- fill ---------------------------------------------------------------------------------------
def _check_fill(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    param_float("fill", p, "value")


def _fill(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    # Converted on the host as NumPy converts (ints wrap, floats round): one rule for every device.
    y[0][...] = np.asarray(p["value"]).astype(y[0].dtype)[()]


def _fill_halves(x: list[Any], y: list[Any], p: Mapping[str, Any], cp: Any, sig: Sig) -> None:
    _cuda.fill(y[0], p["value"], sig[0], cp)


light(Operator("fill", 0, 1, check=_check_fill, doc="out[...] = value"))
register_both("fill", [(d,) for d in ALL if d not in HALVES], _fill)
register_both("fill", [(d,) for d in HALVES], _fill, _fill_halves)


# --- cast ---------------------------------------------------------------------------------------
def _check_cast(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    if i[0].shape != o[0].shape:
        raise fail("cast", f"shapes differ: {i[0].shape} vs {o[0].shape}")


def _cast(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    xp.copyto(y[0], x[0], casting="unsafe")


def _cast_bf16(x: list[Any], y: list[Any], p: Mapping[str, Any], cp: Any, sig: Sig) -> None:
    _cuda.cast(x[0], y[0], (sig[0], sig[1]), cp)


light(Operator("cast", 1, 1, check=_check_cast, doc="out = x converted to out's dtype (as NumPy's astype)"))
_pairs = list(product(ALL, ALL))
register_both("cast", [s for s in _pairs if "bfloat16" not in s], _cast)
# bfloat16 <-> floats: a CUDA conversion; bfloat16 <-> ints and bool: CPU only (falls back).
register_both("cast", [s for s in _pairs if "bfloat16" in s and set(s) <= set(FLOATS)], _cast, _cast_bf16)
register_both("cast", [s for s in _pairs if "bfloat16" in s and not set(s) <= set(FLOATS)], _cast, gpu=False)


# --- scale_add ----------------------------------------------------------------------------------
def _check_scale_add(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    if i[0].shape != o[0].shape:
        raise fail("scale_add", f"shapes differ: {i[0].shape} vs {o[0].shape}")
    param_float("scale_add", p, "a", 1.0)
    param_float("scale_add", p, "b", 0.0)


def _scale_add(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    acc = acc_of(dtype_name(x[0].dtype))
    y[0][...] = x[0].astype(acc, copy=False) * xp.asarray(p.get("a", 1.0), dtype=acc) + xp.asarray(p.get("b", 0.0), dtype=acc)


def _scale_add_cuda(x: list[Any], y: list[Any], p: Mapping[str, Any], cp: Any, sig: Sig) -> None:
    _cuda.unary("scale_add", x[0], y[0], (sig[0], sig[1]), cp, p.get("a", 1.0), p.get("b", 0.0))


light(Operator("scale_add", 1, 1, in_place=True, check=_check_scale_add, doc="out = a * x + b, in float32 for 16-bit floats"))
register_both("scale_add", [(d, d) for d in FLOATS], _scale_add, _scale_add_cuda)


# --- sum, mean ----------------------------------------------------------------------------------
def _check_reduce(op: str) -> Any:
    def check(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
        want = reduced_shape(i[0].shape, param_axis(op, p, len(i[0].shape)))
        if o[0].shape != want:
            raise fail(op, f"reduction output must have shape {want}, got {o[0].shape}")

    return check


def _reduce(mean: bool) -> KernelFn:
    def fn(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
        axis = p.get("axis")
        xd, yd = dtype_name(x[0].dtype), dtype_name(y[0].dtype)
        acc = acc_of(xd, yd) if xd in FLOATS or mean else yd  # integer sums wrap in the output's type
        r = x[0].mean(axis=axis, dtype=acc) if mean else x[0].sum(axis=axis, dtype=acc)
        y[0][...] = r

    return fn


def _reduce_cuda(mean: bool) -> CudaFn:
    def fn(x: list[Any], y: list[Any], p: Mapping[str, Any], cp: Any, sig: Sig) -> None:
        _cuda.reduce_sum(x[0], y[0], p.get("axis"), (sig[0], sig[1]), cp, mean)

    return fn


#: Float reductions: same dtype, 16-bit -> float32, float32 -> float64 (accumulated in float32 at least).
_FLOAT_REDUCE = [(d, d) for d in FLOATS] + [(h, "float32") for h in HALVES] + [("float32", "float64")]
light(Operator("sum", 1, 1, check=_check_reduce("sum"), doc="out = x.sum(axis)"))
light(Operator("mean", 1, 1, check=_check_reduce("mean"), doc="out = x.mean(axis)"))
register_both("sum", _FLOAT_REDUCE, _reduce(False), _reduce_cuda(False))
register_both("sum", [(d, d) for d in INTS] + [(d, "int64" if d in SIGNED else "uint64") for d in INTS], _reduce(False))
register_both("mean", _FLOAT_REDUCE, _reduce(True), _reduce_cuda(True))
register_both("mean", [(d, "float64") for d in INTS], _reduce(True))


# --- checksum -----------------------------------------------------------------------------------
def _checksum(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> int:
    return checksum64_xp(x[0], xp)


light(Operator("checksum", 1, 0, doc="result = checksum64(x's bytes)"))
register_both("checksum", [(d,) for d in ALL], _checksum, gpu=True)  # bytes are bytes: bfloat16 too
