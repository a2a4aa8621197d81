"""The event loop's share of the rings: the ones it serves itself, and the doorbell.

A ring whose native worker handed it over (or that has none: `--no-ring-workers`) is
served by the loop: it busy-polls such rings while they are busy, then arms them and
sleeps on the doorbell, a pipe every client writes a byte to when it finds its ring armed
(each client holds a write end of its own), and the workers write when they hand a ring
over, break, or pass a watched index.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import trio

from .. import errors as E
from ..ring import RingCorrupted
from ._dataplane import BROKEN, NATIVE, PYTHON
from ._session import Session

__all__ = ["Doorbell", "RingLoop", "room", "served_here"]

log = logging.getLogger("transfer.server")


class Doorbell:
    """A pipe clients write a byte to when they find the loop asleep (trio can poll an fd, not
    a futex).

    It has no name: each client gets a write end of its own over the fd socket (`writer`),
    a new open file description of the pipe, so the flags one client sets on its end
    (blocking, say) are not the daemon's or another client's. The daemon's read end and its
    own write end (its workers' and `RingLoop.wake`'s) are non-blocking: a writer never
    blocks, and a full pipe rings already.
    """

    def __init__(self) -> None:
        self.fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def writer(self) -> int:
        """A write end for one client (ours until handed over): reopened through /proc, so
        it is an open file description of its own."""
        return os.open(f"/proc/self/fd/{self.write_fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        for name in ("fd", "write_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


class RingLoop:
    """Polls the rings the loop serves, sleeps on the doorbell; one per daemon (`Rings.loop`)."""

    def __init__(self, rings: Any) -> None:
        #: The rings (`_rings.Rings`): their sessions, and how a ring is ingested, settled, ended.
        self.rings = rings
        self.bell: Doorbell | None = None
        self._started = False

    def doorbell(self) -> Doorbell:
        """The doorbell, made on first use (a daemon without ring clients has none)."""
        if self.bell is None:
            try:
                self.bell = Doorbell()
            except OSError as exc:
                raise E.OutOfSharedMemory(f"cannot create the rings' doorbell: {exc}") from None
        return self.bell

    def start(self, nursery: trio.Nursery) -> None:
        """Run the loop's service (once, with the first ring)."""
        if not self._started:
            self._started = True
            nursery.start_soon(self.run)

    def close(self) -> None:
        if self.bell is not None:
            self.bell.close()
            self.bell = None

    def poll(self) -> int:
        """Ingest every ring its worker does not own; each session's pass decides to run
        inline or on its task. Note what the workers rang the bell for."""
        took = 0
        for session in list(self.rings.sessions.values()):
            try:
                worker = session.worker
                if worker is not None:
                    if worker.take_signal():
                        session.ring_moved.set()
                        if session.ring_cut is not None:
                            session.wake.set()  # a draining session's task waits for the cut
                    mode = worker.mode
                    if mode == NATIVE:
                        continue
                    if mode == BROKEN:
                        self.rings.broken(session, RingCorrupted("the ring's worker found impossible indices"))
                        continue
                n = self.rings.ingest(session, self.rings.config.max_pass)
                if n:
                    took += n
                    self.rings.kick(session)
                elif worker is not None:
                    self.rings.settle(session)
            except Exception as exc:  # a bug: this session goes, the daemon keeps serving the rest
                log.exception("session %d: internal error on its ring", session.id, extra={"session": session.id})
                self.rings.broken(session, exc)
        return took

    async def run(self) -> None:
        """Busy-poll while the rings are busy, then sleep on the doorbell pipe.

        Busy-polling holds the event loop for at most 50 µs at a time, then lets the
        other tasks (the zmq pump) run; after `ring_spin_s` without a descriptor it
        arms every ring (a client's next push then writes the doorbell) and sleeps.
        """
        assert self.bell is not None
        bell = self.bell
        spin = self.rings.config.ring_spin_s
        clock = time.perf_counter
        poll = self.poll
        until = 0.0
        while True:
            try:
                now = clock()
                if poll():
                    until = now + spin
                if clock() < until:
                    end = min(until, clock() + 50e-6)
                    while (now := clock()) < end:
                        if poll():
                            until = now + spin
                            end = min(until, now + 50e-6)
                    await trio.lowlevel.checkpoint()
                    continue
                if self.arm():
                    continue
                await trio.lowlevel.wait_readable(bell.fd)
                bell.drain()
                for session in list(self.rings.sessions.values()):
                    if served_here(session):
                        session.ring.disarm()
            except RingCorrupted:  # a ring went bad between checks: ingest ends its session
                await trio.lowlevel.checkpoint()

    def wake(self) -> None:
        """Ring our own doorbell: the loop, maybe asleep on it, polls and re-arms every ring."""
        if self.bell is not None:
            try:
                os.write(self.bell.write_fd, b"\0")
            except BlockingIOError:
                pass  # a full pipe rings already

    def arm(self) -> bool:
        """Arm every ring's doorbell; True (and disarmed) if one has work after all."""
        ready = False
        for session in list(self.rings.sessions.values()):
            ring = session.ring
            if ring is None or not session.running or session.ring_wait is not None or session.ring_held is not None:
                continue  # (a waiting frame's `catch_up` takes that ring's requests, a held one's frame the rest)
            if session.ring_cut is not None and ring.inbox.index >= session.ring_cut:
                continue  # drained to its cut: what comes after is not served
            if session.worker is not None:
                if session.worker.mode != PYTHON:
                    continue  # the worker sleeps on the ring itself
                self.rings.settle(session)
                if session.worker.mode != PYTHON:
                    continue
            try:
                if ring.arm() and room(session) > 0:
                    ready = True
            except RingCorrupted as exc:
                self.rings.broken(session, exc)
        if ready:
            for session in self.rings.sessions.values():
                if served_here(session):
                    session.ring.disarm()
        return ready


def room(session: Session) -> int:
    """Descriptors the loop may take from a ring: each needs a completion slot when it is
    answered, counting those of a chain taken in part (a verified one answers each of its
    pieces) besides those reserved."""
    assert session.ring is not None
    open_chain = len(session.ring_chain) if session.ring_chain is not None else 0
    return int(session.ring.free()) - session.ring_pending - open_chain

def served_here(session: Session) -> bool:
    """The event loop serves this ring now (it has no worker, or its worker handed it over)."""
    return session.ring is not None and (session.worker is None or session.worker.mode == PYTHON)
