"""What every backend with queued device work shares: ordering, overlap, alignment.

A GPU backend does not *do* a device copy, fill or kernel: it queues it on
the device's stream and returns. This class holds everything that follows
from that, once, for the CuPy backend and for its test double
(`_streamsim.StreamSimBackend`, which queues in host RAM), so that the
simulation's tests exercise the real backend's logic:

* **Host work is ordered after queued device work that touches it.** A copy
  between two host segments, a host fill and a host checksum run on the CPU
  at once; queued device work that reads or writes the same host bytes (an
  H2D copy from them, a D2H copy into them) may not have run yet. Every
  queued operation's host ranges are recorded per device, and host work that
  overlaps one first synchronizes that device. So the pieces of one request
  (a CopyV, or a run of copies merged into one vector op) take effect in
  order even when host and device pieces alternate. (The alternative, queueing
  host copies on the stream as host functions, would keep the CPU copy off
  the event loop's thread but run it on the driver's callback thread, where
  a Python copy holds the GIL against everything else; these mixes are rare.)
* **No overlapping ranges reach `cudaMemcpyAsync`**: it is undefined for
  them. An overlapping device-to-device copy is split into non-overlapping
  chunks copied in the safe direction (few chunks), or goes through a
  scratch buffer.
* **Kernels only see aligned device operands.** A device pointer handed to a
  kernel must be a multiple of its element size (8 for the checksum, which
  reads 64-bit words): a misaligned load faults, and a CUDA fault is sticky
  (the context is lost, every later call on the device fails). A misaligned
  device operand is copied to an aligned scratch buffer (and back, for an
  output); a stride that is not a multiple of the element size cannot be
  made aligned and is refused (`InvalidField`).
* Scratch buffers stay referenced until the stream is synchronized.
* **Pinning happens off the event loop, under a cap.** `register_host` only
  notes that a segment may be page-locked. The first device copy from or to
  it on a worker thread (`off_loop()`) pins the whole segment, as long as
  `max_pinned_bytes` allows (0: no cap); pinning a large segment takes
  milliseconds, and pinned memory is memory the kernel can no longer page
  out. Until pinned (on the loop, or past the cap) copies still work, through
  the driver's staging.
* **Lanes.** Work is queued per *lane*: a (device, lane) key names one CUDA
  stream. The daemon runs each session's requests on the session's own
  lanes (`lane()` sets the calling thread's lane, the way `with stream:` does
  in CuPy), so two tenants' work overlaps on one GPU and a request's `stream`
  field picks among its session's lanes. Device allocation and zeroing run
  on the device's default lane and are synchronized before the buffer is
  handed out, so no other lane can see it unzeroed.

Subclasses provide the primitives: `_memcpy`, `_memset`, `_scratch`,
`_device_ptr`, `_device_checksum`, `_launch`, `_upload`, `_download`,
`_sync`, and the host primitives (`_host_copy`, `_host_fill`,
`_host_checksum`), which the simulation overrides to catch misordering.
"""

from __future__ import annotations

import abc
import contextlib
import itertools
import logging
import threading
from collections import defaultdict
from typing import Any, ContextManager, Hashable, Iterator, Sequence

import numpy as np

from .. import _native
from .. import errors as E
from .._checksum import checksum64
from ..addressing import SegmentKind
from ..kernels import OPERATORS
from ._base import Backend, Span, host_bytes
from ._replay import Replay

__all__ = ["StreamBackend", "Fence", "kernel_alignment", "Key"]

#: What work is queued on: (device, lane). Lane None is the device's default lane.
Key = tuple[int, Hashable]

log = logging.getLogger("transfer.backends")

#: An overlapping device copy is done in at most this many non-overlapping chunks, else via scratch.
MAX_OVERLAP_CHUNKS = 8


def kernel_alignment(op: str, itemsize: int) -> int:
    """Bytes a device operand's address must be a multiple of for this operator's kernel."""
    return max(itemsize, 8) if op == "checksum" else itemsize


class StreamBackend(Backend):
    """A backend whose device work is queued per lane (one stream each) until synchronized."""

    def __init__(self) -> None:
        self._pending_lock = threading.Lock()
        self._tls = threading.local()
        #: Every (device, lane) that has had work queued and not been forgotten.
        self._keys: set[Key] = set()
        #: Per key: host ranges queued, unfinished work touches: (seq, id(host mem), start, end, writes).
        self._host_pending: dict[Key, list[tuple[int, int, int, int, bool]]] = defaultdict(list)
        #: Per key: scratch buffers queued work may still use: (seq, memory).
        self._live_scratch: dict[Key, list[tuple[int, Any]]] = defaultdict(list)
        #: Orders the entries above against fences: a fence retires what came before it.
        self._seq = itertools.count()
        #: Host segments that may be pinned (id -> segment), and those pinned (id -> bytes).
        self._pinnable: dict[int, Any] = {}
        self._pinned: dict[int, int] = {}
        self.pinned_bytes = 0
        #: Page-locked bytes at most (the daemon's --max-pinned-bytes); 0: no cap.
        self.max_pinned_bytes = 0
        #: Owners whose lanes are a latency tenant's (`prioritize`).
        self._urgent: set[Any] = set()

    # --- lanes ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _for_this_thread(self, name: str, value: Any, default: Any) -> Iterator[None]:
        """Set a per-thread setting for the block (as `with stream:` does in CuPy)."""
        prev = getattr(self._tls, name, default)
        setattr(self._tls, name, value)
        try:
            yield
        finally:
            setattr(self._tls, name, prev)

    def lane(self, lane: Hashable) -> ContextManager[None]:
        """Queue this thread's device work on `lane` (of whichever device it runs on)."""
        return self._for_this_thread("lane", lane, None)

    def off_loop(self) -> ContextManager[None]:
        """This thread may block on slow driver calls (pinning): a worker, not the event loop."""
        return self._for_this_thread("worker", True, False)

    # --- pinning ----------------------------------------------------------------------------------
    def _pin(self, shm: Any) -> None:
        """Page-lock a host segment for DMA (subclasses)."""

    def _unpin(self, shm: Any) -> None:
        """Undo `_pin`."""

    def register_host(self, shm: Any) -> None:
        self._pinnable[id(shm)] = shm

    def unregister_host(self, shm: Any) -> None:
        self._pinnable.pop(id(shm), None)
        with self._pending_lock:
            nbytes = self._pinned.pop(id(shm), None)
        if nbytes is not None:
            self.synchronize()  # nothing queued may still read the pages
            self._unpin(shm)
            with self._pending_lock:
                self.pinned_bytes -= nbytes

    def all_pinned(self) -> bool:
        """Every host segment is page-locked: a device copy queues without blocking the caller
        (an unpinned one is staged by the driver, or pinned first, on the calling thread).
        Where the native workers pin (each segment once registered, in the background), a
        segment not pinned yet costs only its own copies a staging, not every tenant a hop."""
        return self.pins_natively or len(self._pinned) == len(self._pinnable)

    def _maybe_pin(self, span: Span) -> None:
        """A device copy touches this host segment: pin it, if on a worker and under the cap."""
        key = id(span.mem)
        if self.pins_natively or key in self._pinned or key not in self._pinnable or not getattr(self._tls, "worker", False):
            return
        shm = self._pinnable[key]
        with self._pending_lock:
            if key in self._pinned or (self.max_pinned_bytes and self.pinned_bytes + shm.nbytes > self.max_pinned_bytes):
                return
            self._pinned[key] = shm.nbytes  # claimed: another thread does not pin it too
            self.pinned_bytes += shm.nbytes
        try:
            self._pin(shm)
        except Exception as exc:  # pinning is an optimization: copies work unpinned
            log.warning("could not pin a %d-byte segment (%s): its copies go through staging", shm.nbytes, exc)
            self._pinnable.pop(key, None)
            with self._pending_lock:
                del self._pinned[key]
                self.pinned_bytes -= shm.nbytes

    def _key(self, device: int) -> Key:
        """The key the calling thread's work on `device` is queued on."""
        key = (device, getattr(self._tls, "lane", None))
        if key not in self._keys:
            with self._pending_lock:
                self._keys.add(key)
        return key

    # --- primitives (subclasses) ----------------------------------------------------------------
    @abc.abstractmethod
    def _memcpy(self, dst: Span, src: Span, device: int) -> None:
        """Queue a copy of src.nbytes; never host-to-host, never overlapping."""

    @abc.abstractmethod
    def _memset(self, dst: Span, value: int, device: int) -> None:
        """Queue a fill of device memory."""

    @abc.abstractmethod
    def _scratch(self, nbytes: int, device: int) -> Any:
        """Device memory (256-byte aligned, contents undefined) for queued work on `device`."""

    @abc.abstractmethod
    def _device_ptr(self, mem: Any) -> int:
        """The device address of a device allocation's first byte."""

    @abc.abstractmethod
    def _device_of_mem(self, mem: Any) -> int: ...

    @abc.abstractmethod
    def _device_checksum(self, span: Span, device: int) -> int:
        """checksum64 of 8-byte-aligned device memory; waits for the stream (the result is a host int)."""

    @abc.abstractmethod
    def _launch(self, kernel: Any, inputs: list[tuple[Any, Any, int]], outputs: list[tuple[Any, Any, int]], params: Any, device: int) -> Any:
        """Queue a kernel on (TensorRef, device memory at an aligned address) operands: (ref, mem, offset)."""

    @abc.abstractmethod
    def _upload(self, host: np.ndarray, device: int) -> Any:
        """Device memory holding a contiguous host array's bytes as of now (the host array may then change)."""

    @abc.abstractmethod
    def _sync(self, key: Key) -> None:
        """Wait for everything queued on the key's stream."""

    def _drop(self, key: Key) -> None:
        """The key's lane will not be used again (its stream may go)."""

    def _host_copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def _host_fill(self, dst: np.ndarray, value: int) -> None:
        dst.fill(value)

    def _host_checksum(self, src: np.ndarray) -> int:
        return checksum64(src)

    # --- ordering ---------------------------------------------------------------------------------
    @staticmethod
    def _host_view(span: Span) -> np.ndarray:
        view: np.ndarray = host_bytes(span)
        return view

    def _queued_host(self, device: int, span: Span, writes: bool) -> None:
        """Queued work on this thread's lane of `device` reads (or writes) this host range until synchronized."""
        key = self._key(device)
        with self._pending_lock:
            self._host_pending[key].append((next(self._seq), id(span.mem), span.offset, span.offset + span.nbytes, writes))

    def _before_host(self, span: Span, writes: bool) -> None:
        """Host work on `span` is about to run: first finish queued device work that touches it."""
        if not self._host_pending:
            return
        key, a, b = id(span.mem), span.offset, span.offset + span.nbytes
        with self._pending_lock:
            keys = [
                q for q, ranges in self._host_pending.items()
                if any(k == key and s < b and a < e and (writes or w) for _, k, s, e, w in ranges)
            ]
        for q in keys:
            self._synchronize_key(q)

    def _synchronize_key(self, key: Key) -> None:
        mark = next(self._seq)
        try:
            self._sync(key)
        finally:
            self._retire(key, mark)

    def _retire(self, key: Key, mark: int) -> None:
        """What was queued on `key` before `mark` is done (or failed): forget its ranges and scratch."""
        with self._pending_lock:
            tables: tuple[dict[Key, list[Any]], ...] = (self._host_pending, self._live_scratch)  # entries: (mark, ...)
            for table in tables:
                entries = table.get(key)
                if entries:
                    entries[:] = [e for e in entries if e[0] > mark]
                    if not entries:
                        del table[key]

    def fence(self, device: int, lane: Hashable) -> "Fence":
        """Mark everything queued on the lane so far; `Fence.wait()` returns once it is done.

        What lets the daemon queue the next pass while this one's work runs (pipelining)."""
        key = (device, lane)
        mark = next(self._seq)
        return Fence(self, key, mark, self._record(key))

    @abc.abstractmethod
    def _record(self, key: Key) -> Any:
        """Record an event on the key's stream: an object whose `synchronize()` waits for it."""

    def synchronize_lane(self, device: int, lane: Hashable) -> None:
        if (device, lane) in self._keys:
            self._synchronize_key((device, lane))

    def synchronize_device(self, device: int) -> None:
        with self._pending_lock:
            keys = [k for k in self._keys if k[0] == device]
        for key in keys:
            self._synchronize_key(key)

    def synchronize(self) -> None:
        for dev in range(self.device_count):
            self.synchronize_device(dev)

    def prioritize(self, owner: Any) -> None:
        self._urgent.add(owner)

    def _urgent_key(self, key: Key) -> bool:
        """Whether the lane of `key` is a latency tenant's (its stream: the greatest priority)."""
        return isinstance(key[1], tuple) and key[1][0] in self._urgent

    def forget_lanes(self, owner: Any) -> None:
        """Lanes `(owner, n)` are done with (their session ended): finish their work, drop them."""
        self._urgent.discard(owner)
        with self._pending_lock:
            keys = [k for k in self._keys if isinstance(k[1], tuple) and k[1][0] == owner]
        for key in keys:
            try:
                self._synchronize_key(key)
            finally:
                with self._pending_lock:
                    self._keys.discard(key)
                self._drop(key)

    def _scratch_span(self, nbytes: int, device: int) -> Span:
        mem = self._scratch(max(nbytes, 1), device)
        key = self._key(device)
        with self._pending_lock:
            self._live_scratch[key].append((next(self._seq), mem))
        return Span(SegmentKind.DEVICE, mem, 0, nbytes)

    def _device_of(self, *spans: Span) -> int:
        for s in spans:
            if s.kind == SegmentKind.DEVICE:
                return self._device_of_mem(s.mem)
        return 0

    # --- operations ---------------------------------------------------------------------------------
    def copy(self, dst: Span, src: Span) -> None:
        if not src.nbytes:
            return
        if dst.kind == SegmentKind.HOST and src.kind == SegmentKind.HOST:
            self._before_host(src, writes=False)
            self._before_host(dst, writes=True)
            self._host_copy(self._host_view(dst), self._host_view(src))
            return
        dev = self._device_of(dst, src)
        if dst.mem is src.mem and dst.offset < src.offset + src.nbytes and src.offset < dst.offset + dst.nbytes:
            self._copy_overlapping(dst, src, dev)
            return
        if src.kind == SegmentKind.HOST:
            self._maybe_pin(src)
            self._queued_host(dev, src, writes=False)
        if dst.kind == SegmentKind.HOST:
            self._maybe_pin(dst)
            self._queued_host(dev, dst, writes=True)
        self._memcpy(dst, src, dev)

    def _copy_overlapping(self, dst: Span, src: Span, dev: int) -> None:
        """memmove on the stream: cudaMemcpyAsync is undefined for overlapping ranges."""
        n, shift = src.nbytes, abs(dst.offset - src.offset)
        if shift == 0:
            return
        chunks = -(-n // shift)
        if chunks > MAX_OVERLAP_CHUNKS:
            tmp = self._scratch_span(n, dev)
            self._memcpy(tmp, src, dev)
            self._memcpy(dst, tmp, dev)
            return
        # Chunks of `shift` bytes never overlap; copying from the end the destination moves
        # towards makes each chunk read source bytes no earlier chunk has overwritten.
        starts = range(0, n, shift) if dst.offset < src.offset else reversed(range(0, n, shift))
        for at in starts:
            k = min(shift, n - at)
            self._memcpy(dst._replace(offset=dst.offset + at, nbytes=k), src._replace(offset=src.offset + at, nbytes=k), dev)

    def fill(self, dst: Span, value: int) -> None:
        if dst.kind == SegmentKind.HOST:
            self._before_host(dst, writes=True)
            self._host_fill(self._host_view(dst), value)
            return
        if dst.nbytes:
            self._memset(dst, value, self._device_of(dst))

    def checksum(self, src: Span) -> int:
        if src.kind == SegmentKind.HOST:
            self._before_host(src, writes=False)
            return self._host_checksum(self._host_view(src))
        dev = self._device_of(src)
        if (self._device_ptr(src.mem) + src.offset) % 8:  # read as 64-bit words: align first
            tmp = self._scratch_span(src.nbytes, dev)
            self._memcpy(tmp, src, dev)
            src = tmp
        return self._device_checksum(src, dev)

    def compute(self, kernel: Any, inputs: list[tuple[Any, Span]], outputs: list[tuple[Any, Span]], params: Any, device: int) -> Any:
        """Device operands in place (staged when misaligned); host operands staged through the device."""
        ins = [self._operand(kernel, t, s, device, output=False) for t, s in inputs]
        outs = [self._operand(kernel, t, s, device, output=True) for t, s in outputs]
        result = self._launch(kernel, [(t, m, o) for t, m, o, _ in ins], [(t, m, o) for t, m, o, _ in outs], params, device)
        for (t, mem, off, back), (_, span) in zip(outs, outputs):
            if back is None:
                continue
            if span.kind == SegmentKind.DEVICE:  # a misaligned device output: copy the result back
                self._memcpy(span, Span(SegmentKind.DEVICE, mem, off, span.nbytes), device)
                continue
            host = back
            if host.flags.c_contiguous:
                self._queued_host(device, span, writes=True)
                self._memcpy(span._replace(nbytes=host.nbytes), Span(SegmentKind.DEVICE, mem, 0, host.nbytes), device)
            else:  # scattered host output: land it in a contiguous array, wait, scatter on the host
                stage = np.empty(t.shape, dtype=t.np_dtype)
                self._memcpy(Span(SegmentKind.HOST, _Array(stage), 0, stage.nbytes), Span(SegmentKind.DEVICE, mem, 0, stage.nbytes), device)
                self._synchronize_key(self._key(device))
                self._before_host(span, writes=True)
                self._host_copy(host, stage)
        return result

    # --- graph runs a ring worker serves (`_replay`) ---------------------------------------------
    #: Whether this backend's kernels run as host functions on the driver's streams (the
    #: simulation over the fake driver) rather than as device kernels.
    host_kernels = False

    def inline_steps(self, steps: Sequence[Any], device: int, counters: dict[str, int]) -> Replay | None:
        """A stretch whose operands all lie in this device's memory, aligned for its kernels,
        as a `Replay` (captured into a CUDA graph at its first run, on the worker's stream);
        None otherwise (the Python pass stages host operands and copes with misalignment)."""
        if not _native.cuda_graphs():
            return None
        ordinal = None
        calls = []
        for _, kernel, ins, outs, params, _, _ in steps:
            op = OPERATORS.get(kernel.op)
            if op is None or op.n_outputs == 0:
                return None  # (a value for the host: a synchronize, never a graph)
            for t, span in (*ins, *outs):
                where = self.cuda_pointer(span.mem) if span.kind == SegmentKind.DEVICE else None
                if where is None or (ordinal is not None and where[1] != ordinal):
                    return None
                ordinal = where[1]
                item = t.np_dtype.itemsize
                if (where[0] + span.offset) % kernel_alignment(kernel.op, item) or (
                        t.strides is not None and any(st % item for st in t.strides)):
                    return None
            calls.append(self._device_call(kernel, ins, outs, params, device))
        return None if ordinal is None else Replay(self, calls, ordinal, counters)

    def _device_call(self, kernel: Any, ins: Any, outs: Any, params: Any, device: int) -> Any:
        """One kernel over device operands, bound once: what a capture records."""
        raise NotImplementedError

    def _capture(self, replay: Replay, stream: int) -> Any:
        """Record the replay's kernels on `stream` (nothing runs); the executable graph."""
        raise NotImplementedError

    def _replay(self, replay: Replay, stream: int) -> None:
        """Queue one launch of the captured graph on `stream`."""
        raise NotImplementedError

    def _eager(self, replay: Replay, stream: int) -> None:
        """Queue the replay's kernels on `stream` one by one (its capture failed)."""
        raise NotImplementedError

    def _free_graph(self, replay: Replay, graph: Any) -> None:
        """An executable graph goes (a launch in flight completes first)."""

    def _operand(self, kernel: Any, t: Any, span: Span, device: int, output: bool) -> tuple[Any, Any, int, Any]:
        """(ref, device mem, offset, write-back): where a kernel operand lives on the device.

        Write-back is None (in place), a host array (stage through the device), or True
        (a misaligned device range staged through scratch)."""
        item = t.np_dtype.itemsize
        if span.kind == SegmentKind.HOST:
            host = np.ndarray(t.shape, dtype=t.np_dtype, buffer=span.mem.array, offset=span.offset, strides=t.strides)
            dense = t.__class__(0, t.dtype, t.shape)  # staged operands are C-contiguous
            if output:
                tmp = self._scratch_span(host.nbytes, device)
                return dense, tmp.mem, 0, host
            if host.flags.c_contiguous:  # read on the stream by a copy: DMA once pinned, no wait
                tmp = self._scratch_span(host.nbytes, device)
                self.copy(tmp, span._replace(nbytes=host.nbytes))
                return dense, tmp.mem, 0, None
            self._before_host(span, writes=False)  # scattered: gathered here, now
            mem = self._upload(np.ascontiguousarray(host), device)
            key = self._key(device)
            with self._pending_lock:
                self._live_scratch[key].append((next(self._seq), mem))
            return dense, mem, 0, None
        if t.strides is not None and any(s % item for s in t.strides):
            raise E.InvalidField(f"a {t.dtype} tensor in GPU memory needs strides that are multiples of {item} bytes, got {t.strides}")
        if (self._device_ptr(span.mem) + span.offset) % kernel_alignment(kernel.op, item) == 0 or not span.nbytes:
            return t, span.mem, span.offset, None
        tmp = self._scratch_span(span.nbytes, device)  # misaligned: work on an aligned copy
        self._memcpy(tmp, span, device)  # outputs too: strided outputs keep the bytes between elements
        return t, tmp.mem, 0, (True if output else None)


class Fence:
    """A point on one lane: `wait()` blocks until the work queued there before it is done."""

    __slots__ = ("backend", "key", "mark", "event")

    def __init__(self, backend: StreamBackend, key: Key, mark: int, event: Any) -> None:
        self.backend, self.key, self.mark, self.event = backend, key, mark, event

    def wait(self) -> None:
        try:
            self.event.synchronize()
        finally:
            self.backend._retire(self.key, self.mark)

    def done(self) -> bool:
        """Whether the work is done, without waiting (a device error raises, as `wait`'s)."""
        try:
            if not self.event.done:
                return False
        except BaseException:
            self.backend._retire(self.key, self.mark)
            raise
        self.backend._retire(self.key, self.mark)
        return True


class _Array:
    """A bare host array seen as a host segment (for a Span)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array.reshape(-1).view(np.uint8)
