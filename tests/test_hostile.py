"""Hostile clients: none can take the daemon down, exhaust it, or act in another's name.

Each test runs a real transferd and real client processes or sockets, and
names the item of the issue it proves (docs/security.md lists them).
"""

from __future__ import annotations

import os
import socket as pysocket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

import transfer
from transfer import protocol as P

BIG = P.Limits(max_frame_bytes=1 << 30, max_batch=1 << 24)


def raw(endpoint: str, routing_id: bytes | None = None, timeout_ms: int = 5000) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, timeout_ms)
    if routing_id is not None:
        s.setsockopt(zmq.ROUTING_ID, routing_id)
    s.connect(endpoint)
    return s


def call(s: zmq.Socket, *reqs: P.Request) -> list[P.Reply]:
    """Send one frame, collect the replies to every request in it (in any number of frames)."""
    s.send(P.encode_requests(reqs))
    want = {r.id for r in reqs}
    out: dict[int, P.Reply] = {}
    while want - out.keys():
        for r in P.decode_replies(s.recv(), BIG):
            out[r.id] = r
    return [out[r.id] for r in reqs]


def ok(reply: P.Reply) -> object:
    assert reply.error is None, reply.error
    return reply.result


def hello(s: zmq.Socket, name: str = "raw", pid: int = 0) -> dict:
    (r,) = call(s, P.Hello(1, P.VERSION, name, pid, b""))
    return ok(r)  # type: ignore[return-value]


# --- 2: a guest's Unregister/Free detaches it; the owner's memory and quota stay ----------------
def test_guest_free_detaches_and_leaves_the_owner_alone(daemon_factory) -> None:
    d = daemon_factory("--max-host-bytes-per-session", "64KiB", "--max-device-bytes-per-session", "64KiB")
    with transfer.connect(d.endpoint) as owner, transfer.connect(d.endpoint) as guest:
        seg = owner.segment(64 << 10)
        buf = owner.alloc(64 << 10)
        owner.fill(buf, 64 << 10, 7).result()
        shared_seg = guest.attach(owner.share(seg))
        shared_buf = guest.attach(owner.share(buf))
        guest.fill(shared_seg, 16, 1).result()  # the guest may use it while attached
        # The guest "frees" the owner's segment and buffer: it only detaches.
        guest._call(P.Unregister, shared_seg.va)
        guest._call(P.Free, shared_buf.va)
        with pytest.raises(transfer.NotOwner):
            guest.fill(shared_seg, 16, 2).result()
        with pytest.raises(transfer.NotOwner):
            guest.checksum(shared_buf, 16).result()
        # The owner's memory still works...
        owner.fill(seg, 64 << 10, 5).result()
        assert (seg.buffer == 5).all()
        assert owner.checksum(buf).result() == transfer.checksum64(np.full(64 << 10, 7, np.uint8))
        # ...and its quota accounting is unchanged: it is still full for the owner,
        with pytest.raises(transfer.QuotaExceeded):
            owner.segment(4096)
        # and the guest gained no credit from "freeing" what was never its own.
        guest.segment(64 << 10)
        with pytest.raises(transfer.QuotaExceeded):
            guest.segment(4096)
        assert owner.stats()["daemon"]["segments"] == 3


# --- 7: a session's identity comes from the transport, never from the client's routing id --------
def test_ipc_client_cannot_forge_a_curve_identity(daemon_factory, tmp_path: Path) -> None:
    from transfer.cli._keys import keygen

    keys = tmp_path / "curve"
    keygen(keys, ["good"])
    with pysocket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tcp = f"tcp://127.0.0.1:{port}"
    d = daemon_factory("--endpoint", tcp, "--curve-dir", str(keys))
    with transfer.connect(tcp, server_key=str(keys / "server.key"), client_keys=str(keys / "clients" / "good.key_secret")) as remote:
        rseg = remote.alloc(4096)
        remote.fill(rseg, 4096, 3).result()
        victim = raw(d.endpoint, routing_id=b"victim")
        hello(victim, "victim")
        (r,) = call(victim, P.Alloc(2, 4096, -1))
        vva = ok(r)["va"]  # type: ignore[index]
        # A local client whose routing id looks like the CURVE socket's prefix, and one
        # that is the CURVE prefix plus the victim's routing id.
        for rid in (b"\x01forged", b"\x01victim"):
            s = raw(d.endpoint, routing_id=rid)
            # It has no session: it cannot reach the victim's (or the remote client's).
            (r,) = call(s, P.Fill(5, vva, 16, 1))
            assert r.error is not None and r.error.code == transfer.NoSession.code
            hello(s, "forger")
            # It is a local session: it may open a ring (CURVE sessions may not)...
            (r,) = call(s, P.OpenRing(2, 64))
            assert ok(r)["capacity"] >= 64  # type: ignore[index]
            # ...and it still cannot touch the victim's buffer.
            (r,) = call(s, P.Fill(3, vva, 16, 1))
            assert r.error is not None and r.error.code == transfer.NotOwner.code
            ok(call(s, P.Close(4))[0])
            s.close(0)
        # The CURVE session and the victim are unaffected; a CURVE session has no ring.
        assert remote.checksum(rseg).result() == transfer.checksum64(np.full(4096, 3, np.uint8))
        with pytest.raises(transfer.RingUnavailable):
            remote._call(P.OpenRing, 64)
        (r,) = call(victim, P.Checksum(6, vva, 16))
        assert ok(r) == transfer.checksum64(np.zeros(16, np.uint8))
        victim.close(0)


# --- 10: the documented limits are the ones a client meets ---------------------------------------
def test_too_many_requests_in_one_frame_is_batch_too_large(daemon_factory) -> None:
    d = daemon_factory("--max-frame-bytes", "16MiB", "--max-bin", "4MiB")
    s = raw(d.endpoint)
    hello(s)
    n = P.Limits().max_batch + 1
    s.send(P.encode_requests([P.Ping(i + 2) for i in range(n)]))
    replies = P.decode_replies(s.recv(), BIG)
    assert len(replies) == 1 and replies[0].error is not None
    assert replies[0].error.code == transfer.BatchTooLarge.code, replies[0].error
    ok(call(s, P.Ping(2))[0])  # the session still works
    s.close(0)
