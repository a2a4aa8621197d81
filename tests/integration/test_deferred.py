"""Deferred creation: resources answered by the client, defined on the daemon at first use."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import transfer
from transfer import protocol as P


@pytest.fixture
def daemon(shared_daemon: Any) -> Any:
    """This module's tests share one daemon (`conftest.shared_daemon`): none needs its own."""
    return shared_daemon


def counts(c: transfer.Client) -> tuple[int, int]:
    st = c.stats()["session"]
    return st["frames"], st["blocking"]


def workload(c: transfer.Client, host: transfer.HostSegment) -> np.ndarray:
    """Allocate 3 buffers, describe 2 tensors, configure 1 plan, copy in, compute, copy out, wait."""
    x_host = host.ndarray((32, 32), np.float32)
    x_host[:] = np.arange(1024, dtype=np.float32).reshape(32, 32)
    a = c.alloc(4096)
    b = c.alloc(4096)
    scratch = c.alloc(4096)
    ta = c.tensor(a, (32, 32), np.float32)
    tb = c.tensor(b, (32, 32), np.float32)
    plan = c.plan("scale_add", {"a": 2.0, "b": 1.0})
    c.copy(a, host.va, 4096)
    c.compute(plan, [ta], [tb])
    c.copy(host.va + 4096, b.va, 4096)
    c.fill(scratch, 16, 0)
    c.fence()
    return host.ndarray((32, 32), np.float32, offset=4096).copy()


def measured(endpoint: str, deferred: bool) -> tuple[int, int, np.ndarray]:
    with transfer.connect(endpoint, deferred=deferred) as c:
        host = c.segment(2 * 4096)  # the producer's own memory, mapped once beforehand
        f0, b0 = counts(c)
        out = workload(c, host)
        f1, b1 = counts(c)
    return f1 - f0 - 1, b1 - b0 - 1, out  # minus the second stats call's own frame and wait


def test_one_blocking_round_trip_deferred_against_one_per_call_eager(daemon) -> None:
    frames_d, blocking_d, out_d = measured(daemon.endpoint, deferred=True)
    frames_e, blocking_e, out_e = measured(daemon.endpoint, deferred=False)
    want = np.arange(1024, dtype=np.float32).reshape(32, 32) * 2 + 1
    assert np.array_equal(out_d, want) and np.array_equal(out_e, want)
    # Only the final wait blocks: on the socket, or (its fence pushed behind the compute's
    # frame) on the ring, where a wait costs no socket round trip.
    assert blocking_d <= 1, (frames_d, blocking_d)
    assert blocking_e >= 6, (frames_e, blocking_e)  # every create/configure call waited
    assert frames_d < frames_e


def test_deferred_alloc_has_a_va_before_any_message(daemon) -> None:
    with transfer.connect(daemon.endpoint) as c:
        before = counts(c)[0]
        bufs = [c.alloc(1 << 20) for _ in range(10)]
        assert len({b.va for b in bufs}) == 10
        assert counts(c)[0] == before + 1  # only the stats call itself travelled
        assert c.stats()["daemon"]["device_bytes"] == 0  # nothing materialized yet
        c.fill(bufs[3], 1 << 20, 1).result()
        assert c.stats()["daemon"]["device_bytes"] == 1 << 20  # the first use defined it


def test_errors_name_the_resource_and_where_it_was_created(daemon_factory) -> None:
    d = daemon_factory("--max-device-bytes", str(1 << 20))
    with transfer.connect(d.endpoint) as hog, transfer.connect(d.endpoint) as c:
        hog.fill(hog.alloc(1 << 20), 16, 0).result()  # the daemon's whole device budget
        big = c.alloc(512 << 10)  # within this session's quota: the client cannot know
        with pytest.raises(transfer.OutOfDeviceMemory, match=r"alloc of 512 KiB created at test_deferred.py:\d+"):
            c.fill(big, 16, 0).result()
        # The session stays usable, and freeing what the daemon refused frees nothing: neither the
        # request its free travels with nor a fence fails for it.
        seg = c.segment(4096)
        assert c.checksum(seg).result() == transfer.checksum64(bytes(4096))
        c.free(big)
        assert c.checksum(seg).result() == transfer.checksum64(bytes(4096))
        c.fence()
        # A free naming anything else is still refused: a VA nothing holds outside the session's
        # arenas, and a host segment's.
        with pytest.raises(transfer.InvalidAddress, match="not a segment of this session's arenas"):
            c._call(transfer.protocol.Define, transfer.protocol.DEF_FREE, 0, 0, 12345 << 40, "")
        with pytest.raises(transfer.InvalidAddress, match="not a device buffer's or remote segment's base VA"):
            c._call(transfer.protocol.Define, transfer.protocol.DEF_FREE, 0, 0, seg.va, "")
    with transfer.connect(d.endpoint) as c:
        with pytest.raises(transfer.QuotaExceeded, match=r"alloc of 64 GiB created at test_deferred.py:\d+ exceeds the device memory this session may hold, 1 MiB"):
            c.alloc(64 << 30)


def test_descriptors_travel_once_and_changes_are_resent(daemon) -> None:
    with transfer.connect(daemon.endpoint) as c:
        seg = c.segment(8192)
        seg.ndarray(1024, np.float32)[:] = 1.0
        x = c.tensor(seg, 1024, np.float32)
        y = c.tensor(seg, 1024, np.float32, offset=4096)
        plan = c.plan("scale_add", {"a": 3.0})
        c.compute(plan, [x], [y]).result()
        after_first = c.stats()["session"]["defines"]
        assert after_first == 3
        for _ in range(5):
            c.compute(plan, [x], [y]).result()
        assert c.stats()["session"]["defines"] == after_first  # ids only
        assert (seg.ndarray(1024, np.float32, offset=4096) == 3.0).all()
        plan.set(a=5.0)  # changed after first use: re-sent under a new version
        c.compute(plan, [x], [y]).result()
        assert c.stats()["session"]["defines"] == after_first + 1
        assert (seg.ndarray(1024, np.float32, offset=4096) == 5.0).all()
        y.set(shape=(512,))  # a changed descriptor too
        with pytest.raises(transfer.InvalidField, match="shape"):
            c.compute(plan, [x], [y]).result()  # the new shape no longer matches: refused, clearly


def test_a_stale_version_is_never_used(daemon) -> None:
    with transfer.connect(daemon.endpoint) as c:
        seg = c.segment(4096)
        x = c.tensor(seg, 16, np.float32)
        plan = c.plan("fill", {"value": 1})
        c.compute(plan, [], [x]).result()
        with pytest.raises(transfer.InvalidField, match="stale"):
            c._submit(P.ComputeRef, [(plan.id, plan.version + 7)], [], [(x.id, x.version)], 0).result()


def test_frees_are_deferred_and_batched(daemon) -> None:
    with transfer.connect(daemon.endpoint) as c:
        bufs = [c.alloc(4096) for _ in range(3)]
        for b in bufs:
            c.fill(b, 4096, 1)
        c.fence()
        assert c.stats()["daemon"]["segments"] == 3
        frames = counts(c)[0]
        for b in bufs:
            c.free(b)
        assert counts(c)[0] == frames + 1  # no message for the frees themselves
        seg = c.segment(4096)  # the next frame carries all three frees
        assert c.stats()["daemon"]["segments"] == 1
        with pytest.raises(transfer.SegmentFreed):
            c.free(bufs[0])
        assert seg.nbytes == 4096


def test_never_used_allocation_costs_nothing(daemon) -> None:
    with transfer.connect(daemon.endpoint) as c:
        b = c.alloc(1 << 30)
        c.free(b)
        assert c.stats()["session"]["defines"] == 0


def test_trio_client_defers_too(daemon) -> None:
    import trio

    async def main() -> None:
        async with transfer.open_client(daemon.endpoint) as c:
            host = await c.segment(2 * 4096)
            host.ndarray(1024, np.float32)[:] = 2.0
            st0 = (await c.stats())["session"]
            a = await c.alloc(4096)  # no message
            b = await c.alloc(4096)
            ta, tb = await c.tensor(a, 1024, np.float32), await c.tensor(b, 1024, np.float32)
            plan = await c.plan("scale_add", {"a": 3.0})
            c.copy(a, host.va, 4096)
            c.compute(plan, [ta], [tb])
            c.copy(host.va + 4096, b.va, 4096)
            await c.fence()
            st1 = (await c.stats())["session"]
            assert (host.ndarray(1024, np.float32, offset=4096) == 6.0).all()
            # Only the fence blocked: on the socket, or on the ring (pushed behind the compute's
            # frame), where a wait costs no socket round trip.
            assert st1["blocking"] - st0["blocking"] - 1 <= 1
            await c.free(a)
            await c.free(b)
            c.fill(host, 16, 0)
            await c.fence()
            assert (await c.stats())["daemon"]["device_bytes"] == 0  # the frees travelled with that frame

    trio.run(main)
