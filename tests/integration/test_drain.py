"""A drain answers everything: work submitted before the stop signal is done within the grace,
whichever transport carried it, and anything after the signal gets ShuttingDown, on a ring
as on the socket. Real daemons, real signals, real rings."""

from __future__ import annotations

import signal

import numpy as np
import pytest
import zmq

import transfer
from transfer import protocol as P

from conftest import draining

MiB = 1 << 20
WORKERS = [pytest.param((), id="native-workers"), pytest.param(("--no-ring-workers",), id="event-loop")]


@pytest.mark.parametrize("extra", WORKERS)
def test_ring_work_pushed_before_the_signal_is_all_done(daemon_factory, extra: tuple[str, ...]) -> None:
    """50 copies of 4 MiB on the ring, then SIGTERM: every one completes (the ring is served
    up to what its client had published when the drain began), and the daemon exits 0."""
    d = daemon_factory("--shutdown-grace", "60", *extra)
    c = transfer.connect(d.endpoint, ring=True)
    try:
        assert c.ring
        src, dst = c.segment(4 * MiB), c.segment(4 * MiB)
        src.buffer[:] = np.arange(4 * MiB, dtype=np.uint8)
        pending = [c.copy(dst, src, 4 * MiB) for _ in range(50)]
        d.proc.send_signal(signal.SIGTERM)
        failed = []
        for p in pending:
            try:
                p.result(60)
            except transfer.TransferError as exc:
                failed.append(type(exc).__name__)
        assert failed == [], f"{len(failed)} of 50 ring copies failed: {sorted(set(failed))}"
        assert (dst.buffer == src.buffer).all()
    finally:
        c.close()
    assert d.proc.wait(60) == 0


@pytest.mark.parametrize("extra", WORKERS)
def test_requests_after_the_signal_get_shutting_down_on_ring_and_socket(daemon_factory, extra: tuple[str, ...]) -> None:
    """While another session's long queue keeps the daemon draining, a ring client's new
    requests fail with ShuttingDown (the documented error), never SessionClosed, and none is
    left unanswered."""
    d = daemon_factory("--shutdown-grace", "60", *extra)
    busy = zmq.Context.instance().socket(zmq.DEALER)
    busy.setsockopt(zmq.LINGER, 0)
    busy.connect(d.endpoint)
    c = transfer.connect(d.endpoint, ring=True)
    try:
        assert c.ring
        seg = c.segment(MiB)
        busy.send(P.encode_requests([P.Hello(1, P.VERSION, "busy", 0, b"")]))
        assert busy.poll(10_000)
        P.decode_replies(busy.recv())
        busy.send(P.encode_requests([P.Alloc(2, 32 * MiB, -1), P.Alloc(3, 32 * MiB, -1)]))
        a, b = (r.result["va"] for r in P.decode_replies(busy.recv()))
        # Seconds of copies queued on the busy session's socket: the drain lasts that long.
        busy.send(P.encode_requests([P.Copy(10 + i, a, b, 32 * MiB) for i in range(300)]))
        busy.send(P.encode_requests([P.Ping(5)]))  # answered at once, so once the copies are read
        while not any(r.id == 5 for r in P.decode_replies(busy.recv())):
            pass
        d.proc.send_signal(signal.SIGTERM)
        draining(d.endpoint)
        ring_reqs = [c.fill(seg, 4096, 1) for _ in range(20)]
        errors = set()
        for p in ring_reqs:
            with pytest.raises(transfer.TransferError) as info:
                p.result(60)
            errors.add(type(info.value))
        with pytest.raises(transfer.TransferError) as info:
            c.fence()
        errors.add(type(info.value))
        assert errors == {transfer.ShuttingDown}, errors
    finally:
        c.close()
        busy.close(0)
    assert d.proc.wait(120) == 0
