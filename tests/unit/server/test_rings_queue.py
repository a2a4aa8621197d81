"""server/_rings.py's placing of ring requests among a session's queued frames: what a worker
hands over goes ahead of the frames its client sent after it, and a frame's own requests keep
their order, however many requests the pass took from the queue's head since the frame came."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from transfer import protocol as P
from transfer.server._ops import RING, SOCKET
from transfer.server._rings import Rings
from transfer.server._session import Session


def _session() -> Session:
    s = Session(b"id", "c", 1)
    s.queue = deque()
    return s


def _rings() -> Any:
    r = Rings.__new__(Rings)  # (only `_queue` and its accounting are used)
    r.accounting = SimpleNamespace(received=lambda session, n: None)
    return r


@given(earlier=st.integers(0, 6), taken=st.integers(0, 6), frame=st.integers(1, 4), ring=st.integers(1, 3))
def test_ring_requests_go_ahead_of_the_waiting_frame_and_the_frame_keeps_its_order(earlier: int, taken: int, frame: int, ring: int) -> None:
    """`earlier` requests queued before a frame of `frame` requests that waits for the ring;
    the pass then takes up to `taken` from the head (the earlier ones); then the worker's
    `ring` requests are placed: exactly between what was before the frame and the frame, the
    frame's own requests still in order (a stale index once rotated the queue past them)."""
    rings, s = _rings(), _session()
    before = [(P.Fence(100 + k), SOCKET) for k in range(earlier)]
    s.queue.extend(before)
    s.waiting_frames.append((1, s.queue_taken + len(s.queue)))
    mine = [(P.Define(200 + k, P.DEF_FREE, 0, 0, 1 << 40, ""), SOCKET) for k in range(frame)]
    s.queue.extend(mine)
    took = min(taken, earlier)
    for _ in range(took):
        s.queue.popleft()
        s.queue_taken += 1
    items = [(P.Copy(300 + k, 1, 2, 3), RING) for k in range(ring)]
    rings._queue(s, items, 0)
    assert list(s.queue) == [*before[took:], *items, *mine]
