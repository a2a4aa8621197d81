"""A session's order across its two transports, sans I/O: every rule in one place.

A same-host session sends requests on its control socket and on its ring. The daemon must
execute them as if one at a time, in the order the client submitted them; the two
transports are read independently, so three rules keep that order:

1. **The client's route** (`route`): a call's requests take the ring only if nothing the
   client sent on the socket is still pending, or, where the daemon orders descriptors
   after socket frames (`after`), with a fence: the first descriptor carries `FLAG_AFTER`
   and the number of socket frames the client has sent so far, which must be read first.
2. **Ring after socket** (`fences`, `first_held`): a descriptor waits until the daemon has
   read as many of the session's socket frames as the highest fence at or before it names
   (a fence holds every descriptor after it too). The native workers never serve a fenced
   descriptor: they hand the ring to the event loop there, which applies this rule.
3. **Socket after ring** (`frame_waits`): a socket frame that arrives while the ring holds
   descriptors published before it, which the worker has not yet done, waits until the
   worker's done index reaches the tail the client had published (or, if the worker hands
   the ring over first, those descriptors are queued ahead of the frame). A session on
   another host publishes into a ring of its own, which a data channel carries to the
   daemon's (docs/ring.md, "Remote rings"): the frame's own RingMark then names that tail,
   since descriptors pushed before the frame may reach the daemon after it.

The client's Python (`ClientCore.ring_route`) and the daemon's (`server/_rings.py`) follow
these functions; the native submission (`native/submission.c`, its `route`) and the native
workers (`native/dataplane.c`, `TDP_WHY_AFTER`) follow the same rules, and the equivalence
properties hold them to one answer (tests/unit/client/test_submission.py, tests/integration/test_ring_daemon.py,
tests/unit/ring/test_ring_order.py).
"""

from __future__ import annotations

import numpy as np

from ._layout import FLAG_AFTER

__all__ = ["route", "fences", "first_held", "frame_waits", "plausible"]


def route(pending: int, outstanding: int, unsent: int, frames: int, after: bool) -> int | None:
    """Where a call's requests go: None for the socket, else the ring, with the socket
    frame count its first descriptor waits for (0: none).

    `pending`: requests in the client's pending table; `outstanding`: those of them on the
    ring; `unsent`: those not handed to any transport yet (the call's own among them);
    `frames`: socket frames sent so far; `after`: the daemon honours `FLAG_AFTER`."""
    if pending - outstanding == unsent:
        return 0  # nothing sent on the socket is pending: the ring keeps order with itself
    return frames if after else None


def fences(flags: np.ndarray, arg2: np.ndarray, floor: int) -> np.ndarray:
    """Per descriptor, the socket frames the daemon must have read before it runs: the
    highest fence (`arg2` of a `FLAG_AFTER` descriptor) at or before it, and at least
    `floor` (what the ring's earlier descriptors waited for)."""
    flagged = (flags & FLAG_AFTER) != 0
    return np.maximum(np.maximum.accumulate(np.where(flagged, arg2, np.uint64(0))), np.uint64(floor))


def first_held(fence: np.ndarray, frames_seen: int) -> int | None:
    """The first descriptor whose fence names a frame not read yet (it and every one after
    it wait for that frame), or None when all may go."""
    held = np.flatnonzero(fence > np.uint64(frames_seen))
    return int(held[0]) if len(held) else None


def plausible(tail: int, done: int, capacity: int) -> bool:
    """Whether a client's published tail can be real, against the worker's done index: at
    most two rings' worth ahead. One is the requests in flight (the client's credits); the
    other, those the worker has answered but not yet counted: it pushes a batch's
    completions before it publishes `done`, and in between the client may take them and
    push as many again (a frame that read that tail as impossible went ahead of them)."""
    return 0 <= tail - done <= 2 * capacity


def frame_waits(tail: int, done: int, capacity: int) -> int | None:
    """The ring index a socket frame arriving now waits for: the tail the client published,
    when the worker has not done everything before it; None when it has, or when the tail
    is impossible (`plausible`: the worker reports that one)."""
    return tail if tail != done and plausible(tail, done, capacity) else None
