"""A stand-in GPU for tests: CUDA stream semantics in host RAM (`--backend streamsim`, test-only).

It has the CuPy backend's interface and shares its logic (`_stream.StreamBackend`);
only the primitives differ. The model:

* **Device memory** is a NumPy array per allocation (`SimMemory`), at a
  256-byte-aligned *simulated* device address. Host code cannot touch it
  directly: views (`memory[a:b].view(dtype)`, what `device_array` and DLPack
  export hand out) check on access.
* **Device work is queued, not done.** Copies to, from and between device
  memory, fills, uploads and kernels are appended to the device's stream.
  They run only when the stream is synchronized (`synchronize_device`, or
  a device checksum, which like CuPy's `int(x.sum())` waits for the stream).
  Then they run in a random order that is *legal*: an operation may pass an
  earlier one only if their byte ranges do not conflict, so the outcome is
  that of stream order (the seed is `TRANSFER_STREAMSIM_SEED`, else random,
  and is shown by `describe()`).
* **Reading too early is a test failure.** Host work (a host-to-host copy,
  a host fill or checksum) over bytes that queued work writes, or writing
  bytes that queued work still reads, and host reads of device memory that
  queued work writes (a DLPack export, `read()`), raise `StreamSimViolation`
  (an `AssertionError`) and are recorded in `violations`. Host bytes that a
  queued device-to-host copy will write are *poisoned* (0xDB) when it is
  queued, so a reply sent before the synchronize shows garbage to the client.
* **What CUDA leaves undefined or fatal raises.** An overlapping
  device-to-device `memcpyAsync` raises at once (undefined behaviour on a real
  GPU). A kernel given a device operand whose address is not a multiple of
  its element size (8 for the checksum, which loads 64-bit words), or a
  stride that is not, *faults when it runs*: the synchronize raises, and like
  a real CUDA fault the error is sticky: every later call on that device
  fails. A DLPack export at a misaligned address raises (its consumer's
  kernels would fault).
* `inject_fault(device)` makes the next synchronize of that device fail
  (its queued work is dropped), for tests of error containment.

The daemon picks it with `--backend streamsim` (tests only: it is slower than
NumPy and proves nothing about speed). Its devices are GPUs to the daemon
(kind "gpu", with the GPU kernels). Each lane (see `_stream`) is a queue
of its own, synchronized on its own; work queued on one of a session's
lanes that conflicts with work still queued on another of its lanes is a
violation (two streams race: nothing orders them).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import random
import threading
import weakref
from typing import Any

import numpy as np

from .. import _native
from .._native import cuda_alloc, cuda_devices, cuda_free

from ..addressing import SegmentKind
from ._base import Span, host_bytes
from ._stream import Key, StreamBackend, kernel_alignment

__all__ = ["StreamSimBackend", "StreamSimViolation", "SimMemory", "SimArray", "POISON"]

log = logging.getLogger("transfer.streamsim")

#: What host bytes hold between a device-to-host copy's submission and its completion.
POISON = 0xDB
#: Fresh scratch memory holds this (cudaMalloc'ed memory is not zeroed).
_GARBAGE = 0xCD
#: Queued operations the random order may pick from (the head and the next few).
_WINDOW = 4
_HOST, _DEV = 0, 1

_addresses = itertools.count(1)


class StreamSimViolation(AssertionError):
    """Host code touched memory that queued device work still reads or writes, or CUDA was misused."""


def _free_quietly(ptr: int, device: int) -> None:
    """cuMemFree from a finalizer: after a sticky fault (injected) the driver refuses; nothing to do."""
    try:
        cuda_free(ptr, device)
    except OSError:
        pass


class SimMemory:
    """A device allocation: bytes in host RAM at a simulated, 256-byte-aligned device address."""

    __slots__ = ("backend", "data", "device", "address", "cuda_ptr", "__weakref__")

    def __init__(self, backend: "StreamSimBackend", nbytes: int, device: int, fill: int = 0, cuda: bool = False) -> None:
        self.backend = backend
        #: Memory of the loaded CUDA driver (the fake's host memory), so the native workers'
        #: device copies and this simulation touch the same bytes; else plain NumPy memory.
        self.cuda_ptr = 0
        if cuda:
            self.cuda_ptr = cuda_alloc(nbytes, device)
            raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(self.cuda_ptr)
            weakref.finalize(raw, _free_quietly, self.cuda_ptr, device)  # once no view of it is left
            self.data: np.ndarray = np.frombuffer(memoryview(raw), np.uint8)[:nbytes]
            self.data.fill(fill)
        else:
            self.data = np.full(nbytes, fill, np.uint8) if fill else np.zeros(nbytes, np.uint8)
        self.device = device
        self.address = next(_addresses) << 40  # far apart, and aligned far beyond 256

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, key: slice) -> "SimArray":
        start, stop, step = key.indices(self.nbytes)
        if step != 1:
            raise TypeError("SimMemory: only contiguous byte slices")
        return SimArray(self, start, (max(stop - start, 0),), np.dtype(np.uint8))

    def __repr__(self) -> str:
        return f"<SimMemory {self.nbytes} B on sim GPU {self.device} at {self.address:#x}>"


class SimArray:
    """A typed view of device memory; reading it (DLPack, `get`) checks the work that writes it is done."""

    def __init__(self, mem: SimMemory, offset: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self.mem, self.offset, self.shape, self.dtype = mem, offset, tuple(shape), np.dtype(dtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def view(self, dtype: Any) -> "SimArray":
        dt = np.dtype(dtype)
        if self.nbytes % dt.itemsize:
            raise ValueError("view: size is not a multiple of the new itemsize")
        return SimArray(self.mem, self.offset, (self.nbytes // dt.itemsize,), dt)

    def reshape(self, shape: Any) -> "SimArray":
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
        if int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize != self.nbytes:
            raise ValueError("reshape: wrong size")
        return SimArray(self.mem, self.offset, shape, self.dtype)

    def _checked(self) -> np.ndarray:
        b = self.mem.backend
        a = self.mem.address + self.offset
        if a % self.dtype.itemsize:
            b._violation(f"device view at {a:#x} is not aligned to its {self.dtype} elements: a consumer's kernel would fault")
        b._check_read((_DEV, a, a + self.nbytes), "a host read of device memory (DLPack, get)")
        return self.mem.data[self.offset : self.offset + self.nbytes].view(self.dtype).reshape(self.shape)

    def get(self) -> np.ndarray:
        """A host copy (CuPy's `get()`), once the work writing these bytes is done."""
        return self._checked().copy()

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._checked().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self._checked().__dlpack_device__()  # kDLCPU: the simulation's memory is host RAM

    def __repr__(self) -> str:
        return f"<SimArray {self.shape} {self.dtype} of {self.mem!r}+{self.offset}>"


class _Work:
    __slots__ = ("fn", "reads", "writes", "fault", "what")

    def __init__(self, fn: Any, reads: list[tuple[int, int, int]], writes: list[tuple[int, int, int]], what: str, fault: str | None = None) -> None:
        self.fn, self.reads, self.writes, self.what, self.fault = fn, reads, writes, what, fault


def _overlap(x: tuple[int, int, int], y: tuple[int, int, int]) -> bool:
    return x[0] == y[0] and x[1] < y[2] and y[1] < x[2]


def _conflict(a: _Work, b: _Work) -> bool:
    return any(_overlap(w, r) for w in a.writes for r in (*b.reads, *b.writes)) or any(_overlap(r, w) for r in a.reads for w in b.writes)


class StreamSimBackend(StreamBackend):
    """CuPy's interface and stream semantics, in host RAM (see the module docstring)."""

    name = "streamsim"

    def __init__(self, devices: int = 1, seed: int | None = None) -> None:
        super().__init__()
        self._count = devices
        if seed is None:
            env = os.environ.get("TRANSFER_STREAMSIM_SEED")
            seed = int(env) if env else random.SystemRandom().randrange(1 << 32)
        self.seed = seed
        self._rng = random.Random(seed)
        self._queues: dict[Key, list[_Work]] = {}
        self._lock = threading.RLock()
        #: Device -> the sticky error that broke its context.
        self.broken: dict[int, str] = {}
        self._injected: dict[int, str] = {}
        #: Every violation seen (also raised where it happened).
        self.violations: list[str] = []
        self.pinned: set[int] = set()
        #: Operations run so far, per device (tests check that work was really queued).
        self.executed = [0] * devices

    @property
    def device_count(self) -> int:
        return self._count

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "devices": self._count, "seed": self.seed, "simulated": True}

    # --- checks -------------------------------------------------------------------------------
    def _violation(self, msg: str) -> None:
        self.violations.append(msg)
        log.error("streamsim violation: %s", msg)
        raise StreamSimViolation(msg)

    def _queued(self) -> list[_Work]:
        return [w for q in self._queues.values() for w in q]

    def _check_read(self, rng: tuple[int, int, int], what: str) -> None:
        with self._lock:
            for w in self._queued():
                if any(_overlap(rng, x) for x in w.writes):
                    self._violation(f"{what} before the device work that writes it completed ({w.what})")

    def _check_write(self, rng: tuple[int, int, int], what: str) -> None:
        with self._lock:
            for w in self._queued():
                if any(_overlap(rng, x) for x in (*w.reads, *w.writes)):
                    self._violation(f"{what} while queued device work still uses those bytes ({w.what})")

    def _alive(self, device: int) -> None:
        why = self.broken.get(device)
        if why is not None:
            raise RuntimeError(f"{why} (sticky: the CUDA context of sim GPU {device} is lost)")

    @staticmethod
    def _host_range(arr: np.ndarray) -> tuple[int, int, int]:
        lo = int(arr.ctypes.data)
        if arr.size:  # the extent of the view (strides are non-negative here)
            hi = lo + sum((d - 1) * st for d, st in zip(arr.shape, arr.strides)) + arr.itemsize
        else:
            hi = lo
        return (_HOST, lo, hi)

    def _range(self, span: Span) -> tuple[int, int, int]:
        if span.kind == SegmentKind.HOST:
            a = int(span.mem.array.ctypes.data) + span.offset
            return (_HOST, a, a + span.nbytes)
        a = span.mem.address + span.offset
        return (_DEV, a, a + span.nbytes)

    def _bytes(self, span: Span) -> np.ndarray:
        if span.kind == SegmentKind.HOST:
            view: np.ndarray = host_bytes(span)
            return view
        return span.mem.data[span.offset : span.offset + span.nbytes]  # type: ignore[no-any-return]

    def _enqueue(self, device: int, work: _Work) -> None:
        key = self._key(device)
        with self._lock:
            self._alive(device)
            owner = key[1][0] if isinstance(key[1], tuple) else None
            for other, queue in self._queues.items():
                if other == key or owner is None or not isinstance(other[1], tuple) or other[1][0] != owner:
                    continue
                for w in queue:
                    if _conflict(w, work) or _conflict(work, w):
                        self._violation(f"{work.what} on lane {key} races {w.what} still queued on lane {other}: nothing orders two streams")
            self._queues.setdefault(key, []).append(work)

    # --- memory ---------------------------------------------------------------------------------
    def alloc(self, nbytes: int, device: int) -> SimMemory:
        self._alive(device)
        return SimMemory(self, nbytes, device, cuda=cuda_devices() > device)

    def free(self, mem: Any) -> None:
        pass  # queued work keeps its memory alive (CuPy's pool is stream-ordered too)

    cuda_driver = "if-named"

    def cuda_pointer(self, mem: Any) -> tuple[int, int] | None:
        return (mem.cuda_ptr, mem.device) if mem.cuda_ptr else None

    def nixl_memory(self, mem: Any) -> tuple[int, int, str, int]:
        """The simulated device memory is host memory: NIXL registers it as DRAM, and a remote
        READ lands in it as it would land in a GPU's VRAM (no host segment between)."""
        return int(mem.data.ctypes.data), int(mem.nbytes), "DRAM", 0

    def _pin(self, shm: Any) -> None:
        self.pinned.add(id(shm))

    def _unpin(self, shm: Any) -> None:
        self.pinned.discard(id(shm))

    def read(self, mem: SimMemory, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """A checked host copy of device memory (for tests): raises if queued work writes it."""
        n = mem.nbytes - offset if nbytes is None else nbytes
        return mem[offset : offset + n].get()

    def inject_fault(self, device: int = 0, message: str = "cudaErrorLaunchFailure: injected") -> None:
        """The next synchronize of `device` fails and drops its queued work (not sticky)."""
        self._injected[device] = message

    def pending(self, device: int | None = None) -> int:
        with self._lock:
            return sum(len(q) for k, q in self._queues.items() if device is None or k[0] == device)

    # --- primitives -------------------------------------------------------------------------------
    def _device_ptr(self, mem: Any) -> int:
        return int(mem.address)

    def _device_of_mem(self, mem: Any) -> int:
        return int(mem.device)

    def _memcpy(self, dst: Span, src: Span, device: int) -> None:
        if not src.nbytes:
            return
        d, s = self._range(dst), self._range(src)
        if d[0] == s[0] == _HOST:
            self._violation("a host-to-host copy handed to memcpyAsync")
        if d[0] == s[0] == _DEV and _overlap(d, s):
            self._violation(f"overlapping device ranges handed to cudaMemcpyAsync (undefined): {d[1]:#x}+{dst.nbytes} <- {s[1]:#x}+{src.nbytes}")
        dv, sv = self._bytes(dst), self._bytes(src)

        def run() -> None:
            np.copyto(dv, sv)

        what = f"memcpyAsync {'HD'[d[0]]}<-{'HD'[s[0]]} {src.nbytes} B"
        with self._lock:
            self._alive(device)
            if d[0] == _HOST and not any(_overlap(d, r) for w in self._queued() for r in w.reads):
                dv.fill(POISON)  # undefined until the copy completes
            self._enqueue(device, _Work(run, [s], [d], what))

    def _memset(self, dst: Span, value: int, device: int) -> None:
        v = self._bytes(dst)
        self._enqueue(device, _Work(lambda: v.fill(value), [], [self._range(dst)], f"memsetAsync {dst.nbytes} B"))

    def _scratch(self, nbytes: int, device: int) -> SimMemory:
        self._alive(device)
        return SimMemory(self, nbytes, device, fill=_GARBAGE)

    def _upload(self, host: np.ndarray, device: int) -> SimMemory:
        snapshot = np.ascontiguousarray(host).reshape(-1).view(np.uint8).copy()  # cp.asarray stages the host bytes now
        mem = SimMemory(self, snapshot.nbytes, device, fill=_GARBAGE)
        self._enqueue(device, _Work(lambda: np.copyto(mem.data, snapshot), [], [(_DEV, mem.address, mem.address + mem.nbytes)], "upload"))
        return mem

    def _device_checksum(self, span: Span, device: int) -> int:
        from .._checksum import checksum64

        r = self._range(span)
        fault = None if r[1] % 8 == 0 else f"cudaErrorMisalignedAddress: checksum reads 64-bit words at {r[1]:#x}"
        out: list[int] = []
        v = self._bytes(span)
        self._enqueue(device, _Work(lambda: out.append(checksum64(v)), [r], [], "checksum reduction", fault))
        self._sync(self._key(device))  # int(result): the host waits for the stream
        return out[0]

    def _launch(self, kernel: Any, inputs: list[tuple[Any, Any, int]], outputs: list[tuple[Any, Any, int]], params: Any, device: int) -> Any:
        from ..kernels import OPERATORS, tensor_extent

        fault = None
        reads: list[tuple[int, int, int]] = []
        writes: list[tuple[int, int, int]] = []
        for k, (t, mem, off) in enumerate((*inputs, *outputs)):
            item = t.np_dtype.itemsize
            a = mem.address + off
            align = kernel_alignment(kernel.op, item)
            if a % align or (t.strides is not None and any(s % item for s in t.strides)):
                fault = fault or f"cudaErrorMisalignedAddress: {kernel.op} operand {k} ({t.dtype}) at {a:#x}, strides {t.strides}"
            (reads if k < len(inputs) else writes).append((_DEV, a, a + tensor_extent(t)))

        def view(t: Any, mem: Any, off: int) -> np.ndarray:
            return np.ndarray(t.shape, dtype=t.np_dtype, buffer=mem.data, offset=off, strides=t.strides)

        out: list[Any] = []

        def run() -> None:
            with np.errstate(all="ignore"):
                out.append(kernel.run([view(*x) for x in inputs], [view(*x) for x in outputs], params, np))

        self._enqueue(device, _Work(run, reads, writes, f"kernel {kernel.op}", fault))
        op = OPERATORS.get(kernel.op)
        if op is not None and op.n_outputs == 0:  # a host value (CuPy's int()): waits for the stream
            self._sync(self._key(device))
            return out[0]
        return None

    # --- graph runs a ring worker serves: kernels as host functions on the fake driver's stream --
    host_kernels = True

    def _device_call(self, kernel: Any, ins: Any, outs: Any, params: Any, device: int) -> Any:
        def view(t: Any, span: Span) -> np.ndarray:
            return np.ndarray(t.shape, dtype=t.np_dtype, buffer=span.mem.data, offset=span.offset, strides=t.strides)

        vins, vouts = [view(*p) for p in ins], [view(*p) for p in outs]

        def call() -> None:  # (on the driver's thread, when the stream reaches it)
            with np.errstate(all="ignore"):
                kernel.run(vins, vouts, params, np)

        return call

    def _capture(self, replay: Any, stream: int) -> Any:
        _native.cuda_capture_begin(stream, replay.ordinal)
        try:
            for key in replay.keys:
                _native.cuda_host_call(stream, replay.ordinal, key)
        finally:
            graph = _native.cuda_capture_end(stream, replay.ordinal)
        return graph

    def _replay(self, replay: Any, stream: int) -> None:
        _native.cuda_graph_launch(replay.exec, stream, replay.ordinal)

    def _eager(self, replay: Any, stream: int) -> None:
        for key in replay.keys:
            _native.cuda_host_call(stream, replay.ordinal, key)

    def _free_graph(self, replay: Any, graph: Any) -> None:
        _native.cuda_graph_free(graph, replay.ordinal)

    def _record(self, key: Key) -> Any:
        backend = self

        class _Event:  # the simulation runs the whole lane at the wait: work may finish early
            def synchronize(self) -> None:
                backend._sync(key)

            @property
            def done(self) -> bool:  # a query: the simulated device finishes now, or on a later look
                if backend._rng.random() < 0.5:
                    return False
                backend._sync(key)
                return True

        return _Event()

    def _drop(self, key: Key) -> None:
        with self._lock:
            if not self._queues.get(key, True):
                del self._queues[key]

    def _sync(self, key: Key) -> None:
        device = key[0]
        with self._lock:
            self._alive(device)
            queue = self._queues.get(key, [])
            pending, queue[:] = list(queue), []
            injected = self._injected.pop(device, None)
            if injected is not None:
                raise RuntimeError(injected)
            while pending:
                # Any op in the window that conflicts with no earlier queued op may go next.
                ready = [i for i in range(min(_WINDOW, len(pending))) if not any(_conflict(pending[i], pending[j]) for j in range(i))]
                work = pending.pop(self._rng.choice(ready))
                if work.fault is not None:
                    self.broken[device] = work.fault
                    raise RuntimeError(work.fault)
                work.fn()
                self.executed[device] += 1

    # --- host primitives: checked against queued work ---------------------------------------------------
    def _host_copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        self._check_read(self._host_range(src), "a host copy read host memory")
        self._check_write(self._host_range(dst), "a host copy wrote host memory")
        np.copyto(dst, src)

    def _host_fill(self, dst: np.ndarray, value: int) -> None:
        self._check_write(self._host_range(dst), "a host fill wrote host memory")
        dst.fill(value)

    def _host_checksum(self, src: np.ndarray) -> int:
        from .._checksum import checksum64

        self._check_read(self._host_range(src), "a host checksum read host memory")
        return checksum64(src)
