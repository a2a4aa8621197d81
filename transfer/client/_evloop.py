"""What the event-loop clients (trio, asyncio) share: all but the loop's own primitives.

Submitting never waits on an event loop, so requests beyond the daemon's credits
(or the ring's room) are *held*, in order, and handed to the ring or the socket as
completions free credits (`_release_held`). Waiting for a request first reaps the
ring in place for a few microseconds, since most ring answers come that fast, and
only then sleeps on the loop. The ring's completion reaper is a generator
(`_reaper`) that says what it waits for next; each client drives it with its own
primitives, as it drives operations (`_drive`). So the trio and asyncio clients
differ only in how they sleep, yield, and watch file descriptors.

A client supplies `_checkpoint`, `_sleep`, `_kick_ring` and `_spawn_reaper`, and a
socket pump with `send_nowait(parts)` that calls `_on_message` with what arrives.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Generator, Sequence, TypeVar

import zmq

from .. import _results as R
from .. import errors as E
from .. import protocol as P
from .._pending import AwaitablePending, Pending
from ..ring import RingLink
from ._session import Op, Session

__all__ = ["LoopSession", "SPIN_S", "FAIR_S", "YIELD", "IDLE", "BELL"]

#: How long a waiter, or the reaper, polls the ring for a completion before it sleeps.
SPIN_S = 30e-6
#: An await answered without sleeping yields to the event loop at least this often, not
#: every time (a loop pass costs more than a ring reply): other tasks are never starved.
FAIR_S = 1e-3

#: What the ring reaper waits for next (`LoopSession._reaper`): let other tasks run;
#: nothing is outstanding, so wait for `_kick_ring`; the completion doorbell is armed,
#: so wait until the ring link's `cbell_fd` is readable.
YIELD, IDLE, BELL = "yield", "idle", "bell"

T = TypeVar("T")


class LoopSession(Session):
    """A session driven by an event loop: operations are coroutines, requests are awaitable."""

    #: The daemon makes the ring's completion doorbell (a pipe) only when asked: an
    #: event loop can poll a pipe, but cannot sleep on the ring's futex.
    _completion_bell = True

    def __init__(self, endpoint: str, sock: zmq.Socket[bytes], pending_cls: type[AwaitablePending], liveness_timeout: float,
                 max_inflight: int) -> None:
        super().__init__(endpoint, pending_cls, self._wait)
        self._sock = sock
        self._pump: Any = None  # the client's socket pump: send_nowait(parts)
        self._liveness_timeout = liveness_timeout
        self._core.max_inflight = max(1, max_inflight)
        #: Submitted, not yet handed to the ring or the socket (credits), in order.
        self._held: deque[P.Request] = deque()
        self._core.hold_while(self._held)  # (a request submitted now goes after those)
        self._core.sub.kick = self._kick_ring  # the reaper: a native submit pushed descriptors
        self._last_rx = time.monotonic()
        self._closed = False
        self._yielded_at = time.perf_counter()

    async def _checkpoint(self) -> None:
        """A cancel point always; a schedule point only if this client has not yielded for
        `FAIR_S`: a ring reply reaped in the waiter then costs no pass of the event loop
        (more than the reply costs), and `while True: await c.copy(...)` still lets the
        program's other tasks (and this client's heartbeats) run."""
        now = time.perf_counter()
        if now - self._yielded_at > FAIR_S:
            self._yielded_at = now
            await self._yield()
        else:
            await self._cancel_point()

    # --- what each loop supplies ------------------------------------------------------------
    async def _yield(self) -> None:
        """Let the loop run its other tasks (a schedule point, and a cancel point)."""
        raise NotImplementedError

    async def _cancel_point(self) -> None:
        """Raise if the task was cancelled; never suspends."""
        raise NotImplementedError

    async def _sleep(self, p: Pending, timeout: float | None) -> None:
        """Until `p` finishes (its `_waker` is set) or `timeout` passes; return either way."""
        raise NotImplementedError

    def _kick_ring(self) -> None:
        """Wake the reaper: descriptors went out."""
        raise NotImplementedError

    def _spawn_reaper(self, link: RingLink) -> None:
        """Start a background task that drives `_reaper(link)`."""
        raise NotImplementedError

    # --- the API's remaining method -----------------------------------------------------------
    def poll(self) -> int:
        """Take in what the ring has completed (the socket's replies come in by themselves);
        return how many requests are still pending."""
        self._core.check_usable()
        if self._core.reap_ring():
            self._release_held()
        return len(self._core.pending)

    # --- how these clients wait: awaiting ---------------------------------------------------
    def _run(self, op: Op[T], timeout: float | None = None) -> Any:
        return self._drive(op, timeout)

    async def _drive(self, op: Op[T], timeout: float | None) -> T:
        """Run an operation, awaiting each request it yields."""
        deadline = None if timeout is None else time.monotonic() + timeout
        failed: BaseException | None = None
        scheduled = False  # one checkpoint per operation: the first wait that sleeps, or the end
        while True:
            try:
                p = op.throw(failed) if failed is not None else op.send(None)
            except StopIteration as stop:
                if not scheduled:
                    await self._checkpoint()
                result: T = stop.value
                return result
            failed = None
            try:
                scheduled = await self._await(p, None if deadline is None else max(0.0, deadline - time.monotonic())) or scheduled
            except BaseException as exc:  # thrown in (a cancellation too): the operation may clean up
                failed = exc
                scheduled = True

    async def _wait(self, p: Pending, timeout: float | None) -> None:
        """`await p`: one checkpoint, whether or not it had to sleep."""
        if not await self._await(p, timeout):
            await self._checkpoint()

    async def _await(self, p: Pending, timeout: float | None) -> bool:
        """Wait for `p`; True if that yielded to the loop (slept), False if it never had to
        (the caller owes its task a checkpoint: `_drive` makes one per operation)."""
        if self._batch:  # requests held back by batch() must leave before we can wait on them
            reqs, self._batch = self._batch, []
            self._send(reqs)
        link = self._core.ring
        if not p._done and link is not None and p.id in link.outstanding:
            # On the ring, the answer is usually microseconds away: reap it here rather than
            # hop through the reaper task (two task switches and a doorbell).
            # The spin is the queue's own (native: without the GIL, yielding the CPU every
            # 5 us, so a daemon worker that shares our core gets to answer).
            until = time.perf_counter() + SPIN_S
            while not p._done and (left := until - time.perf_counter()) > 0:
                if link.ring.wait(timeout=left, spin=left) and self._core.reap_ring():
                    self._release_held()
        if not p._done:
            try:
                await self._sleep(p, timeout)
            finally:
                self._yielded_at = time.perf_counter()
            if not p._done:
                raise E.RequestTimeout(f"no reply within {timeout}s")
            return True
        return False

    # --- how these clients move bytes: queued for the tasks ---------------------------------
    def _send(self, reqs: Sequence[P.Request]) -> None:
        self._held.extend(reqs)
        self._release_held()

    def _release_held(self) -> None:
        """Hand held requests, in order, to the ring or the socket as far as credits go."""
        held, core = self._held, self._core
        if not held:
            return
        unsent = core.unsent(held, self._batch)
        while held:
            link = core.ring
            after = None if link is None else core.ring_route([held[0]], unsent)
            if link is not None and after is not None:
                n = link.fitting(held)
                if n == 0:
                    return  # the ring is full: the reaper calls again as completions come
                chunk = [held.popleft()] if n == 1 else [held.popleft() for _ in range(n)]
                # A field out of range fails those requests (fence() reports them), nothing else.
                link.push(chunk, core.pending, self._no_credits, after, core.unobserved)
                self._kick_ring()
            else:
                room = core.socket_room(unsent)
                if room <= 0:
                    return  # out of credits: replies call again
                chunk = [held.popleft() for _ in range(min(room, len(held)))]
                for frame in core.encode(chunk):
                    self._pump.send_nowait([frame])
                    core.sub.frames += 1
            if held:
                unsent -= core.unsent(chunk, None)

    @staticmethod
    def _no_credits(need: int) -> None:
        raise AssertionError("pushed beyond the ring's credits")  # (`_release_held` pushes within them)

    def _on_message(self, parts: list[bytes]) -> None:
        """The pump's delivery: replies finish their requests, and free credits."""
        self._last_rx = time.monotonic()
        for part in parts:
            self._core.on_frame(part)
        self._release_held()

    def _link(self, info: R.RingOpened | R.ChannelOpened) -> RingLink:
        link = self._map(info)
        self._spawn_reaper(link)
        return link

    # --- background work, sans waiting ----------------------------------------------------------
    def _reaper(self, link: RingLink) -> Generator[str, None, None]:
        """Finish ring requests as completions come: reap; if none, arm the completion
        inbox, re-check (the daemon's push either sees the armed word and rings the
        doorbell, or our re-check sees its completion), then sleep until the doorbell
        is readable. Yields what to wait for (YIELD, IDLE, BELL); ends with the ring."""
        core, ring = self._core, link.ring
        while core.broken is None:
            if core.reap_ring():
                self._release_held()
                yield YIELD
                continue
            if not link.outstanding:
                yield IDLE
                continue
            # A short spin first: a completion due within microseconds costs no doorbell,
            # no epoll round and no wakeup (the daemon's worker answers most that fast).
            ring.wait(timeout=SPIN_S, spin=SPIN_S)
            if ring.arm():
                ring.disarm()
                continue
            if ring.peer_closed:
                core.ring_closed()
                return
            # No timeout needed: the daemon holds the pipe's only write end, so its end of the
            # session (or its death) makes the pipe readable with EOF; liveness covers the rest.
            yield BELL
            gone = link.drain_bell()
            ring.disarm()
            if gone:  # the daemon closed its end: the session ended, or the daemon died
                core.reap_ring()
                if ring.peer_closed:
                    core.ring_closed()
                else:
                    core.fail_all(E.ConnectionLost(f"the daemon (pid {core.server_pid}) closed the ring's doorbell"))
                return

    def _heartbeat(self) -> bool:
        """One liveness beat: ping the daemon, or fail the session (and return False) when
        it has been silent longer than the liveness timeout."""
        if time.monotonic() - self._last_rx > self._liveness_timeout:
            self._core.fail_all(E.ConnectionLost(f"the daemon at {self.endpoint} has not answered for {self._liveness_timeout}s"))
            return False
        self._send([self._core.ping()])
        return True

    def _daemon_exited(self) -> None:
        """The daemon's pidfd turned readable: it is gone, and every request with it."""
        self._core.fail_all(E.ConnectionLost(f"the daemon (pid {self.server_pid}) exited"))
