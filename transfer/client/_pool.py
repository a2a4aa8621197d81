"""Batch-slot pools: safe reuse of zero-copy buffers, with backpressure.

A pool carves one registered segment into N equal slots. A producer
acquires a slot, writes into it through NumPy views, and submits it; the
slot comes back to the pool only when the daemon has *finished reading it*
(its request completed). Until then the API refuses to hand out the slot
again, and the views it gave out are turned read-only, so the classic
zero-copy bug (overwriting a buffer the consumer is still reading) cannot
happen through the API. When every slot is in flight, `acquire` waits:
that is the backpressure.

The same Slot/Pool code serves the blocking and the trio client; only
"wait for a completion" differs (see `SyncWaiter` / `TrioPool`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .. import errors as E
from ..kernels import TensorRef
from ._core import DeviceBuffer, HostSegment, Pending, make_tensor

if TYPE_CHECKING:
    from ._sync import Client

__all__ = ["SlotPool", "Slot"]

_FREE, _WRITING, _IN_FLIGHT, _RELEASED = "free", "writing", "in flight", "released"


class Slot:
    """One slot of a pool: writable until submitted, then owned by the daemon until done."""

    __slots__ = ("pool", "index", "offset", "nbytes", "va", "_state", "_views", "_generation", "pending")

    def __init__(self, pool: "SlotPool", index: int, offset: int, nbytes: int, va: int) -> None:
        self.pool = pool
        self.index = index
        self.offset = offset
        self.nbytes = nbytes
        self.va = va
        self._state = _FREE
        self._views: list[np.ndarray] = []
        self._generation = 0
        self.pending: Pending | Any | None = None

    # --- writing ---------------------------------------------------------------------------
    def _check_writable(self, what: str) -> None:
        if self._state != _WRITING:
            raise E.SlotError(f"slot {self.index}: cannot {what}: the slot is {self._state}")

    def ndarray(self, shape: int | Sequence[int], dtype: Any = np.uint8, offset: int = 0) -> np.ndarray:
        """A writable view into the slot (no copy). It turns read-only when the slot is submitted."""
        self._check_writable("hand out a view")
        dt = np.dtype(dtype)
        shape_t = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
        n = int(np.prod(shape_t, dtype=np.int64)) * dt.itemsize
        if offset < 0 or offset + n > self.nbytes:
            raise E.OutOfBounds(f"view of {n} bytes at offset {offset} exceeds the slot's {self.nbytes} bytes")
        view = self.pool.segment.ndarray(shape_t, dt, offset=self.offset + offset)
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
        return self._hand_over(lambda: self.pool.client.copy(dst + offset, self.va, n, stream=stream))

    def compute(self, op: str, inputs: Sequence[TensorRef], outputs: Sequence[TensorRef] = (), params: dict[str, Any] | None = None, **kw: Any) -> Any:
        """Run an operator whose inputs include this slot's tensors; the slot returns when it is done."""
        self._check_writable("submit a compute request")
        return self._hand_over(lambda: self.pool.client.compute(op, inputs, outputs, params, **kw))

    def _hand_over(self, send: Callable[[], Any]) -> Any:
        for v in self._views:
            v.flags.writeable = False  # the daemon reads these bytes now
        self._views.clear()
        self.pending = send()
        self._state = _IN_FLIGHT
        self.pool._in_flight.append(self)
        return self.pending

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
    """N slots of `slot_nbytes` over one registered segment (blocking client)."""

    def __init__(self, client: "Client", slot_nbytes: int, slots: int, *, align: int = 4096) -> None:
        if slot_nbytes <= 0 or slots <= 0:
            raise ValueError("slot_nbytes and slots must be positive")
        stride = -(-slot_nbytes // align) * align  # each slot starts page-aligned
        self.client = client
        self.slot_nbytes = slot_nbytes
        self.segment: HostSegment = client.segment(stride * slots)
        self.slots = [Slot(self, i, i * stride, slot_nbytes, self.segment.va + i * stride) for i in range(slots)]
        self._free: deque[Slot] = deque(self.slots)
        self._in_flight: deque[Slot] = deque()

    # --- returns -------------------------------------------------------------------------------
    def _give_back(self, slot: Slot) -> None:
        slot._state = _FREE
        slot.pending = None
        self._free.append(slot)

    def _reap(self) -> None:
        """Return every slot whose request has completed (failed ones too: the daemon is done with it)."""
        still: deque[Slot] = deque()
        for slot in self._in_flight:
            if slot.pending is not None and slot.pending.done():
                self._give_back(slot)
            else:
                still.append(slot)
        self._in_flight = still

    def _take(self) -> Slot:
        slot = self._free.popleft()
        slot._state = _WRITING
        slot._generation += 1
        return slot

    def acquire(self, timeout: float | None = None) -> Slot:
        """A free slot; waits (driving the client's I/O) while all are in flight."""
        self._reap()
        if not self._free:
            self.client.poll()
            self._reap()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._free:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise E.RequestTimeout(f"no slot of {len(self.slots)} came back within {timeout}s (all held or in flight)")
            if not self._in_flight:
                # Every slot is held by the caller's code: only a release (another thread) helps.
                time.sleep(0.001 if left is None else min(0.001, left))
                continue
            oldest = self._in_flight[0]
            try:
                oldest.pending.exception(timeout=left)  # type: ignore[union-attr]
            except E.RequestTimeout:
                continue
            self._reap()
        return self._take()

    @property
    def in_flight(self) -> int:
        self._reap()
        return len(self._in_flight)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every slot is back (raises the first failure nobody looked at)."""
        for slot in list(self._in_flight):
            if slot.pending is not None:
                slot.pending.exception(timeout=timeout)
        self._reap()

    def close(self) -> None:
        self.drain()
        self.client.free(self.segment)

    def __enter__(self) -> "SlotPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TrioSlotPool(SlotPool):
    """The same pool for the trio client: `await pool.acquire()`."""

    def __init__(self, client: Any, segment: HostSegment, slot_nbytes: int, slots: int, stride: int) -> None:
        self.client = client
        self.slot_nbytes = slot_nbytes
        self.segment = segment
        self.slots = [Slot(self, i, i * stride, slot_nbytes, segment.va + i * stride) for i in range(slots)]
        self._free = deque(self.slots)
        self._in_flight = deque()
        self._released: Any = None

    @classmethod
    async def create(cls, client: Any, slot_nbytes: int, slots: int, align: int = 4096) -> "TrioSlotPool":
        if slot_nbytes <= 0 or slots <= 0:
            raise ValueError("slot_nbytes and slots must be positive")
        stride = -(-slot_nbytes // align) * align
        return cls(client, await client.segment(stride * slots), slot_nbytes, slots, stride)

    async def acquire(self, timeout: float | None = None) -> Slot:  # type: ignore[override]
        import trio

        self._reap()
        with trio.move_on_after(float("inf") if timeout is None else timeout):
            while not self._free:
                if not self._in_flight:
                    self._released = trio.Event()
                    await self._released.wait()  # every slot is held: wait for a release
                    continue
                try:
                    await self._in_flight[0].pending
                except E.TransferError:
                    pass  # the request failed; the daemon is done with the slot all the same
                self._reap()
            return self._take()
        raise E.RequestTimeout(f"no slot of {len(self.slots)} came back within {timeout}s (all in flight)")

    def _give_back(self, slot: Slot) -> None:
        super()._give_back(slot)
        if self._released is not None:
            self._released.set()

    async def drain(self, timeout: float | None = None) -> None:  # type: ignore[override]
        for slot in list(self._in_flight):
            try:
                await slot.pending
            except E.TransferError:
                pass
        self._reap()

    async def aclose(self) -> None:
        await self.drain()
        await self.client.free(self.segment)
