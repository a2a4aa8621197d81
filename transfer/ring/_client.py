"""The client's end of a session's ring (docs/ring.md).

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
import os
import socket
import stat
import struct
from typing import Any, Callable, Sequence

import numpy as np

from .._native import Submission
from .. import _results as R
from .. import errors as E
from .. import protocol as P
from .._pending import Pending
from ..memory._shm import check_sealed
from ._channel import Channel
from ._endpoint import Ring, RingError
from ._layout import COMPLETION_DETAIL, KIND_NAMES, MAX_CHAIN

__all__ = ["RingLink", "descriptors_of", "PLAIN", "KINDS", "Sums"]

_RING_TYPES = frozenset((P.Copy, P.CopyV, P.Fill, P.Checksum, P.ChecksumV, P.Fence, P.Wait, P.RunGraph))
#: Kinds every request of which takes the ring.
PLAIN = frozenset((P.Copy, P.Fill, P.Checksum, P.Fence, P.Wait))
#: Vector requests: one descriptor per range, so at most the ring's credits.
_VECTORS = frozenset((P.CopyV, P.ChecksumV))
#: Kinds only some requests of which take the ring (`takes` decides each).
_SOME = _VECTORS | {P.RunGraph}


#: A ring-able request type's kind code for `push_requests` (`_layout.KIND_NAMES`, checked
#: against native/layout.h's K_*: which fields go where in its descriptors).
KINDS: dict[type, int] = {t: KIND_NAMES.index(name) for t, name in (
    (P.Wait, "WAIT"), (P.Copy, "COPY"), (P.Fill, "FILL"), (P.Checksum, "CHECKSUM"), (P.Fence, "FENCE"),
    (P.RunGraph, "RUN_GRAPH"), (P.CopyV, "COPYV"), (P.ChecksumV, "CHECKSUMV"))}


#: A run's results as pop_runs packs them: little-endian words.
_WORDS = np.dtype("<u8")


class Sums:
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

    def __init__(self, ring: Ring, info: R.RingOpened | R.ChannelOpened, sub: Submission, bell_fd: int = -1, cbell_fd: int = -1) -> None:
        """A client's end of a ring mapped here (`open`). `info`: the daemon's OpenRing reply
        (`graphs`, `after`); `sub`: the session's submission state (`_submission`), which
        takes the ring's credits and counts; `bell_fd`, `cbell_fd`: the request doorbell
        and the completion doorbell, ours to close (-1: none)."""
        self.sub = sub
        self.ring = ring
        self.bell_fd, self.cbell_fd = bell_fd, cbell_fd
        #: A remote session's data channel (`remote`): the ring's far end, here.
        self.channel: Channel | None = None
        #: The completion doorbell's write end that channel's bridge rings (-1: none).
        self._cbell_wr = -1
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
        #: Sums), descriptors it took).
        self.outstanding: dict[int, tuple[Pending, bool | Sums, int]] = {}
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
        #: call). Whether the daemon orders
        #: descriptors after socket frames (`FLAG_AFTER`; else the ring is taken only while
        #: nothing sent on the socket is pending) goes there too.
        sub.attach(self._outbox, self._outbox.push_requests, self.outstanding, credits, self.max_chain, info.after, KINDS, Sums)
        #: Pop the completions and finish the lone successes in one native call.
        self._pop_finished: Callable[..., tuple[int, int, list[Any]]] = self._inbox.pop_finished
        #: Completions waiting in the inbox (the queue's own call: a look before a reap
        #: costs no Python frame when none are in yet).
        self.ready: Callable[[], int] = self._inbox.available

    @classmethod
    def open(cls, info: R.RingOpened, collect: Callable[[bytes], int], sub: Submission, *,
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

    @classmethod
    def remote(cls, info: R.ChannelOpened, sock: socket.socket, sub: Submission, *, completion_bell: bool = False) -> RingLink:
        """A ring in this process's memory whose far end is the daemon's, over the connected
        data channel `sock` (ours from now on): a native bridge serves it here as a daemon's
        worker would. `completion_bell`: the bridge also rings a pipe (for the trio client)."""
        try:
            ring = Ring.create(None, info.capacity, info.completion_capacity, role="client")
        except BaseException:
            sock.close()
            raise
        rd = wr = -1
        try:
            if completion_bell:
                rd, wr = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            channel = Channel(ring.fd, "server", sock, E.SessionClosed.code, bell=wr)
        except BaseException:
            for f in (rd, wr):
                if f >= 0:
                    os.close(f)
            ring.close()
            sock.close()
            raise
        link = cls(ring, info, sub, -1, rd)
        link.channel, link._cbell_wr = channel, wr
        return link

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
            if type(valued) is Sums and status and valued.chain:
                # A verified copy_many failed: its one completion frees the whole chain.
                used = 1
                sub.in_flight -= took - len(valued.values)
            elif type(valued) is Sums:
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
            elif not flags & COMPLETION_DETAIL:
                pending.pop(rid, None)
                p._finish(None, E.error_for_code(status, _ring_failure(status, result)))
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
            if type(valued) is Sums and valued.chain:  # failed: its one completion frees the rest
                left = took - len(valued.values)
                self.early[rid] = [left, left]
            elif type(valued) is Sums:  # its ranges still to complete, one credit each
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
        if self.channel is not None:
            self.channel.close()  # joins the bridge: nothing else touches the ring
            self.channel = None
        if not self.ring.closed:
            self.ring.close()
        for name in ("bell_fd", "cbell_fd", "_cbell_wr"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


def _ring_failure(status: int, result: Any) -> str:
    """The words for a failure a native worker answered with no detail on the socket."""
    if status == E.DeviceFault.code and isinstance(result, int):
        return f"the GPU failed while executing it: CUDA error {result} (native/device.c; from 700 on the context is lost)"
    return "failed on the ring (no detail)"
