"""One placement decision per session: the home device chosen at hello.

`alloc()` with no device puts a buffer on the session's home device, eager and
deferred alike, so a workload's buffers share a device (compute across devices
is refused) and the two modes cannot disagree. Sessions are spread over the
devices of the fastest kind. The daemon here has two simulated GPUs
(`TRANSFER_STREAMSIM_DEVICES`, read by `make_backend`; tests only).
"""

from __future__ import annotations

import time


from typing import Any

import numpy as np
import pytest

import transfer
from transfer.backends import STREAMSIM_DEVICES_ENV
from transfer.server._placement import VirtualDevice, choose_home


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch, daemon_factory: Any) -> Any:
    monkeypatch.setenv(STREAMSIM_DEVICES_ENV, "2")  # the daemon process inherits it
    d = daemon_factory("--backend", "streamsim")
    assert d.ready["backend"] == "streamsim"
    return d


def daemon_device(c: transfer.Client, buf: Any) -> int:
    """Where the daemon put `buf` (its own table's answer, through a share and attach)."""
    return c.attach(c.share(buf)).device


def workload(c: transfer.Client) -> tuple[np.ndarray, list[Any]]:
    """Default-allocated buffers, a copy in, a compute between two of them, a copy out."""
    host = c.segment(2 * 4096)
    host.ndarray(1024, np.float32)[:] = np.arange(1024, dtype=np.float32)
    bufs = [c.alloc(4096) for _ in range(3)]
    a, b = bufs[0], bufs[1]
    c.copy(a, host.va, 4096)
    plan = c.plan("scale_add", {"a": 2.0, "b": 1.0})
    c.compute(plan, [c.tensor(a, 1024, np.float32)], [c.tensor(b, 1024, np.float32)]).result(10)
    c.copy(host.va + 4096, b.va, 4096)
    c.fence()
    return host.ndarray(1024, np.float32, offset=4096).copy(), bufs


def test_each_session_allocates_on_its_home_device(two_gpus: Any) -> None:
    ep = two_gpus.endpoint
    with transfer.connect(ep, deferred=False) as eager, transfer.connect(ep, deferred=True) as deferred:
        # Spread: the second session finds the first one's GPU taken (a tie on bytes, broken by homes).
        assert sorted([eager.home_device, deferred.home_device]) == [0, 1]
        for c in (eager, deferred):
            assert c.stats()["session"]["home_device"] == c.home_device
            out, bufs = workload(c)
            assert (out == 2 * np.arange(1024, dtype=np.float32) + 1).all()  # the compute ran
            # Every default allocation is on the home device: per the client and per the daemon.
            assert [buf.device for buf in bufs] == [c.home_device] * 3
            assert [daemon_device(c, buf) for buf in bufs] == [c.home_device] * 3
        # Explicit devices still work as before.
        other = 1 - deferred.home_device
        for c in (eager, deferred):
            buf = c.alloc(4096, device=other)
            c.fill(buf, 4096, 7).result(10)
            assert daemon_device(c, buf) == other
        homes = {eager.home_device, deferred.home_device}
    assert homes == {0, 1}
    # Both gone: once the daemon has released them (a Close is answered before its session's
    # task ends), a new session ties everywhere and takes device 0.
    deadline = time.monotonic() + 10
    while True:
        with transfer.connect(ep) as c:
            if c.home_device == 0:
                break
        assert time.monotonic() < deadline, "the closed sessions' homes were never released"
        time.sleep(0.05)


def test_a_new_session_goes_where_fewer_bytes_are(two_gpus: Any) -> None:
    ep = two_gpus.endpoint
    with transfer.connect(ep, deferred=False) as first:
        big = first.alloc(1 << 20)
        assert big.device == first.home_device == 0
        with transfer.connect(ep) as second, transfer.connect(ep) as third:
            assert second.home_device == 1  # device 0 holds a MiB
            # Device 1 still holds no bytes (second allocated nothing): it is still the least used.
            assert third.home_device == 1


def test_choose_home_orders_kind_bytes_homes_index() -> None:
    def dev(i: int, kind: str, nbytes: int = 0) -> VirtualDevice:
        return VirtualDevice(i, kind, None, info={"bytes": nbytes})

    gpus_then_cpu = [dev(0, "gpu", 100), dev(1, "gpu", 100), dev(2, "cpu")]
    assert choose_home(gpus_then_cpu, {}).index == 0  # GPUs before the idle CPU; ties by index
    assert choose_home(gpus_then_cpu, {0: 2, 1: 1}).index == 1  # then fewest sessions homed
    assert choose_home([dev(0, "gpu", 10), dev(1, "gpu", 5)], {1: 9}).index == 1  # bytes first
    assert choose_home([dev(0, "cpu", 10), dev(1, "cpu")], {}).index == 1  # CPU-only daemons alike
