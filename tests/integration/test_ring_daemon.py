"""The request ring through a real transferd: semantics, hostile input, crashes.

"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import transfer
from transfer import errors as E
from transfer import protocol as P
from transfer.ring import COMPLETION_DTYPE, FLAG_AFTER, FLAG_CHAIN, FLAG_SUM, Op, Ring
from transfer.testing import start_daemon, stop_process

from conftest import FAST, leftovers, segment_files

psutil = pytest.importorskip("psutil")


@pytest.fixture
def ringd(shared_daemon):  # type: ignore[no-untyped-def]
    """The module's daemon (`conftest.shared_daemon`), shared by the tests that need none of
    their own: each waits for the sessions of the tests before it to be gone where it counts."""
    return shared_daemon


def _raw(client: transfer.Client) -> Ring:
    assert client._ring is not None
    return client._ring.ring


def _completions(ring: Ring, n: int, timeout: float = 10.0) -> np.ndarray:
    got: list[np.ndarray] = []
    have = 0
    deadline = time.monotonic() + timeout
    while have < n:
        assert time.monotonic() < deadline, f"only {have} of {n} completions"
        ring.wait(timeout=0.2, need=n - have)
        c = ring.pop_many()
        got.append(c)
        have += len(c)
    return np.concatenate(got) if got else np.zeros(0, COMPLETION_DTYPE)


def test_requests_over_the_ring(ringd) -> None:
    with transfer.connect(ringd.endpoint, ring=True) as c:
        assert c.ring
        seg = c.segment(1 << 20)
        data = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
        seg.buffer[:4096] = data
        sent = c.frames_sent
        assert c.copy(seg.at(8192), seg.at(0), 4096).result(5) is None
        assert c.checksum(seg.at(8192), 4096).result(5) == transfer.checksum64(data)
        c.fill(seg.at(0), 100, 7)
        c.fence()
        assert c.frames_sent == sent, "data requests and the fence took the socket"
        assert (seg.buffer[:100] == 7).all() and (seg.buffer[8192 : 8192 + 4096] == data).all()
        # a batch leaves as one push_many; the copies chain, so order matters
        with c.batch():
            for k in range(1, 200):
                c.copy(seg.at(k * 64), seg.at((k - 1) * 64), 64)
        c.fence()
        assert all((seg.buffer[k * 64 : (k + 1) * 64] == 7).all() for k in range(200))
        assert c.frames_sent == sent
        stats = c.stats()
        assert stats["session"]["requests"] >= 204


def test_errors_carry_their_message_and_the_daemon_keeps_serving(ringd) -> None:
    with transfer.connect(ringd.endpoint, ring=True) as c, transfer.connect(ringd.endpoint, ring=True) as other:
        seg = c.segment(4096)
        theirs = other.segment(4096)
        with pytest.raises(E.OutOfBounds, match="runs past the end"):
            c.copy(seg.at(0), seg.at(4000), 200).result(5)
        with pytest.raises(E.NotOwner):
            c.checksum(theirs.at(0), 16).result(5)
        p = c.fill(seg.at(0), 1 << 20, 1)  # unobserved: the next fence raises it
        with pytest.raises(E.OutOfBounds):
            c.fence()
        assert p.done
        assert c.checksum(seg.at(0), 16).result(5) == transfer.checksum64(bytes(16))
        assert other.checksum(theirs.at(0), 16).result(5) == transfer.checksum64(bytes(16))


def test_a_fence_waits_for_socket_requests_after_ring_failures(ringd) -> None:
    """A failed ring request's socket reply may come before its completion is reaped (the
    daemon sends a pass's replies, then pushes its completions). Routing must still count it
    answered: it once stayed "outstanding on the ring", the count of socket requests in flight
    came out short, and a fence took the ring past copies sent on the socket, returning
    before them and without their failure (`test_equivalence` found it)."""
    with transfer.connect(ringd.endpoint, ring=True) as c:
        seg, dead = c.segment(4096), c.segment(4096)
        c.free(dead)
        va = seg.va
        t1, t2 = transfer.TensorRef(va, "float32", (1,)), transfer.TensorRef(va, "float32", (2,))
        for trial in range(30):
            c.copy(va, dead.va, 0)  # a freed segment: the worker hands the ring to the loop
            c.copy(va + 4097, va + 4096, 0)  # out of bounds, even for zero bytes
            c.copy(va, va, 0)
            c.copy(va, va, 1 << 40)
            for _ in range(3):
                c.checksum(va, 0)
                c.copy(va, va, 0)
            c.compute("scale_add", [t1], [t2], {"a": 0.5, "b": 0.0})  # the socket (and an error)
            c.copy(va, va, 0)
            with pytest.raises(E.SegmentFreed):
                c.fence()
            after = [c.checksum(va, 0), c.copy(va, va, 0), c.copy(va, va, 1 << 40)]
            with pytest.raises(E.OutOfBounds):
                c.fence()
            assert all(p.done() for p in after), f"trial {trial}: the fence returned before the requests it follows"

def test_a_field_the_ring_cannot_carry_is_refused_before_anything_is_pushed(ringd) -> None:
    """RingLink.push packs every descriptor before it publishes one: a field out of range (here a
    stream past u32, which the public calls refuse earlier) is an InvalidField, and the requests
    of that push are forgotten, since nobody will answer them."""
    with transfer.connect(ringd.endpoint, ring=True) as c:
        seg = c.segment(4096)
        link = c._ring
        assert link is not None
        ok, bad = P.Fill(901, seg.at(0), 16, 1, 0), P.Fill(902, seg.at(0), 16, 1, 1 << 40)
        pending: dict[int, Any] = {901: object(), 902: object()}
        with pytest.raises(E.InvalidField, match="out of range"):
            link.push([ok, bad], pending, lambda n: None)
        assert pending == {} and link.in_flight == 0
        assert c.checksum(seg.at(0), 16).result(5) == transfer.checksum64(bytes(16))  # nothing ran


def test_hostile_descriptors_get_error_completions(daemon_factory) -> None:
    ringd = daemon_factory()  # (its own: its errors name segment ids no earlier test may have used)
    with transfer.connect(ringd.endpoint, ring=True) as c:
        seg = c.segment(4096)
        ring = _raw(c)
        base = 1 << 60
        bad = [
            (Op.COPY, 0, seg.at(0), seg.at(64), 8),  # id 0
            (Op.COPY, base + 1, seg.at(0), seg.at(64), 8, 0, 0x40),  # unknown flags
            (99, base + 2),  # unknown opcode
            (Op.COMPUTE, base + 3),  # not served on the ring
            (Op.FILL, base + 4, seg.at(0), 0, 8, 0, 0, 256),  # not a byte
            (Op.COPY, base + 5, seg.at(0), (77 << 40), 8),  # no such segment
            (Op.CHECKSUM, base + 6, 0, seg.at(4090), 2**64 - 1),  # size overflow
            (Op.COPY, base + 7, seg.at(0), seg.at(64), 8),  # fine
            (Op.RUN_GRAPH, base + 8, seg.at(0), seg.at(64), 0, 0, 0, seg.at(0)),  # not a graph's VA
            (Op.RUN_GRAPH, base + 9, seg.at(0), seg.at(64), 0, 0, 0, 77 << 40),  # no such graph
            (Op.RUN_GRAPH, base + 10, seg.at(0), seg.at(64), 8, 0, 0, seg.at(0)),  # nbytes must be 0
        ]
        for d in bad:
            assert ring.push(d)
        comps = _completions(ring, len(bad))
        status = {int(i): int(s) for i, s in zip(comps["id"], comps["status"])}
        assert status[base + 7] == 0
        assert status[0] == E.InvalidField.code
        assert status[base + 1] == E.InvalidField.code
        assert status[base + 2] == E.UnknownOperation.code
        assert status[base + 3] == E.UnknownOperation.code
        assert status[base + 4] == E.InvalidField.code
        assert status[base + 5] in (E.UnknownSegment.code, E.InvalidAddress.code)
        assert status[base + 6] in (E.OutOfBounds.code, E.InvalidAddress.code)
        assert status[base + 8] == E.InvalidField.code
        assert status[base + 9] in (E.UnknownSegment.code, E.InvalidAddress.code)
        assert status[base + 10] == E.InvalidField.code
        assert all(comps["flags"][comps["status"] != 0] == 1), "errors announce their detail reply"
        # a batch big enough for the planned (vector) path, with one bad copy in it
        descs = np.zeros(64, ring.out_dtype)
        descs["op"], descs["id"], descs["nbytes"] = Op.COPY, np.arange(base + 100, base + 164), 8
        descs["dst"], descs["src"] = seg.at(1024), seg.at(0)
        descs["src"][17] = seg.at(4095)
        assert ring.push_many(descs) == 64
        comps = _completions(ring, 64)
        failed = comps["id"][comps["status"] != 0].tolist()
        assert failed == [base + 117]
        assert c.checksum(seg.at(0), 8).result(5) == transfer.checksum64(bytes(8))


def test_copy_many_takes_the_ring_as_one_chained_request(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A CopyV travels as COPY descriptors chained under its id, is joined back into one request
    (also when the daemon takes the chain over several polls: --max-pass 7), and is answered
    once, all or nothing, as on the socket."""
    d = daemon_factory("--max-pass", "7")
    with transfer.connect(d.endpoint, ring=True) as c:
        seg = c.segment(1 << 16)
        seg.buffer[:4096] = np.arange(4096) % 251
        k = 40
        p = c.copy_many([seg.at(8192 + 64 * i) for i in range(k)], [seg.at(64 * (k - 1 - i)) for i in range(k)], [64] * k)
        assert c._ring is not None and p.id in c._ring.outstanding  # it went on the ring
        p.result(10)
        got = np.asarray(seg.buffer[8192 : 8192 + 64 * k]).reshape(k, 64)
        assert (got == np.asarray(seg.buffer[: 64 * k]).reshape(k, 64)[::-1]).all()
        before = np.asarray(seg.buffer[8192 : 8192 + 64 * k]).copy()
        bad = c.copy_many([seg.at(0), seg.at(128)], [seg.at(4096), (77 << 40)], [64, 64])  # one bad piece
        with pytest.raises((E.UnknownSegment, E.InvalidAddress)):
            bad.result(10)
        assert (np.asarray(seg.buffer[8192 : 8192 + 64 * k]) == before).all() and c.stats()["session"]["errors"] == 1
        assert c._ring.in_flight == 0


@pytest.mark.parametrize("workers", [True, False], ids=["workers", "event-loop"])
def test_checksum_many_takes_the_ring_as_one_request(workers: bool, daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A ChecksumV travels as one CHECKSUM descriptor per range under its id (also when the
    daemon's loop takes them over several passes: --max-pass 7), each completed on its own;
    the client answers the one request with every range's sum, in order. A bad range fails
    the whole with its full error, and every range's credit comes back."""
    d = daemon_factory("--max-pass", "7", *(() if workers else ("--no-ring-workers",)))
    with transfer.connect(d.endpoint, ring=True) as c:
        seg = c.segment(1 << 16)
        seg.buffer[:] = np.arange(1 << 16) % 253
        k = 40
        srcs, sizes = [seg.at(97 * i) for i in range(k)], [64 + i for i in range(k)]
        frames = c.frames_sent
        p = c.checksum_many(srcs, sizes)
        assert c._ring is not None and p.id in c._ring.outstanding  # it went on the ring
        want = [transfer.checksum64(seg.buffer[97 * i : 97 * i + 64 + i]) for i in range(k)]
        assert p.result(10).tolist() == want and c.frames_sent == frames
        bad = c.checksum_many([seg.at(0), 77 << 40, seg.at(64)], [64, 64, 64])
        with pytest.raises((E.UnknownSegment, E.InvalidAddress)):
            bad.result(10)
        c.fence()
        assert c._ring.in_flight == 0 and not c._ring.early and not c._ring.outstanding


def test_hostile_descriptor_chains_fail_alone(ringd) -> None:
    """Chains that mix opcodes, ids or streams are refused as one request each; one left open
    when the session ends goes with it; the daemon keeps serving."""
    # (A chain left open holds the Close behind it: the client gives up after its liveness bound.)
    with transfer.connect(ringd.endpoint, ring=True, liveness_timeout=2.0) as c:
        seg = c.segment(4096)
        ring = _raw(c)
        base = 1 << 60
        chains = [
            [(Op.COPY, base + 1, seg.at(0), seg.at(64), 8, 0, 1), (Op.FILL, base + 1, seg.at(0), 0, 8, 0, 0, 1)],
            [(Op.COPY, base + 2, seg.at(0), seg.at(64), 8, 0, 1), (Op.COPY, base + 3, seg.at(0), seg.at(64), 8)],
            [(Op.COPY, base + 4, seg.at(0), seg.at(64), 8, 0, 1), (Op.COPY, base + 4, seg.at(0), seg.at(64), 8, 5)],
            [(Op.COPY, base + 5, seg.at(0), seg.at(64), 8, 0, 1), (Op.COPY, base + 5, seg.at(8), seg.at(72), 8)],  # fine
        ]
        for chain in chains:
            for d in chain:
                assert ring.push(d)
        comps = _completions(ring, len(chains))
        status = {int(i): int(s) for i, s in zip(comps["id"], comps["status"])}
        assert status == {base + 1: E.InvalidField.code, base + 2: E.InvalidField.code, base + 4: E.InvalidField.code, base + 5: 0}
        assert c.checksum(seg.at(0), 8, stream=0).result(5) == transfer.checksum64(bytes(seg.buffer[:8]))
        assert ring.push((Op.COPY, base + 9, seg.at(0), seg.at(64), 8, 0, 1))  # a chain left open: goes with the session
    with transfer.connect(ringd.endpoint) as c2:
        seg2 = c2.segment(4096)
        assert c2.checksum(seg2.at(0), 8).result(5) == transfer.checksum64(bytes(8))


def test_hostile_verified_chains_fail_alone(ringd) -> None:
    """FLAG_SUM where no verified copy can be (a fill, half a chain) is refused as one request,
    with one completion; a whole verified chain answers one completion per piece, its sum;
    the daemon keeps serving."""
    with transfer.connect(ringd.endpoint, ring=True) as c:
        seg = c.segment(4096)
        seg.buffer[:] = np.arange(4096) % 251
        ring = _raw(c)
        base = 1 << 60
        C, S = FLAG_CHAIN, FLAG_SUM
        pushes = [
            (Op.FILL, base + 1, seg.at(0), 0, 8, 0, S, 1),
            (Op.COPY, base + 2, seg.at(0), seg.at(64), 8, 0, C | S), (Op.COPY, base + 2, seg.at(8), seg.at(72), 8, 0, 0),
            (Op.COPY, base + 3, seg.at(0), seg.at(64), 8, 0, C), (Op.COPY, base + 3, seg.at(8), seg.at(72), 8, 0, S),
            (Op.COPY, base + 4, seg.at(1024), seg.at(64), 16, 0, C | S), (Op.COPY, base + 4, seg.at(2048), seg.at(512), 100, 0, S),
        ]
        for d in pushes:
            assert ring.push(d)
        comps = _completions(ring, 5)
        # (A pass answers its requests in any order across ids; one id's in order.)
        got = sorted(((int(i), int(st_), int(r)) for i, st_, r in zip(comps["id"], comps["status"], comps["result"])), key=lambda g: g[0])
        bad = E.InvalidField.code
        want_sums = [transfer.checksum64(bytes(seg.buffer[64:80])), transfer.checksum64(bytes(seg.buffer[512:612]))]
        assert [g[:2] for g in got] == [(base + 1, bad), (base + 2, bad), (base + 3, bad), (base + 4, 0), (base + 4, 0)]
        assert [g[2] for g in got[3:]] == want_sums
        assert c.checksum(seg.at(1024), 16).result(5) == want_sums[0]


def test_verified_chains_fill_the_completion_queue_and_wait(ringd) -> None:
    """A client that pushes verified chains up to its credits before it takes any completion
    fills its completion queue to the last slot a whole chain fits in: the rest waits for
    room (a chain answers all its pieces at once), on that ring only, while another session
    is served; taken, every chain is answered whole and in order, round after round."""
    # (Past its credits the Close waits behind what is never taken: the client gives up after its liveness bound.)
    with transfer.connect(ringd.endpoint, ring=True, liveness_timeout=2.0) as c:
        seg = c.segment(1 << 16)
        seg.buffer[:] = np.arange(1 << 16) % 253
        ring = _raw(c)
        base, k = 1 << 60, 48
        credits = min(ring.request_capacity, ring.completion_capacity)
        chains = credits // k
        want = [transfer.checksum64(bytes(seg.buffer[64 * i:64 * i + 64])) for i in range(k)]
        for rnd in range(3):  # three queues' worth in all
            for j in range(chains):
                for i in range(k):
                    flags = FLAG_SUM | (FLAG_CHAIN if i + 1 < k else 0)
                    assert ring.push((Op.COPY, base + rnd * chains + j, seg.at(32768 + 64 * i), seg.at(64 * i), 64, 0, flags))
            with transfer.connect(ringd.endpoint, ring=True) as other:  # served meanwhile
                theirs = other.segment(4096)
                assert other.checksum(theirs.at(0), 16).result(5) == transfer.checksum64(bytes(16))
            comps = _completions(ring, chains * k)
            assert len(comps) == chains * k and (comps["status"] == 0).all()
            assert comps["id"].tolist() == [base + rnd * chains + j for j in range(chains) for _ in range(k)]
            assert comps["result"].tolist() == want * chains
        # Past its credits (more than the completion queue holds, never taken): that ring
        # waits, or its session ends; nobody else notices.
        over = (ring.request_capacity + ring.completion_capacity) // k - 2
        for j in range(over):
            for i in range(k):
                flags = FLAG_SUM | (FLAG_CHAIN if i + 1 < k else 0)
                if not ring.push((Op.COPY, base + 10_000 + j, seg.at(32768 + 64 * i), seg.at(64 * i), 64, 0, flags), timeout=2):
                    break  # (its session ended: nothing takes descriptors any more)
        with transfer.connect(ringd.endpoint, ring=True) as other:
            theirs = other.segment(4096)
            assert other.checksum(theirs.at(0), 16).result(5) == transfer.checksum64(bytes(16))
    with transfer.connect(ringd.endpoint) as c2:
        deadline = time.monotonic() + 5
        while c2.stats()["daemon"]["sessions"] > 1:  # the lazy session went, with its ring
            assert time.monotonic() < deadline, "the session past its credits was not released"
            time.sleep(0.02)


def test_hostile_fences_hold_only_their_own_ring(ringd) -> None:
    """FLAG_AFTER naming a frame that never comes holds that descriptor and those behind it,
    on its own ring and nothing else: the session's socket serves on, another session runs,
    and the session's end takes what was held. A fence met already costs nothing, on a
    chain's later piece too."""
    with transfer.connect(ringd.endpoint, ring=True) as c:
        seg = c.segment(4096)
        seg.buffer[:] = 3
        ring = _raw(c)
        base = 1 << 60
        assert ring.push((Op.COPY, base + 1, seg.at(0), seg.at(64), 8, 0, FLAG_AFTER, 0, 0, 1))  # the hello: met
        assert ring.push((Op.COPY, base + 2, seg.at(16), seg.at(64), 8, 0, FLAG_CHAIN))
        assert ring.push((Op.COPY, base + 2, seg.at(24), seg.at(72), 8, 0, FLAG_AFTER, 0, 0, 1))
        comps = _completions(ring, 2)
        assert {int(i): int(s) for i, s in zip(comps["id"], comps["status"])} == {base + 1: 0, base + 2: 0}
        assert ring.push((Op.FILL, base + 3, seg.at(0), 0, 8, 0, FLAG_AFTER, 7, 0, 1 << 62))  # never met
        assert ring.push((Op.FILL, base + 4, seg.at(8), 0, 8, 0, 0, 9))  # behind it
        assert c.stats()["session"]["id"] == c.session_id  # the socket serves on
        time.sleep(0.2)
        assert len(ring.pop_many()) == 0 and (seg.buffer[:16] == 3).all(), "a held descriptor ran"
        with transfer.connect(ringd.endpoint, ring=True) as other:
            theirs = other.segment(4096)
            assert other.checksum(theirs.at(0), 16).result(5) == transfer.checksum64(bytes(16))
    with transfer.connect(ringd.endpoint, ring=True) as c2:
        seg2 = c2.segment(4096)
        assert c2.checksum(seg2.at(0), 8).result(5) == transfer.checksum64(bytes(8))
        deadline = time.monotonic() + 5
        while c2.stats()["daemon"]["sessions"] > 1:  # the holder's session goes, with its ring
            assert time.monotonic() < deadline, "the session holding descriptors was not released"
            time.sleep(0.02)


def test_a_corrupted_ring_ends_only_its_session(ringd, shm_dir: Path) -> None:
    with transfer.connect(ringd.endpoint, ring=True) as good:
        gseg = good.segment(4096)
        bad = transfer.connect(ringd.endpoint, ring=True)
        ring = _raw(bad)
        words = memoryview(ring._mm).cast("Q")
        words[128 // 8] += 1 << 40  # the request queue's tail: impossible
        words.release()
        os.write(bad._ring.bell_fd, b"\0")  # wake the daemon whether or not it armed the ring
        deadline = time.monotonic() + 5
        while good.stats()["daemon"]["rings"] != 1:
            assert time.monotonic() < deadline, "the daemon did not end the corrupted ring's session"
            time.sleep(0.02)
        with pytest.raises((E.SessionClosed, E.ConnectionLost, E.NoSession)):
            bad.fence(timeout=5)
        bad.close()
        assert good.checksum(gseg.at(0), 64).result(5) == transfer.checksum64(bytes(64))
    deadline = time.monotonic() + 5
    while [n for n in segment_files(shm_dir) if ".ring-" in n] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [n for n in segment_files(shm_dir) if ".ring-" in n]


def _model(size: int, ops: list[tuple]) -> np.ndarray:
    mem = (np.arange(size) % 251).astype(np.uint8)
    for op in ops:
        if op[0] == "copy":
            _, d, s, n, _ = op
            mem[d : d + n] = mem[s : s + n].copy()
        else:
            _, d, n, v = op
            mem[d : d + n] = v
    return mem


_SIZE = 4096
_op = st.one_of(
    st.tuples(st.just("copy"), st.integers(0, _SIZE - 1), st.integers(0, _SIZE - 1), st.integers(1, 512), st.sampled_from(["ring", "zmq"])),
    st.tuples(st.just("fill"), st.integers(0, _SIZE - 1), st.integers(1, 512), st.integers(0, 255)),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, min_size=1, max_size=60), batched=st.booleans())
def test_ring_and_socket_requests_run_in_submission_order(ringd, ops: list[tuple], batched: bool) -> None:
    """Any mix of ring requests and socket requests (a copy_many too long for the ring's
    credits) equals sequential execution."""
    clipped = []
    for op in ops:
        if op[0] == "copy":
            _, d, s, n, via = op
            n = min(n, _SIZE - d, _SIZE - s)
            clipped.append(("copy", d, s, n, via))
        else:
            _, d, n, v = op
            clipped.append(("fill", d, min(n, _SIZE - d), v))
    with transfer.connect(ringd.endpoint, ring=2) as c:  # 2 credits: a 3-piece copy_many takes the socket
        seg = c.segment(_SIZE)
        seg.buffer[:] = (np.arange(_SIZE) % 251).astype(np.uint8)
        ctx = c.batch() if batched else _Null()
        with ctx:
            for op in clipped:
                if op[0] == "copy":
                    _, d, s, n, via = op
                    if via == "ring":
                        c.copy(seg.at(d), seg.at(s), n)
                    else:  # a chain longer than the ring's credits: the socket (empty pieces do nothing)
                        c.copy_many([seg.at(d), seg.at(0), seg.at(0)], [seg.at(s), seg.at(0), seg.at(0)], [n, 0, 0])
                else:
                    _, d, n, v = op
                    c.fill(seg.at(d), n, v)
        c.fence()
        assert (seg.buffer == _model(_SIZE, clipped)).all()


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_many_descriptors_none_lost_duplicated_or_reordered(ringd) -> None:
    """200k descriptors through the daemon: each answered once; chained copies prove the order."""
    with transfer.connect(ringd.endpoint, ring=True) as c:
        seg = c.segment(1 << 16)
        ring = _raw(c)
        seg.buffer[:8] = np.frombuffer(b"ABCDEFGH", np.uint8)
        total, batch = 200_000, 1000
        base = 1 << 61
        seen = np.zeros(total, np.uint8)
        for first in range(0, total, batch):
            descs = np.zeros(batch, ring.out_dtype)
            descs["op"] = Op.COPY
            descs["id"] = np.arange(base + first, base + first + batch, dtype=np.uint64)
            k = np.arange(first, first + batch, dtype=np.uint64) % 8000
            descs["src"] = seg.at(0) + k * 8  # a chain: slot k+1 copies slot k
            descs["dst"] = seg.at(0) + (k + 1) * 8
            descs["nbytes"] = 8
            descs["src"][k == 7999] = seg.at(0)  # wrap: restart from slot 0
            descs["dst"][k == 7999] = seg.at(0)
            assert ring.push_many(descs, timeout=10) == batch
            comps = _completions(ring, batch)
            assert not comps["status"].any()
            idx = comps["id"].astype(np.int64) - base
            np.add.at(seen, idx, 1)
        assert (seen == 1).all(), "a descriptor was lost or answered twice"
        # every slot now holds slot 0's bytes only if each copy ran after the one before it
        assert bytes(seg.buffer[: 8000 * 8]) == b"ABCDEFGH" * 8000


def test_client_killed_mid_stream_is_reclaimed(daemon_factory, shm_dir: Path, tmp_path: Path) -> None:
    ringd = daemon_factory()  # (its own: its shared-memory directory is looked at)
    script = tmp_path / "producer.py"
    script.write_text(textwrap.dedent(f"""
        import sys, transfer
        c = transfer.connect({ringd.endpoint!r}, ring=True)
        seg = c.segment(1 << 20)
        print("ready", flush=True)
        while True:
            with c.batch():
                for k in range(256):
                    c.copy(seg.at(4096 + k * 64), seg.at(k * 64), 64)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 5
    while segment_files(shm_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert segment_files(shm_dir) == []
    with transfer.connect(ringd.endpoint, ring=True) as c:
        seg = c.segment(64)
        assert c.checksum(seg.at(0), 64).result(5) == transfer.checksum64(bytes(64))
        assert c.stats()["daemon"]["sessions"] == 1


def test_daemon_killed_while_a_client_waits_on_the_ring(shm_dir: Path, tmp_path: Path) -> None:
    wd = tmp_path / "run"
    wd.mkdir(mode=0o700)
    d = start_daemon([*FAST, "--ring-spin", "0"], workdir=wd, shm_dir=shm_dir)
    try:
        c = transfer.connect(d.endpoint, ring=True, liveness_timeout=2.0)
        seg = c.segment(1 << 20)
        stop_process(d.pid)  # every thread, its ring worker too: the client waits on the ring
        p = c.checksum(seg.at(0), 1 << 20)
        os.kill(d.pid, signal.SIGKILL)
        d.proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises(E.ConnectionLost):
            p.result(30)
        assert time.monotonic() - t0 < 5
        c.close()
        assert any(".fds." in n for n in leftovers(shm_dir))  # the dead daemon's fd socket
        d.restart()  # the sweep removes the dead instance's files (its ring was a memfd: gone with it)
        assert segment_files(shm_dir) == []
    finally:
        d.stop()


def test_rings_can_be_disabled(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--no-rings")
    with pytest.raises(E.RingUnavailable, match="disabled"):
        transfer.connect(d.endpoint, ring=True)
    with transfer.connect(d.endpoint) as c:
        assert not c.ring
        with pytest.raises(E.RingUnavailable, match="disabled"):
            c._open_ring(64)


@pytest.mark.parametrize("ring", [False, True])
def test_one_accounting_whatever_the_path(daemon_factory, ring: bool) -> None:  # type: ignore[no-untyped-def]
    """Requests, bytes and errors are counted once, the same way, on the ring and on the socket."""
    d = daemon_factory()
    with transfer.connect(d.endpoint, ring=ring) as c:
        seg = c.segment(1 << 16)
        before = c.stats()
        c.copy(seg.at(4096), seg.at(0), 4096).result(5)  # small: runs inline
        with c.batch():
            for k in range(20):  # a run of copies: one vector op
                c.copy(seg.at(8192 + 64 * k), seg.at(64 * k), 64)
        c.fill(seg.at(0), 1000, 3)
        with pytest.raises(E.OutOfBounds):
            c.checksum(seg.at(0), 1 << 20).result(5)
        c.fence()
        after = c.stats()
    moved = 4096 + 20 * 64 + 1000
    s0, s1, d0, d1 = before["session"], after["session"], before["daemon"], after["daemon"]
    assert s1["bytes_moved"] - s0["bytes_moved"] == moved
    assert d1["bytes_moved"] - d0["bytes_moved"] == moved
    assert s1["errors"] - s0["errors"] == 1
    assert s1["requests"] - s0["requests"] >= 23  # + the fence and the stats request


def test_a_field_no_descriptor_holds_fails_its_call_and_nothing_else(ringd: Any) -> None:
    """Requests whose fields a descriptor cannot hold (made past the client's checks) fail
    with InvalidField before anything of their call is published: raised to a blocking
    caller, or (event-loop clients, whose caller has returned) finished and left for
    fence(). Nothing of them stays pending, and the session serves on."""
    with transfer.connect(ringd.endpoint) as c:
        seg = c.segment(4096)
        seg.buffer[:64] = 7
        core, link = c._core, c._ring
        assert link is not None
        for failed in (None, []):
            with c._lock:
                good, pg = core.new(P.Copy, seg.va + 64, seg.va, 64, 0)
                bad, pb = core.new(P.Copy, 1 << 64, seg.va, 64, 0)  # a VA past any descriptor
                pushed = link.pushed
                if failed is None:
                    with pytest.raises(E.InvalidField):
                        link.push([good, bad], core.pending, c._wait_room, 0)
                    assert not pg.done() and not pb.done()
                else:
                    link.push([good, bad], core.pending, c._wait_room, 0, failed)
                    assert failed == [pg, pb] and all(isinstance(p.exception(), E.InvalidField) for p in failed)
                assert link.pushed == pushed and good.id not in core.pending and bad.id not in core.pending
                assert good.id not in link.outstanding and bad.id not in link.outstanding
        c.copy(seg.va + 128, seg.va, 64).result()
        c.fence()
        assert bytes(seg.buffer[128:192]) == bytes([7]) * 64 and not core.pending
