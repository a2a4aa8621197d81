"""Remote producers over RDMA: transferd with a tcp endpoint, producers in other processes.

The daemon is a real `transferd` process on 127.0.0.1; the test process (and,
for the kill test, a third process) is the producer: it registers its own
NumPy memory with NIXL and the daemon pulls (READ) or pushes (WRITE) by VA.
Skipped when NIXL is not importable. See docs/rdma.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

import transfer
from transfer import protocol as P
from conftest import tcp_daemon as loopback_daemon
from transfer.testing import DaemonProcess, loopback_endpoint, start_daemon
from transfer.transport import _nixl

if not _nixl.available():
    pytest.skip("NIXL not installed (pip install --no-deps nixl-cu12==1.5.1)", allow_module_level=True)

pytestmark = [pytest.mark.rdma, pytest.mark.timeout(60)]

HERE = Path(__file__).parent
FAST = ["--heartbeat", "0.2", "--session-timeout", "2.0", "--backend", "numpy"]


def _daemon(args: list[str]) -> Iterator[tuple[DaemonProcess, str]]:
    yield from loopback_daemon(args, "rdma")


@pytest.fixture(scope="module")
def tcp_daemon() -> Iterator[tuple[DaemonProcess, str]]:
    yield from _daemon(["--allow-insecure-tcp"])


@pytest.fixture(scope="module")
def client(tcp_daemon: tuple[DaemonProcess, str]) -> Iterator[transfer.Client]:
    with transfer.connect(tcp_daemon[1], name="rdma-test") as c:
        yield c


def test_read_remote_into_device_buffer(client: transfer.Client) -> None:
    arr = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
    seg = client.register_remote(arr)
    buf = client.alloc(arr.nbytes)
    client.copy(buf, seg).result()
    assert client.checksum(buf).result() == transfer.checksum64(arr)
    # A slice, at offsets: the daemon reads exactly the declared bytes.
    client.copy(buf.at(5), seg.at(1000), 4096).result()
    assert client.checksum(buf.at(5), 4096).result() == transfer.checksum64(arr[1000:5096])
    # Into a shared-memory segment too (registered with the daemon's agent as DRAM).
    shm = client.segment(1 << 20)
    client.copy(shm, seg.at(77), 1 << 20).result()
    assert np.array_equal(shm.buffer, arr[77 : 77 + (1 << 20)])
    client.free(shm)
    client.free(buf)
    client.free(seg)


def test_write_device_buffer_to_remote(client: transfer.Client) -> None:
    seg = client.remote_segment(1 << 20)
    buf = client.alloc(1 << 20)
    client.fill(buf, 1 << 20, 0x5A).result()
    client.copy(seg.at(4096), buf, 65536).result()
    view = seg.buffer
    assert (view[4096 : 4096 + 65536] == 0x5A).all()
    assert not view[:4096].any() and not view[4096 + 65536 :].any()
    client.free(buf)
    client.free(seg)


def test_verified_remote_copies_answer_what_landed(client: transfer.Client) -> None:
    """copy_many(checksum=True) over RDMA: a READ answers each piece's checksum64 of its
    destination once the bytes landed, a WRITE of its source; a piece past the producer's
    declared range fails the request, and the session serves on."""
    arr = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    seg = client.register_remote(arr)
    buf = client.alloc(1 << 20)
    u = np.uint64
    offs = np.array([0, 65536, 200_000, 700_000], u)
    sizes = np.array([65536, 4096, 100_000, 1000], u)
    got = client.copy_many(buf.va + offs, seg.va + offs, sizes, checksum=True).result()
    want = [transfer.checksum64(arr[o:o + n]) for o, n in zip(offs.tolist(), sizes.tolist())]
    assert got.tolist() == want
    assert client.checksum_many(buf.va + offs, sizes).result().tolist() == want  # what landed
    out = client.remote_segment(1 << 20)
    client.fill(buf, 4096, 9).result()
    got = client.copy_many(out.va + offs, buf.va + offs, sizes, checksum=True).result()
    assert (out.buffer[:4096] == 9).all() and got[0] == transfer.checksum64(out.buffer[:65536])
    assert got.tolist()[1:] == want[1:]
    with pytest.raises(transfer.TransferError):
        client.copy_many(buf.va + offs, seg.va + offs, np.array([65536, 4096, 100_000, 1 << 20], u), checksum=True).result()
    assert client.checksum(buf.va, 64).result() == transfer.checksum64(np.full(64, 9, np.uint8))
    client.free(out)
    client.free(buf)
    client.free(seg)


def test_a_repeated_vector_is_checked_against_the_table_each_time(tcp_daemon: tuple[DaemonProcess, str], client: transfer.Client) -> None:
    """A producer's fixed slots send the same copy vector again and again: the daemon keeps
    its plan (`RemotePlan`) and checks it against the table each time. So each answer is of
    the bytes as they are then, and a freed segment, an ended share or another session is
    refused as a first translation would refuse it."""
    u = np.uint64
    arr = np.zeros(1 << 20, np.uint8)
    seg = client.register_remote(arr)
    buf = client.alloc(1 << 20)
    offs, sizes = np.array([0, 4096, 65536], u), np.array([4096, 8192, 100_000], u)
    vec = (buf.va + offs, seg.va + offs, sizes)

    def want() -> list[int]:
        return [transfer.checksum64(arr[o:o + n]) for o, n in zip(offs.tolist(), sizes.tolist())]

    reposts = client.stats()["daemon"]["nixl_reposts"]
    for fill in (1, 2, 3):  # the same vector each time, new bytes each time
        arr[:] = fill
        assert client.copy_many(*vec, checksum=True).result().tolist() == want()
    assert client.stats()["daemon"]["nixl_reposts"] == reposts + 2  # its NIXL request made once, posted again
    with transfer.connect(tcp_daemon[1], name="rdma-other") as other:  # the same VAs, not its own
        with pytest.raises(transfer.NotOwner):
            other.copy_many(*vec, checksum=True).result()
        shm = other.segment(1 << 20)  # a guest's copies into a segment shared with it ...
        shared = client.attach(other.share(shm))
        into_shared = (shared.va + offs, seg.va + offs, sizes)
        for _ in range(2):
            assert client.copy_many(*into_shared, checksum=True).result().tolist() == want()
        assert shm.buffer[:4096].tolist() == [3] * 4096
        client._call(P.Unregister, shared.va)  # ... until it lets go (the guest's free detaches)
        with pytest.raises(transfer.NotOwner):
            client.copy_many(*into_shared, checksum=True).result()
        other.free(shm)
    client.free(seg)  # the remote segment goes: the vector that named it is refused (its VA was of the arena)
    with pytest.raises(transfer.InvalidAddress, match="freed"):
        client.copy_many(*vec, checksum=True).result()
    seg2 = client.register_remote(arr)  # a new one: new VAs, the same bytes
    assert client.copy_many(buf.va + offs, seg2.va + offs, sizes, checksum=True).result().tolist() == want()
    client.free(buf)  # the destination goes (its id was of the session's arena)
    with pytest.raises(transfer.InvalidAddress, match="freed"):
        client.copy_many(buf.va + offs, seg2.va + offs, sizes, checksum=True).result()
    client.free(seg2)


def test_compute_pulls_remote_inputs_first(client: transfer.Client) -> None:
    """A compute naming a remote VA: the daemon READs it into staging, then runs the kernel."""
    x = np.arange(4096, dtype=np.float32)
    seg = client.register_remote(x)
    out = client.segment(x.nbytes)
    posts = client.stats()["daemon"]["nixl_posts"]
    client.compute("scale_add", [seg.tensor(4096, np.float32)], [out.tensor(4096, np.float32)], {"a": 2.0, "b": 1.0}).result()
    assert np.array_equal(out.ndarray(4096, np.float32), x * 2 + 1)
    # A strided view of the remote array, and a reduction into a device buffer.
    acc = client.alloc(8)
    client.compute("sum", [seg.tensor((64, 64), np.float32)], [acc.tensor((), np.float64)]).result()
    back = client.segment(8)
    client.copy(back, acc).result()
    assert back.ndarray((), np.float64) == x.astype(np.float64).sum()
    assert client.stats()["daemon"]["nixl_posts"] >= posts + 2
    with pytest.raises(transfer.InvalidField, match="cannot write a remote segment"):
        client.compute("fill", [], [seg.tensor(16, np.float32)], {"value": 0}).result()
    with pytest.raises(transfer.InvalidField, match="nothing to read"):  # no empty NIXL descriptor is posted
        client.compute("sum", [seg.tensor(0, np.float32)], [acc.tensor((), np.float64)]).result()
    client.free(seg)


def test_thousand_small_reads_are_one_nixl_post(client: transfer.Client) -> None:
    arr = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
    seg = client.register_remote(arr)
    buf = client.alloc(1000 * 256)
    before = client.stats()["daemon"]
    with client.batch():
        for i in range(1000):  # scattered: every other KiB of the producer's buffer
            client.copy(buf.at(i * 256), seg.at(i * 1024), 256)
    client.fence()
    after = client.stats()["daemon"]
    assert after["nixl_posts"] - before["nixl_posts"] == 1
    assert after["nixl_descs"] - before["nixl_descs"] == 1000
    want = arr[: 1000 * 1024].reshape(1000, 1024)[:, :256].reshape(-1)
    assert client.checksum(buf).result() == transfer.checksum64(want)
    # The same as one vector request (CopyV): again one post.
    i = np.arange(1000, dtype=np.uint64)
    client.copy_many(buf.va + i * 256, seg.va + i * 1024 + 512, np.full(1000, 256, np.uint64)).result()
    assert client.stats()["daemon"]["nixl_posts"] - after["nixl_posts"] == 1
    client.free(buf)
    client.free(seg)


def test_forged_and_out_of_range_remote_vas_are_refused(tcp_daemon: tuple[DaemonProcess, str], client: transfer.Client) -> None:
    seg = client.remote_segment(64 << 10)
    buf = client.alloc(64 << 10)
    with pytest.raises(transfer.OutOfBounds):
        client.copy(buf, seg.at(60 << 10), 8 << 10).result()  # past the producer's buffer
    with pytest.raises(transfer.UnknownSegment):
        client.copy(buf, 999 << 40, 16).result()  # no such segment
    with pytest.raises(transfer.InvalidField, match="remote"):
        client.checksum(seg, 16).result()  # only copies may name a remote VA
    with pytest.raises(transfer.InvalidField, match="two remote"):
        client.copy(seg, seg.at(100), 10).result()
    # Another session cannot name our remote segment, nor reuse our NIXL agent's name.
    with transfer.connect(tcp_daemon[1], name="intruder") as other:
        theirs = other.alloc(4096)
        with pytest.raises(transfer.NotOwner):
            other.copy(theirs, seg.va, 16).result()
        md = client._remote.ep.metadata
        descs = _nixl.encode_descs([(seg.buffer.ctypes.data, 4096)])
        with pytest.raises(transfer.InvalidField, match="already in use"):
            other._call(P.RegisterRemote, md, descs, 4096)
        with pytest.raises(transfer.InvalidField):  # not the strict descriptor layout (e.g. a pickle)
            other._call(P.RegisterRemote, md, b"\x80\x04K\x01.", 4096)
        with pytest.raises(transfer.InvalidField, match="length"):
            other._call(P.RegisterRemote, md, descs, 8192)
    # Our segment still works after all that.
    client.copy(buf, seg, 64 << 10).result()
    client.free(buf)
    client.free(seg)


def test_hostile_remote_vectors_fail_alone(client: transfer.Client) -> None:
    """A copy vector naming a remote segment is one NIXL post, so what one post cannot
    order or express is refused whole, with a clear error, and the session serves on."""
    arr = np.arange(64 << 10, dtype=np.uint8)
    seg = client.register_remote(arr)
    buf = client.alloc(64 << 10)
    shm = client.segment(4096)
    u = np.uint64
    with pytest.raises(transfer.InvalidField, match="overlaps another copy"):  # one post has no order inside
        client.copy_many(np.array([buf.va, buf.va + 100], u), np.array([seg.va, seg.va + 4096], u),
                         np.array([256, 256], u)).result()
    with pytest.raises(transfer.InvalidField, match="mixing remote and local-only"):
        client.copy_many(np.array([buf.va, buf.va + 4096], u), np.array([seg.va, shm.va], u),
                         np.array([256, 256], u)).result()
    with pytest.raises(transfer.InvalidField, match="mixing reads from and writes to"):
        client.copy_many(np.array([buf.va, seg.va + 8192], u), np.array([seg.va, buf.va + 4096], u),
                         np.array([256, 256], u)).result()
    with pytest.raises(transfer.InvalidField, match="two remote"):
        client.copy_many(np.array([seg.va], u), np.array([seg.va + 8192], u), np.array([256], u)).result()
    with pytest.raises(transfer.OutOfBounds):
        client.copy_many(np.array([buf.va, buf.va + 4096], u), np.array([seg.va, seg.va + (64 << 10) - 8], u),
                         np.array([256, 256], u)).result()
    # Zero-length pieces are no work; adjacent pieces merge into one descriptor: still exact.
    before = client.stats()["daemon"]["nixl_descs"]
    client.copy_many(np.array([buf.va, buf.va + 4096, buf.va + 4096, buf.va + 8192], u),
                     np.array([seg.va + 1, seg.va + 9, seg.va + 4097, seg.va + 8193], u),
                     np.array([4096, 0, 4096, 100], u)).result()
    assert client.stats()["daemon"]["nixl_descs"] - before == 1
    assert client.checksum(buf, 8292).result() == transfer.checksum64(arr[1:8293])
    client.free(shm)
    client.free(buf)
    client.free(seg)


def test_freed_remote_segment_is_dead(client: transfer.Client) -> None:
    seg = client.remote_segment(4096)
    buf = client.alloc(4096)
    va = seg.va
    client.free(seg)
    with pytest.raises(transfer.InvalidAddress, match="freed"):  # (its VA was of the session's arena)
        client.copy(buf, va, 16).result()
    client.free(buf)


def test_remote_copies_land_in_gpu_memory_with_no_host_bounce() -> None:
    """A daemon with a GPU (the stream simulation, whose device memory NIXL registers as the
    host memory it is; VRAM on a real GPU): a READ from a producer's memory lands in a device
    buffer directly, and a WRITE leaves one directly: one NIXL post each, no host segment."""
    for d, endpoint in _daemon(["--allow-insecure-tcp", "--backend", "streamsim"]):
        with transfer.connect(endpoint, name="rdma-gpu") as c:
            arr = np.random.default_rng(9).integers(0, 256, 1 << 20, dtype=np.uint8)
            seg, out = c.register_remote(arr), c.remote_segment(1 << 20)
            buf = c.alloc(1 << 20)
            assert buf.device == c.home_device and c.stats()["daemon"]["devices"][buf.device]["kind"] == "gpu"
            posts = c.stats()["daemon"]["nixl_posts"]
            c.copy(buf, seg).result()
            assert c.checksum(buf).result() == transfer.checksum64(arr)
            c.copy(out.at(4096), buf.at(8192), 65536).result()
            assert np.array_equal(out.buffer[4096 : 4096 + 65536], arr[8192 : 8192 + 65536])
            assert c.stats()["daemon"]["nixl_posts"] - posts == 2
            for s in (seg, out, buf):
                c.free(s)


def test_requests_that_touch_a_remote_segment_take_the_socket(client: transfer.Client) -> None:
    """The daemon's loop posts NIXL for them either way: they skip the data channel (and
    its worker's handover), every kind of them, and the rest of the session keeps it."""
    link = client._ring
    assert link is not None and link.channel is not None
    arr = np.random.default_rng(5).integers(0, 256, 1 << 16, dtype=np.uint8)
    orig = arr.copy()
    seg = client.register_remote(arr)
    buf = client.alloc(arr.nbytes)
    sent = link.channel.counters()["sent"]
    client.copy(buf, seg).result()
    offs = np.arange(0, arr.nbytes, 4096, dtype=np.uint64)
    sizes = np.full(len(offs), 4096, np.uint64)
    client.copy_many(buf.va + offs, seg.va + offs, sizes).result()
    client.copy(seg.at(64), buf, 64).result()
    assert np.array_equal(seg.buffer[64:128], orig[:64])
    assert link.channel.counters()["sent"] == sent, "none took the channel"
    client.fill(buf, 64, 1).result()
    assert link.channel.counters()["sent"] > sent  # (the session's other requests do)
    assert client.checksum(buf, 4096).result() == transfer.checksum64(bytes([1] * 64) + orig[64:4096].tobytes())
    client.free(seg)
    client.stats()  # (a frame: the free travels with it, and its answer deregisters)
    assert seg.va >> 40 not in client._core.remote_sids, "a freed segment's id routes nothing"


def test_registering_the_same_memory_again_reuses_its_registration(client: transfer.Client) -> None:
    """The same memory registered again while it is registered: the same segment and NIXL
    registration (no round trip, no new metadata); each handle is freed on its own, and the
    memory goes with the last; other memory, or a part of it, is a registration of its own."""
    arr = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    segs_before = client.stats()["session"]["segments"]
    a = client.register_remote(arr)
    b = client.register_remote(arr)
    c = client.register_remote(arr.reshape(1024, 1024))  # (the same bytes, another view)
    part = client.register_remote(arr[: 1 << 19])
    assert a.va == b.va == c.va and a._reg is b._reg is c._reg and part.va != a.va
    buf = client.alloc(arr.nbytes)
    client.copy(buf, a, 16).result(), client.copy(buf, part, 16).result()  # (each defined with its first use)
    assert client.stats()["session"]["segments"] == segs_before + 3  # (a, part, buf)
    client.free(a)
    client.copy(buf, b).result()  # still mapped: b and c hold it
    assert client.checksum(buf).result() == transfer.checksum64(arr)
    client.free(c)
    client.free(b)
    with pytest.raises(transfer.InvalidAddress, match="freed"):
        client.copy(buf, b.va, 16).result()
    d = client.register_remote(arr)  # registered afresh, now that none is live
    client.copy(buf, d, 16).result()
    assert d._reg is not a._reg and client.stats()["session"]["segments"] == segs_before + 3  # (d, part, buf)
    for s in (d, part, buf):
        client.free(s)


def test_free_does_not_wait_and_the_daemon_s_answer_deregisters(client: transfer.Client) -> None:
    """free() of a registration the daemon has mapped sends nothing: the free travels with
    the next frame, and the memory stays registered with NIXL until its answer is read,
    which deregisters it. Registering the same memory again before then sends the free and
    waits for that answer, then registers afresh."""
    arr = np.random.default_rng(8).integers(0, 256, 1 << 16, dtype=np.uint8)
    buf = client.alloc(arr.nbytes)
    seg = client.register_remote(arr)
    client.copy(buf, seg).result()
    agent, reg, va = client._remote, seg._reg, seg.va
    assert agent is not None
    frames = client.frames_sent
    client.free(seg)
    assert client.frames_sent == frames  # nothing went, nothing was waited for
    assert reg.registered and (reg.addr, reg.nbytes) in agent.leaving
    client.fence()  # (the free goes ahead of it, and its answer is read)
    assert not reg.registered and not agent.leaving and not agent.live
    with pytest.raises(transfer.InvalidAddress, match="freed"):
        client.copy(buf, va, 16).result()
    # Freed, and registered again before the answer was read: the new registration waits for it.
    seg = client.register_remote(arr)
    client.copy(buf, seg).result()
    old = seg._reg
    client.free(seg)
    assert old.registered
    again = client.register_remote(arr)
    assert not old.registered and again._reg is not old
    client.fill(buf, arr.nbytes, 0).result()
    client.copy(buf, again).result()
    assert client.checksum(buf).result() == transfer.checksum64(arr)
    for s in (again, buf):
        client.free(s)
    client.fence()


def test_a_free_whose_answer_never_comes_deregisters_when_the_session_fails(tmp_path: Path) -> None:
    """The daemon dies with a free unanswered: the session fails, and the memory is
    deregistered then (nothing left registered behind a session that is gone). (Over ipc,
    where the client sees the daemon's exit at once.)"""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    d = start_daemon(FAST, workdir=tmp_path, shm_dir=shm)
    try:
        with transfer.connect(d.endpoint, name="rdma-dies") as c:
            seg, buf = c.register_remote(np.ones(4096, np.uint8)), c.alloc(4096)
            c.copy(buf, seg).result()
            reg = seg._reg
            d.kill()
            c.free(seg)
            with pytest.raises(transfer.TransferError):
                c.fence(timeout=30)
            assert not reg.registered and not c._remote.leaving
    finally:
        d.stop()


def test_a_registration_travels_with_its_first_use(client: transfer.Client) -> None:
    """register_remote sends nothing: the daemon maps the segment when the first request
    naming it arrives (the RegisterRemote goes ahead of it in the same frame); a registration
    freed before any use never reaches the daemon, and its VA is the arena's again."""
    arr = np.random.default_rng(6).integers(0, 256, 1 << 16, dtype=np.uint8)
    buf = client.alloc(arr.nbytes)
    client.fill(buf, 16, 0).result()  # (buf defined)
    before = client.stats()
    per_stats = client.stats()["session"]["requests"] - before["session"]["requests"]  # (what a stats() call counts)
    seg = client.register_remote(arr)
    unused = client.register_remote(np.zeros(4096, np.uint8))
    after = client.stats()
    assert after["session"]["requests"] - before["session"]["requests"] == 2 * per_stats  # nothing else went
    assert after["session"]["segments"] == before["session"]["segments"]
    client.copy(buf, seg).result()
    assert client.checksum(buf).result() == transfer.checksum64(arr)
    assert client.stats()["session"]["segments"] == before["session"]["segments"] + 1
    freed_va = unused.va
    client.free(unused)  # never sent: nothing to tell the daemon
    again = client.register_remote(np.zeros(8192, np.uint8))
    assert again.va == freed_va  # (the arena's id, given back)
    client.copy(again, buf, 8192).result()
    assert np.array_equal(again.buffer, arr[:8192])
    for s in (seg, again, buf):
        client.free(s)


def test_a_refused_deferred_registration_fails_its_first_use_naming_where_it_was_made() -> None:
    """A daemon that serves no remote segments: the registration still returns at once; the
    first request naming it fails with the daemon's reason and the file and line that
    registered, the session serves on, and the handle frees cleanly."""
    for _d, endpoint in _daemon(["--allow-insecure-tcp", "--no-rdma"]):
        with transfer.connect(endpoint, name="rdma-refused") as c:
            arr = np.ones(4096, np.uint8)
            seg = c.register_remote(arr); line = sys._getframe().f_lineno  # noqa: E702
            buf = c.alloc(4096)
            with pytest.raises(transfer.InvalidField, match=rf"registered at test_remote.py:{line}: remote segments are disabled"):
                c.copy(buf, seg).result()
            c.fill(buf, 4096, 7).result()
            assert c.checksum(buf).result() == transfer.checksum64(b"\x07" * 4096)
            c.free(seg)
            c.free(buf)
            c.fence()  # (the free of a segment the daemon refused frees nothing: no error)
            assert seg.freed and not c._remote.leaving
        with transfer.connect(endpoint, name="rdma-eager", deferred=False) as c:  # eager: the answer at once
            with pytest.raises(transfer.InvalidField, match="remote segments are disabled"):
                c.register_remote(np.ones(4096, np.uint8))


def test_registrations_take_ids_of_the_arena_and_give_them_back() -> None:
    """Remote segments are named from the home arena: past its ids a registration is refused
    at once (naming the flag), and a freed one's id serves the next."""
    for _d, endpoint in _daemon(["--allow-insecure-tcp", "--arena-ids", "2"]):
        with transfer.connect(endpoint, name="rdma-arena") as c:
            a, b = c.register_remote(np.zeros(4096, np.uint8)), c.register_remote(np.zeros(4096, np.uint8))
            with pytest.raises(transfer.QuotaExceeded, match=r"already names 2 buffers and segments from its arena.*--arena-ids"):
                c.register_remote(np.zeros(4096, np.uint8))
            c.free(a)
            d = c.register_remote(np.ones(4096, np.uint8))
            assert d.va == a.va
            c.free(b)  # (never used: nothing to send)
            buf = c.alloc(4096)  # (a device buffer takes an id of the same arena)
            c.copy(buf, d).result()
            assert c.checksum(buf).result() == transfer.checksum64(b"\x01" * 4096)
            c.free(d)
            c.free(buf)


def test_an_eager_registration_is_answered_before_it_returns(tcp_daemon: tuple[DaemonProcess, str]) -> None:
    with transfer.connect(tcp_daemon[1], name="rdma-eager", deferred=False) as c:
        before = c.stats()["session"]["segments"]
        arr = np.arange(4096, dtype=np.uint8)
        seg = c.register_remote(arr)
        assert c.stats()["session"]["segments"] == before + 1
        buf = c.alloc(4096)
        c.copy(buf, seg).result()
        assert c.checksum(buf).result() == transfer.checksum64(arr)
        c.free(seg)
        c.free(buf)


@pytest.mark.parametrize("verified", [False, True], ids=["copies", "verified-copies"])
def test_producer_killed_mid_transfer(tcp_daemon: tuple[DaemonProcess, str], client: transfer.Client, verified: bool) -> None:
    """A producer killed while the daemon READs from it: its session and NIXL peer go, and
    the daemon serves on (verified copies too, whose sums wait for the READ)."""
    d, endpoint = tcp_daemon
    base = client.stats()["daemon"]
    env = {**os.environ, "TRANSFER_TEST_VERIFIED": "1"} if verified else None
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_remote_producer.py"), endpoint, str(32 << 20)],
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert json.loads(line)["checksum"] == transfer.checksum64(
            np.random.default_rng(7).integers(0, 256, 32 << 20, dtype=np.uint8)
        )
        assert client.stats()["daemon"]["sessions"] == base["sessions"] + 1
        time.sleep(0.15)  # it is streaming 32 MiB READs now
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            st = client.stats()["daemon"]
            if st["sessions"] == base["sessions"] and st["nixl_peers"] == base["nixl_peers"]:
                break
            time.sleep(0.1)
        assert st["sessions"] == base["sessions"], st
        assert st["nixl_peers"] == base["nixl_peers"], st
        assert st["segments"] == base["segments"], st
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The daemon and this session keep going.
    assert d.alive()
    seg = client.remote_segment(1 << 20)
    seg.buffer[:] = 3
    buf = client.alloc(1 << 20)
    client.copy(buf, seg).result()
    assert client.checksum(buf).result() == transfer.checksum64(np.full(1 << 20, 3, np.uint8))
    client.free(buf)
    client.free(seg)


# --- CURVE ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transfer.cli._keys import keygen

    d = tmp_path_factory.mktemp("keys") / "curve"
    keygen(d, ["good"])
    keygen(tmp_path_factory.mktemp("other") / "curve", ["bad"])  # a pair the daemon never saw
    return d


@pytest.fixture(scope="module")
def curve_daemon(keys: Path) -> Iterator[tuple[DaemonProcess, str]]:
    yield from _daemon(["--curve-dir", str(keys)])


def test_curve_keys_admit_the_pinned_client(keys: Path, curve_daemon: tuple[DaemonProcess, str]) -> None:
    with transfer.connect(curve_daemon[1], server_key=str(keys / "server.key"), client_keys=str(keys / "clients" / "good.key_secret")) as c:
        assert c._ring is not None and c._ring.channel is not None, "a CURVE session gets its data channel"
        seg = c.remote_segment(4096)
        seg.buffer[:] = 9
        buf = c.alloc(4096)
        c.copy(buf, seg).result()
        assert c.checksum(buf).result() == transfer.checksum64(b"\x09" * 4096)


def test_wrong_curve_keys_are_refused_quickly(keys: Path, curve_daemon: tuple[DaemonProcess, str]) -> None:
    other = keys.parent.parent / [p for p in os.listdir(keys.parent.parent) if p.startswith("other")][0] / "curve"
    good_client = str(keys / "clients" / "good.key_secret")
    cases = [
        dict(server_key=str(other / "server.key"), client_keys=good_client),  # wrong server key
        dict(server_key=str(keys / "server.key"), client_keys=str(other / "clients" / "bad.key_secret")),  # unknown client
        dict(),  # no keys at all
    ]
    for kw in cases:
        t0 = time.monotonic()
        with pytest.raises(transfer.DaemonUnavailable, match="handshake"):
            transfer.connect(curve_daemon[1], connect_timeout=5.0, **kw)
        assert time.monotonic() - t0 < 2.0, kw


def test_tcp_without_keys_is_refused_unless_insecure_allowed(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "transfer.cli.transferd", "--endpoint", loopback_endpoint(), "--shm-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=30,
    )
    assert r.returncode == 1 and "without authentication" in r.stderr and "keygen" in r.stderr


def test_keygen_subcommand(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "transfer.cli.transferd", "keygen", str(tmp_path / "k"), "--client", "a"],
        capture_output=True, text=True, timeout=30,
    )
    assert r.returncode == 0, r.stderr
    paths = json.loads(r.stdout)
    assert Path(paths["server_key"]).exists() and Path(paths["client:a"]).exists()
    assert (tmp_path / "k" / "authorized_clients" / "a.key").exists()
    assert os.stat(paths["server_secret"]).st_mode & 0o077 == 0


def test_trio_client_with_curve_keys(keys: Path, curve_daemon: tuple[DaemonProcess, str]) -> None:
    import trio

    async def main() -> None:
        async with transfer.open_client(curve_daemon[1], server_key=str(keys / "server.key"), client_keys=str(keys / "clients" / "good.key_secret")) as c:
            assert c._ring is not None and c._ring.channel is not None  # (its completions ring the trio client's pipe)
            buf = await c.alloc(4096)
            await c.fill(buf, 4096, 1)
            assert await c.checksum(buf, 4096) == transfer.checksum64(b"\x01" * 4096)
            assert c._ring.channel.counters()["received"] >= 1

    trio.run(main)


def test_trio_client_remote_segments(tcp_daemon: tuple[DaemonProcess, str]) -> None:
    import trio

    async def main() -> None:
        async with transfer.open_client(tcp_daemon[1], name="rdma-trio") as c:
            arr = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
            seg = await c.register_remote(arr)
            buf = await c.alloc(arr.nbytes)
            await c.copy(buf, seg)  # a one-sided READ of our memory
            assert await c.checksum(buf) == transfer.checksum64(arr)
            out = await c.remote_segment(4096)
            await c.fill(buf, 4096, 0x33)
            await c.copy(out, buf, 4096)  # a WRITE into our memory
            assert (out.buffer == 0x33).all()
            await out.free()
            await c.free(seg)
            assert seg.freed and out.freed
            with pytest.raises(transfer.InvalidAddress, match="freed"):
                await c.copy(buf, seg.va, 16)
            await c.free(buf)

    trio.run(main)
