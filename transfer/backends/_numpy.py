"""The NumPy backend: host memory stands in for device memory.

Used where there is no GPU, and as the reference the CuPy backend is tested
against. Its copies are real memcpys (NumPy releases the GIL for them), so
the benchmark's figures for it are honest CPU figures.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._checksum import checksum64
from ..addressing import SegmentKind
from ._base import Backend, Span

__all__ = ["NumpyBackend"]


class NumpyBackend(Backend):
    name = "numpy"

    def __init__(self, devices: int = 1) -> None:
        self._devices = devices

    @property
    def device_count(self) -> int:
        return self._devices

    def alloc(self, nbytes: int, device: int) -> np.ndarray:
        # calloc'ed: zero pages appear lazily, so a large alloc is cheap until touched.
        return np.zeros(nbytes, dtype=np.uint8)

    def free(self, mem: Any) -> None:
        pass  # dropped with its last reference

    def host_buffer(self, mem: Any) -> Any:
        return mem  # "device" memory is a host array

    @staticmethod
    def view(span: Span) -> np.ndarray:
        base: np.ndarray = span.mem.array if span.kind == SegmentKind.HOST else span.mem
        return base[span.offset : span.offset + span.nbytes]

    def copy(self, dst: Span, src: Span) -> None:
        if src.nbytes:
            np.copyto(self.view(dst), self.view(src))

    def fill(self, dst: Span, value: int) -> None:
        self.view(dst).fill(value)

    def checksum(self, src: Span) -> int:
        return checksum64(self.view(src))

    @staticmethod
    def tensor(t: Any, span: Span) -> np.ndarray:
        """A NumPy view of a tensor reference over checked memory (NumPy re-checks the extent)."""
        base = span.mem.array if span.kind == SegmentKind.HOST else span.mem
        # Positional: NumPy parses keyword arguments here at a cost of about 0.5 us a view.
        return np.ndarray(t.shape, t.np_dtype, base, span.offset, t.strides)

    def compute(self, kernel: Any, inputs: list[tuple[Any, Span]], outputs: list[tuple[Any, Span]], params: Any, device: int) -> Any:
        ins = [self.tensor(t, s) for t, s in inputs]
        outs = [self.tensor(t, s) for t, s in outputs]
        return kernel.run(ins, outs, params, np)
