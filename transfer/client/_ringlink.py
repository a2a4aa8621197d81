"""The client's end of a session's shared-memory request ring (docs/ring.md).

Sans-I/O in the h11 sense as far as a ring allows: it turns requests into
descriptors and completions into finished `Pending`s; each client decides
when to push and how to wait. The blocking client sleeps on the completion
futex (`Ring.wait`); trio cannot wait on a futex, so the trio client opens
the session's completion doorbell (`cbell`, a FIFO the daemon's end of the
ring writes a byte to whenever it finds our completion inbox armed) and
waits for it to become readable (`arm`, `bell_fd`, `drain_bell`). Only plain
data requests travel here (copy, fill, checksum, fence); everything else,
and every error's message, stays on the control socket.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, Callable, Sequence, cast

import numpy as np

from .. import errors as E
from .. import protocol as P
from .._ring import FLAG_CHAIN, MAX_CHAIN, REQUEST_DTYPE, Op as RingOp, Ring
from ..memory._shm import check_sealed
from ._pending import Pending

__all__ = ["RingLink", "descriptors_of"]

#: A completion whose error message follows on the control socket (server._rings).
_DETAIL = 1
_RING_TYPES = frozenset((P.Copy, P.CopyV, P.Fill, P.Checksum, P.Fence, P.Wait))
_COPY, _FILL, _CHECKSUM, _FENCE = (int(o) for o in (RingOp.COPY, RingOp.FILL, RingOp.CHECKSUM, RingOp.FENCE))


#: A descriptor's bytes, fields in layout order (REQUEST_DTYPE): op, flags, stream, id, dst,
#: src, nbytes, arg0, arg1, arg2. Packing with struct costs a fraction of a NumPy record.
_PACK = struct.Struct("<HHIQQQQQQQ").pack
assert struct.calcsize("<HHIQQQQQQQ") == REQUEST_DTYPE.itemsize


def _chain(req: P.CopyV) -> np.ndarray:
    """A CopyV as its chain of COPY descriptors, built as one array (no Python per piece)."""
    k = len(req.dst)
    d = np.zeros(k, REQUEST_DTYPE)
    d["op"], d["id"], d["stream"] = RingOp.COPY, req.id, req.stream
    d["dst"], d["src"], d["nbytes"] = req.dst, req.src, req.nbytes
    d["flags"][:-1] = FLAG_CHAIN
    return d


#: Per ring-able request kind: its descriptors (one packed descriptor, or a CopyV's chain as
#: an array) and their count. One dict lookup per request, not a chain of type tests (a
#: batch of checksums packs at twice the speed). Raises struct.error for a field out of range.
_PACKERS: dict[type, Callable[[Any], tuple[bytes | np.ndarray, int]]] = {
    P.Copy: lambda r: (_PACK(_COPY, 0, r.stream, r.id, r.dst, r.src, r.nbytes, 0, 0, 0), 1),
    P.CopyV: lambda r: (_chain(r), len(r.dst)),
    P.Fill: lambda r: (_PACK(_FILL, 0, r.stream, r.id, r.dst, 0, r.nbytes, r.value, 0, 0), 1),
    P.Checksum: lambda r: (_PACK(_CHECKSUM, 0, r.stream, r.id, 0, r.src, r.nbytes, 0, 0, 0), 1),
    P.Fence: lambda r: (_PACK(_FENCE, 0, r.stream, r.id, 0, 0, 0, 0, 0, 0), 1),
}


def descriptors_of(req: P.Request) -> int:
    """How many descriptors (credits) a ring-able request takes."""
    return len(req.dst) if type(req) is P.CopyV else (0 if type(req) is P.Wait else 1)


class RingLink:
    """One session's ring, mapped here: descriptors out, completions in."""

    def __init__(self, info: dict[str, Any], shm_dir: Path, collect: Callable[[Any], int], *, completion_bell: bool = False) -> None:
        """`collect` turns the reply's token into the ring's memfd (the daemon's fd socket).
        `completion_bell`: also open the session's completion doorbell (for a waiter
        that polls an fd instead of sleeping on the futex: the trio client)."""
        bell = Path(info["bell"])
        if completion_bell and not info.get("cbell"):
            raise E.RingUnavailable("this daemon's rings have no completion doorbell (the trio client needs one)")
        if bell.parent != shm_dir:
            raise E.ProtocolError(f"the daemon named a ring file outside its shm dir: {bell}")
        fd = collect(info.get("token"))
        try:
            check_sealed(fd)  # a ring whose size could change could SIGBUS us
            self.ring = Ring.attach(fd)  # maps it; the kernel frees it with the last mapping
        finally:
            os.close(fd)
        self.bell_fd = self.cbell_fd = -1
        try:
            self.bell_fd = os.open(bell, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            if completion_bell:
                # A pipe's read end: the daemon holds the only write end, so when it closes
                # (the session ended, or the daemon died) the fd turns readable with EOF.
                self.cbell_fd = collect(info["cbell"])
                os.set_blocking(self.cbell_fd, False)
        except BaseException:
            self.close()
            raise
        self.ring.set_doorbell(self.bell_fd)
        #: Never more descriptors outstanding than completion slots: the daemon never waits on us.
        self.credits = min(self.ring.request_capacity, self.ring.completion_capacity)
        #: Outstanding requests: id -> (pending, answers with a value, descriptors it took).
        self.outstanding: dict[int, tuple[Pending, bool, int]] = {}
        #: Descriptors of the outstanding requests (a CopyV takes one per piece).
        self.in_flight = 0
        #: Failed on the ring; their reply with the full error is on its way over the socket.
        self.detail: dict[int, Pending] = {}
        #: The other order: answered on the socket before their ring completion was reaped
        #: (the daemon sends a pass's replies, then pushes its completions). Id -> descriptors
        #: they took, given back when the completion comes.
        self.early: dict[int, int] = {}
        self.pushed = 0
        #: The request queue itself: its native push takes our packed bytes as they are.
        self._outbox = self.ring.outbox

    @property
    def room(self) -> int:
        """Descriptors that may still be pushed before some complete."""
        return self.credits - self.in_flight

    def takes(self, req: P.Request) -> bool:
        """Whether `req` may take this ring (a chain longer than the credits takes the socket)."""
        if type(req) is P.CopyV:
            return 0 < len(req.dst) <= min(MAX_CHAIN, self.credits)
        return type(req) in _RING_TYPES

    def takes_all(self, reqs: Sequence[P.Request]) -> bool:
        """`takes` for every one of `reqs`, by kind: one set, not a call per request."""
        if len(reqs) == 1:
            return self.takes(reqs[0])
        kinds = {type(r) for r in reqs}
        if not kinds.issubset(_RING_TYPES):
            return False
        return P.CopyV not in kinds or all(self.takes(r) for r in reqs if type(r) is P.CopyV)

    def push(self, reqs: Sequence[P.Request], pending: dict[int, Pending], wait_credits: Callable[[int], None]) -> None:
        """Publish `reqs` (all `takes`), waiting for credits when the window is full; a
        request's descriptors (a CopyV's chain) go out in one push, never split."""
        try:
            # (A Wait marker has no descriptor: the ring has no round-trip accounting to do.)
            groups = [(r.id, t is P.Checksum, *_PACKERS[t](r)) for r in reqs if (t := type(r)) is not P.Wait]
        except (OverflowError, TypeError, ValueError, struct.error) as exc:  # a field out of range
            self._forget([(r.id, False, b"", 0) for r in reqs], pending)
            raise E.InvalidField(f"request field out of range: {exc}") from None
        need = groups[0][3] if len(groups) == 1 else sum(g[3] for g in groups)
        while groups:
            room = self.room
            if need <= room:  # (nearly always: everything at once)
                take, groups, used = groups, [], need
            else:  # the longest prefix the credits allow
                n = used = 0
                for g in groups:
                    if used + g[3] > room:
                        break
                    used += g[3]
                    n += 1
                if n == 0:
                    wait_credits(groups[0][3])
                    continue
                take, groups = groups[:n], groups[n:]
                need -= used
            # One buffer of whole descriptors, published with one release store (and one wake).
            data = take[0][2] if len(take) == 1 else b"".join([g if isinstance(g, bytes) else g.tobytes() for _, _, g, _ in take])
            if self._outbox.push_buffer(data, used) != used:  # cannot happen within credits unless the daemon broke the ring
                raise E.ConnectionLost("the daemon stopped taking ring descriptors")
            outstanding = self.outstanding
            for rid, valued, _, k in take:
                outstanding[rid] = (pending[rid], valued, k)
            self.in_flight += used
            self.pushed += used

    @staticmethod
    def _forget(groups: Sequence[tuple[int, bool, bytes | np.ndarray, int]], pending: dict[int, Pending]) -> None:
        """Requests that never left: nobody will answer them."""
        for rid, _, _, _ in groups:
            pending.pop(rid, None)

    def reap(self, pending: dict[int, Pending], unobserved: list[Pending]) -> int:
        """Finish the requests whose completions are in; return how many were."""
        ring = self.ring
        n = ring.available()
        if not n:
            return 0
        comps = [cast("tuple[int, ...]", ring.pop())] if n == 1 else ring.pop_many().tolist()  # n available
        out = self.outstanding
        for rid, status, result, flags, _ in comps:
            entry = out.pop(rid, None)
            if entry is None:
                self.in_flight -= self.early.pop(rid, 0)  # else not ours (a confused daemon): ignore
                continue
            p, valued, took = entry
            self.in_flight -= took
            if status == 0:
                pending.pop(rid, None)
                p._finish(result if valued else None, None)
            elif not flags & _DETAIL:
                pending.pop(rid, None)
                p._finish(None, E.error_for_code(status, "failed on the ring (no detail)"))
                unobserved.append(p)
            else:
                self.detail[rid] = p  # the reply with the full error is on the socket; it finishes p
        return len(comps)

    def answered_early(self, rid: int) -> None:
        """Request `rid`'s socket reply came before its ring completion: it is no longer
        outstanding (so routing counts it as answered), but its descriptors stay in flight
        until the completion frees their slot."""
        entry = self.outstanding.pop(rid, None)
        if entry is not None:
            self.early[rid] = entry[2]

    def drain_bell(self) -> bool:
        """Empty the completion doorbell; True if the daemon closed its end (EOF)."""
        try:
            while True:
                if not os.read(self.cbell_fd, 4096):
                    return True
        except BlockingIOError:
            return False

    def details_in(self) -> bool:
        """Whether every failure seen on the ring has had its reply (a fence reports them)."""
        for rid in [r for r, p in self.detail.items() if p._done]:
            del self.detail[rid]
        return not self.detail

    def close(self) -> None:
        if not self.ring.closed:
            self.ring.close()
        for name in ("bell_fd", "cbell_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)
