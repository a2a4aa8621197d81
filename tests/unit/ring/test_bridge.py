"""The native bridge (native/bridge.c): a ring's far end carried over a stream socket.

Two rings in this process joined by a socketpair, each with a bridge on its far half (as
a remote client and its daemon have): what one side pushes, the other pops, byte for byte,
however the stream cuts it; and when the stream ends, each side's user sees its peer closed.
"""

from __future__ import annotations

import os
import socket
from typing import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer._native import Bridge
from transfer.ring import COMPLETION_DTYPE, REQUEST_DTYPE, Ring
from transfer.ring._channel import Channel
from transfer.ring._layout import OFF_CLIENT_CLOSED

CAP = 64


class Pair:
    """A client's ring and a daemon's ring, bridged over one socketpair."""

    def __init__(self) -> None:
        a, b = socket.socketpair()
        self.client = Ring.create(None, CAP, role="client")
        self.daemon = Ring.create(None, CAP, role="server")
        self.client_end = Channel(self.client.fd, "server", a, 7)  # plays the daemon on the client
        self.daemon_end = Channel(self.daemon.fd, "client", b, 9)  # plays the client on the daemon

    def close(self) -> None:
        for ch in (self.client_end, self.daemon_end):
            ch.close()
        self.client.close()
        self.daemon.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def _pop(ring: Ring, n: int) -> np.ndarray:
    """Wait for n slots (the futex; the bridge wakes it), then pop them."""
    got = []
    while sum(len(g) for g in got) < n:
        assert ring.wait(timeout=30, need=1) >= 1, "nothing came"
        got.append(ring.pop_many(n - sum(len(g) for g in got)))
    return np.concatenate(got).astype(ring.in_dtype)  # (concatenate repacks the fields: astype restores the layout)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_slots_cross_in_both_directions_byte_for_byte(data: st.DataObject) -> None:
    p = Pair()
    try:
        for _ in range(data.draw(st.integers(1, 4))):
            n = data.draw(st.integers(1, CAP))
            descs = np.frombuffer(os.urandom(n * REQUEST_DTYPE.itemsize), REQUEST_DTYPE)
            assert p.client.push_many(descs) == n
            got = _pop(p.daemon, n)
            assert got.tobytes() == descs.tobytes()
            comps = np.frombuffer(os.urandom(n * COMPLETION_DTYPE.itemsize), COMPLETION_DTYPE)
            assert p.daemon.push_many(comps) == n
            assert _pop(p.client, n).tobytes() == comps.tobytes()
    finally:
        p.close()


def test_more_than_a_ring_waits_for_room_and_loses_nothing(pair: Pair) -> None:
    """A producer faster than the far consumer: the bridge waits for room, TCP holds the rest."""
    total = CAP * 8
    descs = np.zeros(total, REQUEST_DTYPE)
    descs["id"] = np.arange(1, total + 1)
    pushed = 0
    seen: list[int] = []
    while len(seen) < total:
        if pushed < total:
            pushed += pair.client.push_many(descs[pushed:pushed + CAP])
        if pair.daemon.available():
            seen += pair.daemon.pop_many(CAP)["id"].tolist()
        else:
            pair.daemon.wait(timeout=0.05)
    assert seen == list(range(1, total + 1))


def test_a_slot_cut_across_reads_arrives_whole() -> None:
    ring = Ring.create(None, CAP, role="server")
    a, b = socket.socketpair()
    end = Channel(ring.fd, "client", b, 9)
    try:
        desc = np.frombuffer(os.urandom(REQUEST_DTYPE.itemsize * 2), REQUEST_DTYPE)
        raw = desc.tobytes()
        a.sendall(raw[:10])
        a.sendall(raw[10:70])  # the first slot, and 6 bytes of the second
        assert _pop(ring, 1).tobytes() == raw[:64]
        assert ring.available() == 0  # (not half a slot)
        a.sendall(raw[70:])
        assert _pop(ring, 1).tobytes() == raw[64:]
        assert end.counters()["received"] == 2
    finally:
        a.close()
        end.close()
        ring.close()


def test_the_stream_s_end_closes_the_ring_for_its_user() -> None:
    ring = Ring.create(None, CAP, role="server")
    a, b = socket.socketpair()
    end = Channel(ring.fd, "client", b, 9)
    try:
        assert not ring.peer_closed
        a.close()  # the peer went
        assert ring.wait(timeout=30) == 0  # woken by the end, not by data
        assert ring.peer_closed and ring.close_reason == 9
        assert end.ended and end.bridge.why == -1
    finally:
        end.close()
        ring.close()


def test_a_bridge_takes_one_ring_s_two_queues_in_the_right_roles() -> None:
    r1 = Ring.create(None, CAP, role="server")
    r2 = Ring.create(None, CAP, role="server")
    a, b = socket.socketpair()
    try:
        with pytest.raises(TypeError):  # a consumer for `into`, a producer for `out`
            Bridge(r1.outbox, r1.inbox, a.fileno(), OFF_CLIENT_CLOSED, 1)
        far1, far2 = Ring.attach(r1.fd, role="client"), Ring.attach(r2.fd, role="client")
        with pytest.raises(ValueError, match="one ring"):
            Bridge(far1.inbox, far2.outbox, a.fileno(), OFF_CLIENT_CLOSED, 1)
        with pytest.raises(ValueError, match="closed"):
            Bridge(far1.inbox, far1.outbox, a.fileno(), 1 << 40, 1)
        with pytest.raises(ValueError, match="reason"):
            Bridge(far1.inbox, far1.outbox, a.fileno(), OFF_CLIENT_CLOSED, 0)
        bridge = Bridge(far1.inbox, far1.outbox, a.detach(), OFF_CLIENT_CLOSED, 1)  # (the fd is the bridge's)
        with pytest.raises(RuntimeError):  # its queues are the bridge's until it stops
            far1.inbox.close()
        with pytest.raises(ValueError, match="already served"):
            Bridge(far1.inbox, far1.outbox, b.fileno(), OFF_CLIENT_CLOSED, 1)
        bridge.stop()
        far1.close()
        far2.close()
    finally:
        b.close()
        r1.close()
        r2.close()
