"""The daemon's end of the shared-memory request rings (docs/ring.md).

A same-host session may open a ring (`OpenRing`): then copy, fill, checksum
and fence arrive as 64-byte descriptors in shared memory instead of zmq
frames. Here they are popped in whole batches, validated, and turned into
the pass's one batch form, (request, RING) pairs in the session's queue:
from there on, nothing tells a ring request from a socket one except where
its answer goes. Answers go back as 32-byte completions; a failed descriptor
also gets an ordinary reply frame carrying the full error (a completion has
room for the code only).

Everything in a descriptor is hostile: a batch is copied out of shared
memory before it is read (`Ring.pop_many`), every field is checked, and every
VA goes through the mapping table like a zmq request's.

trio cannot wait on a futex, so each direction also has a pipe for a doorbell:
the daemon sleeps on one pipe that every client writes a byte to when it finds
its ring armed (each client holds a write end of its own, handed over the fd
socket like the ring's memfd), and each session may have a pipe the daemon
writes to when it pushes completions while that client sleeps on them (the
trio client).

Where the native extension is built, a ring is served by its own worker
thread (`_dataplane`): copies, fills, checksums and fences never reach this
module. The loop here serves a ring only while its worker has handed it over
(a request the worker does not serve), and hands it back once idle; a socket
frame waits until the worker has done what the client pushed before it
(`before_frame`, `catch_up`), so the two paths keep the client's order.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import numpy as np
import trio

from .. import errors as E
from .. import _results as R
from ..ring import COMPLETION_DTYPE, FLAG_AFTER, FLAG_CHAIN, FLAG_SUM, REQUEST_DTYPE, Ring, RingCorrupted, RingError, answers, join_chains, to_batch
from ..memory._shm import PREFIX, new_memfd, reserve, seal
from ._accounting import Accounting
from ._config import DaemonConfig
from ._dataplane import NATIVE, PYTHON, DataPlane
from ._fds import FdChannel
from ._ops import RING
from ..ring import _order as order
from ._ringloop import RingLoop, room, served_here
from ._session import Phase, Session

__all__ = ["Rings"]

log = logging.getLogger("transfer.server")

#: How soon a frame waiting for a data channel's descriptors still on their way first looks
#: for them again while the event loop serves the ring (the worker's watch wakes it
#: otherwise); each look doubles the wait, up to the second figure (a client whose mark
#: names descriptors it never sends holds its own frames, at a few wake-ups a second).
ARRIVAL_POLL_S = 200e-6
ARRIVAL_POLL_MAX_S = 0.05


class Rings:
    """Every session's ring: open, ingest into the queue, push completions, poll, sleep."""

    def __init__(self, config: DaemonConfig, instance: Callable[[], str], accounting: Accounting, fds: FdChannel, dataplane: DataPlane) -> None:
        self.config = config
        self.dataplane = dataplane
        #: Where the client collects its ring's memfd.
        self.fds = fds
        self._instance = instance
        self.accounting = accounting
        self.sessions: dict[int, Session] = {}
        #: The event loop's service of the rings it serves itself, and the doorbell (`_ringloop`).
        self.loop = RingLoop(self)
        #: Set by the server: run what a session has queued (`Pass.kick`), and end a session.
        self.kick: Callable[[Session], None] = lambda s: None
        self.on_broken: Callable[[Session, str], None] = lambda s, why: None

    # --- setup ---------------------------------------------------------------------------------
    def create(self, session: Session, cap: int) -> tuple[Ring, int]:
        """A ring in a sealed memfd (its size can never change under us: no SIGBUS), and the fd."""
        fd = new_memfd(f"{PREFIX}{self._instance()}.ring-{session.id}")
        try:
            reserve(fd, Ring.nbytes_for(cap), f"a {cap}-descriptor ring")
            seal(fd)
            ring = Ring.create(fd, cap)
        except RingError as exc:
            os.close(fd)
            raise E.OutOfSharedMemory(f"cannot create a {cap}-descriptor ring: {exc}") from None
        except BaseException:
            os.close(fd)
            raise
        return ring, fd

    def open(self, session: Session, capacity: int, completion_bell: bool, nursery: trio.Nursery) -> R.RingOpened:
        cfg = self.config
        if not cfg.rings:
            raise E.RingUnavailable("request rings are disabled on this daemon (--no-rings)")
        if session.remote_peer:
            raise E.RingUnavailable("request rings are for clients on the daemon's host")
        cap = self.capacity(session, capacity)
        self.fds.check_room(session, 3 if completion_bell else 2)
        doorbell = self.loop.doorbell()  # made with the first ring: daemons without ring clients have none
        ring, ring_fd = self.create(session, cap)
        offered: list[bytes] = []
        wr = -1
        try:
            # Each fd is the channel's once offered (it closes it if the offer fails).
            offered.append(self.fds.offer(session, ring_fd))
            offered.append(self.fds.offer(session, self._fd("the rings' doorbell", doorbell.writer)))
            if completion_bell:
                # Its read end goes to the client by token; when our write end closes (the
                # session is over, or the daemon died) the client reads EOF.
                rd, wr = self._fd("the ring's completion doorbell", lambda: os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC))
                offered.append(self.fds.offer(session, rd))
        except BaseException:
            ring.close()
            for token in offered:
                self.fds.revoke(token)
            if wr >= 0:
                os.close(wr)
            raise
        token, bell = offered[:2]
        cbell = offered[2] if completion_bell else None
        if wr >= 0:
            ring.set_doorbell(wr)  # our completion pushes ring it when the client sleeps armed
            session.ring_bell = wr
        self.install(session, ring, nursery)
        return R.RingOpened(
            token, bell, cbell, ring.request_capacity, ring.completion_capacity,
            # Served beyond copy, fill, checksum and fence (a client takes the ring for a
            # kind only where its daemon says so: an older daemon refuses what it lacks).
            graphs=True,
            # Descriptors may wait for the socket frames sent before them (`FLAG_AFTER`).
            after=True,
        )

    def capacity(self, session: Session, capacity: int) -> int:
        """The ring a session may open (`capacity` rounded up to a power of two), or why not."""
        if session.ring is not None:
            raise E.RingUnavailable("this session already has a ring")
        limit = self.config.max_ring_capacity
        if not 2 <= capacity <= limit:
            raise E.InvalidField(f"ring capacity {capacity} is outside 2..{limit}")
        return min(1 << (capacity - 1).bit_length(), 1 << (limit.bit_length() - 1))

    def install(self, session: Session, ring: Ring, nursery: trio.Nursery) -> None:
        """The session's ring is served from now on: by its worker, else by the loop."""
        session.ring = ring
        self.sessions[session.id] = session
        try:
            session.worker = self.dataplane.start(session, ring, self.loop.doorbell().write_fd, -1 if session.ring_bell is None else session.ring_bell)
        except OSError as exc:  # no thread to be had: the loop serves this ring
            log.warning("session %d: no ring worker (%s); the event loop serves its ring", session.id, exc, extra={"session": session.id})
        if session.worker is None:
            ring.arm()  # if the ring loop sleeps now, the client's first push must ring the bell
        self.loop.start(nursery)
        log.info("session %d opened a %d-descriptor ring", session.id, ring.request_capacity, extra={"session": session.id})

    @staticmethod
    def _fd(what: str, make: Callable[[], Any]) -> Any:
        try:
            return make()
        except OSError as exc:
            raise E.OutOfSharedMemory(f"cannot create {what}: {exc}") from None

    def close(self, session: Session, reason: type[E.TransferError] = E.SessionClosed) -> None:
        """Closing writes `reason`'s code as our closed flag and wakes a client sleeping on
        the ring: it fails its outstanding descriptors with that error. Nothing maps the
        ring afterwards."""
        self.sessions.pop(session.id, None)
        session.ring_chain = session.ring_held = None
        self.dataplane.stop(session)  # joins its thread: nothing touches the ring after this
        channel, session.channel = session.channel, None
        if channel is not None:  # (one that never connected holds the ring's memfd: it goes)
            channel.close(reason.code)  # joins the bridge's threads; the client reads EOF
        ring, session.ring = session.ring, None
        if ring is not None:
            ring.close(reason.code)  # its memfd goes with the client's mapping (an uncollected one with its token)
        bell, session.ring_bell = session.ring_bell, None
        if bell is not None:
            os.close(bell)

    def shutdown(self) -> None:
        self.loop.close()

    # --- the drain -----------------------------------------------------------------------------
    def cut(self, session: Session) -> None:
        """The daemon began to drain: what the client has published on its ring so far is
        served, and nothing after it (the ring's close answers that, ShuttingDown). The cut
        is a published tail, so it never falls inside a request."""
        ring, worker = session.ring, session.worker
        if ring is None or session.ring_cut is not None:
            return
        try:
            if worker is not None and worker.mode == NATIVE:
                done, tail = worker.done, worker.tail()
                session.ring_cut = tail if order.plausible(tail, done, ring.request_capacity) else done  # (an impossible tail: the worker reports it)
                worker.limit = session.ring_cut
                worker.watch(session.ring_cut)  # it rings the bell when it gets there
            else:
                session.ring_cut = ring.inbox.index + ring.available()
        except RingCorrupted as exc:
            session.ring_cut = ring.inbox.index
            self.broken(session, exc)
        if served_here(session):
            self.loop.wake()  # the loop ingests up to the cut (it skipped this ring unarmed)

    def drained(self, session: Session) -> bool:
        """Whether everything published before the cut is answered (or the ring is gone)."""
        ring, worker, cut = session.ring, session.worker, session.ring_cut
        if ring is None or cut is None:
            return True
        if worker is not None and worker.mode == NATIVE:
            return bool(worker.done >= cut)
        return (ring.inbox.index >= cut and not session.ring_pending and session.ring_chain is None
                and session.ring_held is None)

    # --- ingest and complete -------------------------------------------------------------------
    def ingest(self, session: Session, limit: int | None = None, front: bool = False) -> int:
        """Move what the session's ring holds (within its completion budget) into its queue;
        return how many it moved (not counting those held for a frame).

        `limit` bounds one poll's take (fairness between rings). `front`: `catch_up` takes
        what the worker handed over while frames wait for it (each descriptor goes ahead of
        the frames its client sent after it). Only while no worker owns the ring.
        """
        ring = session.ring
        if ring is None or not session.running:
            return 0
        if session.worker is not None and session.worker.mode != PYTHON:
            return 0
        if session.ring_wait is not None and not front:
            return 0  # a frame waits for what the ring holds: `catch_up` queues it ahead of the frame
        placed = 0
        if session.ring_held is not None:
            held, session.ring_held = session.ring_held, None
            self._place(session, held)
            if session.ring_held is not None:  # its frame has not come: nothing behind it may go first
                return len(held) - len(session.ring_held)
            placed = len(held)
        rows: list[tuple[int, ...]] | None
        try:
            avail = ring.available()
            if session.ring_cut is not None:  # draining: nothing published after the cut
                avail = min(avail, max(0, session.ring_cut - ring.inbox.index))
            if not avail:
                return placed
            n: int = min(avail, room(session), avail if limit is None else limit)
            if n <= 0:
                return placed  # the client has not taken its completions: it waits, we do not
            if n <= 4:  # tuples, no NumPy (one wake for the batch, if any)
                rows = [ring.pop(wake=False) for _ in range(n)]
                ring.inbox.notify()
                array = None
                flags = 0
                for r in rows:
                    flags |= r[6]
            else:
                rows, array = None, ring.pop_many(n)
                flags = int(np.bitwise_or.reduce(array["flags"]))
        except RingCorrupted as exc:
            self.broken(session, exc)
            return placed
        if flags & FLAG_AFTER or session.waiting_frames:
            self._place(session, np.array(rows, dtype=REQUEST_DTYPE) if array is None else array)
            if session.ring_held is not None:
                n -= len(session.ring_held)
        else:  # (nearly always: after every frame already read)
            self._queue(session, self._requests(session, rows, array, bool(flags & (FLAG_CHAIN | FLAG_SUM))), 0)
        return placed + n

    @staticmethod
    def _requests(session: Session, rows: list[tuple[int, ...]] | None, array: np.ndarray | None, chained: bool) -> list[tuple[Any, int]]:
        """Descriptors as the batch form; a CopyV's chain (maybe begun in an earlier take) is one request."""
        if not chained and session.ring_chain is None:
            return to_batch(rows, array, RING)
        taken = np.array(rows, dtype=REQUEST_DTYPE) if array is None else array
        if session.ring_chain is not None:  # (np.concatenate repacks the layout: astype restores it)
            taken = np.concatenate([session.ring_chain, taken]).astype(REQUEST_DTYPE)
        items, rest = join_chains(taken, RING)
        session.ring_chain = rest if len(rest) else None
        return items

    def _place(self, session: Session, array: np.ndarray) -> None:
        """Descriptors, in ring order, into the queue behind the frames their fences name
        (`FLAG_AFTER`: a descriptor and those after it follow the first `arg2` frames); from
        the first whose frame has not been read, they are held until it is."""
        after = (array["flags"] & FLAG_AFTER) != 0
        fences = order.fences(array["flags"], array["arg2"], session.ring_fence)
        held = order.first_held(fences, session.frames_seen)
        clean = array
        if after.any():  # the fence is read: the request itself has neither
            clean = array.copy()
            clean["flags"] &= np.uint16(~FLAG_AFTER & 0xFFFF)
            clean["arg2"][after] = 0
        cuts = (np.flatnonzero(fences[1:] != fences[:-1]) + 1).tolist()
        for a, b in zip([0, *cuts], [*cuts, len(array)]):  # runs of one fence
            if held is not None and a >= held:
                session.ring_held = array[a:].copy()
                return
            fence = int(fences[a])
            session.ring_fence = fence
            part = clean[a:b]
            self._queue(session, self._requests(session, None, part, bool((part["flags"] & (FLAG_CHAIN | FLAG_SUM)).any())), fence)

    def _queue(self, session: Session, items: list[tuple[Any, int]], fence: int) -> None:
        """Requests from the ring into the queue: at its end, or ahead of the first waiting
        frame its client sent after them (`fence`: the frames sent before them)."""
        # Each request answers once: that is what its descriptors reserved (a chain, one slot;
        # a verified chain, one per piece).
        owed = sum(answers(req, True) for req, _ in items)
        self.accounting.received(session, owed)
        session.ring_pending += owed
        waits = session.waiting_frames
        for k, (number, begins) in enumerate(waits):
            if number > fence:
                queue = session.queue
                # (its index now: requests taken from the head since it arrived moved it forward)
                at = min(max(0, begins - session.queue_taken), len(queue))
                queue.rotate(-at)
                queue.extendleft(reversed(items))
                queue.rotate(at)
                waits[k:] = [(m, i + len(items)) for m, i in waits[k:]]
                return
        session.queue.extend(items)

    # --- the native worker's ring ----------------------------------------------------------------
    def before_frame(self, session: Session, mark: int | None = None) -> None:
        """A socket frame arrived: what the client pushed on its ring before it goes first.
        `mark`: its RingMark, the descriptors pushed before it (a data channel's may still
        be on their way: the frame waits for them too)."""
        worker, ring = session.worker, session.ring
        tail = None
        if worker is None or worker.mode != NATIVE:
            self.ingest(session)
            taken = ring.inbox.index
            if mark is not None and order.plausible(mark, taken, ring.request_capacity) and taken + ring.available() < mark:
                tail = mark  # (an impossible mark is a hostile client's: its order is its own affair)
        else:
            tail = order.frame_waits(max(worker.tail(), mark or 0), worker.done, ring.request_capacity)
        if tail is not None:
            session.ring_wait = tail if session.ring_wait is None else max(session.ring_wait, tail)
        if session.ring_wait is not None:  # this frame's requests begin here (`_queue` places ahead of them)
            session.waiting_frames.append((session.frames_seen + 1, session.queue_taken + len(session.queue)))

    def after_frame(self, session: Session) -> None:
        """A frame was counted: what its ring held for it goes into the queue, and the loop
        (which left this ring unarmed while they waited) looks at it again."""
        self.ingest(session)
        if session.ring_held is None and served_here(session):
            self.loop.wake()

    async def catch_up(self, session: Session) -> None:
        """Wait until the worker has done what came before the waiting frame, or handed it over
        (then that rest is queued ahead of the frame)."""
        worker = session.worker
        delay = ARRIVAL_POLL_S
        try:
            while session.running and session.ring_wait is not None:
                mode = PYTHON if worker is None else worker.mode
                if mode != NATIVE:
                    if mode == PYTHON:
                        self.ingest(session, front=True)
                        ring = session.ring
                        if ring is not None and ring.inbox.index < session.ring_wait:  # (a data channel's, on their way)
                            await trio.sleep(delay)
                            delay = min(2 * delay, ARRIVAL_POLL_MAX_S)
                            continue
                    return
                session.ring_moved = trio.Event()
                if worker.watch(session.ring_wait) >= session.ring_wait:
                    return
                await session.ring_moved.wait()
        finally:
            session.ring_wait = None
            session.waiting_frames.clear()
            if served_here(session):
                self.loop.wake()  # `_arm` skipped this ring while the frame waited: look again

    def settle(self, session: Session) -> None:
        """Give a handed-over ring back to its worker once the session is idle on it."""
        worker = session.worker
        ring = session.ring
        if (
            worker is None or ring is None or worker.mode != PYTHON or not session.accepting
            or session.ring_pending or session.ring_chain is not None or session.ring_wait is not None
            or session.ring_held is not None
            or not session.idle
        ):
            return
        try:
            if ring.available():
                return
        except RingCorrupted as exc:
            self.broken(session, exc)
            return
        ring.disarm()
        worker.resume()

    def push(self, session: Session, comps: list[tuple[int, int, int, int, int]] | np.ndarray) -> None:
        """Completions onto the ring; a ring that cannot take them ends its session."""
        ring = session.ring
        if ring is None or session.phase is Phase.CLOSED:
            return  # the ring closes with the session; the client fails what it waits for
        try:
            if isinstance(comps, list):
                ok = ring.push(comps[0]) if len(comps) == 1 else ring.push_many(np.array(comps, dtype=COMPLETION_DTYPE)) == len(comps)
            else:
                ok = ring.push_many(comps) == len(comps)
        except RingCorrupted as exc:
            self.broken(session, exc)
            return
        if not ok:  # the budget reserved these slots: only a hostile client gets here
            self.broken(session, RingCorrupted("the completion queue was full although its slots were reserved"))

    def broken(self, session: Session, exc: Exception) -> None:
        if not session.running:
            return  # already on its way out
        log.warning("session %d: %s; ending the session", session.id, exc, extra={"session": session.id})
        self.on_broken(session, f"ring: {exc}")
