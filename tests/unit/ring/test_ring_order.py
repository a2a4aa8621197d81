"""The daemon's merge of a session's two request paths, sans I/O: socket frames and ring
descriptors end up in its queue in the order the client submitted them (docs/ring.md).

The client pushes on the ring while requests it sent on the socket are pending; the first
descriptor pushed after a new frame carries `FLAG_AFTER` with the frames sent so far. The
daemon reads frames and the ring in whatever order they reach it: frames it reads while a
native worker still has descriptors to do wait for them (`ring_wait`), and what the worker
hands over goes ahead of the frames sent after it. Here a real ring in shared memory is
driven through `Rings` with every schedule hypothesis can find; the whole daemon's version
of the same property is `test_ring_daemon.py`'s submission-order test.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import trio
from hypothesis import example, given, settings, strategies as st

from transfer import protocol as P
from transfer.ring import FLAG_AFTER, REQUEST_DTYPE, Op, Ring
from transfer.ring import _order as order
from transfer.server._accounting import Accounting
from transfer.server._config import DaemonConfig
from transfer.server._dataplane import NATIVE, PYTHON, DataPlane
from transfer.server._metrics import Metrics
from transfer.server._ops import SOCKET
from transfer.server._rings import Rings
from transfer.server._session import Session

#: A schedule's steps: the client's next submission, a frame read, a poll of the ring, the
#: worker's handover (rarer: the native window ends with it).
_STEPS = ["client"] * 4 + ["arrive"] * 3 + ["poll"] * 2 + ["handover"]


class _Worker:
    """A native worker as the loop sees it, that has served nothing yet: every descriptor
    reaches the loop once it hands the ring over (as at a fenced one)."""

    def __init__(self, tail: Callable[[], int]) -> None:
        self.mode = NATIVE
        self.done = 0
        self.tail = tail

    def watch(self, index: int) -> int:
        return self.done

    def take_signal(self) -> bool:
        return False


class _Model:
    def __init__(self, native: bool) -> None:
        config, accounting = DaemonConfig(ring_workers=False), Accounting(Metrics(process=False))
        self.rings = Rings(config, lambda: "t", accounting, None, DataPlane(config, accounting))  # type: ignore[arg-type]
        self.server = Ring.create(None, capacity=256)
        self.client = Ring.attach(self.server.fd)
        self.session = Session(b"s", "t", 0)
        self.session.ring = self.server
        self.session.frames_seen = 1  # the hello
        self.pushed = 0
        self.worker: _Worker | None = None
        if native:
            self.worker = _Worker(lambda: self.pushed)
            self.session.worker = self.worker
        # The client: frames sent (hello included), the fence last pushed, ids in submission order.
        self.sent: list[int] = []
        self.frames = 1
        self.fenced = 0
        self.next_id = 1
        self.order: list[int] = []

    def close(self) -> None:
        self.client.close()
        self.server.close()

    # --- the client --------------------------------------------------------------------------
    def submit(self, frame: bool) -> None:
        rid = self.next_id
        self.next_id += 1
        self.order.append(rid)
        if frame:
            self.sent.append(rid)
            self.frames += 1
            return
        d = np.zeros(1, REQUEST_DTYPE)
        d["op"], d["id"] = Op.FENCE, rid
        if self.frames > 1 and self.frames > self.fenced:  # socket requests pending (all are, here)
            d["flags"], d["arg2"] = FLAG_AFTER, self.frames
            self.fenced = self.frames
        assert self.client.push_many(d) == 1
        self.pushed += 1

    # --- the daemon (what `Front.on_message` does with a frame) -------------------------------
    def arrive(self) -> bool:
        read = self.session.frames_seen - 1
        if read >= len(self.sent):
            return False
        rings, session = self.rings, self.session
        rings.before_frame(session)
        session.queue.append((P.Fence(self.sent[read], 0), SOCKET))
        session.frames_seen += 1
        if session.ring_held is not None:
            rings.after_frame(session)
        return True

    def handover(self) -> None:
        if self.worker is not None and self.worker.mode == NATIVE:
            self.worker.mode = PYTHON
        if self.session.ring_wait is not None:
            trio.run(self.rings.catch_up, self.session)

    def finish(self) -> list[int]:
        self.handover()
        while self.arrive():
            pass
        self.rings.ingest(self.session)
        return [r.id for r, _ in self.session.queue]


@settings(max_examples=300, deadline=None)
@given(native=st.booleans(), frames=st.lists(st.booleans(), min_size=1, max_size=40), steps=st.lists(st.sampled_from(_STEPS), max_size=120))
@example(native=True, frames=[True, False, True], steps=["client"] * 3 + ["arrive"] * 2)  # a descriptor between two waiting frames
@example(native=True, frames=[True, False, True, False, True], steps=["client"] * 5 + ["arrive"] * 3)  # two, in one take
def test_requests_are_queued_in_submission_order(native: bool, frames: list[bool], steps: list[str]) -> None:
    m = _Model(native)
    try:
        ops = iter(frames)
        for step in steps:
            if step == "client":
                frame = next(ops, None)
                if frame is not None:
                    m.submit(frame)
            elif step == "arrive":
                m.arrive()
            elif step == "poll":
                m.rings.ingest(m.session)
            else:
                m.handover()
        for frame in ops:
            m.submit(frame)
        assert m.finish() == m.order
        assert m.session.ring_held is None and not m.session.waiting_frames
    finally:
        m.close()


def test_a_fence_never_reached_holds_only_its_own_ring() -> None:
    """A hostile fence (a frame that never comes) holds its descriptor and every one after
    it, and nothing else: the session's frames still queue, and closing the ring drops them."""
    m = _Model(native=False)
    try:
        m.submit(frame=True)
        d = np.zeros(3, REQUEST_DTYPE)
        d["op"], d["id"] = Op.FENCE, [100, 101, 102]
        d["flags"][1], d["arg2"][1] = FLAG_AFTER, 1 << 62
        assert m.client.push_many(d) == 3
        assert m.rings.ingest(m.session) == 1  # queued: the one before the fence
        assert [r.id for r, _ in m.session.queue] == [100]
        assert m.arrive()
        assert [r.id for r, _ in m.session.queue] == [100, 1]
        assert m.session.ring_held is not None and len(m.session.ring_held) == 2
        assert m.rings.ingest(m.session) == 0
        m.rings.close(m.session)  # (the session's end)
        assert m.session.ring_held is None
    finally:
        m.client.close()


def test_a_frame_waits_for_a_tail_past_completions_not_yet_counted() -> None:
    """The worker pushes a batch's completions before it publishes `done`: in between, its
    client may take them and push a ring's worth more, and a frame arriving then must wait
    for all of it (it went ahead of those descriptors, under load, when a tail more than one
    ring ahead of `done` read as impossible). Past two rings, a tail is impossible."""
    cap = 2
    assert order.frame_waits(4, 0, cap) == 4  # two answered but not counted, two pushed since
    assert order.frame_waits(3, 1, cap) == 3
    assert order.frame_waits(2, 2, cap) is None  # all done
    assert order.frame_waits(5, 0, cap) is None and not order.plausible(5, 0, cap)
    assert not order.plausible(0, 1, cap)  # behind what was done: impossible too
