"""The NumPy backend: host memory stands in for device memory.

Used where there is no GPU, and as the reference the CuPy backend is tested
against. Its copies are real memcpys (NumPy releases the GIL for them), so
the benchmark's figures for it are honest CPU figures.

Its kernels run in a process per device (`_devproc`), not on a thread of the daemon: a
kernel's Python between NumPy calls would otherwise wait on the event loop's GIL. So all of
its memory is shareable: device buffers are memfds like host segments, and both are in the
`SharedIndex` the device processes map from.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Callable, Sequence

import numpy as np

from .._checksum import checksum64
from ..addressing import SegmentKind
from ..kernels import DTYPES, FAILED, fuse_steps, run_through
from ..memory._shm import new_memfd
from ._base import Answer, Backend, Span, Then, host_bytes
from ._devproc import DeviceProcess, SharedIndex

__all__ = ["NumpyBackend"]


class NumpyBackend(Backend):
    name = "numpy"
    out_of_process = True

    def __init__(self, devices: int = 1) -> None:
        self._devices = devices
        self.shared = SharedIndex()
        # A process per device, up to one per core: more would only take turns on the cores
        # (and --devices allows 1024, each a process of ~50 MB). Device i uses process i % n.
        n = max(1, min(devices, os.cpu_count() or 1))
        self.procs = [DeviceProcess(self.shared, i) for i in range(n)]

    @property
    def device_count(self) -> int:
        return self._devices

    def alloc(self, nbytes: int, device: int) -> np.ndarray:
        """A memfd's pages, mapped: zero pages appear as they are touched, so a large alloc is
        cheap until used (as calloc was), and the device's process can map the same memory."""
        fd = new_memfd(f"transfer.device{device}")
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            raise MemoryError(str(exc)) from None
        arr = np.frombuffer(mm, np.uint8, count=nbytes)
        self.shared.add(arr, fd, nbytes)
        return arr

    def free(self, mem: Any) -> None:
        self.shared.remove(mem)  # the mapping goes with its last view

    def host_buffer(self, mem: Any) -> Any:
        return mem  # "device" memory is a host array

    def nixl_memory(self, mem: Any) -> tuple[int, int, str, int]:
        return int(mem.ctypes.data), int(mem.nbytes), "DRAM", 0  # (host memory standing in for a device's)

    def register_host(self, shm: Any) -> None:
        self.shared.add(shm.array, os.dup(shm.fd), shm.nbytes)

    def unregister_host(self, shm: Any) -> None:
        self.shared.remove(shm.array)

    @staticmethod
    def view(span: Span) -> np.ndarray:
        if span.kind == SegmentKind.HOST:
            host: np.ndarray = host_bytes(span)
            return host
        base: np.ndarray = span.mem
        return base[span.offset : span.offset + span.nbytes]

    def copy(self, dst: Span, src: Span) -> None:
        if src.nbytes:
            np.copyto(self.view(dst), self.view(src))

    def fill(self, dst: Span, value: int) -> None:
        self.view(dst).fill(value)

    def checksum(self, src: Span) -> int:
        return checksum64(self.view(src))

    def compute(self, kernel: Any, inputs: list[tuple[Any, Span]], outputs: list[tuple[Any, Span]], params: Any, device: int) -> Any:
        return self.begin_compute(kernel, inputs, outputs, params, device)()

    def begin_compute(self, kernel: Any, inputs: list[tuple[Any, Span]], outputs: list[tuple[Any, Span]], params: Any,
                      device: int, block: bool = True) -> Answer | Then:
        """`compute` sent to the device's process; its result is the answer's."""
        return self.procs[device % len(self.procs)].begin([(0, kernel, inputs, outputs, params, (), None)], set(), block).then(_result)

    def begin_steps(self, steps: Sequence[Any], failed: set[int], device: int, block: bool = True) -> Answer:
        return self.procs[device % len(self.procs)].begin(steps, failed, block)

    def inline_steps(self, steps: Sequence[Any], device: int, counters: dict[str, int]) -> Callable[[Any], tuple[float, Any]]:
        """The stretch run where it is called, on views made once of its operands' memory
        (each view keeps its mapping: memory freed meanwhile stays mapped until the views go,
        so a run never touches unmapped pages), after the device work the worker queued
        before it (a copy from a GPU into its input). The same kernels the device's process
        runs, fused as it fuses them (`kernels.fuse_steps`: a linear and the relu that
        rectifies its output in place, the bias and the relu in one pass)."""
        def bound(pairs: Any) -> list[np.ndarray]:
            return [np.ndarray(t.shape, DTYPES[t.dtype], s.mem.array if s.kind is SegmentKind.HOST else s.mem, s.offset, t.strides)
                    for t, s in pairs]

        ready = fuse_steps([(i, kernel, bound(ins), bound(outs), params, deps, name) for i, kernel, ins, outs, params, deps, name in steps])

        def run(worker: Any) -> tuple[float, Any]:
            worker.device_wait()
            return run_through(ready, _run_kernel)  # (timed once; node by node only to name a failure)

        return run

    def read_answers_with(self, adopt: Callable[[Any], bool]) -> None:
        for proc in self.procs:
            proc.adopt = adopt

    def close(self) -> None:
        for proc in self.procs:
            proc.close()
        self.shared.close()


def _run_kernel(kernel: Any, ins: list[np.ndarray], outs: list[np.ndarray], params: Any) -> Any:
    return kernel.run(ins, outs, params, np)


def _result(outcomes: list[tuple[int, Any, float]]) -> Any:
    ((state, value, _),) = outcomes
    if state == FAILED:
        raise value
    return value
