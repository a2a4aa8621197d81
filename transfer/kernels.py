"""Operators and the kernel registry (virtual devices and placement: server._placement).

A compute request names an operator and tensor references (VA, dtype, shape,
strides). The registry maps (operator, dtype, device kind) to a kernel; a
placement policy picks the virtual device. Kernels receive NumPy (or CuPy)
arrays that are *views* of already-checked memory; they never see a VA.

Placement rule (one rule, documented in docs/architecture.md): compute runs
on the device that holds its device-buffer operands. If they live on
different devices the request is refused. Only when every operand is host
(shared) memory does the placement policy choose a device
(`transfer.server._placement`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from . import errors as E
from ._checksum import checksum64_xp

__all__ = [
    "DTYPES",
    "TensorRef",
    "shape_tuple",
    "Kernel",
    "Registry",
    "REGISTRY",
    "tensor_extent",
    "tensor_nbytes",
    "OPERATORS",
]

#: dtypes a tensor may have on the wire (names as NumPy spells them).
DTYPES: dict[str, np.dtype[Any]] = {
    n: np.dtype(n)
    for n in ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16", "float32", "float64")
}
FLOATS = ("float16", "float32", "float64")
INTS = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64")
NUMERIC = INTS + FLOATS
MAX_DIMS = 8


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor described by address: never data. Strides are in bytes; None = C-contiguous."""

    va: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None = None

    @property
    def np_dtype(self) -> np.dtype[Any]:
        return DTYPES[self.dtype]

    def to_wire(self) -> list[Any]:
        return [self.va, self.dtype, list(self.shape), None if self.strides is None else list(self.strides)]


def shape_tuple(shape: Any) -> tuple[int, ...]:
    """A shape as a tuple of ints (an int is one dimension), refusing negative dimensions
    with a message that names them, before any arithmetic turns them into odd byte counts."""
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    try:
        out = tuple(int(d) for d in dims)
    except (TypeError, ValueError):
        raise E.InvalidField(f"shape {shape!r}: dimensions must be integers") from None
    bad = [(i, d) for i, d in enumerate(out) if d < 0]
    if bad:
        i, d = bad[0]
        raise E.InvalidField(f"shape {out}: dimension {i} is {d}; every dimension must be 0 or more")
    return out


def tensor_extent(t: TensorRef) -> int:
    """Bytes from t.va that the tensor may touch (exact integer arithmetic, no overflow)."""
    item = DTYPES[t.dtype].itemsize
    if any(d == 0 for d in t.shape):
        return 0
    if t.strides is None:
        n = item
        for d in t.shape:
            n *= d
        return n
    return sum((d - 1) * s for d, s in zip(t.shape, t.strides)) + item


def tensor_nbytes(t: TensorRef) -> int:
    """Bytes of the tensor's elements (product of its dims times the itemsize): the work a
    kernel does on it. Larger than the extent when strides repeat memory (stride 0)."""
    n = DTYPES[t.dtype].itemsize
    for d in t.shape:
        n *= d
    return n


# --- operators -----------------------------------------------------------------------------
KernelFn = Callable[[list[Any], list[Any], Mapping[str, Any], Any], Any]


@dataclass(frozen=True)
class Operator:
    """What the daemon checks before any kernel runs."""

    name: str
    n_inputs: int
    n_outputs: int
    #: Outputs may be exactly the same range as the first input (in place).
    in_place: bool = False
    check: Callable[[list[TensorRef], list[TensorRef], Mapping[str, Any]], None] = lambda i, o, p: None
    doc: str = ""


def _param_float(params: Mapping[str, Any], key: str, default: float | None = None) -> float:
    v = params.get(key, default)
    if v is None:
        raise E.InvalidField(f"parameter {key!r} is required")
    if type(v) not in (int, float) or v != v or v in (float("inf"), float("-inf")):
        raise E.InvalidField(f"parameter {key!r} must be a finite number, got {v!r}")
    return float(v)


def _same_shape(a: TensorRef, b: TensorRef, what: str) -> None:
    if a.shape != b.shape:
        raise E.InvalidField(f"{what}: shapes differ: {a.shape} vs {b.shape}")


def _check_fill(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    _param_float(p, "value")


def _check_cast(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    _same_shape(i[0], o[0], "cast")


def _check_scale_add(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    _same_shape(i[0], o[0], "scale_add")
    if i[0].dtype != o[0].dtype:
        raise E.InvalidField("scale_add: input and output dtypes differ (use cast first)")
    _param_float(p, "a", 1.0)
    _param_float(p, "b", 0.0)


def _axis(p: Mapping[str, Any], ndim: int) -> int | None:
    axis = p.get("axis")
    if axis is None:
        return None
    if type(axis) is not int or not -ndim <= axis < ndim:
        raise E.InvalidField(f"axis {axis!r} is out of range for {ndim} dimensions")
    return axis % ndim


def _reduced_shape(shape: tuple[int, ...], axis: int | None) -> tuple[int, ...]:
    return () if axis is None else shape[:axis] + shape[axis + 1 :]


def _check_reduce(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    want = _reduced_shape(i[0].shape, _axis(p, len(i[0].shape)))
    if o[0].shape != want:
        raise E.InvalidField(f"reduction output must have shape {want}, got {o[0].shape}")


def _check_matmul(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    a, b, c = i[0].shape, i[1].shape, o[0].shape
    if len(a) != 2 or len(b) != 2 or a[1] != b[0] or c != (a[0], b[1]):
        raise E.InvalidField(f"matmul needs (M,K) @ (K,N) -> (M,N), got {a} @ {b} -> {c}")
    if not i[0].dtype == i[1].dtype == o[0].dtype:
        raise E.InvalidField("matmul: all three tensors must share a dtype")


def _check_normalize(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    x, y = i[0], o[0]
    _same_shape(x, y, "normalize")
    if len(x.shape) != 4:
        raise E.InvalidField(f"normalize expects (N, C, H, W), got {x.shape}")
    if y.dtype != "float32":
        raise E.InvalidField("normalize writes float32")
    c = x.shape[1]
    for key in ("mean", "std"):
        v = p.get(key)
        if not isinstance(v, list) or len(v) != c or any(type(e) not in (int, float) for e in v):
            raise E.InvalidField(f"normalize: {key!r} must be a list of {c} numbers (one per channel)")
    if any(s == 0 for s in p["std"]):
        raise E.InvalidField("normalize: std must be non-zero")
    _param_float(p, "scale", 1.0)


OPERATORS: dict[str, Operator] = {
    op.name: op
    for op in (
        Operator("fill", 0, 1, check=_check_fill, doc="out[...] = value"),
        Operator("cast", 1, 1, check=_check_cast, doc="out = x converted to out's dtype"),
        Operator("scale_add", 1, 1, in_place=True, check=_check_scale_add, doc="out = a * x + b"),
        Operator("sum", 1, 1, check=_check_reduce, doc="out = x.sum(axis)"),
        Operator("mean", 1, 1, check=_check_reduce, doc="out = x.mean(axis)"),
        Operator("matmul", 2, 1, check=_check_matmul, doc="out = a @ b"),
        Operator("normalize", 1, 1, check=_check_normalize, doc="out = (x * scale - mean[c]) / std[c], uint8 NCHW -> float32"),
        Operator("checksum", 1, 0, doc="result = checksum64(x's bytes)"),
    )
}


# --- kernels and the registry ------------------------------------------------------------------
@dataclass(frozen=True)
class Kernel:
    op: str
    dtypes: frozenset[str]
    device_kind: str
    fn: KernelFn


class Registry:
    """(operator, dtype, device kind) -> kernel. The dtype that selects is the first input's
    (the output's for operators without inputs)."""

    def __init__(self) -> None:
        self._kernels: dict[tuple[str, str, str], Kernel] = {}

    def register(self, op: str, dtypes: Iterable[str], device_kind: str) -> Callable[[KernelFn], KernelFn]:
        def wrap(fn: KernelFn) -> KernelFn:
            k = Kernel(op, frozenset(dtypes), device_kind, fn)
            for dt in k.dtypes:
                self._kernels[(op, dt, device_kind)] = k
            return fn

        return wrap

    def supported(self, op: str, device_kind: str | None = None) -> list[str]:
        return sorted({dt for (o, dt, kind) in self._kernels if o == op and (device_kind is None or kind == device_kind)})

    def lookup(self, op: str, dtype: str, device_kind: str) -> Kernel:
        k = self._kernels.get((op, dtype, device_kind))
        if k is None:
            if op not in OPERATORS:
                raise E.UnknownOperation(f"unknown operator {op!r}; known: {', '.join(sorted(OPERATORS))}")
            raise E.InvalidField(
                f"{op} has no {device_kind} kernel for {dtype}; supported dtypes: {', '.join(self.supported(op, device_kind)) or 'none'}"
            )
        return k


REGISTRY = Registry()
reg = REGISTRY.register


@reg("fill", NUMERIC + ("bool",), "cpu")
def _np_fill(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    y[0][...] = p["value"]


@reg("cast", NUMERIC + ("bool",), "cpu")
def _np_cast(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    xp.copyto(y[0], x[0], casting="unsafe")


@reg("scale_add", FLOATS, "cpu")
def _np_scale_add(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    a, b = p.get("a", 1.0), p.get("b", 0.0)
    xp.multiply(x[0], y[0].dtype.type(a), out=y[0])
    if b:
        xp.add(y[0], y[0].dtype.type(b), out=y[0])


@reg("sum", NUMERIC, "cpu")
def _np_sum(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    y[0][...] = x[0].sum(axis=p.get("axis"), dtype=y[0].dtype)


@reg("mean", FLOATS, "cpu")
def _np_mean(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    y[0][...] = x[0].mean(axis=p.get("axis"), dtype=y[0].dtype)


@reg("matmul", ("float32", "float64"), "cpu")
def _np_matmul(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    xp.matmul(x[0], x[1], out=y[0])


@reg("normalize", ("uint8",), "cpu")
def _np_normalize(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    # (x * scale - mean) / std == x * (scale/std) - mean/std: one multiply-add per element.
    c = x[0].shape[1]
    scale = float(p.get("scale", 1.0))
    std = np.asarray(p["std"], dtype=np.float32).reshape(1, c, 1, 1)
    mean = np.asarray(p["mean"], dtype=np.float32).reshape(1, c, 1, 1)
    xp.multiply(x[0], xp.asarray(scale / std), out=y[0], casting="unsafe")
    xp.subtract(y[0], xp.asarray(mean / std), out=y[0])


@reg("checksum", NUMERIC + ("bool",), "cpu")
def _np_checksum(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> int:
    return checksum64_xp(x[0], xp)


# The kernels above are written against the array API NumPy and CuPy share (`xp`), so the
# GPU registers the same functions. float16 matmul is GPU-only (tensor cores).
for _k in list({id(k): k for k in REGISTRY._kernels.values()}.values()):
    _dtypes = set(_k.dtypes) | ({"float16"} if _k.op == "matmul" else set())
    REGISTRY.register(_k.op, _dtypes, "gpu")(_k.fn)
