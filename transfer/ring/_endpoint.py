"""One endpoint of a session's ring: the mapping, its header, and its two queues
(transfer._native.Queue).

    srv = Ring.create(None, capacity=1024)        # the daemon: a fresh memfd (ring.fd)
    cli = Ring.attach(fd)                         # the client: the fd it was handed
    cli.push((Op.COPY, 7, dst_va, src_va, 4096))  # a request
    srv.wait(timeout=1.0); reqs = srv.pop_many()  # a structured array of REQUEST_DTYPE
    srv.push_many(completions)                    # completions
    cli.wait(timeout=1.0); done = cli.pop_many()

Each endpoint (``role="server"`` or ``role="client"``) has an *outbox* it produces into
and an *inbox* it consumes, so the API is symmetric. The layout is `_layout`'s.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import time
from pathlib import Path
from typing import Any

import numpy as np

from .._native import Queue as NativeQueue
from .._native import _set_corrupt_error
from ._layout import (
    COMPLETION_DTYPE, HEADER, HEADER_SIZE, LAYOUT_VERSION, MAGIC, MAX_CAPACITY, OFF_CLIENT_CLOSED, OFF_CLIENT_PID,
    OFF_CQ_DATA_W, OFF_CQ_HEAD, OFF_CQ_SPACE_W, OFF_CQ_TAIL, OFF_SERVER_CLOSED, OFF_SERVER_PID, OFF_SQ_DATA_W,
    OFF_SQ_HEAD, OFF_SQ_SPACE_W, OFF_SQ_TAIL, REQUEST_DTYPE, check_capacity, fields, geometry,
)

__all__ = ["Ring", "RingError", "RingCorrupted"]


class RingError(RuntimeError):
    """A ring could not be created, attached or used."""


class RingCorrupted(RingError):
    """The peer wrote impossible indices or header fields: stop trusting this ring."""


_set_corrupt_error(RingCorrupted)


class Ring:
    """One endpoint of a session's request/completion ring pair.

    ``role="server"`` consumes requests and produces completions;
    ``role="client"`` the reverse. ``push``/``push_many``/``notify`` act on
    the outbox, ``pop``/``pop_many``/``wait`` on the inbox. One thread per
    endpoint (single producer, single consumer); ``close()`` may come from
    another thread and interrupts a ``wait``.
    """

    REQUEST_DTYPE = REQUEST_DTYPE
    COMPLETION_DTYPE = COMPLETION_DTYPE

    #: The queue type both ends are made of (a test oracle's stands in for it there).
    Queue: type[NativeQueue] = NativeQueue

    def __init__(self, mm: mmap.mmap, fd: int, path: Path | None, role: str, sq_cap: int, cq_cap: int) -> None:
        if role not in ("server", "client"):
            raise ValueError("role must be 'server' or 'client'")
        self._mm = mm
        self._fd = fd
        self.path = path
        self.role = role
        self.request_capacity = sq_cap
        self.completion_capacity = cq_cap
        sq_off, cq_off, total = geometry(sq_cap, cq_cap)
        self.nbytes = total
        Q = self.Queue
        server = role == "server"
        peer_closed = OFF_CLIENT_CLOSED if server else OFF_SERVER_CLOSED
        sq = Q(mm, not server, sq_cap, REQUEST_DTYPE.itemsize, sq_off, OFF_SQ_TAIL, OFF_SQ_HEAD,
               OFF_SQ_DATA_W, OFF_SQ_SPACE_W, peer_closed, fields(REQUEST_DTYPE))
        try:
            cq = Q(mm, server, cq_cap, COMPLETION_DTYPE.itemsize, cq_off, OFF_CQ_TAIL, OFF_CQ_HEAD,
                   OFF_CQ_DATA_W, OFF_CQ_SPACE_W, peer_closed, fields(COMPLETION_DTYPE))
        except BaseException:
            sq.close()
            raise
        self.outbox: NativeQueue
        self.inbox: NativeQueue
        self.outbox, self.inbox = (cq, sq) if server else (sq, cq)
        self.out_dtype = COMPLETION_DTYPE if server else REQUEST_DTYPE
        self.in_dtype = REQUEST_DTYPE if server else COMPLETION_DTYPE
        self._words = memoryview(mm)[:HEADER_SIZE].cast("I")  # header u32 view (closed flags, pids)
        self._my_closed = (OFF_SERVER_CLOSED if server else OFF_CLIENT_CLOSED) // 4
        self._peer_closed = peer_closed // 4
        self._closed = False
        self.spin = 50e-6

    # -- construction
    @staticmethod
    def nbytes_for(capacity: int, completion_capacity: int | None = None) -> int:
        """The size of a ring's mapping (what ``create`` sizes a given fd to)."""
        sq_cap = check_capacity(capacity, "capacity")
        return geometry(sq_cap, check_capacity(completion_capacity or capacity, "completion_capacity"))[2]

    @classmethod
    def create(cls, target: str | os.PathLike[str] | int | None = None, capacity: int = 1024,
               completion_capacity: int | None = None, *, role: str = "server") -> "Ring":
        """Create a new ring. ``target``: a path (created O_EXCL, mode 0600), an
        fd (e.g. a memfd; resized here), or None for a fresh memfd (``ring.fd``)."""
        sq_cap = check_capacity(capacity, "capacity")
        cq_cap = check_capacity(completion_capacity or capacity, "completion_capacity")
        sq_off, cq_off, total = geometry(sq_cap, cq_cap)
        path: Path | None = None
        own_fd = True
        if target is None:
            fd = os.memfd_create("transfer-ring", os.MFD_CLOEXEC)
        elif isinstance(target, int):
            fd, own_fd = target, False
        else:
            path = Path(target)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, total)
            try:
                os.posix_fallocate(fd, 0, total)  # ENOSPC now, not SIGBUS on first touch
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise RingError(f"no shared memory for a {total}-byte ring: {exc}") from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if own_fd:
                os.close(fd)
            if path is not None:
                _unlink(path)
            raise
        mv = memoryview(mm)
        mv[:HEADER_SIZE] = bytes(HEADER_SIZE)
        pid = os.getpid()
        # geometry first, magic last: an attacher that sees the magic sees a whole header
        HEADER.pack_into(mm, 0, 0, LAYOUT_VERSION, HEADER_SIZE, sq_cap, cq_cap, REQUEST_DTYPE.itemsize,
                     COMPLETION_DTYPE.itemsize, sq_off, cq_off, total,
                     pid if role == "server" else 0, pid if role == "client" else 0)
        mv[0:8].cast("Q")[0] = MAGIC
        mv.release()
        if not own_fd:
            fd = -1
        try:
            return cls(mm, fd, path, role, sq_cap, cq_cap)
        except BaseException:
            mm.close()
            if fd >= 0:
                os.close(fd)
            raise

    @classmethod
    def attach(cls, target: str | os.PathLike[str] | int, *, role: str = "client") -> "Ring":
        """Map an existing ring (a path, or an fd received with socket.recv_fds),
        validating its header against the layout this code expects."""
        path: Path | None = None
        if isinstance(target, int):
            fd = os.dup(target)
        else:
            path = Path(target)
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RingError(f"{target!r} is not a regular file")
            if path is not None and (st.st_uid != os.geteuid() or st.st_mode & 0o077):
                raise RingError(f"{path} is not a private file of this user")
            if st.st_size < HEADER_SIZE:
                raise RingCorrupted(f"{target!r} is too small for a ring ({st.st_size} bytes)")
            hdr = os.pread(fd, HEADER.size, 0)
            (magic, ver, hsize, sq_cap, cq_cap, sq_slot, cq_slot, sq_off, cq_off, total, _, _) = HEADER.unpack(hdr)
            if magic != MAGIC:
                raise RingCorrupted(f"{target!r} is not a transfer ring (bad magic)")
            if ver != LAYOUT_VERSION or hsize != HEADER_SIZE:
                raise RingCorrupted(f"ring layout version {ver} (header {hsize}), expected {LAYOUT_VERSION}")
            for n in (sq_cap, cq_cap):
                if n < 2 or n > MAX_CAPACITY or n & (n - 1):
                    raise RingCorrupted(f"ring capacity {n} is not a power of two in range")
            if (sq_slot, cq_slot) != (REQUEST_DTYPE.itemsize, COMPLETION_DTYPE.itemsize):
                raise RingCorrupted(f"ring slot sizes {sq_slot}/{cq_slot} do not match this code")
            if (sq_off, cq_off, total) != geometry(sq_cap, cq_cap) or st.st_size != total:
                raise RingCorrupted(f"ring geometry does not match its size ({st.st_size} bytes)")
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        try:
            ring = cls(mm, -1, path, role, sq_cap, cq_cap)
        except BaseException:
            mm.close()
            raise
        ring._words[(OFF_SERVER_PID if role == "server" else OFF_CLIENT_PID) // 4] = os.getpid()
        return ring

    # -- doorbell for a peer that sleeps in an event loop
    def set_doorbell(self, fd: int) -> None:
        """Also ring ``fd`` (a pipe the peer polls; we write one byte) whenever
        the peer armed its inbox (``arm()``) instead of sleeping on the futex.
        The fd stays the caller's; -1 turns it off."""
        self.outbox.bell = fd  # the queue writes it itself, in the same call as the futex wake

    def arm(self) -> int:
        """Consumer about to sleep elsewhere (the bell): set the waiter word so the
        peer's next publish rings, fence, and return what is available now. Sleep
        only if that is 0; ``disarm()`` when you find work instead."""
        return self.inbox.arm()

    def disarm(self) -> None:
        self.inbox.disarm()

    # -- outbox (producer side)
    def push(self, desc: tuple[int, ...], *, wake: bool = True, timeout: float = 0.0) -> bool:
        """Publish one descriptor tuple (fields in dtype order; missing trailing
        fields are 0). False if the outbox stayed full for ``timeout`` seconds."""
        return bool(self.outbox.push(desc, wake) or (
            timeout > 0 and self.outbox.wait(1, timeout, self.spin) >= 1 and self.outbox.push(desc, wake)
        ))

    def push_many(self, descs: np.ndarray | bytes, *, wake: bool = True, timeout: float = 0.0) -> int:
        """Publish as many of ``descs`` (a structured array of ``out_dtype``, or its bytes) as
        fit, with one release store (per wrap-free chunk) and at most one wake.
        With ``timeout`` > 0, keep waiting for space until all are in or the
        time is up. Returns how many were published (a prefix of ``descs``)."""
        ss = self.out_dtype.itemsize
        if isinstance(descs, (bytes, bytearray)):  # whole slots, already in the layout
            if len(descs) % ss:
                raise ValueError(f"push_many: {len(descs)} bytes are not whole {ss}-byte slots")
            raw: Any = descs
            total = len(descs) // ss
        elif isinstance(descs, np.ndarray) and descs.dtype == self.out_dtype:
            descs = np.ascontiguousarray(descs).reshape(-1)
            raw = descs.view(np.uint8)
            total = len(descs)
        else:
            raise TypeError(f"push_many takes a structured array of dtype {self.out_dtype}, or its bytes")
        # Each push wakes the peer before any wait for space: it drains only once rung.
        done = self.outbox.push_buffer(raw, total, wake)
        if done < total and timeout > 0:
            deadline = time.monotonic() + timeout
            while done < total:
                left = deadline - time.monotonic()
                if left <= 0 or self.outbox.wait(1, left, self.spin) < 1:
                    break
                done += self.outbox.push_buffer(memoryview(raw)[done * ss :], total - done, wake)
        return done

    def free(self) -> int:
        """Slots the outbox can take now."""
        return self.outbox.free()

    def wait_space(self, need: int = 1, timeout: float | None = None, spin: float | None = None) -> int:
        """Wait until ``need`` outbox slots are free (or the peer closes / timeout)."""
        return self.outbox.wait(need, timeout, self.spin if spin is None else spin)

    def notify(self) -> bool:
        """Ring the peer's doorbell for what was pushed with ``wake=False``.

        The bell fd is written only when the sleeper armed the word with 1 (an event loop
        that sleeps on it); a native data-plane worker arms with 2 and needs the futex only."""
        return bool(self.outbox.notify())  # (the queue writes the bell itself)

    # -- inbox (consumer side)
    def pop(self, *, wake: bool = True) -> tuple[int, ...] | None:
        """One descriptor as a tuple, or None if the inbox is empty."""
        return self.inbox.pop(wake)

    def pop_many(self, max: int | None = None, *, wake: bool = True) -> np.ndarray:  # noqa: A002
        """Up to ``max`` (default: all available) descriptors, copied out of
        shared memory into a private structured array (so validating it cannot
        race with the peer), released with one store of the head index."""
        avail = self.inbox.available()
        n = avail if max is None else min(int(max), avail)
        out = np.empty(n, dtype=self.in_dtype)
        if n == 0:
            return out
        got = self.inbox.pop_into(out.view(np.uint8), n, wake)
        return out[:got]

    def available(self) -> int:
        """Descriptors waiting in the inbox."""
        return self.inbox.available()

    def wait(self, timeout: float | None = None, spin: float | None = None, need: int = 1) -> int:
        """Spin for ``spin`` seconds (default ``self.spin``, 50 µs), then sleep on
        the futex until the inbox holds ``need`` descriptors, the peer closes,
        ``close()`` is called from another thread, or ``timeout`` passes.
        Returns the number available (less than ``need`` on timeout/close)."""
        return self.inbox.wait(need, timeout, self.spin if spin is None else spin)

    # -- lifetime
    @property
    def peer_closed(self) -> bool:
        return bool(self._words[self._peer_closed]) if not self._closed else True

    @property
    def peer_pid(self) -> int:
        return int(self._words[(OFF_CLIENT_PID if self.role == "server" else OFF_SERVER_PID) // 4])

    def peer_alive(self) -> bool:
        """Peer has not closed, and its recorded pid exists (a hint: pids are
        reused and are meaningless across pid namespaces; the daemon should
        prefer its pidfd)."""
        if self.peer_closed:
            return False
        pid = self.peer_pid
        if pid <= 0:
            return True  # not attached yet
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    @property
    def fd(self) -> int:
        """The memfd a ``create(None, ...)`` made (to pass with socket.send_fds); -1 otherwise."""
        return self._fd

    @property
    def closed(self) -> bool:
        return self._closed

    def unlink(self) -> None:
        if self.path is not None:
            _unlink(self.path)

    @property
    def close_reason(self) -> int:
        """What the peer's `close` wrote (0 while it is open, or once this end is closed):
        the daemon writes the error code of why it closed. Unvalidated: the peer wrote it."""
        return int(self._words[self._peer_closed]) if not self._closed else 0

    def close(self, reason: int = 1) -> None:
        """Mark this endpoint closed, wake the peer's sleepers, interrupt a local
        wait(), unmap. Never blocks on the peer (it may be dead). `reason` (non-zero) is
        what the peer reads in `close_reason`."""
        if self._closed:
            return
        self._closed = True
        # A plain store, then the queues' wakes: each is a seq_cst store and a futex wake in C,
        # which orders this store before them for a peer that wakes and looks.
        self._words[self._my_closed] = reason if 0 < reason < 1 << 32 else 1
        for q in (self.outbox, self.inbox):
            try:
                q.wake_peer()
            except ValueError:
                pass
        self.outbox.close()
        self.inbox.close()
        self._words.release()
        try:
            self._mm.close()
        except BufferError:  # pragma: no cover - a caller kept a view; unmapped when it dies
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"<Ring {self.role} requests={self.request_capacity} "
                f"completions={self.completion_capacity} {'closed' if self._closed else 'open'}>")


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


