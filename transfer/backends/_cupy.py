"""The CuPy backend: device buffers in GPU memory, DMA straight from shared memory.

Host segments are page-locked in place with `cudaHostRegister`, so a
host-to-device copy is the GPU's DMA engine reading the producer's pages:
no staging copy. Each lane (a session's stream on a device, see `_stream`)
is one non-blocking CUDA stream; the scheduler submits a wave's copies and
kernels to the session's lanes and synchronizes those lanes once (on a
worker thread, so the event loop never blocks on the GPU), so sessions
overlap on one GPU.

Everything that follows from queued execution (host work ordered after the
device work touching it, no overlapping `cudaMemcpyAsync`, aligned kernel
operands) lives in `_stream.StreamBackend`, shared with the stream
simulation the tests run on CPU-only machines; this module is only the CUDA
primitives.

Imported lazily: `import cupy` is slow, and succeeds on machines whose
driver cannot run anything, so `probe()` makes a real allocation first.
"""

from __future__ import annotations

import threading
from typing import Any, Hashable

import numpy as np

from .._checksum import checksum64_xp
from ..kernels import storage_dtype
from ..addressing import SegmentKind
from ._base import Span
from ._stream import Key, StreamBackend

__all__ = ["CupyBackend"]

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from unified virtual addressing


class CupyBackend(StreamBackend):
    name = "cupy"

    def __init__(self) -> None:
        import cupy

        super().__init__()
        self.cp = cupy
        self._count: int = cupy.cuda.runtime.getDeviceCount()
        self._streams: dict[Key, Any] = {}
        self._lock = threading.Lock()
        for dev in range(self._count):  # compile the checksum's reduction now, not on a request
            with cupy.cuda.Device(dev):
                checksum64_xp(cupy.zeros(16, cupy.uint8), cupy)

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
        """The CUDA stream of the calling thread's lane on `device`."""
        key = self._key(device)
        s = self._streams.get(key)
        if s is None:
            with self._lock, self.cp.cuda.Device(device):
                s = self._streams.get(key)
                if s is None and self._urgent_key(key):  # a latency tenant's lane: the greatest priority
                    s = self.cp.cuda.Stream(non_blocking=True, priority=self.cp.cuda.runtime.deviceGetStreamPriorityRange()[1])
                s = s or self.cp.cuda.Stream(non_blocking=True)
                self._streams[key] = s
        return s

    # --- memory -------------------------------------------------------------------------------
    def alloc(self, nbytes: int, device: int) -> Any:
        """Zeroed, and synchronized: any lane may use the buffer next."""
        cp = self.cp
        try:
            with cp.cuda.Device(device), self.lane(None):
                stream = self.stream(device)
                with stream:
                    mem = cp.zeros(nbytes, dtype=cp.uint8)
                stream.synchronize()
                return mem
        except cp.cuda.memory.OutOfMemoryError as exc:
            raise MemoryError(str(exc)) from None

    def free(self, mem: Any) -> None:
        pass  # returned to CuPy's pool when the last reference goes (the pool is stream-ordered)

    cuda_driver = "always"

    def cuda_pointer(self, mem: Any) -> tuple[int, int] | None:
        return int(mem.data.ptr), int(mem.device.id)

    def nixl_memory(self, mem: Any) -> tuple[int, int, str, int]:
        return int(mem.data.ptr), int(mem.nbytes), "VRAM", int(mem.device.id)

    def lane_streams(self, lane: Hashable) -> dict[int, int]:
        out = {}
        with self.lane(lane):
            for dev in range(self._count):
                with self.cp.cuda.Device(dev):
                    out[dev] = int(self.stream(dev).ptr)  # the lane's stream (forget_lanes drops it, after the worker)
        return out

    def _pin(self, shm: Any) -> None:
        """Page-lock the segment so copies from it are DMA (portable: every device may use it)."""
        self.cp.cuda.runtime.hostRegister(shm.address, shm.nbytes, 1)  # cudaHostRegisterPortable

    def _unpin(self, shm: Any) -> None:
        self.cp.cuda.runtime.hostUnregister(shm.address)

    # --- primitives -----------------------------------------------------------------------------
    def _ptr(self, span: Span) -> int:
        if span.kind == SegmentKind.HOST:
            arr = span.mem.array
            return int(arr.ctypes.data) + span.offset
        return int(span.mem.data.ptr) + span.offset

    def _device_ptr(self, mem: Any) -> int:
        return int(mem.data.ptr)

    def _device_of_mem(self, mem: Any) -> int:
        return int(mem.device.id)

    def _memcpy(self, dst: Span, src: Span, device: int) -> None:
        if not src.nbytes:
            return
        with self.cp.cuda.Device(device):
            self.cp.cuda.runtime.memcpyAsync(self._ptr(dst), self._ptr(src), src.nbytes, _MEMCPY_DEFAULT, self.stream(device).ptr)

    def _memset(self, dst: Span, value: int, device: int) -> None:
        with self.cp.cuda.Device(device):
            self.cp.cuda.runtime.memsetAsync(self._ptr(dst), value, dst.nbytes, self.stream(device).ptr)

    def _scratch(self, nbytes: int, device: int) -> Any:
        with self.cp.cuda.Device(device), self.stream(device):
            return self.cp.empty(nbytes, dtype=self.cp.uint8)

    def _upload(self, host: np.ndarray, device: int) -> Any:
        with self.cp.cuda.Device(device), self.stream(device):
            return self.cp.asarray(host.reshape(-1).view(np.uint8))  # bytes: CuPy has no bfloat16

    def _device_checksum(self, span: Span, device: int) -> int:
        with self.cp.cuda.Device(device), self.stream(device):
            return checksum64_xp(span.mem[span.offset : span.offset + span.nbytes], self.cp)  # int(): waits

    def _launch(self, kernel: Any, inputs: list[tuple[Any, Any, int]], outputs: list[tuple[Any, Any, int]], params: Any, device: int) -> Any:
        cp = self.cp
        with cp.cuda.Device(device), self.stream(device):
            ins = [cp.ndarray(t.shape, dtype=storage_dtype(t.dtype, cp), memptr=mem.data + off, strides=t.strides) for t, mem, off in inputs]
            outs = [cp.ndarray(t.shape, dtype=storage_dtype(t.dtype, cp), memptr=mem.data + off, strides=t.strides) for t, mem, off in outputs]
            return kernel.run(ins, outs, params, cp)

    # --- graph runs a ring worker serves: captured with CuPy on the worker's stream -------------
    def _device_call(self, kernel: Any, ins: Any, outs: Any, params: Any, device: int) -> Any:
        cp = self.cp
        with cp.cuda.Device(device):
            vins = [cp.ndarray(t.shape, dtype=storage_dtype(t.dtype, cp), memptr=s.mem.data + s.offset, strides=t.strides) for t, s in ins]
            vouts = [cp.ndarray(t.shape, dtype=storage_dtype(t.dtype, cp), memptr=s.mem.data + s.offset, strides=t.strides) for t, s in outs]
        return lambda: kernel.run(vins, vouts, params, cp)

    def _capture(self, replay: Any, stream: int) -> Any:
        cp = self.cp
        with cp.cuda.Device(replay.ordinal):
            s = cp.cuda.ExternalStream(stream)
            with s, cp.cuda.using_allocator(_refuse):
                s.begin_capture()
                try:
                    for call in replay.calls:
                        call()
                finally:
                    graph = s.end_capture()  # (ends the capture whatever happened: the stream stays usable)
        replay.stream = s
        return graph

    def _replay(self, replay: Any, stream: int) -> None:
        with self.cp.cuda.Device(replay.ordinal):
            replay.exec.launch(replay.stream)

    def _eager(self, replay: Any, stream: int) -> None:
        cp = self.cp
        with cp.cuda.Device(replay.ordinal), cp.cuda.ExternalStream(stream):
            for call in replay.calls:
                call()

    def _sync(self, key: Key) -> None:
        s = self._streams.get(key)
        if s is not None:
            s.synchronize()

    def _record(self, key: Key) -> Any:
        with self.cp.cuda.Device(key[0]), self.lane(key[1]):
            event = self.cp.cuda.Event(block=False, disable_timing=True)
            event.record(self.stream(key[0]))
        return event

    def _drop(self, key: Key) -> None:
        with self._lock:
            self._streams.pop(key, None)


def _refuse(nbytes: int) -> Any:
    """The allocator a capture runs under: a kernel that allocates cannot be replayed (its
    memory would be the capture's forever, or freed under it), so it is refused."""
    raise MemoryError(f"a kernel allocated {nbytes} bytes during graph capture")
