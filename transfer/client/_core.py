"""The session state both clients share, with no I/O and no waiting.

Request ids and the pending table, frame encoding and reply dispatch, the
hello handshake's outcome, deferred definitions, the ring link and its
routing rule, the mapped segments and the NIXL agent: everything a client
knows about its session lives here. `Client` (blocking) and `TrioClient`
differ only in how they move bytes and how they wait.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

import msgspec
import numpy as np

from .._native import Submission
from .. import _results as R
from .. import errors as E
from .. import protocol as P
from ..addressing import OFFSET_BITS
from ..transport._fds import fetch_fd
from ._deferred import DeferredState
from .._pending import Pending
from ._remote import RemoteAgent
from ._resources import HostSegment
from ..ring import PLAIN, RingLink
from ..ring._order import route

#: Bumped in a forked child: a client made before the fork compares its own copy (cheaper
#: than a getpid() per request, which check_usable did before).
_forks = [0]
_AT_FORK = hasattr(os, "register_at_fork")
if _AT_FORK:
    os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))

__all__ = ["ClientCore"]

#: How long collecting a memfd from the daemon's fd socket may take (a local round trip).
FETCH_TIMEOUT_S = 10.0


class ClientCore:
    """One session's state: ids, pending table, replies, deferred state, ring, segments."""

    def __init__(self, pending_cls: type[Pending], waiter: Callable[..., Any]) -> None:
        self._pending_cls = pending_cls
        self._waiter = waiter
        self.pending: dict[int, Pending] = {}
        #: Ids, credits, the routing rule and the push (`_submission`), shared with the ring link.
        self.sub: Submission = Submission(self.pending, pending_cls, waiter)
        #: Segment ids of this session's remote (NIXL) segments: requests that touch one take
        #: the socket, not the ring (the daemon's event loop posts their transfers either way).
        self.remote_sids: set[int] = set()
        self.sub.elsewhere = self.remote_sids
        #: One data request made, routed and pushed in one call, or None when the general
        #: path (`prepare`, then the client's `_send`) must take it.
        self.submit: Callable[[type[P.Request], tuple[Any, ...]], Pending | None] = self.sub.submit
        #: Containers `submit` waits to be empty (an event loop's held requests).
        self._holds: list[Any] = []
        #: Failed requests; fence() raises the first one nobody called result() on.
        self.unobserved: list[Pending] = []
        #: What to do once a request is answered (or failed with the session), by request id:
        #: called with it, when its reply is read (a remote registration's free deregisters).
        self.after: dict[int, Callable[[Pending], None]] = {}
        self.limits = P.Limits()
        self.broken: E.TransferError | None = None
        self.pid = os.getpid()
        self._fork = _forks[0]
        #: Deferred-creation state (arenas, pending definitions); None in eager mode.
        self.deferred: DeferredState | None = None
        self.ring: RingLink | None = None
        self.segments: dict[int, HostSegment] = {}
        self.remote: RemoteAgent | None = None  # the NIXL agent, made by the first register_remote
        self.session_id = 0
        self.server_pid = 0
        self.backend: dict[str, Any] = {}
        #: The daemon's choice for allocations that name no device (hello's `home_device`).
        self.home_device = -1
        self.shm_dir = Path("/dev/shm")
        #: The daemon's fd socket: where the memfds behind segments and rings are collected.
        self.fd_socket: Path | None = None
        self.heartbeat_s = 0.5  # until the daemon says otherwise in hello
        self.max_inflight = 1 << 16
        #: checksum_many requests sent on the socket: id -> ranges (their reply is one packed array).
        self.sums: dict[int, int] = {}
        #: Requests whose reply carries a value: id -> request class (`protocol.RESULTS`
        #: types it). Any other reply's result must be nil.
        self.valued: dict[int, type[P.Request]] = {}

    # --- the handshake ----------------------------------------------------------------------
    def on_hello(self, info: R.HelloResult, deferred: bool) -> None:
        """Take in what the daemon granted (checked: `protocol.result`): limits, heartbeat,
        credits, arenas."""
        self.session_id = info.session
        self.server_pid = info.server_pid
        self.backend = info.backend
        self.shm_dir = Path(info.shm_dir)
        self.fd_socket = Path(info.fd_socket)
        lim = info.limits
        self.limits = P.Limits(lim.max_frame_bytes, lim.max_batch, lim.max_vector, lim.max_str, lim.max_bin)
        self.heartbeat_s = info.heartbeat_s
        self.max_inflight = min(self.max_inflight, info.max_inflight)
        # Deferred creation: allocations, descriptors and plans are answered here and
        # travel with their first use. deferred=False sends each at once (for debugging).
        self.home_device = info.home_device
        self.deferred = DeferredState(info.arenas, self.home_device, self.after) if deferred and info.arenas else None
        self._watch()

    def hold_while(self, held: Any) -> None:
        """`submit` leaves requests to the general path while `held` is not empty."""
        self._holds.append(held)
        self._watch()

    def _watch(self) -> None:
        """What `submit` must leave to the general path: requests touching a deferred buffer
        not defined yet, and any while frees are to be sent or requests are held."""
        state = self.deferred
        holds = (*self._holds, state.frees) if state is not None else tuple(self._holds)
        self.sub.watch(state.buffers if state is not None else None, OFFSET_BITS, holds)

    def collect(self, token: bytes) -> int:
        """The fd a RegisterHost/OpenRing reply's token stands for (ours to close)."""
        if self.fd_socket is None:
            raise E.ProtocolError("no session: the daemon has not named its fd socket")
        if self.fd_socket.parent != self.shm_dir:
            raise E.ProtocolError(f"the daemon named an fd socket outside its shm dir: {self.fd_socket}")
        return fetch_fd(self.fd_socket, token, timeout=FETCH_TIMEOUT_S)

    # --- requests ---------------------------------------------------------------------------
    def prepare(self, cls: type[P.Request], args: tuple[Any, ...], objects: Sequence[Any] = (), blocking: bool = False) -> tuple[list[P.Request], Pending]:
        """The frame's worth of requests for one call: deferred definitions it needs first,
        the request, and a Wait marker when the caller will block on it.

        Every data request comes through here: the common case (a usable session, nothing
        deferred to define) costs two attribute tests before the request is made."""
        if self.broken is not None or _forks[0] != self._fork or not _AT_FORK:
            self.check_usable()
        if cls in _CHECKED:
            P.check_ints(cls, args)
        state = self.deferred
        stale = [o for o in objects if o.sent_version != o.version] if objects else ()
        # (Most calls: nothing deferred to send first, decided by these two tests alone.)
        defs = self._definitions(cls, args, stale) if stale or (state is not None and (state.buffers or state.frees)) else ()
        sub = self.sub  # (new(), inline: a frame less on every submission)
        rid = sub.next_id
        sub.next_id = rid + 1
        req = cls(rid, *args)
        pending = self.pending[rid] = self._pending_cls(rid, self._waiter)
        if defs:
            reqs = [*defs, req]
            # (a free rides along; it is no definition of this request: its failure is not this one's)
            pending._deps = [self.pending[d.id] for d in defs if d.id in self.pending and not _is_free(d)]
        else:
            reqs = [req]
        if blocking:
            marker, _ = self.new(P.Wait)
            self.pending.pop(marker.id, None)  # its reply only counts; nobody waits on it
            reqs.append(marker)
        return reqs, pending

    def _definitions(self, cls: type[P.Request], args: tuple[Any, ...], stale: Sequence[Any]) -> list[P.Request]:
        """Deferred definitions a request needs first: allocations it touches, and the
        `stale` descriptors it names (changed since they were last sent)."""
        state = self.deferred if self.deferred is not None else DeferredState(())
        return state.definitions_for(_touched(cls, args), stale, lambda c, *a: self.new(c, *a)[0])

    def new(self, cls: type[P.Request], *args: Any) -> tuple[P.Request, Pending]:
        sub = self.sub
        rid = sub.next_id
        sub.next_id = rid + 1
        req = cls(rid, *args)  # first: a request that cannot be made leaves nothing pending
        pending = self.pending[rid] = self._pending_cls(rid, self._waiter)
        return req, pending

    def ping(self) -> P.Request:
        """A Ping nobody waits on: its reply only proves the daemon is alive."""
        req, _ = self.new(P.Ping)
        self.pending.pop(req.id, None)
        return req

    def signal(self) -> Pending:
        """A local event in the shape of a request (id 0, never sent): a pool's "a slot was released"."""
        return self._pending_cls(0, self._waiter)

    def encode(self, reqs: Sequence[P.Request]) -> list[bytes]:
        """One or more frames, each within the daemon's batch limit.

        A request that cannot be encoded (a compute param msgpack cannot carry) fails
        alone, with its reason; the rest of its batch still leaves.
        """
        step = self.limits.max_batch
        link = self.ring
        if link is not None and link.channel is not None and link.outstanding:
            # Descriptors pushed on the data channel may reach the daemon after this frame:
            # each frame says how many came before it (a RingMark), and the daemon waits for them.
            step = max(1, step - 1)
            marked: list[P.Request] = []
            for i in range(0, len(reqs), step):
                mark = self.new(P.RingMark, self.sub.pushed)[0]
                self.pending.pop(mark.id, None)  # (its reply only counts)
                marked += [mark, *reqs[i : i + step]]
            reqs, step = marked, step + 1
        frames = []
        for r in reqs:
            if type(r) is P.ChecksumV or (type(r) is P.CopyV and r.sums):
                self.sums[r.id] = len(r.nbytes)
            elif type(r) in _VALUED:
                self.valued[r.id] = type(r)
        for i in range(0, len(reqs), step):
            chunk = reqs[i : i + step]
            try:
                frames.append(P.encode_requests(chunk))
            except (TypeError, ValueError, OverflowError):
                good = []
                for r in chunk:
                    try:
                        P.encode_requests([r])
                    except (TypeError, ValueError, OverflowError) as exc:
                        self.sums.pop(r.id, None)
                        self.valued.pop(r.id, None)
                        p = self.pending.pop(r.id, None)
                        if p is not None:
                            p._finish(None, E.InvalidField(f"{type(r).__name__} cannot be encoded: {exc}"))
                            self.unobserved.append(p)
                        continue
                    good.append(r)
                if good:
                    frames.append(P.encode_requests(good))
        return frames

    # --- routing and credits ------------------------------------------------------------------
    def ring_route(self, reqs: Sequence[P.Request], unsent: int) -> int | None:
        """Whether `reqs` may take the ring: None if not, else the fence their descriptors
        carry (`ring._order.route`, the rule). `unsent`: requests in the pending table not
        handed to any transport yet (including `reqs`). (The other direction, ring then
        socket, the daemon keeps: it takes what is in the ring before each frame it reads.)"""
        link = self.ring
        if link is None:
            return None
        if (len(reqs) != 1 or type(reqs[0]) not in PLAIN) and not link.takes_all(reqs):
            return None  # (one plain request, most submissions, is decided without a call)
        if self.remote_sids and any(touches(r, self.remote_sids) for r in reqs):
            return None
        sub = self.sub
        return route(len(self.pending), len(link.outstanding), unsent, sub.frames, sub.after)

    def unsent(self, reqs: Sequence[P.Request], batch: Sequence[P.Request] | None) -> int:
        """Requests created but not handed to a transport yet: those of `reqs` in the pending
        table (pings and Wait markers are not), and what a batch() holds. (One request: one
        lookup.)"""
        pending = self.pending
        return (reqs[0].id in pending if len(reqs) == 1 else sum(1 for r in reqs if r.id in pending)) + len(batch or ())

    def socket_room(self, unsent: int) -> int:
        """How many more requests the socket may carry within the daemon's credits."""
        outstanding = len(self.ring.outstanding) if self.ring is not None else 0
        return self.max_inflight - (len(self.pending) - unsent - outstanding)

    def socket_owed(self) -> bool:
        """Whether a reply is owed on the socket: a request sent there (or held in a batch),
        or a ring failure whose message follows there."""
        link = self.ring  # (a failed ring request stays pending, not outstanding, until then)
        return link is None or len(self.pending) > len(link.outstanding)

    def reap_ring(self) -> int:
        """Finish what the ring has completed; return how many completions there were."""
        link = self.ring
        if link is None or not link.outstanding:
            return 0
        return link.reap(self.pending, self.unobserved)

    def ring_closed(self) -> None:
        """The daemon closed its end of the ring: the session is over. Why, it wrote in the
        ring (a drain: ShuttingDown); anything else it wrote reads as SessionClosed."""
        reason = self.ring.ring.close_reason if self.ring is not None else 0
        if reason == E.ShuttingDown.code:
            err: E.TransferError = E.ShuttingDown("the daemon is shutting down: it closed this session's ring before this request ran")
        elif self.ring is not None and self.ring.channel is not None:
            err = E.SessionClosed("this session's data channel to the daemon closed (the daemon ended the session, or the connection was lost)")
        else:
            err = E.SessionClosed("the daemon ended this session (its ring is closed)")
        self.fail_all(err)
        if self.ring is not None:
            self.ring.outstanding.clear()
            self.ring.early.clear()

    def answers_before(self, rid: int) -> list[Pending]:
        """Requests submitted before `rid` still waiting for their answer (a fence waits for
        them: the daemon has done them, but their answer may come after the fence's)."""
        return [p for i, p in self.pending.items() if i < rid]

    # --- replies ------------------------------------------------------------------------------
    def on_frame(self, data: bytes) -> None:
        try:
            replies = P.decode_replies(data, self.limits)
        except E.ProtocolError as exc:
            self.fail_all(E.ProtocolError(f"undecodable reply from the daemon: {exc}"))
            return
        pending, link = self.pending, self.ring
        for r in replies:
            if r.id == 0:
                # The daemon could not read one of our frames: nothing can be trusted now.
                self.fail_all(r.error or E.ProtocolError("frame rejected"))
                continue
            if isinstance(r.error, E.NoSession) and self.session_id:
                # The daemon answering no longer knows our session: it restarted on this
                # endpoint, or ended the session. Nothing of it is left: say so, once, for all.
                self.fail_all(self.session_gone(r.error))
                continue
            p = pending.pop(r.id, None)
            kind = self.valued.pop(r.id, None) if self.valued else None
            if p is None:
                continue  # a ping's reply, or a request already failed locally
            if link is not None and r.id in link.outstanding:
                link.answered_early(r.id)  # a ring request's error, ahead of its completion
            result, error = r.result, r.error
            if self.sums and r.id in self.sums:
                result, error = _sums(result, error, self.sums.pop(r.id))
            elif error is None and (kind is not None or result is not None):
                try:  # checked against what the protocol declares for the request
                    result = P.result(kind or P.Copy, result)  # (a request with no declared result: nil)
                except E.MalformedFrame as exc:
                    result, error = None, exc
            p._finish(result, error)
            if error is not None:
                self.unobserved.append(p)
            if self.after:
                then = self.after.pop(r.id, None)
                if then is not None:
                    then(p)

    def session_gone(self, cause: E.TransferError) -> E.TransferError:
        """What requests of a session the daemon no longer knows raise (not NoSession, which
        reads as "you never said hello"): the session and everything it held are gone."""
        err = E.SessionClosed(
            f"the daemon no longer has session {self.session_id}: it restarted on this endpoint, or ended "
            "the session (silent too long, shutting down); connect again"
        )
        err.add_note(f"daemon said: {cause.message}")
        return err

    def fail_all(self, err: E.TransferError) -> None:
        self.broken = err
        self.sub.broken = True
        self.sums.clear()
        self.valued.clear()
        pending = list(self.pending.values())
        self.pending.clear()  # (the one table: the submission state holds it too)
        after = dict(self.after)
        self.after.clear()  # (the same dict: the deferred state files frees' into it)
        for p in pending:
            p._finish(None, err)
            then = after.pop(p.id, None)
            if then is not None:
                then(p)

    def check_usable(self) -> None:
        if self.broken is not None:
            raise self.broken
        if _forks[0] != self._fork or (not _AT_FORK and os.getpid() != self.pid):
            raise E.SessionError("this client was created in another process (fork): connect again in this one")

    def take_unobserved(self) -> E.TransferError | None:
        """The first failure nobody asked about since the last call (fence reports it)."""
        failed, self.unobserved = self.unobserved, []
        failed.sort(key=lambda p: p.id)  # the first submitted, whichever transport answered first
        errs = [p._error for p in failed if not p._observed and p._error is not None]
        for p in failed:
            p._observed = True  # reported here (the first raised, the rest counted): not again by a pool
        if not errs:
            return None
        first = errs[0]
        if len(errs) > 1:
            first.add_note(f"{len(errs) - 1} more request(s) also failed since the last fence")
        return first

    # --- teardown ------------------------------------------------------------------------------
    def release(self) -> None:
        """Local teardown after the session ended: unmap, close the ring, fail what is left."""
        for seg in self.segments.values():
            seg._unmap()
        self.segments.clear()
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        self.fail_all(E.SessionClosed("the client was closed"))
        if self.remote is not None:  # after Close: the daemon no longer reads our buffers
            self.remote.close()
            self.remote = None


#: Requests whose reply carries a value (the rest answer nil).
_VALUED = frozenset(P.RESULTS)
#: Requests that may take the ring: their integer fields are checked at submission (a
#: vector's arrays are uint64 already).
_CHECKED = frozenset((P.Copy, P.Fill, P.Checksum, P.CopyV, P.ChecksumV))


def _sums(result: Any, error: E.TransferError | None, n: int) -> tuple[Any, E.TransferError | None]:
    """A checksum_many's socket reply as its uint64 array: packed bytes, one word per range
    (checked: the daemon's bytes are no more trusted than a client's)."""
    if error is not None:
        return None, error
    if type(result) is not bytes or len(result) != 8 * n:
        got = f"{len(result)} bytes" if type(result) is bytes else f"a {type(result).__name__}"
        return None, E.ProtocolError(f"the daemon answered {n} checksums with {got}, not {8 * n} bytes")
    return np.frombuffer(result, "<u8").astype(np.uint64), None


def _segment_vas(vas: np.ndarray) -> list[int]:
    """One VA per segment a vector of VAs names (its base)."""
    return [int(x) << 40 for x in np.unique(vas >> np.uint64(40)).tolist()]


def _touched(cls: type[P.Request], args: tuple[Any, ...]) -> list[int]:
    """The VAs (one per segment is enough) a data request reads or writes."""
    if cls is P.Copy:
        return [args[0], args[1]]
    if cls in (P.Fill, P.Checksum, P.Share):
        return [args[0]]
    if cls is P.CopyV:
        return _segment_vas(np.concatenate([args[0], args[1]]))
    if cls is P.ChecksumV:
        return _segment_vas(args[0])
    if cls is P.Compute:
        return [t.va for t in (*args[1], *args[2])]
    if cls is P.RunGraph:
        return [*args[1], *args[2]]
    return []


def touches(req: P.Request, sids: set[int]) -> bool:
    """Whether a ring-able request names a VA in one of the segments `sids` (`_touched`: its
    fields after the id are the arguments it was made with)."""
    return any(int(va) >> OFFSET_BITS in sids for va in _touched(type(req), msgspec.structs.astuple(req)[1:]))


def _is_free(req: P.Request) -> bool:
    return type(req) is P.Define and req.kind == P.DEF_FREE
