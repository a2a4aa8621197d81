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

Subclasses provide the primitives: `_memcpy`, `_memset`, `_scratch`,
`_device_ptr`, `_device_checksum`, `_launch`, `_upload`, `_download`,
`_sync`, and the host primitives (`_host_copy`, `_host_fill`,
`_host_checksum`), which the simulation overrides to catch misordering.
"""

from __future__ import annotations

import abc
import threading
from collections import defaultdict
from typing import Any

import numpy as np

from .. import errors as E
from .._checksum import checksum64
from ..addressing import SegmentKind
from ._base import Backend, Span

__all__ = ["StreamBackend", "kernel_alignment"]

#: An overlapping device copy is done in at most this many non-overlapping chunks, else via scratch.
MAX_OVERLAP_CHUNKS = 8


def kernel_alignment(op: str, itemsize: int) -> int:
    """Bytes a device operand's address must be a multiple of for this operator's kernel."""
    return max(itemsize, 8) if op == "checksum" else itemsize


class StreamBackend(Backend):
    """A backend whose device work is queued per device (one stream each) until synchronized."""

    def __init__(self) -> None:
        self._pending_lock = threading.Lock()
        #: Per device: host ranges queued, unsynchronized work touches: (id(host mem), start, end, writes).
        self._host_pending: dict[int, list[tuple[int, int, int, bool]]] = defaultdict(list)
        #: Per device: scratch buffers queued work may still use.
        self._live_scratch: dict[int, list[Any]] = defaultdict(list)

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
    def _launch(self, kernel: Any, inputs: list[tuple[Any, Any]], outputs: list[tuple[Any, Any]], params: Any, device: int) -> Any:
        """Queue a kernel on (TensorRef, device memory at an aligned address) operands: (ref, mem, offset)."""

    @abc.abstractmethod
    def _upload(self, host: np.ndarray, device: int) -> Any:
        """Device memory holding a contiguous host array's bytes as of now (the host array may then change)."""

    @abc.abstractmethod
    def _sync(self, device: int) -> None:
        """Wait for everything queued on the device's stream."""

    def _host_copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def _host_fill(self, dst: np.ndarray, value: int) -> None:
        dst.fill(value)

    def _host_checksum(self, src: np.ndarray) -> int:
        return checksum64(src)

    # --- ordering ---------------------------------------------------------------------------------
    @staticmethod
    def _host_view(span: Span) -> np.ndarray:
        return span.mem.array[span.offset : span.offset + span.nbytes]

    def _queued_host(self, device: int, span: Span, writes: bool) -> None:
        """Queued work on `device` reads (or writes) this host range until the next synchronize."""
        with self._pending_lock:
            self._host_pending[device].append((id(span.mem), span.offset, span.offset + span.nbytes, writes))

    def _before_host(self, span: Span, writes: bool) -> None:
        """Host work on `span` is about to run: first finish queued device work that touches it."""
        if not self._host_pending:
            return
        key, a, b = id(span.mem), span.offset, span.offset + span.nbytes
        with self._pending_lock:
            devices = [
                dev for dev, ranges in self._host_pending.items()
                if any(k == key and s < b and a < e and (writes or w) for k, s, e, w in ranges)
            ]
        for dev in devices:
            self.synchronize_device(dev)

    def synchronize_device(self, device: int) -> None:
        with self._pending_lock:
            n_host = len(self._host_pending.get(device, ()))
            n_scratch = len(self._live_scratch.get(device, ()))
        try:
            self._sync(device)
        finally:
            with self._pending_lock:  # what was queued before this synchronize is done (or failed)
                if device in self._host_pending:
                    del self._host_pending[device][:n_host]
                    if not self._host_pending[device]:
                        del self._host_pending[device]
                if device in self._live_scratch:
                    del self._live_scratch[device][:n_scratch]

    def synchronize(self) -> None:
        for dev in range(self.device_count):
            self.synchronize_device(dev)

    def _scratch_span(self, nbytes: int, device: int) -> Span:
        mem = self._scratch(max(nbytes, 1), device)
        with self._pending_lock:
            self._live_scratch[device].append(mem)
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
            self._queued_host(dev, src, writes=False)
        if dst.kind == SegmentKind.HOST:
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
                self.synchronize_device(device)
                self._before_host(span, writes=True)
                self._host_copy(host, stage)
        return result

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
            self._before_host(span, writes=False)
            mem = self._upload(np.ascontiguousarray(host), device)
            with self._pending_lock:
                self._live_scratch[device].append(mem)
            return dense, mem, 0, None
        if t.strides is not None and any(s % item for s in t.strides):
            raise E.InvalidField(f"a {t.dtype} tensor in GPU memory needs strides that are multiples of {item} bytes, got {t.strides}")
        if (self._device_ptr(span.mem) + span.offset) % kernel_alignment(kernel.op, item) == 0 or not span.nbytes:
            return t, span.mem, span.offset, None
        tmp = self._scratch_span(span.nbytes, device)  # misaligned: work on an aligned copy
        self._memcpy(tmp, span, device)  # outputs too: strided outputs keep the bytes between elements
        return t, tmp.mem, 0, (True if output else None)


class _Array:
    """A bare host array seen as a host segment (for a Span)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array.reshape(-1).view(np.uint8)
