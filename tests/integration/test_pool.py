"""Batch-slot pools: reuse only after the daemon is done, backpressure, misuse caught."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

import transfer


@pytest.fixture
def daemon(shared_daemon: Any) -> Any:
    """This module's tests share one daemon (`conftest.shared_daemon`): none needs its own."""
    return shared_daemon


def test_slot_round_trip_and_views_frozen_in_flight(daemon) -> None:
    with transfer.connect(daemon.endpoint) as c:
        buf = c.alloc(4 * 4096)
        with c.pool(4096, slots=2) as pool:
            with pool.acquire() as slot:
                x = slot.ndarray((1024,), np.float32)
                x[:] = np.arange(1024)
                p = slot.submit(to=buf, offset=4096)
                with pytest.raises(ValueError):
                    x[0] = 5  # the daemon may be reading: the view is read-only now
                with pytest.raises(transfer.SlotError, match="in flight"):
                    slot.ndarray(4)
            p.result()
            back = c.segment(4096)
            c.copy(back, buf.va + 4096, 4096).result()
            assert np.array_equal(back.ndarray((1024,), np.float32), np.arange(1024, dtype=np.float32))


def test_backpressure_and_reuse_only_after_completion(daemon) -> None:
    with transfer.connect(daemon.endpoint) as c:
        big = 64 << 20
        buf = c.alloc(big)
        with c.pool(big, slots=2) as pool:
            seen = []
            for i in range(6):
                slot = pool.acquire(timeout=30)
                # A slot handed out again must have no request still reading it.
                assert slot.pending is None and slot not in pool._in_flight
                seen.append(slot.index)
                slot.ndarray((8,), np.uint64)[:] = i
                slot.submit(to=buf)
            assert set(seen) == {0, 1}
            assert pool.in_flight <= 2
            pool.drain()
            assert pool.in_flight == 0
            assert c.checksum(buf.va, 64).result() == transfer.checksum64(np.full(8, 5, np.uint64))


def test_acquire_times_out_when_every_slot_is_held(daemon) -> None:
    with transfer.connect(daemon.endpoint) as c:
        pool = c.pool(4096, slots=1)
        held = pool.acquire()
        with pytest.raises(transfer.RequestTimeout):
            pool.acquire(timeout=0.05)
        held.release()
        pool.acquire(timeout=1).release()
        pool.close()


def test_misuse_is_refused_at_once(daemon) -> None:
    with transfer.connect(daemon.endpoint) as c:
        buf = c.alloc(4096)
        pool = c.pool(4096, slots=2)
        s = pool.acquire()
        view = s.ndarray(16)
        s.release()
        assert not view.flags.writeable
        with pytest.raises(transfer.SlotError, match="released twice"):
            s.release()
        with pytest.raises(transfer.SlotError, match="free"):
            s.submit(to=buf)
        with pytest.raises(transfer.SlotError):
            s.ndarray(4)
        t = pool.acquire()
        t.submit(to=buf).result()
        with pytest.raises(transfer.SlotError, match="submit"):
            t.submit(to=buf)
        with pytest.raises(transfer.SlotError, match="in flight"):
            t.release()
        with pytest.raises(transfer.OutOfBounds):
            pool.acquire().ndarray(4097)
        pool.close()


def test_slot_compute_normalizes_in_place_of_a_copy(daemon) -> None:
    with transfer.connect(daemon.endpoint) as c:
        shape = (2, 3, 8, 8)
        out = c.segment(int(np.prod(shape)) * 4)
        with c.pool(int(np.prod(shape)), slots=2) as pool:
            with pool.acquire() as slot:
                x = slot.ndarray(shape, np.uint8)
                x[:] = 100
                slot.compute("normalize", [slot.tensor(shape, np.uint8)], [out.tensor(shape, np.float32)], {"mean": [50, 50, 50], "std": [25, 25, 25]}).result()
        assert np.allclose(out.ndarray(shape, np.float32), 2.0)


def test_trio_pool(daemon) -> None:
    async def main() -> None:
        async with transfer.open_client(daemon.endpoint) as c:
            buf = await c.alloc(8192)
            pool = await c.pool(4096, slots=1)
            for i in range(4):
                slot = await pool.acquire(timeout=10)
                slot.ndarray(4096)[:] = i
                slot.submit(to=buf, offset=4096)
            await pool.drain()
            assert await c.checksum(buf.va + 4096, 4096) == transfer.checksum64(np.full(4096, 3, np.uint8))
            held = await pool.acquire()
            with pytest.raises(transfer.RequestTimeout):
                await pool.acquire(timeout=0.05)
            held.release()
            await pool.close()

    trio.run(main)


def test_fan_in_producers_write_into_a_consumers_segment(daemon) -> None:
    """Each producer has its own session; the consumer shares its output segment with them."""
    shape = (4, 3, 8, 8)
    per = int(np.prod(shape)) * 4
    with transfer.connect(daemon.endpoint) as consumer, transfer.connect(daemon.endpoint) as p1, transfer.connect(daemon.endpoint) as p2:
        out = consumer.segment(2 * per)
        token = consumer.share(out)
        for k, prod in enumerate((p1, p2)):
            target = prod.attach(token)
            assert target.va == out.va
            with prod.pool(int(np.prod(shape)), slots=1) as pool, pool.acquire() as slot:
                slot.ndarray(shape, np.uint8)[:] = 10 * (k + 1)
                slot.compute("normalize", [slot.tensor(shape, np.uint8)], [target.tensor(shape, np.float32, offset=k * per)], {"mean": [0, 0, 0], "std": [10, 10, 10]}).result()
        res = out.ndarray((2, *shape), np.float32)
        assert (res[0] == 1.0).all() and (res[1] == 2.0).all()
        with pytest.raises(transfer.NotOwner):
            p1.share(out)  # only the owner grants
        with pytest.raises(transfer.UnknownSegment):
            p1.attach(b"\0" * 16)
        consumer.free(out)
        with pytest.raises(transfer.SegmentFreed):
            p1.fill(out.va, 4, 0).result()  # the grant died with the segment


def test_embedded_daemon_leaves_nothing_behind(tmp_path) -> None:
    import os

    before = set(os.listdir("/tmp"))
    with transfer.serve_in_process(backend="numpy", shm_dir=tmp_path) as d:
        sock_dir = d.endpoint[len("ipc://") :].rsplit("/", 1)[0]
        with transfer.connect(d.endpoint) as c:
            c.fill(c.alloc(4096), 4096, 1).result()
    assert not os.path.exists(sock_dir)
    assert set(os.listdir("/tmp")) - before == set()
    assert [n for n in os.listdir(tmp_path) if not n.endswith(".lock")] == []


class _Completions:
    """A stand-in for a client, only for the pool's bookkeeping: its copies return Pendings
    the test finishes, in any order (a daemon finishes a slow request after a fast one
    behind it); nothing here ever waits."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        from transfer._pending import Pending

        self._pending_cls = Pending
        self.sent: list = []
        self._core = SimpleNamespace(signal=lambda: Pending(0, self._wait))

    def _wait(self, p, timeout) -> None:
        raise AssertionError("the pool waited although a slot was free")

    def copy(self, dst: int, src: int, n: int, *, stream: int = 0):
        p = self._pending_cls(len(self.sent) + 1, self._wait)
        self.sent.append(p)
        return p

    def _run(self, op, timeout=None):
        try:
            while True:
                self._wait(op.send(None), timeout)
        except StopIteration as stop:
            return stop.value


@given(st.lists(st.tuples(st.sampled_from(["submit", "finish"]), st.integers(0, 7)), max_size=60))
def test_slots_come_back_exactly_when_their_request_completes(script) -> None:
    """Completions in any order: a slot returns to the pool as soon as its own request has
    completed (not only when the ones ahead of it have), and never before."""
    from types import SimpleNamespace

    from transfer.client._pool import SlotPool

    client = _Completions()
    segment = SimpleNamespace(va=1 << 40, ndarray=lambda shape, dt, offset=0: np.zeros(shape, dt))
    pool = SlotPool(client, segment, 64, 4, 64)
    reading: dict[int, object] = {}  # slot index -> the pending still reading it
    for action, k in script:
        unfinished = [p for p in client.sent if not p.done()]
        if action == "finish" and unfinished:
            unfinished[k % len(unfinished)]._finish(None, None)
            continue
        if len(unfinished) == len(pool.slots):
            continue  # every slot in flight: acquire would (rightly) wait
        slot = pool.acquire()
        assert slot.index not in reading or reading[slot.index].done()  # type: ignore[attr-defined]
        reading[slot.index] = slot.submit(0)
        assert pool.in_flight == sum(not p.done() for p in client.sent)
