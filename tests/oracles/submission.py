"""A client's submission state in Python: the oracle of transfer._native.Submission
(native/submission.c), held to it by tests/unit/client/test_submission.py: the same ids, errors,
descriptors, frames, tables and counts.

What routing and credits read and write lives in one object: the next request id, the socket
frames sent, the ring's credits and descriptors in flight, the last fence pushed, and the
pending and outstanding tables (the client's own dicts). `route` decides ring or socket,
`push` publishes within the credits and counts what went out. The native one's `submit`
makes, routes and pushes one data request in one call; this one's declines every request,
and the client's general path (`ClientCore.prepare`, then `_send`) does the same work
through `route` and `push`.
"""

from __future__ import annotations

from typing import Any, Callable, Sized

from transfer.ring._order import route

__all__ = ["PySubmission"]


class PySubmission:
    """The pure-Python twin of the native `Submission`."""

    __slots__ = ("_pending", "_pending_cls", "_waiter", "_outbox", "_push", "_outstanding", "_kinds", "_sums", "_buffers",
                 "_holds", "_shift", "kick", "next_id", "frames", "fenced", "pushed", "in_flight", "credits", "after",
                 "batching", "broken", "elsewhere")

    def __init__(self, pending: dict[int, Any], pending_cls: type, waiter: Callable[..., Any]) -> None:
        self._pending = pending
        self._pending_cls, self._waiter = pending_cls, waiter
        self._outbox: Any = None
        self._push: Callable[..., tuple[int, int, int]] | None = None
        self._outstanding: dict[int, Any] = {}
        self._kinds: dict[type, int] = {}
        self._sums: Any = None
        self._buffers: dict[int, Any] | None = None
        self._holds: tuple[Sized, ...] = ()
        self._shift = 40
        #: Called after submit publishes (an event loop's reaper), or None.
        self.kick: Callable[[], Any] | None = None
        self.next_id = 1
        self.frames = self.fenced = self.pushed = 0
        self.in_flight = self.credits = 0
        self.after = self.batching = self.broken = False
        #: Segment ids whose requests take the socket (the general path checks them here).
        self.elsewhere: set[int] | None = None

    def attach(self, outbox: Any, push: Callable[..., tuple[int, int, int]], outstanding: dict[int, Any], credits: int,
               chain: int, after: bool, kinds: dict[type, int], sums: Any) -> None:
        """The ring is open: its queue, push_requests, outstanding table, credits and the
        longest copy_many it carries (`chain`: the native submit's bound)."""
        if credits < 1 or not 1 <= chain <= credits:
            raise ValueError("attach: credits must be at least 1, and chain within 1..credits")
        self._outbox, self._push, self._outstanding = outbox, push, outstanding
        self._kinds, self._sums = kinds, sums
        self.credits, self.after = credits, bool(after)
        self.in_flight = self.fenced = self.pushed = 0

    def guard(self, lock: Any) -> None:
        """The client's lock, which the native `submit` takes while it works (the twin's
        declines without it: the general path takes the lock)."""

    #: Whether `submit` makes a Pending without calling its class (the native one learns
    #: how from one the class made; the twin makes none).
    templated = False

    def detach(self) -> None:
        """The ring is closed: everything takes the socket."""
        self._outbox = self._push = None

    def watch(self, buffers: dict[int, Any] | None, shift: int, holds: tuple[Sized, ...]) -> None:
        """What `submit` leaves to the general path (the native one reads these)."""
        self._buffers, self._shift, self._holds = buffers, shift, holds

    def route(self, unsent: int) -> int | None:
        """None for the socket, else the frame count the descriptors wait for (0: none).
        `unsent`: requests in the pending table not handed to any transport yet.

        The ring keeps order only with itself: while a request sent on the socket is
        pending, the daemon must read the frames sent so far before what is pushed now
        (`FLAG_AFTER`). A daemon that cannot (`after` false) gets ring requests only when
        nothing sent on the socket is pending."""
        if self._outbox is None:
            return None
        return route(len(self._pending), len(self._outstanding), unsent, self.frames, self.after)

    def push(self, reqs: list[Any], start: int, after: int) -> tuple[int, int, int]:
        """push_requests from reqs[start] within the credits left, the fence on the first
        descriptor unless an earlier push carried it (`after`: what route() gave), and what
        went out counted."""
        if self._push is None:
            raise ValueError("push: no ring attached")
        fence = after if after > self.fenced else 0
        taken, used, published = self._push(reqs, start, self._kinds, self.credits - self.in_flight, fence, self._pending,
                                             self._outstanding, self._sums)
        self.in_flight += published
        self.pushed += published
        if published and fence:
            self.fenced = fence
        return taken, used, published

    def submit(self, cls: type, args: tuple[Any, ...]) -> Any:
        """None: the general path takes every request here (the native one takes plain
        requests itself, as that path would, under the client's lock if it is free)."""
        return None
