"""The client's end of a session's shared-memory request ring (docs/ring.md).

Sans-I/O in the h11 sense as far as a ring allows: it turns requests into
descriptors and completions into finished `Pending`s; each client decides
when to push and how to wait. The blocking client sleeps on the completion
futex (`Ring.wait`); trio cannot wait on a futex, so the trio client opens
the session's completion doorbell (`cbell`, a pipe the daemon's end of the
ring writes a byte to whenever it finds our completion inbox armed) and
waits for it to become readable (`arm`, `bell_fd`, `drain_bell`). Only plain
data requests travel here (copy, fill, checksum, fence, and their vector
forms); everything else, and every error's message, stays on the control socket.
"""

from __future__ import annotations

import fcntl
import functools
import os
import stat
import struct
from typing import Any, Callable, Sequence

import numpy as np

from .. import _results as R
from .. import errors as E
from .. import protocol as P
from .._ring import FLAG_AFTER, FLAG_CHAIN, FLAG_SUM, MAX_CHAIN, REQUEST_DTYPE, Op as RingOp, Ring, RingError
from ..memory._shm import check_sealed
from ._pending import Pending
from ._submission import PySubmission

__all__ = ["RingLink", "descriptors_of", "PLAIN"]

#: A completion whose error message follows on the control socket (server._rings).
_DETAIL = 1
_RING_TYPES = frozenset((P.Copy, P.CopyV, P.Fill, P.Checksum, P.ChecksumV, P.Fence, P.Wait, P.RunGraph))
#: Kinds every request of which takes the ring.
PLAIN = frozenset((P.Copy, P.Fill, P.Checksum, P.Fence, P.Wait))
#: Vector requests: one descriptor per range, so at most the ring's credits.
_VECTORS = frozenset((P.CopyV, P.ChecksumV))
#: Kinds only some requests of which take the ring (`takes` decides each).
_SOME = _VECTORS | {P.RunGraph}
_COPY, _FILL, _CHECKSUM, _FENCE, _RUN_GRAPH = (int(o) for o in (RingOp.COPY, RingOp.FILL, RingOp.CHECKSUM, RingOp.FENCE, RingOp.RUN_GRAPH))


#: A descriptor's bytes, fields in layout order (REQUEST_DTYPE): op, flags, stream, id, dst,
#: src, nbytes, arg0, arg1, arg2. Packing with struct costs a fraction of a NumPy record.
_PACK = struct.Struct("<HHIQQQQQQQ").pack
assert struct.calcsize("<HHIQQQQQQQ") == REQUEST_DTYPE.itemsize
#: A descriptor's flags (at byte 2) and one of its words (arg2 at byte 56), for `FLAG_AFTER`.
_FLAGS, _WORD = struct.Struct("<H"), struct.Struct("<Q")


def _py_pack_vector(op: int, chain: bool, rid: int, stream: int, dst: Any, src: Any, nbytes: np.ndarray, flags: int = 0) -> bytes:
    """A vector request's descriptors, one per range, made with NumPy (for the pure-Python
    twin of `push_requests`): dst and src are a VA for every range or a uint64 array,
    `chain` sets FLAG_CHAIN on all but the last, and `flags` goes on every one."""
    if not (0 <= op <= 0xFFFF and 0 <= stream <= 0xFFFFFFFF):
        raise OverflowError("stream or op out of range")
    if not isinstance(nbytes, np.ndarray):
        raise TypeError("nbytes: expected a 1-D uint64 array")
    for name, v in (("nbytes", nbytes), ("dst", dst), ("src", src)):
        if not isinstance(v, int) and (not isinstance(v, np.ndarray) or v.dtype != np.uint64 or v.ndim != 1):
            raise TypeError(f"{name}: expected a 1-D uint64 array")
        if isinstance(v, np.ndarray) and len(v) != len(nbytes):
            raise ValueError(f"{name}: {len(v)} ranges, expected {len(nbytes)}")
    d = np.zeros((len(nbytes), 8), np.uint64)
    head = op | flags << 16 | stream << 32
    d[:, 0] = head | FLAG_CHAIN << 16 if chain else head
    if len(d):
        d[-1, 0] = head
    d[:, 1], d[:, 2], d[:, 3], d[:, 4] = rid, dst, src, nbytes
    return d.tobytes()


#: Per ring-able request kind, for the pure-Python twin: its descriptors as bytes (one, or a
#: vector's, one per range). Raises struct.error or OverflowError for a field out of range.
_PACKERS: dict[type, Callable[[Any], bytes]] = {
    P.Copy: lambda r: _PACK(_COPY, 0, r.stream, r.id, r.dst, r.src, r.nbytes, 0, 0, 0),
    P.CopyV: lambda r: _py_pack_vector(_COPY, True, r.id, r.stream, r.dst, r.src, r.nbytes, FLAG_SUM if r.sums else 0),
    P.Fill: lambda r: _PACK(_FILL, 0, r.stream, r.id, r.dst, 0, r.nbytes, r.value, 0, 0),
    P.Checksum: lambda r: _PACK(_CHECKSUM, 0, r.stream, r.id, 0, r.src, r.nbytes, 0, 0, 0),
    # A checksum per range, each completed on its own under the one id (_Sums gathers them).
    P.ChecksumV: lambda r: _py_pack_vector(_CHECKSUM, False, r.id, r.stream, 0, r.src, r.nbytes),
    P.Fence: lambda r: _PACK(_FENCE, 0, r.stream, r.id, 0, 0, 0, 0, 0, 0),
    P.RunGraph: lambda r: _PACK(_RUN_GRAPH, 0, r.stream, r.id, r.outputs[0], r.inputs[0], 0, r.graph, 0, 0),
}

#: A ring-able request type's kind code for `push_requests` (native/_ring_native.c's K_*:
#: which fields go where in its descriptors). A Wait marker takes no descriptor.
_KINDS: dict[type, int] = {P.Wait: 0, P.Copy: 1, P.Fill: 2, P.Checksum: 3, P.Fence: 4, P.RunGraph: 5, P.CopyV: 6, P.ChecksumV: 7}


#: A run's results as pop_runs packs them: little-endian words.
_WORDS = np.dtype("<u8")


class _Sums:
    """A checksum_many's answers as they come off the ring: one completion per range, in
    order, all under its id; the first failure is kept. `chain`: a verified copy_many's
    (FLAG_SUM), whose failure is one completion that frees the whole chain."""

    __slots__ = ("values", "status", "flags", "chain")

    def __init__(self, chain: bool = False) -> None:
        self.values: list[int] = []
        self.status = 0
        self.flags = 0
        self.chain = chain


#: Descriptors a request of each plain kind takes (a Wait marker: none, it only counts).
_PLAIN_DESCRIPTORS = {t: 0 if t is P.Wait else 1 for t in PLAIN}


def descriptors_of(req: P.Request) -> int:
    """How many descriptors (credits) a ring-able request takes."""
    if type(req) in _VECTORS:
        return len(req.nbytes)  # type: ignore[attr-defined]
    return _PLAIN_DESCRIPTORS.get(type(req), 1)


def _py_push_requests(outbox: Any, reqs: list[P.Request], start: int, kinds: dict[type, int], room: int, after: int,
                      pending: dict[int, Pending], outstanding: dict[int, Any], sums: Callable[..., Any]) -> tuple[int, int, int]:
    """`Queue.push_requests` for the pure-Python queue (no extension built): from reqs[start],
    the whole requests whose descriptors fit in `room`, packed with struct and NumPy,
    published in one push, each noted as outstanding; (requests, descriptors, published)."""
    end, used, datas = start, 0, []
    while end < len(reqs):
        r = reqs[end]
        if type(r) not in kinds:
            raise TypeError(f"a {type(r).__name__} cannot take the ring")
        k = descriptors_of(r)
        if used + k > room:
            break
        if k:
            datas.append(_PACKERS[type(r)](r))
        used += k
        end += 1
    data = b"".join(datas)
    if after and used:  # the first descriptor carries the fence
        first = bytearray(data)
        flags, = _FLAGS.unpack_from(first, 2)
        _FLAGS.pack_into(first, 2, flags | FLAG_AFTER)
        _WORD.pack_into(first, 56, after)
        data = bytes(first)
    published = outbox.push_buffer(data, used) if used else 0
    for r in reqs[start:end]:
        t = type(r)
        if t is not P.Wait:
            answers = sums() if t is P.ChecksumV else sums(True) if t is P.CopyV and r.sums else t is P.Checksum  # type: ignore[attr-defined]
            outstanding[r.id] = (pending[r.id], answers, descriptors_of(r))
    return end - start, used, published


def _py_pop_finished(inbox: Any, outstanding: dict[int, Any], pending: dict[int, Pending],
                     array: Callable[[int], np.ndarray] | None = None) -> tuple[int, int, list[Any]]:
    """`Queue.pop_finished` for the pure-Python queue: pop every completion; until the first
    run that is not one of these, finish each lone success of an outstanding request whose
    answer is a bool (its value, or None), and (with `array`) each run of successes that is
    the whole answer of one that gathers a word per descriptor (a `_Sums` with no values
    yet), as array(n) filled with its n words; hand back (completions, descriptors freed,
    the other runs in order)."""
    total = freed = 0
    rest: list[Any] = []
    for run in inbox.pop_runs(0, 2, 1):
        rid, status, result, _, _, count, words = run
        total += count
        entry = outstanding.get(rid) if status == 0 and not rest else None
        value: Any = None
        if entry is not None:
            p, answers, took = entry
            if type(answers) is bool:
                value = result if answers else None
                entry = entry if count == 1 else None
            elif array is not None and took == count and getattr(answers, "values", None) == []:
                value = array(count)
                value[:] = np.frombuffer(words, _WORDS) if words is not None else result
            else:
                entry = None
        if entry is not None:
            del outstanding[rid]
            pending.pop(rid, None)
            p._finish(value, None)
            freed += took
        else:
            rest.append(run)
    return total, freed, rest


def _new_words(n: int, empty: Callable[..., np.ndarray] = np.empty, u64: np.dtype[Any] = np.dtype(np.uint64)) -> np.ndarray:
    """Room for a gathered answer (a checksum_many's, a verified copy_many's): n uint64
    words, which `pop_finished` fills. (np.empty: half the cost of np.frombuffer here.)"""
    return empty(n, u64)


def _pipe_end(fd: int, mode: int, what: str) -> int:
    """`fd` if it is a pipe's end open for `mode` (made non-blocking), else closed and refused:
    whatever the daemon hands over is checked before it is used."""
    try:
        ok = stat.S_ISFIFO(os.fstat(fd).st_mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == mode
        if ok:
            os.set_blocking(fd, False)
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    raise E.ProtocolError(f"the daemon sent a {what} that is not a pipe's {'write' if mode == os.O_WRONLY else 'read'} end")


class RingLink:
    """One session's ring, mapped here: descriptors out, completions in."""

    def __init__(self, ring: Ring, info: R.RingOpened, sub: PySubmission, bell_fd: int = -1, cbell_fd: int = -1) -> None:
        """A client's end of a ring mapped here (`open`). `info`: the daemon's OpenRing reply
        (`graphs`, `after`); `sub`: the session's submission state (`_submission`), which
        takes the ring's credits and counts; `bell_fd`, `cbell_fd`: the request doorbell
        and the completion doorbell, ours to close (-1: none)."""
        self.sub = sub
        self.ring = ring
        self.bell_fd, self.cbell_fd = bell_fd, cbell_fd
        if bell_fd >= 0:
            ring.set_doorbell(bell_fd)
        #: Never more descriptors outstanding than completion slots: the daemon never waits on us.
        credits = min(self.ring.request_capacity, self.ring.completion_capacity)
        #: The longest CopyV chain it carries (the daemon joins at most MAX_CHAIN).
        self.max_chain = min(MAX_CHAIN, credits)
        #: The most ranges a vector request may have here (one descriptor each; a CopyV's
        #: chain is also bounded by what the daemon joins).
        self.longest: dict[type, int] = {P.CopyV: self.max_chain, P.ChecksumV: credits}
        #: Whether the daemon runs graphs off the ring (RUN_GRAPH); else they take the socket.
        self.graphs = info.graphs
        #: Outstanding requests: id -> (pending, answers with a value (a checksum_many: its
        #: _Sums), descriptors it took).
        self.outstanding: dict[int, tuple[Pending, bool | _Sums, int]] = {}
        #: The other order: answered on the socket before their ring completion was reaped
        #: (the daemon sends a pass's replies, then pushes its completions). Id -> [descriptors
        #: each completion gives back, descriptors left], given back as the completions come.
        self.early: dict[int, list[int]] = {}
        #: The queues themselves: the native push takes our packed bytes as they are, and
        #: pop_runs hands over every completion in as tuples, a run of one id as one (no NumPy for a few).
        self._outbox, self._inbox = self.ring.outbox, self.ring.inbox
        #: The credits, the descriptors in flight (a CopyV takes one per piece), the last
        #: fence and the count pushed live in the session's submission state, which packs,
        #: publishes and notes a call's requests with the queue's push_requests (one native
        #: call; the pure-Python queue: the same in Python). Whether the daemon orders
        #: descriptors after socket frames (`FLAG_AFTER`; else the ring is taken only while
        #: nothing sent on the socket is pending) goes there too.
        sub.attach(self._outbox, getattr(self._outbox, "push_requests", functools.partial(_py_push_requests, self._outbox)),
                   self.outstanding, credits, self.max_chain, info.after, _KINDS, _Sums)
        #: Pop the completions and finish the lone successes in one native call.
        self._pop_finished: Callable[..., tuple[int, int, list[Any]]] = getattr(
            self._inbox, "pop_finished", functools.partial(_py_pop_finished, self._inbox))
        #: Completions waiting in the inbox (the queue's own call: a look before a reap
        #: costs no Python frame when none are in yet).
        self.ready: Callable[[], int] = self._inbox.available

    @classmethod
    def open(cls, info: R.RingOpened, collect: Callable[[bytes], int], sub: PySubmission, *,
             completion_bell: bool = False) -> RingLink:
        """Map the ring an OpenRing reply names. `collect` turns the reply's token into the
        ring's memfd (the daemon's fd socket). `completion_bell`: also open the session's
        completion doorbell (for a waiter that polls an fd instead of sleeping on the
        futex: the trio client)."""
        if completion_bell and info.cbell is None:
            raise E.RingUnavailable("this daemon's rings have no completion doorbell (the trio client needs one)")
        fd = collect(info.token)
        try:
            check_sealed(fd)  # a ring whose size could change could SIGBUS us
            ring = Ring.attach(fd)  # maps it; the kernel frees it with the last mapping
        except (RingError, ValueError) as exc:  # (RingCorrupted is a RingError)
            raise E.ProtocolError(f"the daemon sent a ring that does not hold together: {exc}") from None
        finally:
            os.close(fd)
        if (ring.request_capacity, ring.completion_capacity) != (info.capacity, info.completion_capacity):
            ring.close()
            raise E.ProtocolError(f"the daemon announced a ring of {info.capacity}/{info.completion_capacity} slots "
                                  f"and sent one of {ring.request_capacity}/{ring.completion_capacity}")
        bell_fd = cbell_fd = -1
        try:
            bell_fd = _pipe_end(collect(info.bell), os.O_WRONLY, "doorbell")  # a write end of the daemon's doorbell
            if completion_bell:
                # A pipe's read end: the daemon holds the only write end, so when it closes
                # (the session ended, or the daemon died) the fd turns readable with EOF.
                assert info.cbell is not None
                cbell_fd = _pipe_end(collect(info.cbell), os.O_RDONLY, "completion doorbell")
        except BaseException:
            for f in (bell_fd, cbell_fd):
                if f >= 0:
                    os.close(f)
            ring.close()
            raise
        return cls(ring, info, sub, bell_fd, cbell_fd)

    @property
    def room(self) -> int:
        """Descriptors that may still be pushed before some complete."""
        return self.sub.credits - self.sub.in_flight

    # (Counts kept in the submission state, read here by tests and the bench.)
    in_flight = property(lambda self: self.sub.in_flight, lambda self, v: setattr(self.sub, "in_flight", v))
    pushed = property(lambda self: self.sub.pushed)

    def takes(self, req: P.Request) -> bool:
        """Whether `req` may take this ring (a chain longer than the credits takes the socket)."""
        t = type(req)
        if t in PLAIN:  # (most requests: one set lookup)
            return True
        longest = self.longest.get(t)
        if longest is not None:  # a vector: one descriptor per range
            return 0 < len(req.nbytes) <= longest  # type: ignore[attr-defined]
        if t is P.RunGraph:  # one descriptor: one input, one output, and no profile to carry back
            return self.graphs and len(req.inputs) == 1 and len(req.outputs) == 1 and not req.profile  # type: ignore[attr-defined]
        return False

    def fitting(self, reqs: Sequence[P.Request]) -> int:
        """How many of `reqs`, from the first, take this ring and fit in its room together
        (an event-loop client's held requests: those it may push now, in order)."""
        n, used, room = 0, 0, self.sub.credits - self.sub.in_flight
        for r in reqs:
            k = _PLAIN_DESCRIPTORS.get(type(r))  # (a plain request, most of them: one lookup, no call)
            if k is None:
                if not self.takes(r):
                    break
                k = descriptors_of(r)
            if used + k > room:
                break
            used += k
            n += 1
        return n

    def takes_all(self, reqs: Sequence[P.Request]) -> bool:
        """`takes` for every one of `reqs`: a call each for a few (a producer's group), by
        kind for many (one set, then a call per vector: a batch of 64 checksums at a third
        of the cost of a call each)."""
        if len(reqs) <= 4:
            for r in reqs:
                if type(r) not in PLAIN and not self.takes(r):
                    return False
            return True
        kinds = {type(r) for r in reqs}
        if not kinds.issubset(_RING_TYPES):
            return False
        return kinds.isdisjoint(_SOME) or all(self.takes(r) for r in reqs if type(r) in _SOME)

    def push(self, reqs: Sequence[P.Request], pending: dict[int, Pending], wait_credits: Callable[[int], None], after: int = 0,
             failed: list[Pending] | None = None) -> None:
        """Publish `reqs` (all `takes`), waiting for credits when the window is full; a
        request's descriptors (a CopyV's chain) go out in one push, never split. `after`:
        the daemon takes them only once it has read that many of our socket frames.

        A field that cannot be packed stops the call there: the requests not yet pushed
        leave `pending`, finished with InvalidField, which is raised, or (with `failed`, the
        event-loop clients' unobserved list, since their caller has returned already)
        appended there for fence() to report."""
        reqs = reqs if type(reqs) is list else list(reqs)
        push = self.sub.push  # (the fence goes on the first descriptor pushed, then not again)
        start = 0
        while True:
            try:
                taken, used, published = push(reqs, start, after)
                if taken == len(reqs) and published == used:
                    return  # (all of them, at once: most pushes)
            except (OverflowError, TypeError, ValueError, struct.error) as exc:  # a field out of range
                err = E.InvalidField(f"request field out of range: {exc}")
                for r in reqs[start:]:  # nothing of these left: nobody will answer them
                    p = pending.pop(r.id, None)
                    if p is not None and failed is not None:
                        p._finish(None, err)
                        failed.append(p)
                if failed is None:
                    raise err from None
                return
            if published != used:  # cannot happen within credits unless the daemon broke the ring
                raise E.ConnectionLost("the daemon stopped taking ring descriptors")
            start += taken
            if start == len(reqs):
                return
            if not taken:
                wait_credits(descriptors_of(reqs[start]))

    def reap(self, pending: dict[int, Pending], unobserved: list[Pending]) -> int:
        """Finish the requests whose completions are in; return how many completions there were."""
        # Lone successes, and whole answers in one run, are finished by pop_finished itself.
        # Every other run comes back: id, status, result, flags, aux, then how many completions
        # in a row share that id (all successes, or a single one) and their results as packed words.
        total, freed, runs = self._pop_finished(self.outstanding, pending, _new_words)
        sub = self.sub
        sub.in_flight -= freed
        out = self.outstanding
        for rid, status, result, flags, _, count, words in runs:
            entry = out.get(rid)
            if entry is None:
                for _ in range(count):
                    self._late(rid)  # else not ours (a confused daemon): ignore
                continue
            p, valued, took = entry
            if type(valued) is _Sums and status and valued.chain:
                # A verified copy_many failed: its one completion frees the whole chain.
                used = 1
                sub.in_flight -= took - len(valued.values)
            elif type(valued) is _Sums:
                # A checksum_many (or a verified copy_many): one completion per range, in order,
                # under its id (a run of them comes as one), never more than the ranges it still owes.
                values = valued.values
                used = min(count, took - len(values))
                sub.in_flight -= used
                # (A whole answer in one run is finished by pop_finished, unless a run before it
                # came here: then it is gathered here like any part.)
                if words is None:
                    values.append(result)
                else:
                    values.extend(struct.unpack_from(f"<{used}Q", words))
                if status and not valued.status:  # the first failure is kept (a run has none)
                    valued.status, valued.flags = status, flags
                if len(values) < took:
                    continue
                status, flags, result = valued.status, valued.flags, np.fromiter(values, np.uint64, took)
            else:
                used = 1
                sub.in_flight -= took
            del out[rid]
            if status == 0:
                pending.pop(rid, None)
                p._finish(result if valued else None, None)
            elif not flags & _DETAIL:
                pending.pop(rid, None)
                p._finish(None, E.error_for_code(status, "failed on the ring (no detail)"))
                unobserved.append(p)
            # (else the reply with the full error is on the socket: p stays pending until it finishes p)
            for _ in range(count - used):
                self._late(rid)  # completions past what the request owed: late ones
        return total

    def _late(self, rid: int) -> None:
        """A completion of a request already answered on the socket: give back its credits."""
        left = self.early.get(rid)
        if left is not None:
            self.sub.in_flight -= left[0]
            left[1] -= left[0]
            if left[1] <= 0:
                del self.early[rid]

    def answered_early(self, rid: int) -> None:
        """Request `rid`'s socket reply came before its ring completion: it is no longer
        outstanding (so routing counts it as answered), but its descriptors stay in flight
        until the completions free their slots."""
        entry = self.outstanding.pop(rid, None)
        if entry is not None:
            _, valued, took = entry
            if type(valued) is _Sums and valued.chain:  # failed: its one completion frees the rest
                left = took - len(valued.values)
                self.early[rid] = [left, left]
            elif type(valued) is _Sums:  # its ranges still to complete, one credit each
                self.early[rid] = [1, took - len(valued.values)]
            else:
                self.early[rid] = [took, took]

    def drain_bell(self) -> bool:
        """Empty the completion doorbell; True if the daemon closed its end (EOF)."""
        try:
            while True:
                if not os.read(self.cbell_fd, 4096):
                    return True
        except BlockingIOError:
            return False

    def close(self) -> None:
        self.sub.detach()
        if not self.ring.closed:
            self.ring.close()
        for name in ("bell_fd", "cbell_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)
