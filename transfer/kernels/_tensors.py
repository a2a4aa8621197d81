"""Tensor references and dtypes: what the wire may name, and how many bytes it touches.

Pure: no devices, no kernels. `transfer._fields` validates wire tensors with these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .. import errors as E

__all__ = [
    "DTYPES", "FLOATS", "HALVES", "INTS", "SIGNED", "UNSIGNED", "NUMERIC", "ALL", "MAX_DIMS",
    "TensorRef", "tensor_extent", "tensor_nbytes", "acc_dtype", "dtype_name", "storage_dtype", "shape_tuple",
]

#: dtypes a tensor may have on the wire (names as NumPy spells them; bfloat16 from ml_dtypes).
DTYPES: dict[str, np.dtype[Any]] = {
    n: np.dtype(n)
    for n in ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16", "float32", "float64")
}
DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
#: 16-bit floats: stored narrow, computed in float32 (their 11- and 8-bit mantissas lose a sum
#: of a few hundred terms).
HALVES = ("float16", "bfloat16")
FLOATS = ("float16", "bfloat16", "float32", "float64")
SIGNED = ("int8", "int16", "int32", "int64")
UNSIGNED = ("uint8", "uint16", "uint32", "uint64")
INTS = UNSIGNED + SIGNED
NUMERIC = INTS + FLOATS
ALL = NUMERIC + ("bool",)
MAX_DIMS = 8


#: dtype -> its name, for the wire dtypes: `np.dtype.name` is computed in Python on every call
#: (~3 us), and kernels ask for it per operand, per call.
_NAMES: dict[np.dtype[Any], str] = {dt: name for name, dt in DTYPES.items()}


def dtype_name(dt: np.dtype[Any]) -> str:
    """`dt.name`, looked up for the wire dtypes."""
    return _NAMES.get(dt) or dt.name


def acc_dtype(dtype: str) -> str:
    """The dtype a kernel computes in for `dtype` operands: float32 for 16-bit floats,
    int32 for 8-bit integers (int8 GEMM), 64-bit for wider integers, else the dtype itself."""
    if dtype in HALVES:
        return "float32"
    if dtype in ("int8", "int16"):
        return "int32"
    if dtype in ("uint8", "uint16"):
        return "uint32"
    return dtype


def storage_dtype(dtype: str, xp: Any) -> Any:
    """The dtype an array of `dtype` has under `xp`: CuPy has no bfloat16, so its arrays of
    bfloat16 hold the bit patterns as uint16 (the CUDA kernels convert)."""
    if dtype == "bfloat16" and xp is not np:
        return xp.uint16
    return DTYPES[dtype]


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
    if type(shape) is int and shape >= 0:
        return (shape,)  # the common case, without the general checks below
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
