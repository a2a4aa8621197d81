"""The stream simulation (a GPU's queued execution in host RAM), and what it proves about the daemon.

`StreamSimBackend` runs device work only when its stream is synchronized, in
a random legal order, poisons host bytes a queued device-to-host copy will
write, raises on reads before the writing work completed, on overlapping
device copies, and faults (stickily) on misaligned kernel operands. Each test
below names the GPU issue item it covers; the scheduler property test
(tests/unit/server/test_scheduler.py), tests/integration/test_equivalence.py and the operator suite
also run with it.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

import transfer
from transfer import errors as E
from transfer import protocol as P
from transfer._checksum import checksum64
from transfer.addressing import SegmentKind
from transfer.backends import Span, make_backend
from transfer.backends._streamsim import POISON, StreamSimBackend, StreamSimViolation
from transfer.kernels import REGISTRY, TensorRef
from transfer.server._ops import SOCKET
from transfer.server._batch import plan_batch
from transfer.server._waves import assign_waves, run_waves

from _world import make_world, va

# make_world: segment 0 and 1 are host (4096, 8192 bytes), segment 2 is sim device memory (3000 bytes).


def run(planner, devices, reqs: list[P.Request], inline_bytes: int = 0) -> dict[int, object]:
    ops, refused = plan_batch(planner, "s", [(r, SOCKET) for r in reqs])
    assert not refused, refused
    trio.run(run_waves, assign_waves(ops), {d.index: trio.CapacityLimiter(1) for d in devices}, inline_bytes)
    out: dict[int, object] = {}
    for op in ops:
        for i in [op.rid] if op.ids is None else [int(i) for i in op.ids]:
            out[i] = op.error if op.error is not None else op.result
    return out


@pytest.fixture
def world():
    planner, devices, mem = make_world(backend_name="streamsim")
    sim = devices[0].backend
    rng = np.random.default_rng(7)
    for m in mem[:2]:
        m[:] = rng.integers(0, 256, m.size, dtype=np.uint8)
    mem[2].data[:] = rng.integers(0, 256, mem[2].nbytes, dtype=np.uint8)
    yield planner, devices, mem, sim
    assert sim.violations == []


# --- the model ---------------------------------------------------------------------------------
def test_device_work_runs_only_at_synchronize() -> None:
    sim = StreamSimBackend(1, seed=1)
    dev = sim.alloc(64, 0)
    host = type("H", (), {"array": np.arange(64, dtype=np.uint8)})()
    sim.copy(Span(SegmentKind.DEVICE, dev, 0, 64), Span(SegmentKind.HOST, host, 0, 64))
    assert sim.pending() == 1 and not dev.data.any()  # queued, not done
    with pytest.raises(StreamSimViolation, match="before the device work that writes it completed"):
        sim.read(dev)
    back = type("H", (), {"array": np.zeros(64, np.uint8)})()
    sim.copy(Span(SegmentKind.HOST, back, 0, 64), Span(SegmentKind.DEVICE, dev, 0, 64))
    assert (back.array == POISON).all()  # undefined until the copy completes
    sim.synchronize_device(0)
    assert sim.pending() == 0 and (back.array == np.arange(64)).all() and (sim.read(dev) == np.arange(64)).all()
    sim.violations.clear()


def test_undefined_and_faulting_cuda_use_raises() -> None:
    sim = StreamSimBackend(1, seed=2)
    dev = sim.alloc(256, 0)
    with pytest.raises(StreamSimViolation, match="overlapping"):
        sim._memcpy(Span(SegmentKind.DEVICE, dev, 0, 100), Span(SegmentKind.DEVICE, dev, 10, 100), 0)
    kernel = REGISTRY.lookup("scale_add", ("float32", "float32"), "gpu")
    t = TensorRef(0, "float32", (4,))
    sim._launch(kernel, [(t, dev, 2)], [(t, dev, 2)], {}, 0)  # misaligned: faults when it runs
    with pytest.raises(RuntimeError, match="cudaErrorMisalignedAddress"):
        sim.synchronize_device(0)
    with pytest.raises(RuntimeError, match="sticky"):  # a CUDA fault loses the context
        sim.fill(Span(SegmentKind.DEVICE, dev, 0, 8), 1)
    sim.violations.clear()


def test_lanes_are_streams_of_their_own() -> None:
    """Each (device, lane) is one queue: synchronizing a lane runs only its work, and two lanes
    of one session racing on the same bytes is flagged (nothing orders two streams)."""
    sim = StreamSimBackend(1, seed=3)
    a, b = sim.alloc(64, 0), sim.alloc(64, 0)
    host = type("H", (), {"array": np.arange(64, dtype=np.uint8)})()
    with sim.lane((1, 0)):
        sim.copy(Span(SegmentKind.DEVICE, a, 0, 64), Span(SegmentKind.HOST, host, 0, 64))
    with sim.lane((2, 0)):  # another session: its own stream
        sim.copy(Span(SegmentKind.DEVICE, b, 0, 64), Span(SegmentKind.HOST, host, 0, 64))
    with sim.lane((1, 1)), pytest.raises(StreamSimViolation, match="nothing orders two streams"):
        sim.fill(Span(SegmentKind.DEVICE, a, 0, 8), 1)  # races the copy still queued on lane (1, 0)
    sim.synchronize_lane(0, (2, 0))
    assert sim.pending() == 1 and (sim.read(b) == np.arange(64)).all()  # lane (1, 0) still queued
    sim.forget_lanes(1)  # a session ends: its lanes finish and go
    assert sim.pending() == 0 and (sim.read(a) == np.arange(64)).all()
    assert {k for k in sim._keys if isinstance(k[1], tuple)} == {(0, (2, 0))}
    sim.violations.clear()


def test_the_daemon_can_run_it() -> None:
    assert make_backend("streamsim").name == "streamsim"


# --- item 1: answers only after the device work is visible -----------------------------------------
@pytest.mark.parametrize("inline_bytes", [0, 1 << 30])
def test_a_wave_answers_only_after_its_stream_is_synchronized(world, inline_bytes: int, monkeypatch) -> None:
    planner, devices, mem, sim = world
    want = mem[0][:512].copy()
    reqs = [P.Copy(1, va(2, 0), va(0, 0), 512), P.Copy(2, va(1, 0), va(2, 0), 512), P.Checksum(3, va(2, 0), 512)]
    out = run(planner, devices, reqs, inline_bytes)
    assert out[3] == checksum64(want)
    assert (mem[1][:512] == want).all() and sim.pending() == 0 and sim.executed[0] >= 2
    # The simulation would catch a pass that answered first: without the synchronize, the
    # host bytes the reply vouches for are still poison when it goes out.
    monkeypatch.setattr(sim, "_sync", lambda device: None)
    run(planner, devices, [P.Copy(4, va(1, 1024), va(2, 0), 512)], inline_bytes)
    assert (mem[1][1024:1536] == POISON).all()


# --- item 2: pieces of one request, host and device mixed, in order ----------------------------------
def test_copyv_mixing_device_and_host_pieces_runs_in_order(world) -> None:
    planner, devices, mem, sim = world
    dev = sim.read(mem[2])
    # device -> host A (queued), then host A -> host B (a CPU copy): B must get the device's bytes
    reqs = [P.CopyV(1, np.array([va(0, 0), va(1, 0), va(2, 100)], np.uint64), np.array([va(2, 0), va(0, 0), va(1, 0)], np.uint64), np.full(3, 64, np.uint64))]
    out = run(planner, devices, reqs)
    assert out[1] is None
    assert (mem[0][:64] == dev[:64]).all() and (mem[1][:64] == dev[:64]).all()
    assert (sim.read(mem[2], 100, 64) == dev[:64]).all()


def test_a_merged_run_of_copies_keeps_its_order(world) -> None:
    planner, devices, mem, sim = world
    dev = sim.read(mem[2])
    # Ten plain copies in a row are planned as one vector op: a chain device -> host -> host ->
    # device -> ..., so host copies (run by the CPU) sit between queued device copies.
    def at(k: int) -> int:
        return va(2, 0) if k == 0 else (va(0, k * 32) if k % 3 else va(2, 1000 + k * 32))

    reqs = [P.Copy(k, at(k), at(k - 1), 32) for k in range(1, 11)]
    ops, _ = plan_batch(planner, "s", [(r, SOCKET) for r in reqs])
    assert len(ops) == 1 and ops[0].ids is not None  # one vector op
    out = run(planner, devices, reqs)
    assert all(v is None for v in out.values()), out
    for k in range(1, 11):
        got = mem[0][k * 32 : k * 32 + 32] if k % 3 else sim.read(mem[2], 1000 + k * 32, 32)
        assert (got == dev[:32]).all(), k


# --- item 3: overlapping device-to-device copies ------------------------------------------------------
@pytest.mark.parametrize("shift", [1, 40, -3, -700])
def test_overlapping_device_copies_behave_like_memmove(world, shift: int) -> None:
    planner, devices, mem, sim = world
    ref = sim.read(mem[2])
    src, n = 1000, 1200
    dst = src + shift
    ref[dst : dst + n] = ref[src : src + n].copy()
    out = run(planner, devices, [P.Copy(1, va(2, dst), va(2, src), n)])
    assert out[1] is None and (sim.read(mem[2]) == ref).all()


# --- item 4: misaligned device operands ---------------------------------------------------------------
def test_misaligned_device_operands_are_staged_not_faulted(world) -> None:
    planner, devices, mem, sim = world
    ref = sim.read(mem[2])
    x = TensorRef(va(2, 2), "float32", (16,))
    y = TensorRef(va(2, 302), "float32", (16,))
    reqs = [P.Compute(1, "scale_add", [x], [y], {"a": 2.0, "b": 1.0}), P.Checksum(2, va(2, 3), 77), P.Compute(3, "checksum", [TensorRef(va(2, 5), "uint8", (40,))], [], {})]
    out = run(planner, devices, reqs)
    with np.errstate(all="ignore"):
        want = ref[2:66].view(np.float32) * np.float32(2.0) + np.float32(1.0)
    assert out[1] is None and out[2] == checksum64(ref[3:80]) and out[3] == checksum64(ref[5:45])
    assert sim.read(mem[2], 302, 64).view(np.float32).tobytes() == want.tobytes()
    assert not sim.broken  # the device still serves
    assert run(planner, devices, [P.Fill(4, va(2, 0), 8, 1)])[4] is None


def test_device_strides_that_cannot_be_aligned_are_refused(world) -> None:
    planner, devices, mem, sim = world
    x = TensorRef(va(2, 0), "float32", (4,), (6,))
    out = run(planner, devices, [P.Compute(1, "scale_add", [x], [TensorRef(va(2, 512), "float32", (4,))], {})])
    assert isinstance(out[1], E.InvalidField) and not sim.broken


# --- item 5: a failing device fails its requests, the daemon serves on --------------------------------
def test_a_failing_synchronize_fails_its_requests_only(world) -> None:
    planner, devices, mem, sim = world
    sim.inject_fault(0)
    out = run(planner, devices, [P.Copy(1, va(2, 0), va(0, 0), 64), P.Copy(2, va(2, 64), va(0, 64), 64)])
    assert all(isinstance(out[i], E.BackendError) and "injected" in str(out[i]) for i in (1, 2))
    out = run(planner, devices, [P.Copy(3, va(2, 0), va(0, 0), 64), P.Checksum(4, va(2, 0), 64)])
    assert out[3] is None and out[4] == checksum64(mem[0][:64])


# --- through the daemon: socket, ring, deferred, DLPack --------------------------------------------------
@pytest.fixture
def simd(daemon_factory):
    return daemon_factory("--backend", "streamsim")


@pytest.mark.parametrize("ring", [False, True])
def test_device_round_trips_through_the_daemon(simd, ring: bool) -> None:
    with transfer.connect(simd.endpoint, ring=ring) as c:
        assert c.ring == ring
        seg = c.segment(1 << 16)
        buf = c.alloc(1 << 15)
        data = np.random.default_rng(3).integers(0, 256, 1 << 15, dtype=np.uint8)
        seg.buffer[: 1 << 15] = data
        for k in range(3):  # small (inline) and then larger passes
            n = 1 << (9 + 3 * k)
            c.copy(buf.va, seg.at(0), n).result(10)
            assert c.checksum(buf.va, n).result(10) == checksum64(data[:n])
            c.copy(seg.at(1 << 15), buf.va, n).result(10)
            assert (seg.buffer[1 << 15 : (1 << 15) + n] == data[:n]).all()  # visible when answered
        with c.batch():  # a chain through device and host, one pass
            for k in range(1, 64):
                c.copy(buf.va + k * 64, seg.at((k - 1) * 64 + 100), 64)
                c.copy(seg.at(k * 64 + 100), buf.va + k * 64, 64)
        c.fence()
        chain = np.asarray(seg.buffer[100 : 100 + 64 * 64]).reshape(64, 64)
        assert (chain == data[100:164]).all()  # each link read what the one before wrote
        c.copy(buf.va + 1, buf.va, 4096).result(10)  # overlapping, on the device
        c.fill(buf.va, 16, 9).result(10)
        assert c.checksum(buf.va, 16).result(10) == checksum64(bytes([9]) * 16)
        c.fence()


def test_streams_of_a_session_and_of_two_sessions(simd) -> None:
    """The `stream` field picks a lane; work on streams 0..5 of two sessions, interleaved,
    gives what one-at-a-time execution gives (the simulation flags lanes racing)."""
    data = np.random.default_rng(5).integers(0, 256, 1 << 14, dtype=np.uint8)
    with transfer.connect(simd.endpoint) as c1, transfer.connect(simd.endpoint, ring=True) as c2:
        work = []
        for c in (c1, c2):
            seg, buf = c.segment(1 << 15), c.alloc(1 << 14)
            seg.buffer[: 1 << 14] = data
            work.append((c, seg, buf))
        for c, seg, buf in work:
            with c.batch():
                for k in range(16):  # 16 pieces on 6 streams: in, then back out past the input
                    c.copy(buf.va + k * 1024, seg.at(k * 1024), 1024, stream=k % 6)
                for k in range(16):
                    c.copy(seg.at((1 << 14) + k * 1024), buf.va + ((k + 5) % 16) * 1024, 1024, stream=(k + 1) % 6)
        for c, seg, buf in work:
            c.fence()
            out = np.asarray(seg.buffer[1 << 14 :]).reshape(16, 1024)
            assert (out == np.roll(data.reshape(16, 1024), -5, axis=0)).all()
            assert c.checksum(buf.va, 1 << 14, stream=3).result(10) == checksum64(data)


def test_deferred_resources_on_the_simulated_gpu(simd) -> None:
    with transfer.connect(simd.endpoint) as c:
        seg = c.segment(8192)
        seg.buffer[:4096] = 5
        buf = c.alloc(4096)  # defined with its first use
        c.copy(buf.va, seg.at(0), 4096)
        c.copy(seg.at(4096), buf.va, 4096)
        c.fence()
        assert (seg.buffer[4096:8192] == 5).all()
        c.free(buf)
        c.fence()


def test_dlpack_views_of_simulated_gpu_memory(tmp_path) -> None:
    with transfer.serve_in_process(backend="streamsim", shm_dir=tmp_path) as d, transfer.connect(d.endpoint) as c:
        seg = c.segment(4096)
        seg.buffer[:1024] = np.arange(256, dtype=np.float32).view(np.uint8)
        buf = c.alloc(4096)
        c.copy(buf.va + 16, seg.at(0), 1024).result(10)
        arr = np.from_dlpack(d.device_array(buf, (256,), np.float32, offset=16))  # answered: visible
        assert (arr == np.arange(256, dtype=np.float32)).all()
        with pytest.raises(E.InvalidField, match="multiple of 4"):
            d.device_array(buf, (4,), np.float32, offset=2)
        sim = d.server.backend
        sim.inject_fault(0)
        with pytest.raises(E.BackendError, match="injected"):
            c.copy(buf.va, seg.at(0), 64).result(10)
        c.copy(buf.va, seg.at(1024), 64).result(10)  # the daemon serves on
        assert sim.violations == []


def test_segments_are_pinned_on_a_worker_under_the_cap(daemon_factory) -> None:
    """Pinning waits for a copy on a worker thread (never the event loop), and stops at
    --max-pinned-bytes; an unpinned segment's copies are still right."""
    d = daemon_factory("--backend", "streamsim", "--inline-bytes", "64K", "--max-pinned-bytes", "3M")
    with transfer.connect(d.endpoint) as c:
        data = np.random.default_rng(9).integers(0, 256, 1 << 20, dtype=np.uint8)
        a, b = c.segment(2 << 20), c.segment(2 << 20)
        buf = c.alloc(1 << 20)
        a.buffer[: 1 << 20] = data
        b.buffer[: 1 << 20] = data
        c.copy(buf.va, a.va, 4096).result(10)  # inline: on the loop, so not pinned
        assert c.stats()["daemon"]["pinned_bytes"] == 0
        c.copy(buf.va, a.va, 1 << 20).result(10)  # a worker's copy pins the whole segment
        assert c.stats()["daemon"]["pinned_bytes"] == 2 << 20
        c.copy(buf.va, b.va, 1 << 20).result(10)  # past the cap: not pinned, still copied
        assert c.stats()["daemon"]["pinned_bytes"] == 2 << 20
        assert c.checksum(buf.va, 1 << 20).result(10) == checksum64(data)
        c.free(a)
        assert c.stats()["daemon"]["pinned_bytes"] == 0


@pytest.mark.parametrize("ring", [False, True])
def test_gpu_passes_are_pipelined_and_answered_in_order(daemon_factory, ring: bool) -> None:
    """A stream of copies into device slots: passes are queued behind one another on the lane
    and each is answered only once its work is done (the simulation runs work at the fence)."""
    d = daemon_factory("--backend", "streamsim", "--inline-bytes", "64K")
    size, slots = 256 << 10, 8
    rng = np.random.default_rng(11)
    with transfer.connect(d.endpoint, ring=ring) as c:
        seg, dev, back = c.segment(size * slots), c.alloc(size * slots), c.segment(size * slots)
        pending: list = [None] * slots
        want: list = [None] * slots
        for seq in range(64):
            k = seq % slots
            if pending[k] is not None:
                pending[k].result(10)
                assert checksum64(back.buffer[k * size : (k + 1) * size]) == want[k]  # visible when answered
            data = rng.integers(0, 256, size, dtype=np.uint8)
            seg.buffer[k * size : (k + 1) * size] = data
            want[k] = checksum64(data)
            c.copy(dev.va + k * size, seg.va + k * size, size)
            pending[k] = c.copy(back.va + k * size, dev.va + k * size, size)  # and back: a D2H
        c.fence()
        for k in range(slots):
            assert checksum64(back.buffer[k * size : (k + 1) * size]) == want[k]
        assert c.stats()["daemon"]["pipelined_passes"] > 0


def test_dlpack_export_waits_for_the_device_work_queued_on_that_memory(tmp_path) -> None:
    """GPU issue: an export must be ordered after queued work that writes the memory
    (device memory: its device's queue; host memory: any device's queued D2H copy)."""
    with transfer.serve_in_process(backend="streamsim", shm_dir=tmp_path) as d, transfer.connect(d.endpoint, deferred=False) as c:
        sim, table = d.server.backend, d.server.table
        buf, seg = c.alloc(4096), c.segment(4096)
        dev_mem, host_mem = table.get(buf.va >> 40).handle, table.get(seg.va >> 40).handle
        src = type("H", (), {"array": np.arange(4096, dtype=np.uint8)})()
        # Queued as a wave would queue them, with no synchronize (no fence) after.
        sim.copy(Span(SegmentKind.DEVICE, dev_mem, 0, 4096), Span(SegmentKind.HOST, src, 0, 4096))
        sim.copy(Span(SegmentKind.HOST, host_mem, 0, 4096), Span(SegmentKind.DEVICE, dev_mem, 0, 4096))
        assert sim.pending() == 2
        arr = np.from_dlpack(d.device_array(buf, 4096))  # without the wait: StreamSimViolation
        assert sim.pending() == 0 and (arr == src.array).all()
        sim.copy(Span(SegmentKind.HOST, host_mem, 0, 4096), Span(SegmentKind.DEVICE, dev_mem, 0, 4096))
        assert (seg.buffer == POISON).all()  # the queued D2H copy has not landed
        view = d.device_array(seg, 4096)
        assert (np.from_dlpack(view) == src.array).all() and (np.asarray(view) == src.array).all()
        assert sim.violations == []
