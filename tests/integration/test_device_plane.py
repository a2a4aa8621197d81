"""Device memory in the native data plane, on a CPU, through the fake CUDA driver.

The daemon runs the stream simulation (`--backend streamsim`) with its device
buffers in the memory of tests/fakecuda (TRANSFER_CUDA_DRIVER), so a ring copy or
fill that touches a device buffer is queued by the session's native worker through
the driver's API (native/device.c), as on a GPU; the fake runs streams on an engine
thread of its own, out of order across streams, poisons copy destinations until the
copy has run, and counts every misuse (FAKECUDA_REPORT). Every test here ends with
the fake's report clean. The equivalence property with device memory in its programs
is tests/integration/test_equivalence.py's "fakecuda" daemon.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import zmq

import _workers
import fakecuda
import transfer
from transfer import errors as E
from transfer import protocol as P
from transfer.testing import DaemonProcess


class FakeGpu:
    """A daemon over the fake driver, and the fake's report."""

    def __init__(self, daemon: DaemonProcess, report: Path) -> None:
        self.daemon, self.report = daemon, report

    @property
    def endpoint(self) -> str:
        return self.daemon.endpoint

    def violations(self) -> list[str]:
        return list(fakecuda.report(self.report)["violations"])  # type: ignore[arg-type]


@pytest.fixture
def fake_gpu_factory(daemon_factory: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    made: list[FakeGpu] = []

    def make(*extra: str, driver: str | None = None, **fake_env: str) -> FakeGpu:
        report = tmp_path / f"fakecuda{len(made)}.report"
        monkeypatch.setenv("TRANSFER_CUDA_DRIVER", driver or str(fakecuda.build()))
        monkeypatch.setenv("FAKECUDA_REPORT", str(report))
        monkeypatch.setenv("FAKECUDA_SEED", str(len(made) + 1))
        for k, v in fake_env.items():
            monkeypatch.setenv(k, v)
        g = FakeGpu(daemon_factory("--backend", "streamsim", *extra), report)
        made.append(g)
        return g

    yield make
    for g in made:
        g.daemon.stop()
        assert g.violations() == [], "the fake CUDA driver saw misuse"


@pytest.fixture
def fake_gpu(fake_gpu_factory: Any) -> FakeGpu:
    g: FakeGpu = fake_gpu_factory()
    assert "CUDA device" in g.daemon.ready["data_plane"], g.daemon.ready
    return g


@pytest.fixture(params=["fake", pytest.param("cupy", marks=pytest.mark.gpu)])
def gpu(request: pytest.FixtureRequest, daemon_factory: Any) -> Any:
    """The fake driver's daemon, or (on a machine with a GPU) a CuPy daemon on the real driver."""
    if request.param == "fake":
        return request.getfixturevalue("fake_gpu")
    d = daemon_factory("--backend", "cupy")
    assert "CUDA device" in d.ready["data_plane"], d.ready
    return d


def counts(c: transfer.Client) -> dict[str, int]:
    st = c.stats()["daemon"]
    return {k: st[k] for k in ("device_native_requests", "python_device_requests", "ring_handovers", "device_faults")}


def test_device_copies_and_fills_are_the_workers(gpu: Any) -> None:
    """Host to device, device to device, device to host, fills, and a vector of pieces (merged
    where contiguous), all queued by the worker: the bytes are right and the Python pass saw
    none of them."""
    n = 3 * (4 << 20) + 4097  # more than one of the worker's 4 MiB pieces, a ragged tail
    data = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
    with transfer.connect(gpu.endpoint, deferred=False) as c:
        src, back = c.segment(n), c.segment(n)
        a, b = c.alloc(n), c.alloc(n)
        src.buffer[:] = data
        before = counts(c)
        c.copy(a, src, n).result()
        c.copy(b.va + 1, a.va, n - 1).result()
        c.fill(b.va + n - 100, 100, 0x5A).result()
        c.copy(back, b, n).result()
        want = np.concatenate([[0], data[: n - 1]]).astype(np.uint8)
        want[n - 100:] = 0x5A
        assert np.array_equal(back.buffer[:n], want)
        offs = np.arange(64, dtype=np.uint64) * 1024
        c.copy_many(np.uint64(a.va) + offs, np.uint64(src.va) + offs[::-1], np.full(64, 1024, np.uint64)).result()
        c.copy(back, a, 64 * 1024).result()
        pieces = data[: 64 * 1024].reshape(64, 1024)[::-1].reshape(-1)
        assert np.array_equal(back.buffer[: 64 * 1024], pieces)
        after = counts(c)
    assert after["python_device_requests"] == before["python_device_requests"]
    assert after["ring_handovers"] == before["ring_handovers"]
    assert after["device_native_requests"] - before["device_native_requests"] >= 6


def test_an_answer_means_the_copy_has_run(gpu: Any) -> None:
    """A producer that overwrites its slot the moment a copy to the device is answered, and
    reads the slot a copy from the device filled the moment that is answered: an answer sent
    when the copy was only queued shows the overwrite, or the fake's poison (0xDB)."""
    n = 256 << 10
    with transfer.connect(gpu.endpoint, deferred=False) as c:
        slot, out = c.segment(n), c.segment(n)
        dev = c.alloc(n)
        for k in range(200):
            slot.buffer[:] = k % 199 + 1
            c.copy(dev, slot, n).result()
            slot.buffer[:] = 0xEE  # the producer's next batch, at once
            c.copy(out, dev, n).result()
            assert (out.buffer == k % 199 + 1).all(), k


def test_ring_copies_then_a_socket_compute(gpu: Any) -> None:
    """Ring copies into a device buffer, then a compute that is a socket request, on the same
    lane (on a GPU, the worker queues them on that lane's CUDA stream, CuPy's) and (after a
    fence) on another: the compute reads what the copies wrote."""
    with transfer.connect(gpu.endpoint, deferred=False) as c:
        host = c.segment(3 * 4096)
        x = np.arange(1024, dtype=np.float32)
        host.ndarray(1024, np.float32)[:] = x
        a, b = c.alloc(4096), c.alloc(4096)
        plan = c.plan("scale_add", {"a": 2.0, "b": 1.0})
        for lane in (0, 1):
            c.fill(b, 4096, 0).result()
            c.copy(a.va, host.va, 2048, stream=0)
            c.copy(a.va + 2048, host.va + 2048, 2048, stream=0)
            if lane:
                c.fence()
            c.compute(plan, [c.tensor(a, 1024, np.float32)], [c.tensor(b, 1024, np.float32)], stream=lane).result(10)
            c.copy(host.va + 4096, b.va, 4096).result()
            assert np.array_equal(host.ndarray(1024, np.float32, offset=4096), 2 * x + 1)


def test_free_waits_for_that_segments_work_only(fake_gpu: FakeGpu) -> None:
    """A guest streams copies from its own segment into a buffer it attached, and from the
    owner's host segment, while the owner frees both: the frees wait for the copies in flight
    on those segments (the fake sees no free or unregister of memory in use), the guest's later
    copies fail cleanly, and a third tenant's round trips all answer meanwhile."""
    n = 4 << 20
    with transfer.connect(fake_gpu.endpoint, deferred=False) as owner, \
            transfer.connect(fake_gpu.endpoint, deferred=False) as guest, \
            transfer.connect(fake_gpu.endpoint, deferred=False) as other:
        for round_ in range(6):
            dev, host = owner.alloc(n), owner.segment(n)
            dview, hview = guest.attach(owner.share(dev)), guest.attach(owner.share(host))
            mine = guest.segment(n)
            stop = threading.Event()
            failures: list[BaseException] = []

            def stream() -> None:
                try:
                    while not stop.is_set():
                        p = [guest.copy(dview.va, mine.va, n), guest.copy(mine.va, hview.va, n), guest.copy(dview.va, hview.va, n)]
                        for q in p:
                            try:
                                q.result(30)
                            except (E.UnknownSegment, E.SegmentFreed, E.NotOwner):
                                stop.set()  # freed under it: refused, as it should be
                except BaseException as exc:  # noqa: BLE001 (reported below)
                    failures.append(exc)

            t = threading.Thread(target=stream)
            t.start()
            guest.copy(dview.va, mine.va, n).result(30)  # in flight by now
            o_seg, o_dev = other.segment(4096), other.alloc(4096)
            for _ in range(20):
                other.copy(o_dev, o_seg, 4096).result(30)
            owner.free(dev if round_ % 2 else host)
            owner.free(host if round_ % 2 else dev)
            stop.set()
            t.join(60)
            assert not t.is_alive() and not failures, failures
            other.copy(o_seg, o_dev, 4096).result(30)
            guest.free(mine)
        assert fake_gpu.violations() == []


def test_killed_producer_with_device_work_in_flight(fake_gpu: FakeGpu, tmp_path: Path) -> None:
    """kill -9 of a producer with device copies in flight: its session and memory are
    reclaimed once its work has run (no violation), and the daemon serves on."""
    ready = str(tmp_path / "victim.pid")
    victim = mp.get_context("spawn").Process(target=_workers.device_streamer, args=(fake_gpu.endpoint, ready))
    victim.start()
    with transfer.connect(fake_gpu.endpoint, deferred=False) as survivor:
        seg, buf = survivor.segment(1 << 20), survivor.alloc(1 << 20)
        seg.buffer[:] = 42
        _workers.wait_for_file(ready)
        base = survivor.stats()["daemon"]["device_native_requests"]
        while survivor.stats()["daemon"]["device_native_requests"] < base + 8:  # it streams
            survivor.copy(buf, seg).result()
        os.kill(victim.pid, signal.SIGKILL)
        victim.join()
        for _ in range(50):
            survivor.copy(buf, seg).result()
        while survivor.stats()["daemon"]["sessions"] != 1:
            survivor.copy(seg, buf).result()
        assert survivor.stats()["daemon"]["device_bytes"] == 1 << 20
        assert survivor.checksum(buf).result() == transfer.checksum64(seg.buffer)
    assert fake_gpu.violations() == []


def test_hostile_device_addresses(fake_gpu: FakeGpu) -> None:
    """Device VAs out of bounds, of another tenant's buffer, of no segment, and sizes past any
    buffer: each refused with the Python pass's error, nothing reaches the driver, and the
    session serves on."""
    with transfer.connect(fake_gpu.endpoint, deferred=False) as c, transfer.connect(fake_gpu.endpoint, deferred=False) as other:
        seg, dev = c.segment(4096), c.alloc(4096)
        theirs = other.alloc(4096)
        bad = [
            (lambda: c.copy(dev.va + 4000, seg.va, 200), E.OutOfBounds),
            (lambda: c.copy(seg.va, dev.va + 4096, 1), E.OutOfBounds),
            (lambda: c.copy(theirs.va, seg.va, 64), E.NotOwner),
            (lambda: c.copy(dev.va, seg.va, (1 << 63) + 5), E.OutOfBounds),
            (lambda: c.fill(dev.va - 1, 8, 0), E.AddressError),
            (lambda: c.copy((0xFFFFF << 40) | 5, seg.va, 64), E.UnknownSegment),
        ]
        for make, err in bad:
            with pytest.raises(err):
                make().result(10)
        seg.buffer[:] = 9
        c.copy(dev, seg, 4096).result()
        c.copy(seg.va, dev.va, 4096).result()
        assert (seg.buffer == 9).all()


def test_a_sticky_fault_fails_the_tenant_clearly(fake_gpu_factory: Any) -> None:
    """The fake's fifth copy faults (CUDA_ERROR_ILLEGAL_ADDRESS, sticky): that request and
    every later device request of the session fail with DeviceFault naming the CUDA error,
    none hangs, host copies still work, and the daemon serves another session."""
    g = fake_gpu_factory(FAKECUDA_FAULT_AT="5")
    with transfer.connect(g.endpoint, deferred=False) as c:
        seg, dev = c.segment(4096), c.alloc(4096)
        outcomes = []
        for _ in range(12):
            try:
                c.copy(dev, seg, 4096).result(30)
                outcomes.append("ok")
            except E.DeviceFault as exc:
                assert "CUDA error 700" in str(exc)
                outcomes.append("fault")
        assert outcomes[:4] == ["ok"] * 4 and set(outcomes[4:]) == {"fault"}, outcomes
        other = c.segment(4096)
        seg.buffer[:] = 3
        c.copy(other, seg, 4096).result(30)
        assert (other.buffer == 3).all()
        assert c.stats()["daemon"]["device_faults"] >= 8
    with transfer.connect(g.endpoint) as c2:
        s1, s2 = c2.segment(64), c2.segment(64)
        c2.copy(s2, s1, 64).result(30)


def test_without_a_driver_the_python_pass_serves(fake_gpu_factory: Any, tmp_path: Path) -> None:
    """No loadable driver: the daemon says so, and device requests take the Python pass, as
    before, counted."""
    g = fake_gpu_factory(driver=str(tmp_path / "nowhere" / "libcuda.so.1"))
    assert "through the Python pass" in g.daemon.ready["data_plane"]
    with transfer.connect(g.endpoint, deferred=False) as c:
        seg, dev = c.segment(4096), c.alloc(4096)
        seg.buffer[:] = 5
        before = counts(c)
        for _ in range(10):
            c.copy(dev, seg, 4096).result()
            c.copy(seg, dev, 4096).result()
        after = counts(c)
        assert (seg.buffer == 5).all()
    assert after["device_native_requests"] == before["device_native_requests"] == 0
    assert after["python_device_requests"] - before["python_device_requests"] == 20


def test_pipelined_batches_answer_in_order_once_done(gpu: Any) -> None:
    """Copies kept in flight, many at a time: a worker queues a batch behind the one whose
    event it waits for (counted), and answers each in ring order only once it has run. The
    producer overwrites each slot the moment its copy is answered and reads each copy back the
    moment that is answered: garbage or the fake's poison shows any early answer."""
    n, slots, rounds = 64 << 10, 16, 40
    with transfer.connect(gpu.endpoint, deferred=False) as c:
        src, out = c.segment(n * slots), c.segment(n * slots)
        dev = c.alloc(n * slots)
        before = c.stats()["daemon"]["device_batches_pipelined"]
        for r in range(rounds):
            for k in range(slots):
                src.buffer[k * n:(k + 1) * n] = (r * slots + k) % 251
            ups = [c.copy(dev.va + k * n, src.va + k * n, n) for k in range(slots)]
            downs = []
            for k, p in enumerate(ups):
                p.result()
                src.buffer[k * n:(k + 1) * n] = 0xEE
                downs.append(c.copy(out.va + k * n, dev.va + k * n, n))
            for k, p in enumerate(downs):
                p.result()
                assert (out.buffer[k * n:(k + 1) * n] == (r * slots + k) % 251).all(), (r, k)
        assert c.stats()["daemon"]["device_batches_pipelined"] > before


def test_segments_are_page_locked_when_registered_and_unlocked_when_freed(fake_gpu: FakeGpu) -> None:
    """A host segment is page-locked in the background once registered (the daemon's keeper
    thread: no copy needed, not on the event loop), and unlocked after its owner frees it,
    once no device work touches it."""
    n = 8 << 20
    with transfer.connect(fake_gpu.endpoint, deferred=False) as c:
        base = c.stats()["daemon"]["pinned_bytes"]
        seg = c.segment(n)
        while c.stats()["daemon"]["pinned_bytes"] < base + n:
            c.fence()  # (a round trip: the keeper pins meanwhile)
        dev = c.alloc(n)
        for _ in range(4):
            c.copy(dev, seg, n)
        c.free(seg)
        while c.stats()["daemon"]["pinned_bytes"] > base:
            c.fence()
        assert c.stats()["daemon"]["device_unpinned_copies"] == 0
    assert fake_gpu.violations() == []


def test_a_checksum_after_a_copy_from_the_device_reads_what_it_wrote(fake_gpu: FakeGpu) -> None:
    """In one batch: a host copy (its sum kept for a checksum of its destination later in the
    batch), a device-to-host copy over that destination, then the checksum: it answers the
    bytes the device wrote, not the first copy's sum."""
    n = 64 << 10
    with transfer.connect(fake_gpu.endpoint, deferred=False) as c:
        a, b = c.segment(n), c.segment(n)
        dev = c.alloc(n)
        a.buffer[:] = 1
        b.buffer[:] = 2
        c.copy(dev, b, n).result()
        with c.batch():
            got = [c.copy(b.va, a.va, n), c.copy(b.va, dev.va, n), c.checksum(b.va, n)]
        assert [p.result() for p in got][2] == transfer.checksum64(np.full(n, 2, np.uint8))


def _graph_counts(c: transfer.Client) -> dict[str, int]:
    st = c.stats()["daemon"]
    return {k: st[k] for k in ("native_graph_runs", "graph_captures", "graph_capture_failures", "graph_replays", "graph_eager_runs")}


def _pipeline(c: transfer.Client, n: int) -> tuple[list[np.ndarray], np.ndarray]:
    """n batches, none waited for until the end: each copied to the device, a two-node graph
    (scale_add, relu) run there, the result copied back into its own host slot."""
    seg, out = c.segment(n * 256), c.segment(n * 256)
    din, dmid, dout = c.alloc(256), c.alloc(256), c.alloc(256)
    g = c.graph()
    g.input("x", (64,), np.float32)
    g.output("y", (64,), np.float32)
    g.tensor("h", (64,), np.float32)
    g.op("scale_add", ["x"], ["h"], {"a": 2.0, "b": -50.0})
    g.op("relu", ["h"], ["y"])
    xs = seg.ndarray((n, 64), np.float32)
    xs[...] = np.random.default_rng(n).uniform(0, 50, (n, 64)).astype(np.float32)
    c.copy(din, seg, 256).result()  # (the buffers and the graph defined, its first run planned, before the pipeline)
    c.run_graph(g, [din], [dout]).result()
    c.fill(dmid, 256, 0).result()
    pending = []
    for k in range(n):
        c.copy(din, seg.va + k * 256, 256)
        c.run_graph(g, [din], [dout])
        pending.append(c.copy(out.va + k * 256, dout, 256))
    for p in pending:
        p.result()
    c.free(dmid)
    return [np.maximum(2 * x - 50, 0) for x in xs], out.ndarray((n, 64), np.float32)


def test_a_repeated_device_graph_run_is_captured_once_and_replayed(gpu: Any) -> None:
    """From its second run, a graph run on device memory is the worker's: captured into a CUDA
    graph on the worker's stream once, then one launch per run, in ring order between the
    copies around it (each batch's output is its own), with no wait between batches."""
    n = 40
    with transfer.connect(gpu.endpoint) as c:
        before = _graph_counts(c)
        want, got = _pipeline(c, n)
        after = _graph_counts(c)
        device_ns = c.stats()["session"]["device_ns"]
    for k in range(n):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=f"batch {k}")
    d = {k: after[k] - before[k] for k in after}
    assert d["native_graph_runs"] == n  # (the first run, before them, was planned by the Python pass)
    assert d["graph_captures"] + d["graph_capture_failures"] == 1
    assert d["graph_replays"] + d["graph_eager_runs"] == n
    assert device_ns > 0  # (timed by the events around each flight's work on the worker's stream)
    if isinstance(gpu, FakeGpu):
        assert d["graph_captures"] == 1 and d["graph_replays"] == n


def test_a_run_that_cannot_be_captured_is_launched_kernel_by_kernel(fake_gpu_factory: Any) -> None:
    """A driver that refuses capture: counted, and every run's kernels go on the worker's
    stream one by one instead, with the same answers."""
    g = fake_gpu_factory(FAKECUDA_NO_CAPTURE="1")
    n = 12
    with transfer.connect(g.endpoint) as c:
        want, got = _pipeline(c, n)
        d = _graph_counts(c)
    for k in range(n):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=f"batch {k}")
    assert d["graph_captures"] == 0 and d["graph_capture_failures"] == 1 and d["graph_eager_runs"] == n


def test_a_free_drops_the_capture(fake_gpu: FakeGpu) -> None:
    """Any free drops what the workers captured: the next run is planned and captured again,
    and a run naming the freed buffer is refused, never replayed into it."""
    with transfer.connect(fake_gpu.endpoint) as c:
        seg = c.segment(256)
        x = seg.ndarray(64, np.float32)
        x[:] = np.arange(64)
        din, dout, other = c.alloc(256), c.alloc(256), c.alloc(256)
        g = c.graph()
        g.input("x", (64,), np.float32)
        g.output("y", (64,), np.float32)
        g.op("scale_add", ["x"], ["y"], {"a": 3.0, "b": 0.0})
        c.copy(din, seg, 256).result()
        c.fill(other, 256, 0).result()  # (defined on the daemon: its free is one)
        for _ in range(3):
            c.run_graph(g, [din], [dout]).result()
        assert _graph_counts(c)["graph_captures"] == 1
        c.free(other)
        for _ in range(3):
            c.run_graph(g, [din], [dout]).result()
        assert _graph_counts(c)["graph_captures"] == 2
        c.copy(seg, dout, 256).result()
        np.testing.assert_allclose(x, 3 * np.arange(64))
        c.free(dout)
        with pytest.raises(E.InvalidAddress, match="freed"):
            c.run_graph(g, [din], [dout]).result()
        c.run_graph(g, [din], [din]).result()  # (in place: the session serves on)
        c.copy(seg, din, 256).result()
        np.testing.assert_allclose(x, 3 * np.arange(64))  # (din held arange)


def test_a_latency_tenant_gets_the_devices_greatest_priority(fake_gpu: FakeGpu) -> None:
    """`priority="latency"` at connect: the session's device streams (its ring worker's
    included) are created at the device's greatest priority; a normal session's are not; a
    priority that is not one is refused on both sides."""
    with transfer.connect(fake_gpu.endpoint, priority="latency") as fast, transfer.connect(fake_gpu.endpoint) as bulk:
        assert fast.stats()["session"]["priority"] == "latency" and bulk.stats()["session"]["priority"] == "normal"
        for c in (fast, bulk):
            seg, buf = c.segment(4096), c.alloc(4096)
            for _ in range(3):  # (the first defines the buffer, on the socket; then the ring worker's)
                c.copy(buf, seg, 4096).result()
            assert counts(c)["device_native_requests"] >= 2
    with pytest.raises(ValueError, match="priority"):
        transfer.connect(fake_gpu.endpoint, priority="urgent")
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:  # (the wire: a priority that is not one)
        s.connect(fake_gpu.daemon.endpoint)
        s.send(P.encode_requests([P.Hello(1, P.VERSION, "raw", 0, b"", 5)]))
        assert s.poll(10_000)
        (r,) = P.decode_replies(s.recv())
        assert isinstance(r.error, E.InvalidField) and "priority" in str(r.error)
    finally:
        s.close(0)
    fake_gpu.daemon.stop()
    assert fakecuda.report(fake_gpu.report).get("priority_streams") == 1  # (the fake's counts at its exit)


@pytest.mark.parametrize("bound", [8 << 20, 0])
def test_a_tenant_queues_at_most_its_bound_on_the_copy_engine(fake_gpu_factory: Any, bound: int) -> None:
    """`--device-queue-bytes`: a tenant's worker streaming large copies keeps at most about
    twice the bound queued on its stream (it waits for the older half first), so another
    tenant's copy is never behind more; without a bound, one 64 MiB copy queues all of it."""
    n = 64 << 20
    g = fake_gpu_factory("--device-queue-bytes", str(bound))
    with transfer.connect(g.endpoint, deferred=False) as c:
        seg, buf = c.segment(n), c.alloc(n)
        seg.buffer[::4096] = 7
        for _ in range(3):
            c.copy(buf, seg, n).result()
        back = c.segment(n)
        c.copy(back, buf, n).result()
        assert (back.buffer[::4096] == 7).all()
        waits = c.stats()["daemon"]["device_queue_waits"]
    g.daemon.stop()
    most = fakecuda.report(g.report)["max_stream_bytes"]
    if bound:
        assert most <= 2 * bound + (4 << 20) and waits > 0, (most, waits)  # (a worker's piece is 4 MiB)
    else:
        assert most >= n and waits == 0, (most, waits)
