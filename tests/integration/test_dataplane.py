"""The native data plane (native/dataplane.h, server/_dataplane.py): ring workers.

Every test runs real daemons and real clients. The central one runs the same
random programs (valid and invalid requests mixed) against a daemon whose rings
are served by native workers and one whose rings the Python pass serves
(`--no-ring-workers`), and demands the same answers and the same bytes.
"""

from __future__ import annotations

import os
import tempfile
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import transfer
from transfer import errors as E
from transfer import _native
from transfer.testing import DaemonProcess, start_daemon

from conftest import BRISK, BRISK_TIMEOUT_S, FAST



@pytest.fixture
def daemon(daemon_factory: Any) -> DaemonProcess:
    """A daemon whose rings are served by native workers (the default; the fixtures say `--ring-workers` anyway)."""
    return daemon_factory("--ring-workers")

SEG = 64 << 10
_BAD_SEG = 0xFFFFF0  # a segment id nobody has (nor had: ids are handed out upwards from 1)


def _outcome(p: Any) -> Any:
    try:
        r = p.result(timeout=30)
        return ("ok", r.tolist() if isinstance(r, np.ndarray) else r)
    except E.TransferError as exc:
        return ("err", type(exc).__name__)


# A program: ops over three buffers (two shared-memory segments, one daemon "device" buffer),
# with offsets and sizes that sometimes run out of bounds, and VAs of a segment that does not exist.
_where = st.tuples(st.integers(0, 3), st.integers(0, SEG + 64))  # buffer 3: the unknown segment
_size = st.one_of(st.integers(0, 256), st.integers(0, SEG + 8))
_leaf = st.one_of(
    st.tuples(st.just("copy"), _where, _where, _size),
    st.tuples(st.just("fill"), _where, _size, st.integers(0, 255)),
    st.tuples(st.just("checksum"), _where, _size),
    st.tuples(st.just("copy_many"), st.lists(st.tuples(_where, _where, st.integers(0, 512)), min_size=1, max_size=12)),
    st.tuples(st.just("checksum_many"), st.lists(st.tuples(_where, st.integers(0, 512)), min_size=1, max_size=12)),
    st.tuples(st.just("verified_copy_many"), st.lists(st.tuples(_where, _where, st.integers(0, 512)), min_size=1, max_size=12)),
)
# A batch leaves in one push, so a worker takes it whole: a checksum of what a copy in the same
# batch read or wrote is answered from the copy's sum, unless a write in between touched it.
_verified = st.builds(
    lambda d, s, n, extra: ("batch", [("copy", d, s, n), *extra, ("checksum", s, n), ("checksum", d, n)]),
    _where, _where, _size, st.lists(_leaf, max_size=3),
)
_op = st.one_of(_leaf, st.tuples(st.just("batch"), st.lists(_leaf, min_size=1, max_size=8)), _verified, st.tuples(st.just("fence")))


class _Rig:
    """One client of one daemon with two segments and a device buffer, reset per program."""

    def __init__(self, endpoint: str) -> None:
        self.c = transfer.connect(endpoint)
        assert self.c.ring
        self.segs = [self.c.segment(SEG), self.c.segment(SEG)]
        self.dev = self.c.alloc(SEG)
        self.bases = [self.segs[0].va, self.segs[1].va, self.dev.va, _BAD_SEG << 40]

    def run(self, program: list[tuple[Any, ...]]) -> tuple[list[Any], list[int]]:
        c = self.c
        for i, s in enumerate(self.segs):
            s.ndarray((SEG,), np.uint8)[:] = (np.arange(SEG) * (7 + i) % 251).astype(np.uint8)
        c.copy(self.dev, self.segs[0].va, SEG).result()

        def va(w: tuple[int, int]) -> int:
            return self.bases[w[0]] + w[1]

        answers: list[Any] = []
        pending: list[Any] = []

        def submit(op: tuple[Any, ...]) -> None:
            if op[0] == "copy":
                pending.append(c.copy(va(op[1]), va(op[2]), op[3]))
            elif op[0] == "fill":
                pending.append(c.fill(va(op[1]), op[2], op[3]))
            elif op[0] == "checksum":
                pending.append(c.checksum(va(op[1]), op[2]))
            elif op[0] == "copy_many":
                pieces = op[1]
                pending.append(c.copy_many([va(d) for d, _, _ in pieces], [va(s) for _, s, _ in pieces], [n for _, _, n in pieces]))
            elif op[0] == "verified_copy_many":
                pieces = op[1]
                pending.append(c.copy_many([va(d) for d, _, _ in pieces], [va(s) for _, s, _ in pieces], [n for _, _, n in pieces], checksum=True))
            elif op[0] == "checksum_many":
                pending.append(c.checksum_many([va(w) for w, _ in op[1]], [n for _, n in op[1]]))

        for op in program:
            if op[0] == "batch":
                with c.batch():
                    for inner in op[1]:
                        submit(inner)
            elif op[0] != "fence":
                submit(op)
            else:
                answers.extend(_outcome(p) for p in pending)
                pending.clear()
                c.fence()  # blocks until everything before it is done
                answers.append("fence")
        answers.extend(_outcome(p) for p in pending)
        final = [transfer.checksum64(s.ndarray((SEG,), np.uint8)) for s in self.segs] + [c.checksum(self.dev, SEG).result()]
        return answers, final

    def stats(self) -> dict[str, Any]:
        return self.c.stats()["daemon"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two daemons, one with ring workers and one without, and a rig on each."""
    made: list[DaemonProcess] = []
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tmp_path_factory.getbasetemp())
    for name, extra in (("native", ["--ring-workers"]), ("python", ["--no-ring-workers"])):
        wd = tmp_path_factory.mktemp(f"dp-{name}")
        shm = Path(tempfile.mkdtemp(prefix=f"transfer-test-dp-{name}-", dir=base))  # (a name nobody can guess: mode 0700)
        made.append(start_daemon([*FAST, *extra], workdir=wd, shm_dir=shm))
    rigs = [_Rig(d.endpoint) for d in made]
    yield rigs
    for r in rigs:
        r.c.close()
    for d in made:
        d.stop()
        shutil.rmtree(d.shm_dir, ignore_errors=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(program=st.lists(_op, min_size=1, max_size=24))
# A chain whose pieces are contiguous but overlap each other: merging them into one memmove
# would differ from copying piece by piece.
@example(program=[("copy_many", [((0, 50), (0, 0), 50), ((0, 100), (0, 50), 50)]), ("checksum", (0, 0), 200)])
@example(program=[("copy_many", [((1, 0), (0, 0), 4096), ((1, 4096), (0, 4096), 4096), ((2, 0), (0, 0), 64)])])
# Verified copies: the source overwritten (a fill, a copy onto it) before its checksum, which
# must not be answered from the copy's sum; the destination's still may be.
@example(program=[("batch", [("copy", (2, 0), (0, 0), 4096), ("fill", (0, 100), 10, 7),
                             ("checksum", (0, 0), 4096), ("checksum", (2, 0), 4096)])])
@example(program=[("batch", [("copy_many", [((2, 0), (0, 0), 512), ((2, 512), (0, 512), 512)]),
                             ("copy", (0, 256), (1, 0), 64), ("checksum_many", [((0, 0), 512), ((0, 512), 512), ((2, 0), 512)])])])
# Verified copy_many: a later piece overwrites an earlier piece's destination (each answers
# what it copied), a piece onto itself shifted (overlapping), and a piece nobody can address.
@example(program=[("verified_copy_many", [((2, 0), (0, 0), 512), ((2, 256), (1, 0), 512), ((0, 8), (0, 0), 300)])])
@example(program=[("batch", [("verified_copy_many", [((2, 0), (0, 0), 512), ((3, 0), (0, 0), 8)]), ("checksum", (2, 0), 512)])])
# ... and a copy onto itself, shifted (overlapping: never summed as it copies).
@example(program=[("batch", [("copy", (0, 8), (0, 0), 4096), ("checksum", (0, 0), 4096), ("checksum", (0, 8), 4096)])])
def test_workers_answer_exactly_as_the_python_pass(pair: list[_Rig], program: list[tuple[Any, ...]]) -> None:
    native, python = pair
    got_native = native.run(program)
    got_python = python.run(program)
    assert got_native[0] == got_python[0], "answers differ"
    assert got_native[1] == got_python[1], "memory differs"


def test_workers_really_serve_and_hand_over(pair: list[_Rig]) -> None:
    """The equivalence above is not vacuous: the native daemon's worker ran the valid
    requests and handed the invalid ones over; the other daemon has no workers."""
    native, python = pair
    program: list[tuple[Any, ...]] = [("copy", (0, 0), (1, 0), 4096)] * 50 + [("copy", (3, 0), (0, 0), 8)]
    before = native.stats()
    answers, _ = native.run(program)
    assert answers[:50] == [("ok", None)] * 50 and answers[50] == ("err", "UnknownSegment")
    after = native.stats()
    assert after["native_requests"] - before["native_requests"] >= 50
    assert after["ring_handovers"] > before["ring_handovers"] and after["ring_workers"] == 1
    python.run(program)
    stats = python.stats()
    assert stats["native_requests"] == 0 and stats["ring_workers"] == 0


def test_a_verified_copy_reads_its_bytes_once(daemon: DaemonProcess) -> None:
    """A checksum of what a copy in the same batch read or wrote is answered from the sum the
    worker took while copying (the stats count it), with the value a separate read gives."""
    with transfer.connect(daemon.endpoint) as c:
        S, K = 64 << 10, 4
        seg, dev = c.segment(S * K), c.alloc(S * K)
        data = np.random.default_rng(5).integers(0, 256, S * K, dtype=np.uint8)
        seg.ndarray((S * K,), np.uint8)[:] = data
        offs = np.arange(K, dtype=np.uint64) * np.uint64(S)
        sizes = np.full(K, S, np.uint64)
        c.copy(dev, seg, 8).result()  # defines the device buffer first
        before = c.stats()["daemon"]["fused_checksums"]
        with c.batch():  # the transfer-bench group: a copy vector, then checksums of its sources
            done = c.copy_many(np.uint64(dev.va) + offs, np.uint64(seg.va) + offs, sizes)
            sums = c.checksum_many(np.uint64(seg.va) + offs, sizes)
            whole = c.checksum(dev, S * K)  # not a piece's range: read
        want = [transfer.checksum64(data[i * S:(i + 1) * S]) for i in range(K)]
        assert done.result() is None and sums.result().tolist() == want
        assert whole.result() == transfer.checksum64(data)
        with c.batch():  # one copy, then checksums of both its ends
            one = [c.copy(dev, seg, S), c.checksum(seg, S), c.checksum(dev, S)]
        assert [p.result() for p in one] == [None, want[0], want[0]]
        assert c.stats()["daemon"]["fused_checksums"] - before == K + 2


@pytest.mark.parametrize("helpers", [1, 0])
def test_a_large_copy_is_shared_with_a_copy_helper(daemon_factory: Any, helpers: int) -> None:
    """A copy of 8 MiB or more is shared, chunk by chunk, with an idle copy helper (native/
    dataplane.h, "copy helpers"): the bytes, a verified copy's checksum, and checksums answered
    from the copy's own sum in the same batch are what one thread gives, at offsets that leave
    source and destination unaligned and with a tail that is neither a whole chunk nor a whole
    word; into a daemon buffer too. With `--copy-helpers 0` no copy is shared."""
    d = daemon_factory("--ring-workers", "--copy-helpers", str(helpers))
    n = 3 * (4 << 20) + 4096 + 13  # three whole chunks and a ragged fourth
    with transfer.connect(d.endpoint) as c:
        src, dst, dev = c.segment(n + 64), c.segment(n + 64), c.alloc(n + 64)
        data = np.random.default_rng(7).integers(0, 256, n + 64, dtype=np.uint8)
        src.buffer[:] = data
        c.fence()
        stats = c.stats()["daemon"]
        before, fused = stats["shared_copies"], stats["fused_checksums"]
        for so, do in ((0, 0), (8, 24), (3, 5)):
            want = transfer.checksum64(data[so:so + n])
            dst.buffer[:] = 0
            c.copy(dst.va + do, src.va + so, n).result()
            assert np.array_equal(dst.buffer[do:do + n], data[so:so + n])
            assert not dst.buffer[:do].any() and not dst.buffer[do + n:].any()  # nothing outside the range
            assert c.copy_many([dev.va + do], [src.va + so], [n], checksum=True).result().tolist() == [want]
            with c.batch():  # a copy, then checksums of both its ends: answered from its sum
                got = [c.copy(dev.va + do, src.va + so, n), c.checksum(src.va + so, n), c.checksum(dev.va + do, n)]
            assert [p.result() for p in got] == [None, want, want]
        stats = c.stats()["daemon"]
    assert stats["fused_checksums"] - fused == 6
    assert (stats["shared_copies"] - before > 0) == bool(helpers)  # (9 copies: an idle helper took at least one)


@pytest.mark.parametrize("route", ["native", "python", "socket", "streams"])
def test_verified_copy_many_answers_what_each_piece_copied(daemon_factory: Any, route: str) -> None:
    """copy_many(checksum=True) answers each piece's checksum64 as copied (a later piece that
    overwrites an earlier one's destination does not change the earlier answer), on a native
    worker, the Python pass and the socket alike, and into device memory on a stream backend
    (`streams`: the CPU simulation of a GPU's streams, where each copy is queued and its sum
    must wait for it); a failed one (a piece nobody can address) copies nothing and gives its
    credits back: a ring's worth of them leaves the session serving. The answers are checked
    against NumPy, not against another path."""
    extra = {"python": ["--no-ring-workers"], "streams": ["--backend", "streamsim"]}.get(route, ["--ring-workers"])
    d = daemon_factory(*extra)
    with transfer.connect(d.endpoint, ring=route != "socket") as c:
        S = 4096
        seg, dev = c.segment(8 * S), c.alloc(8 * S)
        data = np.random.default_rng(7).integers(0, 256, 8 * S, dtype=np.uint8)
        seg.ndarray((8 * S,), np.uint8)[:] = data
        c.copy(dev, seg, 8).result()  # defines the device buffer first
        d0, s0 = dev.va, seg.va
        before = c.stats()["daemon"]
        got = c.copy_many([d0, d0 + S // 2, d0 + 2 * S], [s0, s0 + 3 * S, s0 + 5 * S], [S, S, 3 * S], checksum=True).result()
        if route == "native":  # the worker served it, not the Python pass
            after = c.stats()["daemon"]
            assert after["native_requests"] > before["native_requests"] and after["ring_handovers"] == before["ring_handovers"]
        want = [transfer.checksum64(data[:S]), transfer.checksum64(data[3 * S:4 * S]), transfer.checksum64(data[5 * S:8 * S])]
        assert got.dtype == np.uint64 and got.tolist() == want
        assert c.checksum(d0 + S // 2, S).result() == want[1]  # the later piece's bytes are what stayed
        c.fill(dev, S, 0).result()
        for _ in range(20):  # 20 x 64 pieces: more than the ring's 1024 credits, were any kept
            with pytest.raises(E.UnknownSegment):
                c.copy_many([d0] * 63 + [_BAD_SEG << 40], [s0] * 64, [64] * 64, checksum=True).result()
        c.fence()
        if c._ring is not None:
            assert c._ring.in_flight == 0 and not c._ring.early and not c._ring.outstanding
        assert c.checksum(dev, S).result() == transfer.checksum64(np.zeros(S, np.uint8))  # all or nothing
        assert c.copy_many([d0], [s0], [S], checksum=True).result().tolist() == want[:1]
        with pytest.raises(ValueError):
            c.copy_many([], [], [], checksum=True)


def test_long_copies_stream_past_the_cache_byte_exact(daemon: DaemonProcess) -> None:
    """Copies of 4 MiB or more take the worker's streaming-store loop: misaligned ends, odd
    lengths and a verified copy of each end give the bytes and sums a plain copy does."""
    n = (4 << 20) + 4097
    with transfer.connect(daemon.endpoint) as c:
        seg, dev = c.segment(2 * n), c.alloc(2 * n)
        data = np.random.default_rng(9).integers(0, 256, 2 * n, dtype=np.uint8)
        seg.ndarray((2 * n,), np.uint8)[:] = data
        c.copy(dev, seg, 8).result()  # defines the device buffer first
        back = c.segment(2 * n)
        out = back.ndarray((2 * n,), np.uint8)
        # destinations 16-byte aligned, 8 but not 16 (a one-word prologue before the streamed
        # blocks), and not 8 (the cached fused copy instead)
        for doff, soff, size in [(0, 0, n), (3, 0, n), (0, 5, n - 7), (13, 1, n + 999), (8, 0, n), (8, 3, n + 5), (24, 7, n - 1)]:
            out[:] = 0
            c.fill(dev, 2 * n).result()
            with c.batch():
                got = [c.copy(dev.va + doff, seg.va + soff, size), c.checksum(seg.va + soff, size),
                       c.checksum(dev.va + doff, size)]
            want = transfer.checksum64(data[soff:soff + size])
            assert [p.result() for p in got] == [None, want, want]
            c.copy(back, dev, 2 * n).result()
            assert np.array_equal(out[doff:doff + size], data[soff:soff + size])
            assert not out[:doff].any() and not out[doff + size:].any()  # nothing past either end


def test_long_overlapping_copies_are_memmoves(daemon: DaemonProcess) -> None:
    """A copy within one segment longer than the worker's 4 MiB chunk, onto a higher or a
    lower address, shifted by less or more than a chunk, leaves what memmove leaves (NumPy's
    model); a checksum of either end in the same batch, and a verified copy, answer the bytes
    there afterwards."""
    M = 1 << 20
    with transfer.connect(daemon.endpoint) as c:
        seg = c.segment(32 * M)
        mem = seg.ndarray((32 * M,), np.uint8)
        data = np.random.default_rng(11).integers(0, 256, 32 * M, dtype=np.uint8)
        for shift, n, verified in [(8, 16 * M, False), (6 * M, 16 * M + 3, False), (-8, 16 * M, False), (-5 * M, 12 * M, False),
                                   (8 * M + 8, 9 * M, True), (16, 5 * M, True)]:
            mem[:] = data
            src, dst = 8 * M, 8 * M + shift
            model = data.copy()
            model[dst:dst + n] = model[src:src + n].copy()
            if verified:
                got = [c.copy_many([seg.va + dst], [seg.va + src], [n], checksum=True)]
            else:
                with c.batch():
                    got = [c.copy(seg.va + dst, seg.va + src, n), c.checksum(seg.va + src, n), c.checksum(seg.va + dst, n)]
            answers = [p.result() for p in got]
            assert np.array_equal(mem, model), (shift, n)
            if verified:
                assert answers[0].tolist() == [transfer.checksum64(model[dst:dst + n])]
            else:
                assert answers == [None, transfer.checksum64(model[src:src + n]), transfer.checksum64(model[dst:dst + n])]
        del mem


def test_a_socket_request_waits_for_the_ring_requests_before_it(daemon: DaemonProcess) -> None:
    """A compute (socket) right after a big ring copy reads what the copy wrote."""
    n = 32 << 20
    with transfer.connect(daemon.endpoint) as c:
        src = c.segment(n)
        a = src.ndarray((n,), np.uint8)
        pattern = np.resize(np.arange(253, dtype=np.uint8), n)
        for trial in range(3):
            np.add(pattern, np.uint8(trial), out=a)
            dev = c.alloc(n)
            c.copy(dev, src.va, n)  # not awaited: the compute below goes over the socket
            got = c.compute("checksum", [transfer.TensorRef(dev.va, "uint8", (n,))]).result()
            assert got == transfer.checksum64(a)
            c.free(dev)


def test_a_ring_handed_over_while_a_frame_waits_is_served_afterwards(daemon_factory: Any) -> None:
    """A regression: a frame waited for the worker (`catch_up`), the worker handed the ring
    over meanwhile, and the frame's pass was socket-only. The loop had skipped that ring
    when it armed them all and went to sleep, and nothing gave the ring back to its worker:
    the client's next ring request was never served. (One request per pass, so the
    frame's pass is its own.)"""
    daemon = daemon_factory("--ring-workers", "--max-pass", "1")
    n = 32 << 20
    with transfer.connect(daemon.endpoint, ring=True) as c:
        src = c.segment(n)
        src.ndarray((n,), np.uint8)[:] = 7
        dev = c.alloc(n)
        for trial in range(4):
            big = c.copy(dev, src.va, n)  # the worker is busy with this when the frame comes
            bad = c.copy(_BAD_SEG << 40, src.va, 8)  # it hands the ring over here
            got = c.compute("checksum", [transfer.TensorRef(dev.va, "uint8", (n,))])  # the socket
            assert got.result(timeout=30) == transfer.checksum64(np.full(n, 7, np.uint8))
            big.result(timeout=30)
            with pytest.raises(E.UnknownSegment):
                bad.result(timeout=30)
            time.sleep(0.2)  # the daemon goes idle: its loop sleeps on the doorbell
            c.fill(src.va, 4096, trial).result(timeout=10)
            c.copy(src.va + 4096, src.va, 4096).result(timeout=10)
            assert (src.ndarray((8192,), np.uint8) == trial).all()
            src.ndarray((8192,), np.uint8)[:] = 7


def test_one_session_cannot_stall_another(daemon: DaemonProcess) -> None:
    """While one session's worker copies hundreds of MiB, another session's small requests
    are answered: they never wait behind it (each ring has its own worker)."""
    n = 128 << 20
    with transfer.connect(daemon.endpoint) as big, transfer.connect(daemon.endpoint) as small:
        seg = big.segment(2 * n)
        seg.ndarray((2 * n,), np.uint8)[::4096] = 1
        s2 = small.segment(4096)
        t0 = time.perf_counter()
        long = big.copy_many([seg.va + n] * 8, [seg.va] * 8, [n] * 8)
        quick = 0
        while not long.done() and quick < 50:
            small.copy(s2.va + 64, s2.va, 64).result(timeout=10)
            quick += 1
        long.result(timeout=60)
        assert quick == 50, f"only {quick} small requests were answered during a {time.perf_counter() - t0:.3f} s copy"


@pytest.mark.parametrize("helpers", [0, 1])
def test_a_free_races_a_guest_copy_safely(daemon_factory: Any, helpers: int) -> None:
    """The owner frees a segment while a guest's worker copies out of it, alone or with a copy
    helper taking chunks (the owner has no ring, so the guest's worker leaves a core spare): the
    guest's copies succeed or fail with the freed segment; nobody touches unmapped memory; the
    daemon serves on."""
    daemon = daemon_factory("--ring-workers", "--copy-helpers", str(helpers))
    n = 16 << 20
    with transfer.connect(daemon.endpoint, ring=False) as owner, transfer.connect(daemon.endpoint) as guest:
        for _ in range(3):
            seg = owner.segment(n)
            seg.ndarray((n,), np.uint8)[:] = 5
            shared = guest.attach(owner.share(seg))
            dst = guest.segment(n)
            before = guest.stats()["daemon"]["shared_copies"]
            guest.copy(dst.va, shared.va, n).result()  # whole, before the race
            assert (guest.stats()["daemon"]["shared_copies"] > before) == bool(helpers)
            outcomes: list[Any] = []

            def copier() -> None:
                for _ in range(40):
                    outcomes.append(_outcome(guest.copy(dst.va, shared.va, n)))

            t = threading.Thread(target=copier)
            t.start()
            time.sleep(0.005)
            owner.free(seg)
            t.join(60)
            assert not t.is_alive()
            kinds = {o[1] if o[0] == "err" else "ok" for o in outcomes}
            assert kinds <= {"ok", "SegmentFreed", "UnknownSegment", "NotOwner"}, kinds
            guest.free(dst)
        assert daemon.alive()
        s = guest.segment(4096)
        guest.copy(s.va + 2048, s.va, 2048).result()


def test_a_worker_that_slept_is_counted(daemon: DaemonProcess) -> None:
    """`ring_worker_sleeps`: a request after an idle gap longer than the worker's spin woke a
    sleeping worker, and the counter says so (the metric is its STATS_FAMILIES entry)."""
    with transfer.connect(daemon.endpoint) as c:
        s = c.segment(4096)
        c.copy(s.va + 64, s.va, 64).result()
        base = c.stats()["daemon"]["ring_worker_sleeps"]
        for _ in range(3):
            time.sleep(0.05)  # far past the spin (at most 10 ms)
            c.copy(s.va + 64, s.va, 64).result()
        slept = c.stats()["daemon"]["ring_worker_sleeps"] - base
        assert slept >= 3, slept


def test_ring_only_traffic_keeps_a_session_alive(daemon_factory: Any) -> None:
    """A client that only pushes ring descriptors (no pings) for longer than the session
    timeout is busy, not silent: its worker's progress counts as traffic."""
    from transfer.ring import Op

    daemon = daemon_factory("--ring-workers", *BRISK)
    with transfer.connect(daemon.endpoint) as c:
        seg = c.segment(4096)
        c._stop_heartbeat.set()  # no pings from here on: only the ring speaks
        ring = c._ring.ring
        timeout = BRISK_TIMEOUT_S
        t0 = time.monotonic()
        rid = 1 << 40
        while time.monotonic() - t0 < 1.5 * timeout:
            rid += 1
            assert ring.push((int(Op.COPY), rid, seg.va + 2048, seg.va, 64, 0, 0, 0, 0, 0))
            assert ring.wait(timeout=5) >= 1, "no completion: the session was reaped"
            comp = ring.pop()
            assert comp[0] == rid and comp[1] == 0
            time.sleep(0.01)
        assert c.stats()["daemon"]["sessions"] == 1



def test_workers_poll_longer_while_cores_are_spare(tmp_path: Path) -> None:
    """A worker's spin can be changed while it runs (clamped to 10 ms), and the daemon gives
    its workers the spare-core spin exactly while every worker and its client can have a core."""
    from transfer.ring import Ring
    from transfer.server import _dataplane
    from transfer.server._config import DaemonConfig

    native = _native
    srv = Ring.create(tmp_path / "r", 16)
    cli = Ring.attach(tmp_path / "r")
    worker = native.Worker(native.Table(), srv.inbox, srv.outbox, 1, -1, -1, 50e-6, (1e-5,))
    try:
        assert worker.spin == pytest.approx(50e-6)
        worker.spin = 0.0005
        assert worker.spin == pytest.approx(0.0005)
        worker.spin = 5.0
        assert worker.spin == pytest.approx(0.01)
        with pytest.raises(TypeError):
            worker.spin = "fast"
        cli.push((4, 7))  # it still serves: a fence, completed by the worker
        assert cli.wait(timeout=5.0) == 1 and cli.pop()[0] == 7
    finally:
        worker.stop()
        cli.close()
        srv.close()

    class Fake:
        spin = 0.0

    plane = _dataplane.DataPlane(DaemonConfig(worker_spin_s=40e-6, worker_spin_spare_s=400e-6), None)  # type: ignore[arg-type]
    cores = _dataplane._CPUS
    for n in (1, cores // 2, cores // 2 + 1, cores):
        plane._live = [Fake() for _ in range(n)]
        plane._respin()
        want = 400e-6 if 2 * n <= cores else 40e-6
        assert all(w.spin == want for w in plane._live), (n, cores)
    plane.config = DaemonConfig(worker_spin_s=40e-6, worker_spin_spare_s=0)
    plane._respin()
    assert all(w.spin == 40e-6 for w in plane._live)
