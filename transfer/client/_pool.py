"""Batch-slot pools: safe reuse of zero-copy buffers, with backpressure.

A pool carves one registered segment into N equal slots. A producer
acquires a slot, writes into it through NumPy views, and submits it; the
slot comes back to the pool only when the daemon has *finished reading it*
(its request completed). Until then the API refuses to hand out the slot
again, and the views it gave out are turned read-only, so the classic
zero-copy bug (overwriting a buffer the consumer is still reading) cannot
happen through the API. When every slot is in flight, `acquire` waits:
that is the backpressure.

One Slot/Pool implementation serves both clients: the pool takes its client
as a duck-typed parameter (anything with `copy`, `compute`, `free` and the
operation driver `_run`, see client._session), and its waiting methods are
operations, so `pool.acquire()` blocks on a `Client` and is awaited on a
`TrioClient` (`slot = await pool.acquire()`).
"""

from __future__ import annotations

import inspect
import math
from collections import deque
from typing import Any, Generator, Sequence

import numpy as np

from .. import errors as E
from ..kernels import TensorRef, shape_tuple
from .._pending import Pending
from ._resources import DeviceBuffer, HostSegment, make_tensor

__all__ = ["SlotPool", "Slot"]

_FREE, _WRITING, _IN_FLIGHT, _RELEASED = "free", "writing", "in flight", "released"


class Slot:
    """One slot of a pool: writable until submitted, then owned by the daemon until done."""

    __slots__ = ("pool", "index", "offset", "nbytes", "va", "_state", "_views", "pending", "_bases")

    #: Views kept per slot for reuse (by shape, dtype and offset); more are made afresh.
    MAX_BASES = 8

    def __init__(self, pool: "SlotPool", index: int, offset: int, nbytes: int, va: int) -> None:
        self.pool = pool
        self.index = index
        self.offset = offset
        self.nbytes = nbytes
        self.va = va
        self._state = _FREE
        self._views: list[np.ndarray] = []
        self.pending: Pending | Any | None = None
        #: (shape, dtype, offset) -> a view never handed out; callers get a fresh view of it, so
        #: the one made read-only at submit stays so, while the next costs a fraction as much.
        self._bases: dict[Any, np.ndarray] = {}

    # --- writing ---------------------------------------------------------------------------
    def _check_writable(self, what: str) -> None:
        if self._state != _WRITING:
            raise E.SlotError(f"slot {self.index}: cannot {what}: the slot is {self._state}")

    def ndarray(self, shape: int | Sequence[int], dtype: Any = np.uint8, offset: int = 0) -> np.ndarray:
        """A writable view into the slot (no copy). It turns read-only when the slot is submitted."""
        self._check_writable("hand out a view")
        key = (shape, dtype, offset)
        try:
            base = self._bases[key]
        except (KeyError, TypeError):  # (TypeError: a shape given as a list is no key)
            dt = np.dtype(dtype)
            shape_t = shape_tuple(shape)
            n = math.prod(shape_t) * dt.itemsize
            if offset < 0 or offset + n > self.nbytes:
                raise E.OutOfBounds(f"view of {n} bytes at offset {offset} exceeds the slot's {self.nbytes} bytes")
            base = self.pool.segment.ndarray(shape_t, dt, offset=self.offset + offset)
            if type(shape) is not list and len(self._bases) < self.MAX_BASES:
                self._bases[key] = base
        view = base.view()
        self._views.append(view)
        return view

    def tensor(self, shape: int | Sequence[int], dtype: Any = np.uint8, offset: int = 0, strides: Sequence[int] | None = None) -> TensorRef:
        """A tensor reference to the slot's bytes, for compute requests."""
        if self._state == _RELEASED:
            raise E.SlotError(f"slot {self.index}: cannot describe a tensor: the slot is released")
        return make_tensor(self, shape, dtype, offset, strides)

    # --- handing over ------------------------------------------------------------------------
    def submit(self, to: DeviceBuffer | HostSegment | TensorRef | int, nbytes: int | None = None, *, offset: int = 0, stream: int = 0) -> Any:
        """Copy the slot's first `nbytes` (default: all) to `to`; the slot returns when the copy is done."""
        self._check_writable("submit")
        n = self.nbytes if nbytes is None else nbytes
        if not 0 < n <= self.nbytes:
            raise E.OutOfBounds(f"submit of {n} bytes from a {self.nbytes}-byte slot")
        dst = to if isinstance(to, int) else to.va
        self._freeze()
        return self._sent(self.pool.client.copy(dst + offset, self.va, n, stream=stream))

    def compute(self, op: str, inputs: Sequence[TensorRef], outputs: Sequence[TensorRef] = (), params: dict[str, Any] | None = None, **kw: Any) -> Any:
        """Run an operator whose inputs include this slot's tensors; the slot returns when it is done."""
        self._check_writable("submit a compute request")
        self._freeze()
        return self._sent(self.pool.client.compute(op, inputs, outputs, params, **kw))

    def _freeze(self) -> None:
        """Before the request leaves: the views handed out turn read-only (the daemon reads these
        bytes now). If sending then fails, the slot stays the caller's to release."""
        for v in self._views:
            v.setflags(write=False)
        self._views.clear()

    def _sent(self, pending: Any) -> Any:
        """The request is on its way: the slot is in flight until it completes."""
        self.pending = pending
        self._state = _IN_FLIGHT
        self.pool._in_flight.append(self)
        return pending

    def release(self) -> None:
        """Give an unsubmitted slot back to the pool (e.g. the batch was dropped)."""
        if self._state == _IN_FLIGHT:
            raise E.SlotError(f"slot {self.index}: cannot release: it is in flight (it returns by itself when done)")
        if self._state != _WRITING:
            raise E.SlotError(f"slot {self.index}: released twice (it is {self._state})")
        for v in self._views:
            v.flags.writeable = False
        self._views.clear()
        self._state = _RELEASED
        self.pool._give_back(self)

    def __enter__(self) -> "Slot":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._state == _WRITING:
            self.release()  # never submitted: back to the pool at once

    def __repr__(self) -> str:
        return f"<Slot {self.index} {self._state} va={self.va:#x} nbytes={self.nbytes}>"


class SlotPool:
    """N slots of `slot_nbytes` over one registered segment (`client.pool(...)` makes one)."""

    def __init__(self, client: Any, segment: HostSegment, slot_nbytes: int, slots: int, stride: int) -> None:
        self.client = client
        self.slot_nbytes = slot_nbytes
        self.segment = segment
        self.slots = [Slot(self, i, i * stride, slot_nbytes, segment.va + i * stride) for i in range(slots)]
        self._free: deque[Slot] = deque(self.slots)
        self._in_flight: deque[Slot] = deque()
        #: Set while an acquire waits for a slot the caller's own code holds.
        self._released: Pending | None = None
        #: Failed submits whose slots came back (by acquire or in_flight) before anyone
        #: looked at the failure: drain() and close() raise them.
        self._failed: list[Pending] = []

    @staticmethod
    def stride(slot_nbytes: int, slots: int, align: int = 4096) -> int:
        """Bytes between slot starts: each slot starts page-aligned."""
        if slot_nbytes <= 0 or slots <= 0:
            raise ValueError("slot_nbytes and slots must be positive")
        return -(-slot_nbytes // align) * align

    # --- returns -------------------------------------------------------------------------------
    def _give_back(self, slot: Slot) -> None:
        slot._state = _FREE
        slot.pending = None
        self._free.append(slot)
        signal, self._released = self._released, None
        if signal is not None:
            signal._finish(None, None)

    def _reap(self) -> None:
        """Return every slot whose request has completed (failed ones too: the daemon is done
        with it). A slot in flight always has its pending (`_sent` sets it)."""
        in_flight = self._in_flight
        while in_flight:  # in submission order: the common case
            p = in_flight[0].pending
            if p is None or not p._done:
                break
            self._returned(in_flight.popleft(), p)
        for slot in in_flight:  # and any that finished out of order (a slow compute ahead of copies)
            if slot.pending is not None and slot.pending._done:
                done = [(s, s.pending) for s in in_flight if s.pending is not None and s.pending._done]
                self._in_flight = deque(s for s in in_flight if s.pending is None or not s.pending._done)
                for s, p in done:
                    self._returned(s, p)
                return

    def _returned(self, slot: Slot, p: Pending) -> None:
        """A slot whose request `p` completed: its failure kept for drain() if nobody looked, the slot freed."""
        if not p._observed and (p._error is not None or any(d._error is not None for d in p._deps or ())):
            self._failed.append(p)
        self._give_back(slot)

    def _take(self) -> Slot:
        slot = self._free.popleft()
        slot._state = _WRITING
        return slot

    def acquire(self, timeout: float | None = None) -> Any:
        """A free slot; waits while all are in flight (awaitable on a trio client)."""
        return self.client._run(self._op_acquire(timeout), timeout)

    def _op_acquire(self, timeout: float | None) -> Generator[Pending, None, Slot]:
        self._reap()
        while not self._free:
            if self._in_flight:
                wait_on = self._in_flight[0].pending
                assert wait_on is not None  # set before a slot goes in flight (_sent)
            else:  # every slot is held by the caller's code: only a release helps
                if self._released is None:
                    self._released = self.client._core.signal()
                wait_on = self._released
            try:
                yield wait_on
            except E.RequestTimeout:
                raise E.RequestTimeout(f"no slot of {len(self.slots)} came back within {timeout}s (all held or in flight)") from None
            self._reap()
        return self._take()

    @property
    def in_flight(self) -> int:
        self._reap()
        return len(self._in_flight)

    def drain(self, timeout: float | None = None) -> Any:
        """Wait until every slot is back; raise the first failed submit nobody looked at since
        the last drain (slots that came back through `acquire` or `in_flight` included)."""
        return self.client._run(self._op_drain(), timeout)

    def _op_drain(self) -> Generator[Pending, None, None]:
        pendings = [s.pending for s in self._in_flight if s.pending is not None]
        for p in pendings:
            yield p  # waits; a failed request does not raise here (a timeout does)
        self._reap()
        failed, self._failed = self._failed, []
        errs = [err for p in sorted(failed, key=lambda p: p.id) if not p._observed and (err := p.exception()) is not None]
        if errs:
            first = errs[0]
            if len(errs) > 1:
                first.add_note(f"{len(errs) - 1} more submit(s) from this pool also failed")
            raise first

    def close(self) -> Any:
        """Drain, then free the segment (awaitable on a trio client)."""
        return self.client._run(self._op_close())

    def _op_close(self) -> Generator[Pending, None, None]:
        failed: E.TransferError | None = None
        try:
            yield from self._op_drain()
        except E.TransferError as exc:
            failed = exc  # the segment goes all the same
        for slot in self.slots:
            slot._bases.clear()  # views of the segment's mapping: let it go with the segment
        yield from self.client._op_free(self.segment)
        if failed is not None:
            raise failed

    def __enter__(self) -> "SlotPool":
        return self

    def __exit__(self, *exc: object) -> None:
        done = self.close()
        if inspect.isawaitable(done):
            done.close()  # type: ignore[attr-defined]
            raise TypeError("a trio client's pool closes with `async with pool:` or `await pool.close()`")

    async def __aenter__(self) -> "SlotPool":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
