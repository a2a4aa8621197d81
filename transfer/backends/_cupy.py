"""The CuPy backend: device buffers in GPU memory, DMA straight from shared memory.

Host segments are page-locked in place with `cudaHostRegister`, so a
host-to-device copy is the GPU's DMA engine reading the producer's pages:
no staging copy. Each device has one non-blocking CUDA stream; the
scheduler submits a whole wave of copies and kernels to it and synchronizes
once (on a worker thread, so the event loop never blocks on the GPU).

Imported lazily: `import cupy` is slow, and succeeds on machines whose
driver cannot run anything, so `probe()` makes a real allocation first.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .._checksum import checksum64, checksum64_xp
from ..addressing import SegmentKind
from ._base import Backend, Span

__all__ = ["CupyBackend"]

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from unified virtual addressing


class CupyBackend(Backend):
    name = "cupy"

    def __init__(self) -> None:
        import cupy

        self.cp = cupy
        self._count = cupy.cuda.runtime.getDeviceCount()
        self._streams: dict[int, Any] = {}
        self._registered: dict[int, int] = {}  # host address -> nbytes
        self._lock = threading.Lock()

    @staticmethod
    def probe() -> tuple[bool, str]:
        """(usable, why): import success is not enough, so allocate and synchronize for real."""
        try:
            import cupy

            n = cupy.cuda.runtime.getDeviceCount()
            if n < 1:
                return False, "no CUDA device"
            with cupy.cuda.Device(0):
                cupy.zeros(16, dtype=cupy.uint8).sum()
                cupy.cuda.runtime.deviceSynchronize()
            return True, f"{n} CUDA device(s)"
        except Exception as exc:  # cudaErrorInsufficientDriver, no libcuda, ...
            return False, f"{type(exc).__name__}: {exc}"

    @property
    def device_count(self) -> int:
        return self._count

    def describe(self) -> dict[str, Any]:
        names = []
        for i in range(self._count):
            props = self.cp.cuda.runtime.getDeviceProperties(i)
            name = props["name"]
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        return {"backend": self.name, "devices": self._count, "gpus": names}

    def stream(self, device: int) -> Any:
        s = self._streams.get(device)
        if s is None:
            with self._lock, self.cp.cuda.Device(device):
                s = self._streams.get(device) or self.cp.cuda.Stream(non_blocking=True)
                self._streams[device] = s
        return s

    # --- memory -------------------------------------------------------------------------------
    def alloc(self, nbytes: int, device: int) -> Any:
        cp = self.cp
        try:
            with cp.cuda.Device(device), self.stream(device):
                return cp.zeros(nbytes, dtype=cp.uint8)
        except cp.cuda.memory.OutOfMemoryError as exc:
            raise MemoryError(str(exc)) from None

    def free(self, mem: Any) -> None:
        pass  # returned to CuPy's pool when the last reference goes

    def register_host(self, shm: Any) -> None:
        """Page-lock the segment so copies from it are DMA (portable: every device may use it)."""
        rt = self.cp.cuda.runtime
        rt.hostRegister(shm.address, shm.nbytes, 1)  # cudaHostRegisterPortable
        self._registered[shm.address] = shm.nbytes

    def unregister_host(self, shm: Any) -> None:
        if self._registered.pop(shm.address, None) is not None:
            self.synchronize()
            self.cp.cuda.runtime.hostUnregister(shm.address)

    # --- helpers ----------------------------------------------------------------------------------
    @staticmethod
    def _ptr(span: Span) -> int:
        if span.kind == SegmentKind.HOST:
            return span.mem.address + span.offset
        return int(span.mem.data.ptr) + span.offset

    @staticmethod
    def _device_of(*spans: Span) -> int:
        for s in spans:
            if s.kind == SegmentKind.DEVICE and hasattr(s.mem, "device"):
                return int(s.mem.device.id)
        return 0

    def _host_view(self, span: Span) -> np.ndarray:
        return span.mem.array[span.offset : span.offset + span.nbytes]

    # --- operations ------------------------------------------------------------------------------
    def copy(self, dst: Span, src: Span) -> None:
        if not src.nbytes:
            return
        if dst.kind == SegmentKind.HOST and src.kind == SegmentKind.HOST:
            np.copyto(self._host_view(dst), self._host_view(src))
            return
        dev = self._device_of(dst, src)
        with self.cp.cuda.Device(dev):
            self.cp.cuda.runtime.memcpyAsync(self._ptr(dst), self._ptr(src), src.nbytes, _MEMCPY_DEFAULT, self.stream(dev).ptr)

    def fill(self, dst: Span, value: int) -> None:
        if dst.kind == SegmentKind.HOST:
            self._host_view(dst).fill(value)
            return
        dev = self._device_of(dst)
        with self.cp.cuda.Device(dev):
            self.cp.cuda.runtime.memsetAsync(self._ptr(dst), value, dst.nbytes, self.stream(dev).ptr)

    def checksum(self, src: Span) -> int:
        if src.kind == SegmentKind.HOST:
            return checksum64(self._host_view(src))
        dev = self._device_of(src)
        with self.cp.cuda.Device(dev), self.stream(dev):
            return checksum64_xp(src.mem[src.offset : src.offset + src.nbytes], self.cp)

    def synchronize_device(self, device: int) -> None:
        self.stream(device).synchronize()

    def synchronize(self) -> None:
        for dev in list(self._streams):
            self.synchronize_device(dev)

    def compute(self, kernel: Any, inputs: list[tuple[Any, Span]], outputs: list[tuple[Any, Span]], params: Any, device: int) -> Any:
        """Device operands are used in place; host operands are staged through the device."""
        cp = self.cp
        with cp.cuda.Device(device), self.stream(device):
            ins = [self._device_tensor(t, s) for t, s in inputs]
            outs = []
            back: list[tuple[Any, np.ndarray]] = []
            for t, s in outputs:
                if s.kind == SegmentKind.HOST:
                    tmp = cp.empty(t.shape, dtype=t.np_dtype)
                    back.append((tmp, self._host_tensor(t, s)))
                    outs.append(tmp)
                else:
                    outs.append(self._device_tensor(t, s))
            result = kernel.fn(ins, outs, params, cp)
            for tmp, host in back:
                tmp.get(out=host, stream=self.stream(device)) if host.flags.c_contiguous else host.__setitem__(Ellipsis, tmp.get())
            return result

    @staticmethod
    def _host_tensor(t: Any, span: Span) -> np.ndarray:
        return np.ndarray(t.shape, dtype=t.np_dtype, buffer=span.mem.array, offset=span.offset, strides=t.strides)

    def _device_tensor(self, t: Any, span: Span) -> Any:
        cp = self.cp
        if span.kind == SegmentKind.HOST:
            return cp.asarray(self._host_tensor(t, span))  # H2D DMA from the registered pages
        memptr = span.mem.data + span.offset
        return cp.ndarray(t.shape, dtype=t.np_dtype, memptr=memptr, strides=t.strides)
