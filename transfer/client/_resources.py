"""Resources named by VAs: segments, device buffers, attached segments, tensor refs.

A leaf module (no other client module imports into it), so the core, deferred
creation, remote segments and pools can all build on it without a cycle.
The local mirror is what makes addressing free: a resource knows its base VA
and size, so `seg.va + offset` names a byte without asking the daemon.
"""

from __future__ import annotations

import math

from typing import Any, Protocol, Sequence, Union

import numpy as np

from .. import errors as E
from ..kernels import DTYPES, TensorRef, shape_tuple, tensor_extent
from ..memory import ShmFile

__all__ = ["Addressed", "Addressable", "HostSegment", "DeviceBuffer", "SharedSegment", "resolve_va", "make_tensor"]


def make_tensor(owner: Any, shape: int | Sequence[int], dtype: Any, offset: int, strides: Sequence[int] | None) -> TensorRef:
    """A TensorRef inside `owner` (a segment or buffer), bounds-checked locally."""
    dt = np.dtype(dtype)
    if dt.name not in DTYPES:
        raise TypeError(f"dtype {dt} is not supported on the wire; use one of {', '.join(DTYPES)}")
    shape_t = shape_tuple(shape)
    t = TensorRef(owner.va + offset, dt.name, shape_t, None if strides is None else tuple(int(x) for x in strides))
    if offset < 0 or offset + tensor_extent(t) > owner.nbytes:
        raise E.OutOfBounds(f"tensor {shape_t} {dt} at offset {offset} exceeds {owner.nbytes} bytes")
    return t


class HasVA(Protocol):
    va: int


Addressable = Union[int, HasVA]


def resolve_va(x: Addressable) -> int:
    va = x if type(x) is int else getattr(x, "va", None)
    if type(va) is not int:
        raise TypeError(f"expected a VA (int) or an object with .va, got {type(x).__name__}")
    return va


class Addressed:
    """What every resource named by a VA shares: byte addresses and tensor descriptions.

    Subclasses set `va` and `nbytes`; both methods check bounds locally, with no round trip.
    """

    va: int
    nbytes: int

    def at(self, offset: int) -> int:
        """The VA of byte `offset` (plain arithmetic)."""
        if not 0 <= offset <= self.nbytes:
            raise E.OutOfBounds(f"offset {offset} is outside {type(self).__name__} of {self.nbytes} bytes")
        return self.va + offset

    def tensor(self, shape: int | Sequence[int], dtype: Any = np.uint8, offset: int = 0, strides: Sequence[int] | None = None) -> TensorRef:
        """Describe (not copy) a tensor here, for compute requests."""
        return make_tensor(self, shape, dtype, offset, strides)


class HostSegment(Addressed):
    """Shared memory mapped by this process and the daemon."""

    def __init__(self, client: Any, va: int, nbytes: int, shm: ShmFile) -> None:
        self._client = client
        self.va = va
        self.nbytes = nbytes
        self._shm: ShmFile | None = shm

    @property
    def buffer(self) -> np.ndarray:
        """The whole segment as a writable flat uint8 array (no copy)."""
        if self._shm is None:
            raise E.SegmentFreed(f"segment {self.va:#x} has been freed")
        return self._shm.array

    def ndarray(self, shape: int | Sequence[int], dtype: Any = np.uint8, offset: int = 0) -> np.ndarray:
        """A writable NumPy view of part of the segment: what the daemon reads in place."""
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise TypeError("object dtypes cannot live in shared memory")
        shape_t = shape_tuple(shape)
        count = math.prod(shape_t) if shape_t else 1
        nbytes = count * dt.itemsize
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise E.OutOfBounds(f"view of {nbytes} bytes at offset {offset} exceeds the segment's {self.nbytes} bytes")
        return np.ndarray(shape_t, dtype=dt, buffer=self.buffer, offset=offset)

    def _unmap(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None

    @property
    def freed(self) -> bool:
        return self._shm is None

    def __repr__(self) -> str:
        return f"<HostSegment va={self.va:#x} nbytes={self.nbytes}{' freed' if self.freed else ''}>"


class DeviceBuffer(Addressed):
    """Memory on one of the daemon's devices, named by its VA."""

    def __init__(self, client: Any, va: int, nbytes: int, device: int) -> None:
        self._client = client
        self.va = va
        self.nbytes = nbytes
        self.device = device

    def __repr__(self) -> str:
        return f"<DeviceBuffer va={self.va:#x} nbytes={self.nbytes} device={self.device}>"


class SharedSegment(Addressed):
    """Another session's segment or buffer this session attached to: addressable by VA, not mapped here."""

    def __init__(self, va: int, nbytes: int, kind: str, device: int) -> None:
        self.va = va
        self.nbytes = nbytes
        self.kind = kind
        self.device = device

    def __repr__(self) -> str:
        return f"<SharedSegment {self.kind} va={self.va:#x} nbytes={self.nbytes}>"
