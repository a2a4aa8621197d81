"""A real transferd process, real client processes, real shared memory."""

from __future__ import annotations

from typing import Any

import fcntl
import multiprocessing as mp
import os
import stat
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

import _workers
import transfer
from conftest import segment_files
from transfer import protocol as P
from transfer.addressing import MAX_SEGMENT_BYTES
from transfer.memory import ShmFile
from transfer.memory._shm import SEALS, memory_available


@pytest.fixture
def daemon(shared_daemon: Any) -> Any:
    """This module's tests share one daemon (`conftest.shared_daemon`) but those that take
    `daemon_factory` (a restart, a shared-memory directory to look at)."""
    return shared_daemon


def test_round_trip_and_views(daemon) -> None:
    with transfer.connect(daemon.endpoint) as c:
        seg = c.segment(1 << 20)
        img = seg.ndarray((4, 3, 8, 8), np.float32, offset=4096)
        img[:] = np.arange(img.size, dtype=np.float32).reshape(img.shape)
        buf = c.alloc(1 << 20)
        c.copy(buf.va, seg.va, 1 << 20).result()
        out = c.segment(1 << 20)
        c.copy(out, buf).result()
        assert np.array_equal(out.ndarray((4, 3, 8, 8), np.float32, offset=4096), img)
        c.fill(buf.va + 10, 100, 0xAB).result()
        c.copy(out.va, buf.va, 200).result()
        assert (out.buffer[10:110] == 0xAB).all() and out.buffer[110] == seg.buffer[110]
        assert c.checksum(seg).result() == transfer.checksum64(seg.buffer)
        assert c.checksum(seg.va + 3, 1001).result() == transfer.checksum64(seg.buffer[3:1004])


def test_many_client_processes_every_byte_verified(daemon) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_workers.producer, args=(daemon.endpoint, seed, 15)) for seed in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]


def test_batching_vector_and_many_in_flight(daemon) -> None:
    with transfer.connect(daemon.endpoint) as c:
        seg = c.segment(1 << 20)
        seg.buffer[:] = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
        buf = c.alloc(1 << 20)
        with c.batch():
            pend = [c.copy(buf.va + i * 4096, seg.va + (255 - i) * 4096, 4096) for i in range(256)]
        c.fence()
        assert all(p.done() and p.result() is None for p in pend)
        expect = seg.buffer.reshape(256, 4096)[::-1].reshape(-1)
        back = c.segment(1 << 20)
        c.copy(back, buf).result()
        assert np.array_equal(back.buffer, expect)
        # Vector copy: reversed blocks again, and a contiguous run the daemon merges.
        idx = np.arange(256, dtype=np.uint64) * 4096
        c.copy_many(buf.va + idx, seg.va + idx[::-1].copy(), np.full(256, 4096, np.uint64)).result()
        c.copy(back, buf).result()
        assert np.array_equal(back.buffer, expect)
        c.copy_many(buf.va + idx, seg.va + idx, np.full(256, 4096, np.uint64)).result()
        c.copy(back, buf).result()
        assert np.array_equal(back.buffer, seg.buffer)


def test_overlapping_copies_behave_like_sequential(daemon) -> None:
    with transfer.connect(daemon.endpoint) as c:
        seg = c.segment(64 << 10)
        ref = np.random.default_rng(2).integers(0, 256, 64 << 10, dtype=np.uint8)
        seg.buffer[:] = ref
        # A vector whose pieces overlap their own destinations: piecewise semantics.
        idx = np.arange(8, dtype=np.uint64) * 1024
        c.copy_many(seg.va + 1024 + idx, seg.va + idx, np.full(8, 1024, np.uint64)).result()
        for k in range(8):
            ref[1024 + k * 1024 : 2048 + k * 1024] = ref[k * 1024 : 1024 + k * 1024].copy()
        assert np.array_equal(seg.buffer, ref)
        # A single overlapping copy is a memmove.
        c.copy(seg.va + 7, seg.va, 5000).result()
        ref[7:5007] = ref[0:5000].copy()
        assert np.array_equal(seg.buffer, ref)


def test_bad_requests_fail_alone_with_their_codes(daemon) -> None:
    with transfer.connect(daemon.endpoint) as a, transfer.connect(daemon.endpoint) as b:
        seg_a = a.segment(4096)
        seg_b = b.segment(4096)
        gone = b.segment(4096)
        b.free(gone)
        cases = [
            (lambda: b.copy(seg_b.va, seg_a.va, 16), transfer.NotOwner),
            (lambda: b.copy(seg_b.va, seg_b.va + 4000, 100), transfer.OutOfBounds),
            (lambda: b.copy(seg_b.va, seg_b.va, 2**64 - 1), transfer.OutOfBounds),
            (lambda: b.copy(seg_b.va + (1 << 40) - 1, seg_b.va, 2), transfer.OutOfBounds),
            (lambda: b.copy(seg_b.va, gone.va, 16), transfer.SegmentFreed),
            (lambda: b.copy(seg_b.va, transfer.make_va(999_999), 16), transfer.UnknownSegment),
            (lambda: b.fill(0, 1), transfer.UnknownSegment),
        ]
        for submit, err in cases:
            with pytest.raises(err):
                submit().result()
        with pytest.raises(transfer.SegmentFreed):
            b.free(gone)
        with pytest.raises(transfer.NotOwner):
            b.free(seg_a)
        with pytest.raises(transfer.InvalidField):
            b.alloc(0)
        with pytest.raises(transfer.InvalidField):
            b.alloc(16, device=7)
        # One bad request inside a batch does not spoil its neighbours.
        with b.batch():
            ok1 = b.fill(seg_b, 10, 1)
            bad = b.copy(seg_b.va, seg_a.va, 16)
            ok2 = b.fill(seg_b.va + 10, 10, 2)
        assert ok1.result() is None and ok2.result() is None
        assert isinstance(bad.exception(), transfer.NotOwner)
        assert list(seg_b.buffer[:20]) == [1] * 10 + [2] * 10
        # fence() raises a failure nobody looked at, once.
        b.copy(seg_b.va, seg_a.va, 16)
        with pytest.raises(transfer.NotOwner):
            b.fence()
        b.fence()
        # A's session never noticed.
        a.fill(seg_a, 4096, 9).result()
        assert (seg_a.buffer == 9).all()


def raw_socket(endpoint: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(endpoint)
    return s


def raw_error(sock: zmq.Socket, frame: bytes) -> int:
    sock.send(frame)
    (reply,) = P.decode_replies(sock.recv(), P.Limits(max_frame_bytes=1 << 30))
    assert reply.error is not None
    return reply.error.code


def test_hostile_frames_get_errors_and_the_daemon_keeps_serving(daemon) -> None:
    with transfer.connect(daemon.endpoint) as good:
        seg = good.segment(1 << 16)
        seg.buffer[:] = 3
        s = raw_socket(daemon.endpoint)
        assert raw_error(s, P.encode_requests([P.Copy(1, 0, 0, 1)])) == transfer.NoSession.code
        assert raw_error(s, msgpack.packb([P.VERSION, [[1, 1, 99, "x", 0, b""]]])) == transfer.UnsupportedVersion.code
        assert raw_error(s, msgpack.packb([99, [[1, 1, 1, "x", 0, b""]]])) == transfer.UnsupportedVersion.code
        assert raw_error(s, b"\xff\xfe garbage") == transfer.MalformedFrame.code
        assert raw_error(s, P.encode_requests([P.Ping(1)] * 3)[:-2]) == transfer.MalformedFrame.code
        assert raw_error(s, b"\x00" * ((4 << 20) + 10)) == transfer.FrameTooLarge.code
        s.send(P.encode_requests([P.Hello(1, P.VERSION, "raw", 0, b"")]))
        assert P.decode_replies(s.recv())[0].error is None
        assert raw_error(s, msgpack.packb([P.VERSION, [[20, 5, "a", 0, 0, 0]]])) == transfer.InvalidField.code
        assert raw_error(s, msgpack.packb([P.VERSION, [[77, 6]]])) == transfer.UnknownOperation.code
        assert raw_error(s, P.encode_requests([P.Copy(7, seg.va, seg.va, 1)])) == transfer.NotOwner.code
        assert raw_error(s, P.encode_requests([P.Hello(8, P.VERSION, "again", 0, b"")])) == transfer.InvalidField.code
        s.send_multipart([b"two", b"frames"])
        (r,) = P.decode_replies(s.recv())
        assert r.error is not None and r.error.code == transfer.MalformedFrame.code
        s.close(0)
        # The well-behaved client never noticed.
        assert good.checksum(seg).result() == transfer.checksum64(seg.buffer)
        assert good.stats()["daemon"]["bad_frames"] >= 5


def test_shared_memory_is_sealed_and_has_no_name(daemon_factory, shm_dir: Path) -> None:
    daemon = daemon_factory()  # (its own: its shared-memory directory is looked at)
    with transfer.connect(daemon.endpoint) as c:
        seg = c.segment(1 << 20)
        assert segment_files(shm_dir) == []  # a memfd: nothing in the shm dir, ever
        (fds,) = [shm_dir / n for n in os.listdir(shm_dir) if ".fds." in n]
        assert stat.S_ISSOCK(fds.stat().st_mode) and stat.S_IMODE(fds.stat().st_mode) == 0o600
        with open("/proc/self/maps") as f:
            start = seg.buffer.ctypes.data
            (line,) = [ln for ln in f if int(ln.split("-")[0], 16) == start]
        assert "/memfd:transfer." in line and "(deleted)" in line
    f = ShmFile.create("transfer.modetest", 4096)
    try:
        assert fcntl.fcntl(f.fd, fcntl.F_GET_SEALS) == SEALS
        with pytest.raises(PermissionError):
            os.ftruncate(f.fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(f.fd, 8192)
    finally:
        f.close()
    sock = Path(daemon.endpoint[len("ipc://") :])
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700


def test_exhausted_shared_memory_says_so(daemon_factory) -> None:
    d = daemon_factory("--max-host-bytes", str(1 << 20))
    with transfer.connect(d.endpoint) as c:
        c.segment(256 << 10)
        with pytest.raises(transfer.OutOfSharedMemory) as info:
            c.segment(4 << 20)
        msg = str(info.value)
        assert "cannot reserve 4 MiB" in msg and "free" in msg and "--max-host-bytes" in msg
        c.segment(64 << 10)  # the session survives
        # Beyond what the machine has: refused up front (never the OOM killer, never SIGBUS).
        room = memory_available()
        assert room is not None
        if 2 * room[0] < MAX_SEGMENT_BYTES:
            with transfer.connect(daemon_factory().endpoint) as big:
                with pytest.raises(transfer.OutOfSharedMemory) as info:
                    big.segment(2 * room[0])
                assert str(2 * room[0]) in str(info.value) and "free" in str(info.value)
                assert big.checksum(big.segment(4096)).result() == transfer.checksum64(bytes(4096))


def test_trio_client(daemon) -> None:
    import trio

    async def main() -> None:
        async with transfer.open_client(daemon.endpoint) as c:
            seg = await c.segment(1 << 20)
            buf = await c.alloc(1 << 20)
            seg.buffer[:] = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20]
            pend = [c.copy(buf.va + i * 65536, seg.va + i * 65536, 65536) for i in range(16)]
            for p in pend:
                assert await p is None
            assert await c.checksum(buf) == transfer.checksum64(seg.buffer)
            with pytest.raises(transfer.OutOfBounds):
                await c.copy(buf.va, seg.va, 2 << 20)
            with c.batch():
                c.fill(buf, 1 << 20, 5)
                c.copy(seg.va, buf.va + 1, 1 << 20)  # out of bounds, not awaited
            with pytest.raises(transfer.OutOfBounds):
                await c.fence()
            await c.free(seg)
            with pytest.raises(transfer.SegmentFreed):
                await c.checksum(seg.va, 1)

    trio.run(main)


def test_connecting_to_nothing_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(transfer.DaemonUnavailable, match="does not exist"):
        transfer.connect(f"ipc://{tmp_path}/nothing.sock")
    stale = tmp_path / "stale.sock"
    stale.touch()
    # Refused at once, not after the connect timeout: one longer than the test's own limit.
    with pytest.raises(transfer.DaemonUnavailable, match="is not a socket"):
        transfer.connect(f"ipc://{stale}", connect_timeout=3600)


def test_poll_collects_replies_without_blocking(daemon) -> None:
    with transfer.connect(daemon.endpoint) as c:
        seg = c.segment(1 << 20)
        p = c.checksum(seg)
        deadline = time.monotonic() + 5
        while c.poll() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert p.done() and p.result(timeout=0) == transfer.checksum64(seg.buffer)
        slow = c.checksum(seg)
        try:
            slow.result(timeout=0)  # may or may not be in yet; never blocks
        except transfer.RequestTimeout:
            pass
        assert slow.result() == transfer.checksum64(seg.buffer)
