"""The shared client suite: every test body runs against the blocking client, the trio
client and the asyncio client (through tests/_clients.py's facades), with and without
the request ring."""

from __future__ import annotations

import inspect
import re
import time
from typing import Any, Iterator

import numpy as np
import pytest
import trio

import transfer
from transfer import protocol as P
from _clients import connect


@pytest.fixture
def daemon(shared_daemon: Any) -> Any:
    """This module's tests share one daemon (`conftest.shared_daemon`): none needs its own."""
    return shared_daemon

KINDS = ("sync", "trio", "asyncio")
VARIANTS = [(kind, ring) for kind in KINDS for ring in (False, True)]
IDS = [f"{kind}-ring" if ring else kind for kind, ring in VARIANTS]


@pytest.fixture(params=VARIANTS, ids=IDS)
def variant(request: pytest.FixtureRequest) -> tuple[str, bool]:
    return request.param


@pytest.fixture
def client(variant: tuple[str, bool], shared_daemon: Any) -> Iterator[Any]:
    kind, ring = variant
    with connect(kind, shared_daemon.endpoint, ring=ring) as c:
        assert c.ring is ring
        yield c


def test_segment_copy_checksum_fence(client: Any) -> None:
    seg = client.segment(1 << 20)
    x = seg.ndarray((256, 1024), np.float32)
    x[:] = np.arange(256 * 1024, dtype=np.float32).reshape(256, 1024)
    buf = client.alloc(seg.nbytes)
    assert client.copy(buf, seg).result() is None
    assert client.checksum(buf).result() == transfer.checksum64(x)
    client.copy(buf.va + 4096, seg.va, 4096).result(timeout=10)
    assert client.checksum(buf.va + 4096, 4096).result() == transfer.checksum64(seg.buffer[:4096])
    back = client.segment(64 * 64)
    pend = [client.copy(back.va + i * 64, buf.va + i * 64, 64) for i in range(64)]  # many in flight
    client.fence()
    assert all(p.done() for p in pend)
    assert np.array_equal(back.buffer, buf_bytes(client, buf, 64 * 64))
    client.free(back)
    with pytest.raises(transfer.SegmentFreed):
        back.buffer


def buf_bytes(client: Any, buf: Any, n: int) -> np.ndarray:
    out = client.segment(n)
    client.copy(out, buf.va, n).result()
    data = out.buffer.copy()
    client.free(out)
    return data


def test_copy_many_fill_and_batch(client: Any) -> None:
    n = 64
    seg = client.segment(n * 4096)
    seg.buffer[:] = np.arange(n * 4096) % 251
    buf = client.alloc(n * 4096)
    offs = np.arange(n, dtype=np.uint64) * 4096
    client.copy_many(buf.va + offs, seg.va + offs, np.full(n, 4096, np.uint64)).result()
    assert client.checksum(buf).result() == transfer.checksum64(seg.buffer)
    with pytest.raises(transfer.InvalidField, match="CopyV.stream"):  # refused at submission, ring or socket
        client.copy_many(buf.va + offs, seg.va + offs, np.full(n, 4096, np.uint64), stream=1 << 32)
    with client.batch():
        for i in range(8):
            client.fill(buf.va + i * 4096, 4096, i)
    client.fence()
    got = buf_bytes(client, buf, 8 * 4096).reshape(8, 4096)
    assert (got == np.arange(8, dtype=np.uint8)[:, None]).all()


def test_checksum_many(client: Any) -> None:
    n = 96
    seg = client.segment(n * 4096)
    seg.buffer[:] = np.arange(n * 4096) % 249
    srcs = seg.va + np.arange(n, dtype=np.uint64) * 4096
    sizes = np.array([4096 - (i % 7) for i in range(n)], np.uint64)  # odd tails too
    got = client.checksum_many(srcs, sizes).result()
    want = [transfer.checksum64(seg.buffer[i * 4096 : i * 4096 + int(sizes[i])]) for i in range(n)]
    assert got.dtype == np.uint64 and got.tolist() == want
    # Inside a batch, on a deferred buffer: its allocation goes first.
    buf = client.alloc(8192)
    with client.batch():
        client.fill(buf, 8192, 3)
        p = client.checksum_many([buf.va, buf.va + 4096], [4096, 4096])
    assert p.result().tolist() == [transfer.checksum64(bytes([3]) * 4096)] * 2
    # One bad range fails the whole, once: a later fence does not raise it again.
    bad = client.checksum_many([seg.va, 0xFFFFF0 << 40, seg.va], [64, 64, 64])
    good = client.checksum_many([seg.va, seg.va + 64], [64, 64])
    with pytest.raises(transfer.UnknownSegment):
        bad.result()
    assert good.result().tolist() == [transfer.checksum64(seg.buffer[i : i + 64]) for i in (0, 64)]
    client.fence()
    if client.ring:  # every range's completion came back, the failed one's too: no credit lost
        link = client._ring
        assert link.in_flight == 0 and not link.outstanding and not link.early
    # More ranges than the ring has credits: the socket carries them, answered the same.
    many = np.full(1500, seg.va, np.uint64) + (np.arange(1500, dtype=np.uint64) % n) * 4096
    want = [transfer.checksum64(seg.buffer[(i % n) * 4096 : (i % n) * 4096 + 64]) for i in range(1500)]
    assert client.checksum_many(many, np.full(1500, 64, np.uint64)).result().tolist() == want
    with pytest.raises(ValueError):
        client.checksum_many([seg.va], [1, 2])
    with pytest.raises(ValueError):
        client.checksum_many([], [])
    with pytest.raises(transfer.InvalidField):
        client.checksum_many([seg.va], [64], stream=1 << 32)


def test_compute_tensors_and_plans(client: Any) -> None:
    imgs = client.segment(2 * 3 * 8 * 8)
    imgs.ndarray((2, 3, 8, 8), np.uint8)[:] = 128
    out = client.segment(2 * 3 * 8 * 8 * 4)
    client.compute(
        "normalize",
        [imgs.tensor((2, 3, 8, 8), np.uint8)],
        [out.tensor((2, 3, 8, 8), np.float32)],
        {"mean": [64, 64, 64], "std": [32, 32, 32]},
    ).result()
    assert (out.ndarray((2, 3, 8, 8), np.float32) == 2.0).all()
    # Deferred: buffers, descriptors and plans are answered here and travel with first use.
    host = client.segment(2 * 4096)
    host.ndarray(1024, np.float32)[:] = 2.0
    # What the client hands to its socket or ring meanwhile (the heartbeat task of an event-
    # loop client pings every 0.2 s here, from its own thread: a beat may land in the window).
    inner = getattr(client, "_obj", client)  # the client behind the test's facade
    sent: list[Any] = []
    send = inner._send
    inner._send = lambda reqs: (sent.extend(reqs), send(reqs))[1]
    try:
        a, b = client.alloc(4096), client.alloc(4096)
        ta, tb = client.tensor(a, 1024, np.float32), client.tensor(b, 1024, np.float32)
        plan = client.plan("scale_add", {"a": 3.0})
    finally:
        del inner._send
    assert [type(r) for r in sent] == [P.Ping] * len(sent)  # nothing sent yet but heartbeats
    client.copy(a, host.va, 4096)
    client.compute(plan, [ta], [tb])
    client.copy(host.va + 4096, b.va, 4096)
    client.fence()
    assert (host.ndarray(1024, np.float32, offset=4096) == 6.0).all()
    plan.set(a=4.0)  # re-sent under a new version with its next use
    client.compute(plan, [ta], [tb])
    client.copy(host.va + 4096, b.va, 4096)
    client.fence()
    assert (host.ndarray(1024, np.float32, offset=4096) == 8.0).all()
    client.free(a)
    client.free(b)
    client.fill(host, 16, 0)
    client.fence()
    assert client.stats()["daemon"]["device_bytes"] == 0  # the frees travelled with that frame


def _errors(c: Any) -> list[tuple[str, str]]:
    """Bad requests of every kind: (class, message with the numbers taken out)."""
    seg = c.segment(4096)
    buf = c.alloc(4096)
    out: list[tuple[str, str]] = []

    def record(fn: Any) -> None:
        try:
            fn()
        except transfer.TransferError as exc:
            # Numbers differ between sessions; the creation site through the facade is its own file.
            msg = re.sub(r"\w+\.py:\d+", "FILE", str(exc))
            out.append((type(exc).__name__, re.sub(r"0x[0-9a-f]+|\d+", "N", msg)))
        else:
            out.append(("no error", ""))

    record(lambda: c.copy(seg.va, 999 << 40, 16).result())
    record(lambda: c.copy(buf.va, seg.va, 2 << 20).result())
    record(lambda: c.checksum(seg.va + 4096, 1).result())
    record(lambda: c.fill(seg.va, 16, 300).result())
    record(lambda: c.compute("no-such-op", [], []).result())
    record(lambda: c.alloc(1 << 50))
    record(lambda: seg.ndarray(8192))
    c.copy(seg.va, seg.va + 1, 4096)  # nobody looks at this one...
    record(lambda: c.fence())  # ...so the fence reports it
    record(lambda: c.fence())  # and only once
    c.free(seg)
    record(lambda: c.checksum(seg.va, 1).result())
    record(lambda: c.attach(b"\0" * 16))
    return out


@pytest.mark.parametrize("ring", [False, True], ids=["socket", "ring"])
def test_errors_are_the_same_class_and_message_on_both(daemon_factory: Any, ring: bool) -> None:
    daemon = daemon_factory()  # (its own: the errors name segment ids no earlier test may have used)
    got = {}
    for kind in KINDS:
        with connect(kind, daemon.endpoint, ring=ring) as c:
            got[kind] = _errors(c)
            c.fill(c.segment(64), 64, 1).result()  # the session still serves
    assert got["sync"] == got["trio"] == got["asyncio"]
    names = [name for name, _ in got["sync"]]
    assert names == [
        "UnknownSegment", "OutOfBounds", "OutOfBounds", "InvalidField", "UnknownOperation",
        "InvalidField", "OutOfBounds", "OutOfBounds", "no error", "SegmentFreed", "UnknownSegment",
    ]


def test_share_and_attach(variant: tuple[str, bool], daemon: Any) -> None:
    kind, ring = variant
    with connect(kind, daemon.endpoint, ring=ring) as consumer, connect(kind, daemon.endpoint, ring=ring) as producer:
        out = consumer.segment(4096)
        token = consumer.share(out)
        target = producer.attach(token)
        assert (target.va, target.nbytes, target.kind) == (out.va, 4096, "host")
        producer.fill(target.va, 16, 7).result()
        assert (out.buffer[:16] == 7).all() and not out.buffer[16:].any()
        with pytest.raises(transfer.NotOwner):
            producer.share(out)
        consumer.free(out)
        with pytest.raises(transfer.SegmentFreed):
            producer.fill(target.va, 4, 0).result()


def test_pool_acquire_submit_release_drain(client: Any) -> None:
    buf = client.alloc(8192)
    with client.pool(4096, slots=2) as pool:
        for i in range(5):
            with pool.acquire(timeout=10) as slot:
                x = slot.ndarray(4096)
                x[:] = i
                slot.submit(to=buf, offset=4096)
                with pytest.raises(ValueError):
                    x[0] = 1  # in flight: the daemon may be reading it
                with pytest.raises(transfer.SlotError, match="in flight"):
                    slot.release()
        pool.drain()
        assert pool.in_flight == 0
        assert client.checksum(buf.va + 4096, 4096).result() == transfer.checksum64(np.full(4096, 4, np.uint8))
        held = [pool.acquire(), pool.acquire()]
        t0 = time.monotonic()
        with pytest.raises(transfer.RequestTimeout, match="no slot"):
            pool.acquire(timeout=0.05)
        assert time.monotonic() - t0 < 5
        held[0].release()
        pool.acquire(timeout=1).release()
        held[1].release()
        failing = pool.acquire()
        failing.submit(to=buf, nbytes=4096, offset=8192)  # past the buffer: fails in the daemon
        with pytest.raises(transfer.OutOfBounds):
            pool.drain()  # the failure nobody looked at
    assert client.fence() is None


def test_poll_and_stats(client: Any) -> None:
    seg = client.segment(1 << 16)
    p = client.checksum(seg)
    deadline = time.monotonic() + 10
    while client.poll() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert p.done() and p.result(timeout=0) == transfer.checksum64(seg.buffer)
    s = client.stats()
    assert s["session"]["id"] == client.session_id
    assert s["session"]["ring"] is client.ring
    assert s["daemon"]["sessions"] >= 1
    assert client.server_pid > 0 and client.backend == "numpy" and client.backend_info["backend"] == "numpy"


@pytest.mark.parametrize("cls", [transfer.TrioClient, transfer.AsyncioClient], ids=["trio", "asyncio"])
def test_async_clients_have_every_public_method_of_the_blocking_client(cls: type) -> None:
    def public(cls: type) -> dict[str, Any]:
        return {n: getattr(cls, n) for n in dir(cls) if not n.startswith("_")}

    sync, other = public(transfer.Client), public(cls)
    assert set(sync) <= set(other), set(sync) - set(other)
    for name, member in sync.items():
        if callable(member):
            assert inspect.signature(member) == inspect.signature(other[name]), name
    assert inspect.iscoroutinefunction(cls.close)


@pytest.mark.parametrize("ring", [False, True], ids=["socket", "ring"])
def test_trio_raises_the_request_error_itself_not_a_group(daemon: Any, ring: bool) -> None:
    async def failing_request() -> None:
        async with transfer.open_client(daemon.endpoint, ring=ring) as c:
            seg = await c.segment(4096)
            await c.copy(seg.va, seg.va, 1 << 20)

    async def failing_code() -> None:
        async with transfer.open_client(daemon.endpoint, ring=ring):
            raise KeyError("mine")

    async def deferred_site() -> None:
        async with transfer.open_client(daemon.endpoint, ring=ring) as c:
            with pytest.raises(transfer.InvalidField, match=r"test_clients\.py:\d+"):
                await c.alloc(1 << 50)  # names this line, as the blocking client does

    trio.run(deferred_site)
    with pytest.raises(transfer.OutOfBounds) as info:
        trio.run(failing_request)
    assert type(info.value) is transfer.OutOfBounds
    with pytest.raises(KeyError, match="mine"):
        trio.run(failing_code)


def test_trio_ring_waits_without_a_thread_and_survives_a_killed_daemon(daemon_factory: Any) -> None:
    import threading

    d = daemon_factory()

    async def main() -> None:
        async with transfer.open_client(d.endpoint, ring=True) as c:
            seg = await c.segment(4096)
            before = set(threading.enumerate())
            pend = [c.copy(seg.va + 64, seg.va, 64) for _ in range(500)]
            for p in pend:
                await p
            assert set(threading.enumerate()) <= before  # none started (an old one may end)
            assert c._ring.pushed >= 500
            d.kill()
            with trio.fail_after(5):
                with pytest.raises((transfer.ConnectionLost, transfer.SessionClosed)):
                    while True:
                        await c.copy(seg.va + 64, seg.va, 64)
                        await trio.sleep(0.01)

    trio.run(main)


def test_a_tight_trio_await_loop_does_not_starve_other_tasks(daemon) -> None:  # type: ignore[no-untyped-def]
    """A trio await answered at once (here a request already done) is a cancel point, not a
    pass of trio's run loop; the client still yields at least every millisecond (FAIR_S), so
    the program's other tasks run, and a cancelled scope still stops the loop."""

    async def main() -> None:
        async with transfer.open_client(daemon.endpoint, ring=True) as c:
            seg = await c.segment(4096)
            ticks = 0

            async def other() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await trio.lowlevel.checkpoint()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(other)
                p = c.copy(seg.va + 64, seg.va, 64)
                await p
                start = ticks
                end = time.monotonic() + 0.3
                while time.monotonic() < end:
                    await p
                assert ticks - start > 30, ticks - start  # about one per millisecond
                with trio.move_on_after(0.05) as scope:
                    while True:
                        await p  # a cancel point: the deadline ends this loop
                assert scope.cancelled_caught
                nursery.cancel_scope.cancel()

    trio.run(main)
