"""The pure-Python twin of the ring's queue (`_ring_native.Queue`), and the ring's errors.

One single-producer/single-consumer queue of fixed-size slots in a shared
mapping, with the same constructor, methods and layout as the native one (the
two interoperate on one ring: tests/unit/ring/test_ring.py). `transfer._ring` picks one
per ring; this one serves where the extension is not built. The futex goes
through ctypes, and memory ordering relies on x86-64 TSO (below).
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys
import threading
import time
from typing import Any

import numpy as np

from transfer.ring import RingCorrupted, RingError

__all__ = ["PyQueue", "group_runs"]


# Memory-ordering assumption (docs/ring.md): x86-64 TSO. Stores become visible
# in program order and loads are not reordered with older loads, so "copy the
# slots, then store tail" publishes correctly, and "load tail, then read the
# slots, then store head" consumes correctly, provided each step is a separate
# C call (NumPy copy, memoryview store), which the compiler cannot reorder.
# The one reordering TSO allows, a load passing an older store, would break
# the doorbell's Dekker handshake; _fence() closes it with a locked
# instruction (threading.Lock is a glibc semaphore/mutex: lock cmpxchg).
# On a weakly ordered CPU (ARM64) none of this holds: use the extension.

_FENCE_LOCK = threading.Lock()


def _fence() -> None:
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower(), 0)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


try:
    _libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") and _SYS_FUTEX else None
    _syscall = _libc.syscall if _libc is not None else None
except (OSError, AttributeError):  # pragma: no cover
    _syscall = None

SLICE_S = 0.05  # longest single futex sleep in both implementations (native: TRQ_SLICE_NS)


def _futex_wait(addr: int, expect: int, timeout: float) -> None:
    if _syscall is None:  # no futex: sleep-poll (bounded, but not free)
        time.sleep(min(timeout, 0.001))
        return
    sec = int(timeout)
    ts = _Timespec(sec, int((timeout - sec) * 1e9))
    _syscall(
        ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAIT),
        ctypes.c_uint(expect), ctypes.byref(ts), None, ctypes.c_int(0),
    )


def _futex_wake(addr: int) -> None:
    if _syscall is not None:
        _syscall(
            ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE),
            ctypes.c_int(2**31 - 1), None, None, ctypes.c_int(0),
        )


_U64 = (1 << 64) - 1


def group_runs(rows: list[tuple[int, ...]], key: int, value: int, clean: int) -> list[tuple[Any, ...]]:
    """`pop_runs`'s grouping of popped rows (`pop_list`'s tuples): each run of consecutive rows
    sharing `key`, with `clean` zero, as its first row + (its length, the `value` words packed
    little-endian, or None for a run of one). The native `Queue.pop_runs` does the same in C."""
    out: list[tuple[Any, ...]] = []
    i, n = 0, len(rows)
    while i < n:
        first, j = rows[i], i + 1
        if not first[clean]:
            k = first[key]
            while j < n and rows[j][key] == k and not rows[j][clean]:
                j += 1
        words = None if j - i == 1 else struct.pack(f"<{j - i}Q", *(r[value] & _U64 for r in rows[i:j]))  # (the stored bits)
        out.append((*first, j - i, words))
        i = j
    return out


class PyQueue:
    """Pure-Python twin of ``_ring_native.Queue`` (same constructor and methods)."""

    def __init__(
        self, buffer: Any, producer: bool, capacity: int, slot_size: int, slots: int,
        tail: int, head: int, data_waiter: int, space_waiter: int, peer_closed: int,
        fields: tuple[tuple[int, int, bool], ...],
    ) -> None:
        mv = memoryview(buffer)
        if slots + capacity * slot_size > len(mv):
            raise ValueError("queue geometry does not fit the buffer")
        self._producer = bool(producer)
        self._cap = capacity
        self._mask = capacity - 1
        self._ss = slot_size
        self._tail = mv[tail : tail + 8].cast("Q")
        self._head = mv[head : head + 8].cast("Q")
        self._dw = mv[data_waiter : data_waiter + 4].cast("I")
        self._sw = mv[space_waiter : space_waiter + 4].cast("I")
        self._pc = mv[peer_closed : peer_closed + 4].cast("I")
        self._buf = buffer
        base = np.frombuffer(buffer, dtype=np.uint8, count=len(mv))
        self._base_view = base
        self._addr = int(base.ctypes.data)
        self._dw_addr = self._addr + data_waiter
        self._sw_addr = self._addr + space_waiter
        self._slots = base[slots : slots + capacity * slot_size]
        self._slots_off = slots
        # struct format in offset order, plus the tuple-order permutation
        order = sorted(range(len(fields)), key=lambda i: fields[i][0])
        fmt, pos = "<", 0
        for i in order:
            off, size, sgn = fields[i]
            if off > pos:
                fmt += f"{off - pos}x"
            fmt += {1: "b", 2: "h", 4: "i", 8: "q"}[size] if sgn else {1: "B", 2: "H", 4: "I", 8: "Q"}[size]
            pos = off + size
        if pos < slot_size:
            fmt += f"{slot_size - pos}x"
        self._struct = struct.Struct(fmt)
        self._order = order
        self._inverse = [order.index(i) for i in range(len(fields))]
        self._nfields = len(fields)
        self._sizes = [f[1] for f in fields]
        self._identity = order == list(range(len(fields)))
        self._interrupt = False
        self._waiting = 0
        #: Producer: an fd written one byte when a wake finds the peer armed with 1.
        self.bell = -1
        self._closed = False
        if self._producer:
            self._mine, self._seen = self._tail[0], self._head[0]
            bad = self._mine - self._seen
        else:
            self._mine, self._seen = self._head[0], self._tail[0]
            bad = self._seen - self._mine
        if bad % 2**64 > capacity:
            self._release()
            raise RingCorrupted("ring corrupted: indices are more than a capacity apart")

    # -- helpers
    def _check(self, producer: bool) -> None:
        if self._closed:
            raise ValueError("ring queue is closed")
        if self._producer != producer:
            raise TypeError(
                "this endpoint consumes this queue; it cannot push" if producer
                else "this endpoint produces into this queue; it cannot pop"
            )

    def _doorbell(self, word: memoryview, addr: int) -> int:
        """The waker's half (ring.h, trq_ring_doorbell): the word it cleared (0: nobody slept);
        a producer also writes `bell` when the peer armed with 1 (_ring_native.c, ring_peer)."""
        _fence()  # P2: order the index store before the waiter-word load (Dekker)
        was = word[0]
        if was:
            word[0] = 0
            _futex_wake(addr)
            if was == 1 and self._producer and self.bell >= 0:
                try:
                    os.write(self.bell, b"\0")
                except (BlockingIOError, BrokenPipeError):
                    pass  # a full pipe rings already; a closed one has nobody to wake
        return was

    def _corrupt(self) -> RingCorrupted:
        return RingCorrupted(
            "ring corrupted: the consumer's head index is impossible" if self._producer
            else "ring corrupted: the producer's tail index is impossible"
        )

    # -- consumer
    def available(self) -> int:
        self._check(False)
        return self._available()

    def _available(self) -> int:
        t = self._tail[0]
        n = (t - self._mine) % 2**64
        if n > self._cap:
            raise self._corrupt()
        self._seen = t
        return n

    def _pop_raw(self, max_: int, wake: bool) -> tuple[int, int, int]:
        n = (self._seen - self._mine) % 2**64
        if n < max_:
            n = self._available()
        n = min(n, max_)
        return n, (self._mine & self._mask), n

    def _advance_head(self, n: int, wake: bool) -> None:
        self._mine = (self._mine + n) % 2**64
        self._head[0] = self._mine  # after the slot reads (TSO: load->store order kept)
        if wake:
            self._doorbell(self._sw, self._sw_addr)

    def pop(self, wake: bool = True) -> tuple[int, ...] | None:
        self._check(False)
        n, start, _ = self._pop_raw(1, wake)
        if n == 0:
            return None
        vals = self._struct.unpack_from(self._buf, self._slots_off + start * self._ss)
        self._advance_head(1, wake)
        return vals if self._identity else tuple(vals[j] for j in self._inverse)

    def pop_list(self, max: int = 2**64 - 1, wake: bool = True) -> list[tuple[int, ...]]:  # noqa: A002
        self._check(False)
        n, start, _ = self._pop_raw(max, wake)
        out = [self._struct.unpack_from(self._buf, self._slots_off + ((start + i) & self._mask) * self._ss) for i in range(n)]
        out = out if self._identity else [tuple(vals[j] for j in self._inverse) for vals in out]
        if n:
            self._advance_head(n, wake)
        return out

    def pop_runs(self, key: int, value: int, clean: int, wake: bool = True) -> list[tuple[Any, ...]]:
        if not all(0 <= f < self._nfields for f in (key, value, clean)) or self._sizes[value] != 8:
            raise ValueError("key, value and clean must be fields (value an 8-byte one)")
        return group_runs(self.pop_list(wake=wake), key, value, clean)

    def pop_into(self, out: Any, max: int, wake: bool = True) -> int:  # noqa: A002
        self._check(False)
        dst = np.frombuffer(out, dtype=np.uint8)
        if max * self._ss > dst.size:
            raise ValueError("buffer shorter than max slots")
        n, start, _ = self._pop_raw(max, wake)
        if n == 0:
            return 0
        ss = self._ss
        first = min(n, self._cap - start)
        dst[: first * ss] = self._slots[start * ss : (start + first) * ss]
        if n > first:
            dst[first * ss : n * ss] = self._slots[: (n - first) * ss]
        self._advance_head(n, wake)
        return n

    # -- producer
    def free(self) -> int:
        self._check(True)
        return self._free()

    def _free(self) -> int:
        h = self._head[0]
        used = (self._mine - h) % 2**64
        if used > self._cap:
            raise self._corrupt()
        self._seen = h
        return self._cap - used

    def _reserve(self, n: int) -> int:
        free = self._cap - (self._mine - self._seen) % 2**64
        if free < n:
            free = self._free()
        return min(n, free)

    def _publish(self, n: int, wake: bool) -> None:
        self._mine = (self._mine + n) % 2**64
        self._tail[0] = self._mine  # after the slot stores (TSO: store->store order kept)
        if wake:
            self._doorbell(self._dw, self._dw_addr)

    def push(self, desc: tuple[int, ...], wake: bool = True) -> bool:
        self._check(True)
        if not isinstance(desc, tuple):
            raise TypeError("a descriptor is a tuple of integers")
        k = len(desc)
        if k < 1 or k > self._nfields:
            raise ValueError(f"a descriptor has 1 to {self._nfields} fields, got {k}")
        if k < self._nfields:
            desc = desc + (0,) * (self._nfields - k)
        if not self._identity:
            desc = tuple(desc[i] for i in self._order)
        if self._reserve(1) == 0:
            return False
        try:
            self._struct.pack_into(self._buf, self._slots_off + (self._mine & self._mask) * self._ss, *desc)
        except struct.error as exc:
            raise OverflowError(f"descriptor field out of range: {exc}") from None
        self._publish(1, wake)
        return True

    def push_buffer(self, data: Any, count: int, wake: bool = True) -> int:
        self._check(True)
        src = np.frombuffer(data, dtype=np.uint8)
        if count * self._ss > src.size:
            raise ValueError("buffer shorter than count slots")
        n = self._reserve(count)
        if n == 0:
            return 0
        ss, start = self._ss, self._mine & self._mask
        first = min(n, self._cap - start)
        self._slots[start * ss : (start + first) * ss] = src[: first * ss]
        if n > first:
            self._slots[: (n - first) * ss] = src[first * ss : n * ss]
        self._publish(n, wake)
        return n

    # -- both
    def wait(self, need: int = 1, timeout: float | None = None, spin: float = 50e-6) -> int:
        if self._closed:
            raise ValueError("ring queue is closed")
        if need < 1 or need > self._cap:
            raise ValueError("need must be in 1..capacity")
        check = self._free if self._producer else self._available
        word, addr = (self._sw, self._sw_addr) if self._producer else (self._dw, self._dw_addr)
        a = check()
        if a >= need:
            return a
        now = time.monotonic()
        deadline = float("inf") if timeout is None else now + max(0.0, timeout)
        spin_until = now + min(max(0.0, spin), max(0.0, deadline - now))
        while True:  # spin (holding the GIL; keep spin short), yielding the CPU as the native side does
            a = check()
            if a >= need or self._pc[0] or self._interrupt:
                return a
            if time.monotonic() >= spin_until:
                break
            os.sched_yield()
        if spin_until >= deadline:
            return a  # all spin: the waiter word stays as it is (ring.h, trq_wait_armed)
        self._waiting += 1
        try:
            while True:
                word[0] = 1  # C1
                _fence()  # C2
                a = check()  # C3
                if a >= need or self._pc[0] or self._interrupt:
                    break
                now = time.monotonic()
                if now >= deadline:
                    break
                _futex_wait(addr, 1, min(SLICE_S, deadline - now))  # C4 (ctypes drops the GIL)
            word[0] = 0
            return a
        finally:
            self._waiting -= 1

    def arm(self) -> int:
        if self._closed:
            raise ValueError("ring queue is closed")
        word = self._sw if self._producer else self._dw
        word[0] = 1  # C1
        _fence()  # C2
        return self._free() if self._producer else self._available()  # C3

    def disarm(self) -> None:
        if self._closed:
            raise ValueError("ring queue is closed")
        (self._sw if self._producer else self._dw)[0] = 0

    def notify(self) -> int:
        if self._closed:
            raise ValueError("ring queue is closed")
        return self._doorbell(*((self._dw, self._dw_addr) if self._producer else (self._sw, self._sw_addr)))

    def wake_peer(self) -> None:
        if self._closed:
            raise ValueError("ring queue is closed")
        word, addr = (self._dw, self._dw_addr) if self._producer else (self._sw, self._sw_addr)
        word[0] = 0
        _fence()
        _futex_wake(addr)

    def close(self) -> None:
        if self._closed:
            return
        self._interrupt = True
        word, addr = (self._sw, self._sw_addr) if self._producer else (self._dw, self._dw_addr)
        word[0] = 0
        _fence()
        _futex_wake(addr)
        while self._waiting > 0:
            time.sleep(0.0001)
        self._release()

    def _release(self) -> None:
        self._closed = True
        for name in ("_tail", "_head", "_dw", "_sw", "_pc"):
            getattr(self, name).release()
        self._slots = self._base_view = self._buf = None  # type: ignore[assignment]

    @property
    def index(self) -> int:
        return self._mine

    @property
    def capacity(self) -> int:
        return self._cap

    @property
    def closed(self) -> bool:
        return self._closed


from transfer.ring import Ring  # noqa: E402  (below the oracle it is made of)


class OracleRing(Ring):
    """A `Ring` whose two queues are this module's PyQueue: the same layout, so one end of a
    mapping may be this and the other native (tests/unit/ring/test_ring.py's interop and parity)."""

    Queue = PyQueue


#: The ring class of each queue implementation, by the name a test's parameter gives.
RINGS: dict[str, type[Ring]] = {"native": Ring, "python": OracleRing}
