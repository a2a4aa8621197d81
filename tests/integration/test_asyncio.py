"""The asyncio client against a real transferd: what the shared suite (test_clients.py,
through a facade) cannot show, because it needs a task of its own: many requests in
flight without a thread, cancellation, a daemon that dies while a task awaits,
heartbeats while idle, close, and errors raised as themselves."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import numpy as np
import pytest

import transfer
from transfer.testing import stop_process
from conftest import BRISK_TIMEOUT_S


@pytest.fixture
def daemon(shared_daemon: Any) -> Any:
    """This module's tests share one daemon (`conftest.shared_daemon`): none needs its own."""
    return shared_daemon

RINGS = pytest.mark.parametrize("ring", [False, True], ids=["socket", "ring"])


def run(main: Callable[[], Awaitable[Any]], timeout: float = 60) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(timeout):
            return await main()

    return asyncio.run(bounded())


def sessions(endpoint: str) -> int:
    with transfer.connect(endpoint, ring=False) as c:
        return int(c.stats()["daemon"]["sessions"]) - 1  # not counting this one


@RINGS
def test_many_in_flight_without_a_thread(daemon: Any, ring: bool) -> None:
    async def main() -> None:
        async with transfer.open_asyncio_client(daemon.endpoint, ring=ring) as c:
            assert c.ring is ring
            seg = await c.segment(1 << 16)
            seg.buffer[:64] = np.arange(64)
            before = set(threading.enumerate())
            pend = [c.copy(seg.va + 64 * (1 + i % 500), seg.va, 64) for i in range(2000)]
            assert (await asyncio.gather(*pend)) == [None] * 2000
            sums = await asyncio.gather(*(c.checksum(seg.va + 64 * i, 64) for i in range(1, 8)))
            assert sums == [transfer.checksum64(seg.buffer[:64])] * 7
            # No thread was started for them (one from an earlier test may have ended).
            assert set(threading.enumerate()) <= before
            if ring:
                assert c._ring.pushed >= 2000  # they took the ring, and were reaped on the loop
            buf = await c.alloc(1 << 16)
            offs = np.arange(16, dtype=np.uint64) * 4096
            await c.copy_many(buf.va + offs, seg.va + offs, np.full(16, 4096, np.uint64))
            assert await c.checksum(buf) == transfer.checksum64(seg.buffer)
            await c.fence()
            with pytest.raises(RuntimeError, match="await the request"):
                c.fill(seg, 64, 0).result()  # would block the loop that delivers its reply

    run(main)


def test_a_tight_await_loop_does_not_starve_other_tasks(daemon: Any) -> None:
    """An await answered at once (a ring reply reaped in the waiter; here, deterministically,
    a request already done) does not suspend; the client still yields to the loop at
    least every millisecond, so other tasks (its heartbeats too) run."""

    async def main() -> None:
        async with transfer.open_asyncio_client(daemon.endpoint, ring=True) as c:
            seg = await c.segment(4096)
            ticks = 0

            async def other() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            task = asyncio.create_task(other())
            p = c.copy(seg.va + 64, seg.va, 64)
            await p
            start = ticks
            end = time.monotonic() + 0.3
            while time.monotonic() < end:
                await p
            task.cancel()
            assert ticks - start > 30, ticks - start  # about one per millisecond

    run(main)


@RINGS
def test_cancelling_an_awaiting_task_leaves_the_session_usable(daemon: Any, ring: bool) -> None:
    async def main() -> None:
        async with transfer.open_asyncio_client(daemon.endpoint, ring=ring) as c:
            seg = await c.segment(4096)
            pool = await c.pool(4096, slots=1)
            held = await pool.acquire()
            waiter = asyncio.create_task(pool.acquire())  # every slot is held: it waits
            await asyncio.sleep(0.05)
            assert not waiter.done()
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            with pytest.raises(TimeoutError):  # asyncio's own timeout cancels the wait the same way
                await asyncio.wait_for(pool.acquire(), 0.05)
            held.release()
            (await pool.acquire(timeout=5)).release()
            # A request awaited by a task that is cancelled still completes; others see it.
            p = c.fill(seg, 4096, 3)
            t = asyncio.create_task(p.wait())
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            await p
            await c.fence()
            assert (seg.buffer == 3).all()
            await pool.close()

    run(main)
    # A cancelled main task still closes its session (cancellation is an exit like any other).

    async def cancelled() -> None:
        async with transfer.open_asyncio_client(daemon.endpoint, ring=ring) as c:
            await c.segment(4096)
            asyncio.current_task().cancel()  # type: ignore[union-attr]
            await asyncio.sleep(10)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancelled())
    assert sessions(daemon.endpoint) == 0


@pytest.mark.parametrize("how", ["pidfd", "ring-doorbell", "liveness"])
def test_daemon_killed_while_a_task_awaits(daemon_factory: Any, how: str) -> None:
    """Each way the client learns of a dead daemon: its pidfd (same host, the default), the
    ring's completion doorbell closing (EOF), and on the socket the daemon's silence."""
    d = daemon_factory()
    ring = how == "ring-doorbell"
    kw: dict[str, Any] = {"ring": ring, "watch_daemon_pid": how == "pidfd"}
    if how == "liveness":
        kw["liveness_timeout"] = 1.0

    async def main() -> str:
        async with transfer.open_asyncio_client(d.endpoint, **kw) as c:
            seg = await c.segment(4096)
            await c.fill(seg, 4096, 1)
            stop_process(d.pid)  # nothing answers from here on
            pend = c.fill(seg, 4096, 2)
            waiter = asyncio.create_task(pend.wait())
            await asyncio.sleep(0.05)
            assert not waiter.done()
            if how != "liveness":  # (a stopped daemon keeps its fds open: only its silence tells)
                d.kill()
            with pytest.raises(transfer.ConnectionLost) as lost:
                await asyncio.wait_for(waiter, 30)
            with pytest.raises(transfer.ConnectionLost):
                await c.fill(seg, 4096, 3)  # the session is broken: new requests fail at once
            return str(lost.value)

    try:
        said = run(main)
    finally:
        d.kill()
    # Told by the way under test, not by a later one (the liveness timeout is the last resort).
    assert {"pidfd": "exited", "ring-doorbell": "closed the ring's doorbell", "liveness": "has not answered for 1.0s"}[how] in said, said


def test_idle_session_survives_on_heartbeats(brisk_daemon: Any) -> None:
    """The daemon ends sessions silent for --session-timeout: an idle asyncio client is kept
    alive by its heartbeat task, with nothing awaiting."""

    async def main() -> None:
        async with transfer.open_asyncio_client(brisk_daemon.endpoint) as c:
            seg = await c.segment(4096)
            await asyncio.sleep(1.5 * BRISK_TIMEOUT_S)
            await c.fill(seg, 64, 1)

    run(main)


@RINGS
def test_close_releases_everything(daemon: Any, ring: bool) -> None:
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731

    async def settled(most: int) -> int:
        """The fd count once zmq's io thread has closed what it closes later (at most 2 s)."""
        for _ in range(200):
            if fds() <= most:
                break
            await asyncio.sleep(0.01)
        return fds()

    async def main() -> None:
        async with transfer.open_asyncio_client(daemon.endpoint, ring=ring):
            pass  # the first session opens what the process keeps (zmq's context, its io thread)
        await asyncio.sleep(0.1)
        before = fds()
        async with transfer.open_asyncio_client(daemon.endpoint, ring=ring) as c:
            seg = await c.segment(1 << 16)
            await c.alloc(4096)
            c.fill(seg, 64, 1)  # in flight at close: finished or failed, never left hanging
            assert sessions(daemon.endpoint) == 1
        assert sessions(daemon.endpoint) == 0
        assert not c._tasks and c._pidfd == -1
        await c.close()  # twice is fine
        with pytest.raises(transfer.SessionClosed):
            await c.segment(4096)
        with pytest.raises(transfer.SegmentFreed):
            seg.buffer
        assert await settled(before) <= before  # the socket, the pidfd, the ring's fds: all closed

    run(main)


@RINGS
def test_errors_are_plain_exceptions(daemon_factory: Any, ring: bool, tmp_path: Path) -> None:
    daemon = daemon_factory()  # (its own: the errors name segment ids no earlier test may have used)

    async def raised(body: Callable[[Any], Awaitable[None]], endpoint: str = daemon.endpoint) -> BaseException:
        try:
            async with transfer.open_asyncio_client(endpoint, ring=ring) as c:
                await body(c)
        except BaseException as exc:  # noqa: BLE001 - the point is what type arrives
            return exc
        raise AssertionError("nothing raised")

    async def bad_request(c: Any) -> None:
        seg = await c.segment(4096)
        await c.copy(seg.va, seg.va, 1 << 20)

    async def unobserved(c: Any) -> None:
        c.fill(0x1234 << 40, 8, 0)
        await c.fence()

    async def user_error(c: Any) -> None:
        raise KeyError("mine")

    async def deferred_site(c: Any) -> None:
        await c.alloc(1 << 50)

    async def main() -> None:
        for body, cls in ((bad_request, transfer.OutOfBounds), (unobserved, transfer.UnknownSegment),
                          (user_error, KeyError), (deferred_site, transfer.InvalidField)):
            exc = await raised(body)
            assert type(exc) is cls, repr(exc)
        exc = await raised(deferred_site)
        assert "test_asyncio.py:" in str(exc)  # names the line that called alloc, as the other clients do
        exc = await raised(user_error, f"ipc://{tmp_path}/nobody.sock")
        assert type(exc) is transfer.DaemonUnavailable, repr(exc)

    run(main)
    assert sessions(daemon.endpoint) == 0
