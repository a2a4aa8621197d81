"""The shared-memory request ring (transfer/ring, native/queue.h; docs/ring.md).

Every test runs on both implementations (native C extension, pure-Python
fallback) where the extension is built. The multi-process tests run this
file as a script in spawned processes (see ``_worker`` at the bottom).
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from oracles.packing import pop_finished as _py_pop_finished
from oracles.packing import push_requests as _py_push_requests
from oracles.ringqueue import RINGS, group_runs
from oracles.submission import PySubmission
from transfer import checksum64 as transfer_checksum64
from transfer import protocol as P
from transfer._pending import Pending
from transfer.ring import _layout as L
from transfer.ring import (
    COMPLETION_DTYPE,
    FLAG_AFTER,
    FLAG_SUM,
    KINDS as _KINDS,
    REQUEST_DTYPE,
    Op,
    Ring,
    RingCorrupted,
    RingError,
    RingLink,
    descriptors_of,
)

#: The native queue, and the Python oracle it is held to (they share the layout).
IMPLS = ["native", "python"]
HERE = Path(__file__).resolve()


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def pair(impl: str, shm_dir: Path):
    srv = RINGS[impl].create(shm_dir / "r.ring", 8, 4)
    cli = RINGS[impl].attach(shm_dir / "r.ring")
    yield srv, cli
    cli.close()
    srv.close()


# --- descriptors the stress tests can verify field by field ------------------------
M = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        y = x * M
    return y ^ (y >> np.uint64(29))


def make_descs(start: int, n: int) -> np.ndarray:
    i = np.arange(start, start + n, dtype=np.uint64)
    d = np.zeros(n, REQUEST_DTYPE)
    d["op"] = (i % np.uint64(5)).astype(np.uint16)
    d["flags"] = (i >> np.uint64(3)).astype(np.uint16)
    d["stream"] = (i * np.uint64(7)).astype(np.uint32)
    d["id"] = i
    d["dst"] = _mix(i)
    d["src"] = _mix(i + np.uint64(1))
    d["nbytes"] = i * np.uint64(3)
    d["arg0"] = _mix(i + np.uint64(2))
    d["arg1"] = ~i
    d["arg2"] = d["dst"] ^ d["src"] ^ d["nbytes"] ^ d["arg0"]  # checksum of the rest
    return d


def check_descs(got: np.ndarray, start: int) -> None:
    """got must be exactly descriptors start, start+1, ... (no loss, dup, reorder, tear)."""
    want = make_descs(start, len(got))
    bad = np.flatnonzero((got.view(np.uint64).reshape(-1, 8) != want.view(np.uint64).reshape(-1, 8)).any(axis=1))
    assert bad.size == 0, f"descriptor {start + int(bad[0])} wrong: got {got[bad[0]]}, want {want[bad[0]]}"


# --- unit tests ----------------------------------------------------------------------


def test_layouts() -> None:
    assert REQUEST_DTYPE.itemsize == 64 and COMPLETION_DTYPE.itemsize == 32
    # naturally aligned, no overlap, fully covered
    for dt in (REQUEST_DTYPE, COMPLETION_DTYPE):
        spans = sorted((off, off + f.itemsize) for f, off in (dt.fields[n][:2] for n in dt.names))
        assert all(a % (b - a) == 0 for a, b in spans)
        assert spans[0][0] == 0 and spans[-1][1] == dt.itemsize
        assert all(spans[k][1] == spans[k + 1][0] for k in range(len(spans) - 1))
    # indices and futex words each on their own line
    offs = [L.OFF_SQ_TAIL, L.OFF_SQ_HEAD, L.OFF_SQ_DATA_W, L.OFF_SQ_SPACE_W,
            L.OFF_CQ_TAIL, L.OFF_CQ_HEAD, L.OFF_CQ_DATA_W, L.OFF_CQ_SPACE_W]
    assert len({o // 128 for o in offs}) == len(offs) and min(offs) >= 128
    assert max(offs) + 128 <= L.HEADER_SIZE


def test_push_pop_both_directions(pair) -> None:
    srv, cli = pair
    assert cli.push((Op.COPY, 7, 0x10000000000, 0x20000000000, 4096))
    assert srv.available() == 1
    assert srv.pop() == (1, 7, 0x10000000000, 0x20000000000, 4096, 0, 0, 0, 0, 0)
    assert srv.pop() is None
    full = (2, 2**64 - 1, 1, 2, 3, 2**32 - 1, 2**16 - 1, 4, 5, 6)
    assert cli.push(full) and srv.pop() == full
    assert srv.push((7, -5, 2**64 - 1)) and srv.push((8, 0, 1, 2, 3))
    assert cli.pop() == (7, -5, 2**64 - 1, 0, 0)
    got = cli.pop_many()
    assert got.dtype == COMPLETION_DTYPE and got.tolist() == [(8, 0, 1, 2, 3)]
    assert cli.pop_many().size == 0


def test_full_partial_and_wraparound(pair) -> None:
    srv, cli = pair
    rng = np.random.default_rng(1)
    sent = recv = 0
    for _ in range(300):  # many laps of an 8-slot ring, odd batch sizes
        k = int(rng.integers(1, 12))
        n = cli.push_many(make_descs(sent, k))
        assert n == min(k, 8 - (sent - recv)) and cli.free() == 8 - (sent + n - recv)
        sent += n
        got = srv.pop_many(int(rng.integers(1, 10)))
        check_descs(got, recv)
        recv += len(got)
    check_descs(srv.pop_many(), recv)
    assert not cli.push_many(make_descs(0, 0))


def test_full_push_returns_false_and_times_out(pair) -> None:
    srv, cli = pair
    assert cli.push_many(make_descs(0, 8)) == 8
    assert cli.push((1,)) is False
    t = time.monotonic()
    assert cli.push((1,), timeout=0.2) is False
    assert cli.push_many(make_descs(8, 3), timeout=0.2) == 0
    assert 0.35 <= time.monotonic() - t < 2.0
    check_descs(srv.pop_many(3), 0)
    assert cli.push_many(make_descs(8, 3), timeout=0.2) == 3


@given(st.lists(st.tuples(st.integers(1, 3), st.sampled_from([0, 0, 0, -5, 7]), st.integers(0, 2**64 - 1)), max_size=40),
       st.integers(0, 7))
def test_pop_runs_native_matches_python(rows: list[tuple[int, int, int]], skew: int) -> None:
    """`pop_runs` groups a run of one id (every status zero) into one tuple, its results packed;
    the native queue and the pure-Python one hand over the same, across the wrap too, and
    `group_runs` of `pop_list`'s tuples is what both mean."""
    import tempfile

    got = {}
    for impl in ("native", "python"):
        with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
            srv = RINGS[impl].create(Path(d) / "r.ring", 8, 64)
            cli = RINGS[impl].attach(Path(d) / "r.ring")
            for k in range(skew):  # move the indices so the batch wraps
                assert srv.push((9, 0, k))
            cli.inbox.pop_list()
            comps = [(rid, status, result, 1 if status else 0, 0) for rid, status, result in rows]
            for c in comps:
                assert srv.push(c)
            got[impl] = cli.inbox.pop_runs(0, 2, 1)
            assert cli.inbox.pop_runs(0, 2, 1) == []
            with pytest.raises(ValueError):
                cli.inbox.pop_runs(0, 1, 1)  # status is not an 8-byte field
            cli.close()
            srv.close()
        assert got[impl] == group_runs(comps, 0, 2, 1)
        assert sum(r[5] for r in got[impl]) == len(comps)
        for r in got[impl]:
            assert (r[6] is None) == (r[5] == 1) and (r[5] == 1 or not r[1])


def test_pop_list_takes_everything_across_the_wrap(pair) -> None:
    """pop_list: every available descriptor as tuples (as pop gives them), in order, over
    many laps of the ring, released at once (the producer sees the room)."""
    srv, cli = pair
    rng = np.random.default_rng(2)
    sent = recv = 0
    for _ in range(200):
        k = int(rng.integers(0, 9))
        n = cli.push_many(make_descs(sent, k))
        sent += n
        got = srv.inbox.pop_list()
        want = make_descs(recv, sent - recv).tolist()
        assert got == want and cli.free() == 8
        recv = sent
    assert srv.inbox.pop_list() == []
    assert srv.push((7, -5, 2**64 - 1)) and cli.inbox.pop_list() == [(7, -5, 2**64 - 1, 0, 0)]


def test_pop_many_is_a_private_copy(pair) -> None:
    srv, cli = pair
    cli.push_many(make_descs(0, 8))
    got = srv.pop_many(8)
    cli.push_many(make_descs(100, 8))  # overwrites every slot
    check_descs(got, 0)


def test_bad_input_rejected(pair) -> None:
    srv, cli = pair
    with pytest.raises(TypeError):
        cli.push_many(np.zeros(3, COMPLETION_DTYPE))
    with pytest.raises(TypeError):
        cli.push([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        cli.push(tuple(range(11)))
    with pytest.raises(OverflowError):
        cli.push((2**16,))
    with pytest.raises(OverflowError):
        srv.push((1, 2**31))
    with pytest.raises((OverflowError, ValueError)):
        cli.push((-1,))
    with pytest.raises(TypeError):  # wrong direction: a client never produces completions
        cli.inbox.push((1,))
    with pytest.raises(TypeError):
        srv.inbox.push((1,))
    assert srv.available() == 0 and cli.available() == 0


def test_create_and_attach_validation(impl: str, shm_dir: Path) -> None:
    for cap in (0, 1, 3, 1000, 2**25):
        with pytest.raises(ValueError):
            RINGS[impl].create(shm_dir / f"c{cap}", cap)
    p = shm_dir / "r"
    with RINGS[impl].create(p, 16):
        assert p.stat().st_mode & 0o777 == 0o600
        with pytest.raises(FileExistsError):
            RINGS[impl].create(p, 16)
    bad = shm_dir / "bad"
    bad.write_bytes(b"x" * 8192)
    bad.chmod(0o600)
    with pytest.raises(RingCorrupted, match="magic"):
        RINGS[impl].attach(bad)
    bad.write_bytes(b"x" * 100)
    with pytest.raises(RingCorrupted):
        RINGS[impl].attach(bad)
    # a truncated ring: geometry no longer matches the file size
    r = RINGS[impl].create(shm_dir / "t", 64)
    os.truncate(shm_dir / "t", r.nbytes - 4096)
    with pytest.raises(RingCorrupted, match="geometry"):
        RINGS[impl].attach(shm_dir / "t")
    r.close()
    (shm_dir / "loose").write_bytes(b"")
    (shm_dir / "loose").chmod(0o644)
    with pytest.raises(RingError, match="private"):
        RINGS[impl].attach(shm_dir / "loose")


def test_memfd_and_fd_attach(impl: str) -> None:
    with RINGS[impl].create(None, 32) as srv:
        assert srv.fd >= 0 and srv.path is None
        with RINGS[impl].attach(srv.fd) as cli:
            assert cli.peer_pid == os.getpid() and srv.peer_pid == os.getpid()
            cli.push((1, 42))
            assert srv.pop()[1] == 42
    assert srv.fd == -1


def test_corrupt_indices_detected(pair) -> None:
    srv, cli = pair
    cli.push_many(make_descs(0, 3))
    words = np.frombuffer(srv._mm, np.uint64, count=L.HEADER_SIZE // 8)
    words[L.OFF_SQ_TAIL // 8] = 3 + 9  # the "client" claims more than a capacity
    with pytest.raises(RingCorrupted):
        srv.pop_many()
    with pytest.raises(RingCorrupted):
        srv.pop()
    words[L.OFF_SQ_TAIL // 8] = 3
    check_descs(srv.pop_many(), 0)
    words[L.OFF_CQ_HEAD // 8] = 2**63  # the "client" lies about consumed completions
    with pytest.raises(RingCorrupted):
        srv.push_many(np.zeros(5, COMPLETION_DTYPE))
    del words


def test_interop_native_and_python(shm_dir: Path) -> None:
    for a, b in (("native", "python"), ("python", "native")):
        p = shm_dir / f"{a}-{b}"
        with RINGS[a].create(p, 16) as srv, RINGS[b].attach(p) as cli:
            sent = recv = 0
            for k in (5, 16, 3, 9, 16, 1):
                sent += cli.push_many(make_descs(sent, k))
                got = srv.pop_many()
                check_descs(got, recv)
                recv += len(got)
                srv.push_many(np.array([(recv, 0, recv, 0, 0)], COMPLETION_DTYPE))
                assert cli.pop()[0] == recv
            woke = []
            th = threading.Thread(target=lambda: woke.append(srv.wait(timeout=5.0)))
            th.start()
            time.sleep(0.1)
            t = time.monotonic()
            cli.push((1, 99))
            th.join()
            assert woke == [1] and time.monotonic() - t < 1.0


def test_wait_timeout_and_wakeups(pair) -> None:
    srv, cli = pair
    t = time.monotonic()
    assert srv.wait(timeout=0.15) == 0
    assert 0.14 <= time.monotonic() - t < 1.0
    assert cli.notify() is False  # nobody sleeps

    def later(fn, delay=0.1):
        th = threading.Thread(target=lambda: (time.sleep(delay), fn()))
        th.start()
        return th

    th = later(lambda: cli.push((1, 5)))
    t = time.monotonic()
    assert srv.wait(timeout=5.0) == 1  # woken by the push, well before the timeout
    assert time.monotonic() - t < 1.0
    th.join()
    assert srv.pop()[1] == 5
    # wait(need=k) waits for k
    th = later(lambda: [cli.push((1, i)) or time.sleep(0.01) for i in range(4)])
    assert srv.wait(timeout=5.0, need=4) >= 4
    th.join()
    srv.pop_many()
    # producer waits for space
    cli.push_many(make_descs(0, 8))
    th = later(lambda: srv.pop_many(3))
    t = time.monotonic()
    assert cli.wait_space(need=3, timeout=5.0) == 3
    assert time.monotonic() - t < 1.0
    th.join()


def test_peer_close_wakes_and_local_close_interrupts(pair) -> None:
    srv, cli = pair
    out = []
    th = threading.Thread(target=lambda: out.append(srv.wait(timeout=30.0)))
    th.start()
    time.sleep(0.1)
    t = time.monotonic()
    cli.close()
    th.join(5)
    assert out == [0] and time.monotonic() - t < 1.0 and srv.peer_closed and not srv.peer_alive()
    # a wait() in another thread, interrupted by close() of its own endpoint
    r = type(srv).create(None, 8)
    out2 = []
    th = threading.Thread(target=lambda: out2.append(r.wait(timeout=None)))
    th.start()
    time.sleep(0.1)
    t = time.monotonic()
    r.close()
    th.join(5)
    assert out2 == [0] and time.monotonic() - t < 1.0
    with pytest.raises(ValueError):
        r.pop()


def test_an_import_without_the_extension_fails_naming_the_fix() -> None:
    """The native core is the product: without it the package does not import at all, and
    says why and what to do (sys.modules None blocks the extension's import)."""
    hide = "import sys; sys.modules['transfer._native'] = None\nimport transfer\n"
    bad = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True)
    assert bad.returncode != 0 and "ImportError" in bad.stderr, bad.stderr
    assert "transfer._native" in bad.stderr and "C compiler" in bad.stderr and "pip install" in bad.stderr


# --- multi-process tests ---------------------------------------------------------------

STRESS_N = {"native": 2_000_000, "python": 200_000}


def _spawn(impl: str, *args: object) -> subprocess.Popen:
    """This file as a script, with `impl`'s ring class (native, or the Python oracle)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE.parents[2]), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, str(HERE), impl, *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _consume(srv: Ring, recv: int, until: int | None, timeout: float) -> int:
    """Pop, verify and acknowledge (one completion per batch) until `until` or a quiet `timeout`."""
    while until is None or recv < until:
        if srv.wait(timeout=timeout) == 0:
            break
        got = srv.pop_many(4096)
        check_descs(got, recv)
        recv += len(got)
        srv.push((recv - 1, 0, recv))  # may be dropped if the client is not reading: fine
    return recv


def test_two_process_stress(impl: str, shm_dir: Path) -> None:
    n = STRESS_N[impl]
    p = shm_dir / "stress"
    with RINGS[impl].create(p, 1024, 1024) as srv:
        child = _spawn(impl, "producer", p, n)
        try:
            t = time.monotonic()
            recv = _consume(srv, 0, n, timeout=20.0)
            dt = time.monotonic() - t
            out, err = child.communicate(timeout=30)
        finally:
            child.kill()
        assert child.returncode == 0, err
        assert recv == n and srv.pop() is None
        assert json.loads(out)["sent"] == n
        print(f"{impl}: {n} descriptors in {dt:.2f} s = {n / dt / 1e6:.2f} M/s")


def test_producer_killed_mid_stream(impl: str, shm_dir: Path) -> None:
    p = shm_dir / "pk"
    with RINGS[impl].create(p, 1024) as srv:
        child = _spawn(impl, "producer", p, 0)  # 0: push forever
        try:
            recv = _consume(srv, 0, STRESS_N[impl] // 10, timeout=20.0)
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
            # drain what it published before dying: a consistent prefix, nothing torn
            recv = _consume(srv, recv, None, timeout=0.3)
        finally:
            child.kill()
            child.wait()
        assert recv >= STRESS_N[impl] // 10
        assert srv.pop() is None and not srv.peer_closed and not srv.peer_alive()
        t = time.monotonic()
        assert srv.wait(timeout=0.2) == 0
    assert time.monotonic() - t < 2.0  # teardown does not wait for the dead peer


def test_consumer_killed(impl: str, shm_dir: Path) -> None:
    p = shm_dir / "ck"
    with RINGS[impl].create(p, 1024, role="client") as cli:
        child = _spawn(impl, "consumer", p)
        try:
            sent = 0
            while sent < 50_000:
                sent += cli.push_many(make_descs(sent, 500), timeout=10.0)
                cli.pop_many()
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
            t = time.monotonic()
            while True:  # fills the ring, then a push times out instead of hanging
                k = cli.push_many(make_descs(sent, 500), timeout=0.3)
                sent += k
                if k < 500:
                    break
                assert time.monotonic() - t < 10
            assert cli.free() == 0 and cli.push((1,), timeout=0.1) is False
            assert not cli.peer_alive()
        finally:
            child.kill()
            child.wait()
        t = time.monotonic()
    assert time.monotonic() - t < 2.0


def test_an_idle_consumer_waits_and_wakes_for_a_push(impl: str, shm_dir: Path) -> None:
    p = shm_dir / "idle"
    with RINGS[impl].create(p, 64, role="client") as cli:
        child = _spawn(impl, "idle", p, 0.3)
        out, err = child.communicate(timeout=30)
        assert child.returncode == 0, err
        r = json.loads(out)
        assert r["got"] == 0, r  # (its CPU while idle: bench/ring_daemon.py --idle)
        # and a sleeping consumer still wakes for a push
        child = _spawn(impl, "idle", p, 10.0)
        try:
            time.sleep(0.5)
            cli.push((1, 1))
            out, err = child.communicate(timeout=30)
        finally:
            child.kill()
        r = json.loads(out)
        assert r["got"] == 1, r


# --- worker processes (this file run as a script) ----------------------------------------


def _producer(path: str, n: int) -> None:
    """Push descriptors 0..n-1 (forever if n == 0) in odd batches, some one by one."""
    rng = np.random.default_rng(os.getpid())
    with Ring.attach(path) as cli:
        sent = base = 0
        chunk = make_descs(0, 1 << 16)
        while n == 0 or sent < n:
            if sent + 1000 > base + (1 << 16):
                base = sent
                chunk = make_descs(base, 1 << 16)
            k = int(rng.integers(1, 1000))
            if n:
                k = min(k, n - sent)
            if k < 8 or rng.random() < 0.05:  # exercise push() of single tuples too
                k = min(k, 16)
                for d in chunk[sent - base : sent - base + k].tolist():
                    if not cli.push(d, timeout=10.0):
                        raise SystemExit("push timed out")
                sent += k
            else:
                got = cli.push_many(chunk[sent - base : sent - base + k], timeout=10.0)
                if got < k:
                    raise SystemExit("push_many timed out")
                sent += got
            cli.pop_many()  # drain acknowledgements
        print(json.dumps({"sent": sent}), flush=True)


def _consumer(path: str) -> None:
    with Ring.attach(path, role="server") as srv:
        recv = 0
        while True:
            if srv.wait(timeout=10.0):
                got = srv.pop_many()
                check_descs(got, recv)
                recv += len(got)
                srv.push((recv - 1, 0, recv))


def _idle(path: str, seconds: float) -> None:
    import resource

    with Ring.attach(path, role="server") as srv:
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t = time.monotonic()
        got = srv.wait(timeout=seconds)
        wall = time.monotonic() - t
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    print(json.dumps({"got": got, "wall": wall, "cpu": cpu}), flush=True)


if __name__ == "__main__":
    _impl, mode, *args = sys.argv[1:]
    Ring = RINGS[_impl]  # noqa: F811  (this process's ring class: the one its test runs)
    if mode == "producer":
        _producer(args[0], int(args[1]))
    elif mode == "consumer":
        _consumer(args[0])
    elif mode == "idle":
        _idle(args[0], float(args[1]))
    else:
        raise SystemExit(f"unknown mode {mode}")


def test_arm_and_doorbell_fd(pair) -> None:
    """A consumer that sleeps elsewhere: arm(), and the producer's push writes the doorbell fd once."""
    srv, cli = pair
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        cli.set_doorbell(w)
        assert srv.arm() == 0
        assert cli.push((Op.COPY, 1, 2, 3, 4))
        assert os.read(r, 16) == b"\0"
        assert cli.push((Op.COPY, 2))  # the push cleared the word: no second byte
        with pytest.raises(BlockingIOError):
            os.read(r, 16)
        assert srv.arm() == 2  # armed with work waiting: the caller must not sleep
        srv.disarm()
        assert len(srv.pop_many()) == 2
        assert cli.push_many(np.zeros(3, cli.out_dtype)) == 3
        with pytest.raises(BlockingIOError):
            os.read(r, 16)  # disarmed: pushes do not ring
        srv.pop_many()
        srv.arm()
        assert cli.push_many(np.zeros(3, cli.out_dtype)) == 3
        assert os.read(r, 16) == b"\0"  # one byte for the whole batch
    finally:
        os.close(r)
        os.close(w)


def test_a_wait_that_only_spins_leaves_an_armed_word_alone(pair) -> None:
    """An event-loop client's waiter spins on the queue (wait with spin == timeout) while its
    reaper task sleeps on the doorbell, armed: the spin must not clear that arming on its way
    out, or the producer's next push rings nobody and the reaper sleeps forever."""
    srv, cli = pair
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        cli.set_doorbell(w)
        assert srv.arm() == 0  # the reaper, about to sleep on r
        assert srv.wait(timeout=200e-6, spin=200e-6) == 0  # the waiter's spin: nothing came
        assert srv.wait(timeout=0) == 0  # a poll is a spin too
        assert cli.push((Op.COPY, 1))
        assert os.read(r, 16) == b"\0"  # still armed: the push rang the reaper
    finally:
        os.close(r)
        os.close(w)


def test_push_many_rings_the_doorbell_before_waiting_for_space(pair) -> None:
    """A consumer that sleeps on the doorbell fd drains a batch larger than the ring."""
    import select
    import threading

    srv, cli = pair
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    got: list[int] = []

    def consumer() -> None:
        while sum(got) < 20:
            if srv.arm() == 0:
                select.select([r], [], [], 30.0)  # only the doorbell wakes it
                try:
                    os.read(r, 64)
                except BlockingIOError:
                    pass
            srv.disarm()
            got.append(len(srv.pop_many()))

    try:
        cli.set_doorbell(w)
        t = threading.Thread(target=consumer, daemon=True)
        t.start()
        descs = np.zeros(20, cli.out_dtype)  # the request queue holds 8
        assert cli.push_many(descs, timeout=5.0) == 20
        t.join(10)
        assert sum(got) == 20
    finally:
        os.close(r)
        os.close(w)


# --- the client's submission: pack, publish and note requests (RingLink.push) ----------------
_U64 = st.integers(0, 2**64 - 1)
_u64_array = st.lists(_U64, min_size=1, max_size=12).flatmap(
    lambda xs: st.sampled_from([np.array(xs, np.uint64), np.array(xs + xs, np.uint64)[::2]]))  # contiguous or strided


@st.composite
def _requests(draw: st.DrawFn) -> list[P.Request]:
    """A call's worth of ring-able requests, ids in order, with vector operands scalar or arrays."""
    out: list[P.Request] = []
    for rid in range(1, draw(st.integers(1, 8)) + 1):
        stream = draw(st.integers(0, 2**32 - 1))
        kind = draw(st.sampled_from(["copy", "fill", "checksum", "fence", "graph", "copyv", "checksumv", "wait"]))
        if kind == "copy":
            out.append(P.Copy(rid, draw(_U64), draw(_U64), draw(_U64), stream))
        elif kind == "fill":
            out.append(P.Fill(rid, draw(_U64), draw(_U64), draw(st.integers(0, 255)), stream))
        elif kind == "checksum":
            out.append(P.Checksum(rid, draw(_U64), draw(_U64), stream))
        elif kind == "fence":
            out.append(P.Fence(rid, stream))
        elif kind == "graph":
            out.append(P.RunGraph(rid, draw(_U64), [draw(_U64)], [draw(_U64)], False, stream))
        elif kind == "wait":
            out.append(P.Wait(rid))
        else:
            nb = draw(_u64_array)
            k = len(nb)
            src = draw(st.lists(_U64, min_size=k, max_size=k).map(lambda xs: np.array(xs, np.uint64)))
            if kind == "copyv":  # plain, or verified (FLAG_SUM on every piece)
                out.append(P.CopyV(rid, draw(st.one_of(st.just(np.arange(k, dtype=np.uint64)), st.just(np.full(k, 7, np.uint64)))), src, nb, stream,
                                   draw(st.booleans())))
            else:
                out.append(P.ChecksumV(rid, src, nb, stream))
    return out


class _Sums:
    def __init__(self, chain: bool = False) -> None:
        self.chain = chain


@given(_requests(), st.integers(0, 48), st.sampled_from([0, 1, 2**64 - 1]), st.booleans())
def test_push_requests_native_matches_python(reqs: list[P.Request], room: int, after: int, corrupt: bool) -> None:
    """The native submission (`Queue.push_requests`) and its pure-Python twin publish the same
    descriptors, take the same whole requests within the room, note the same outstanding
    entries, and both refuse a field a descriptor cannot hold, publishing nothing."""
    if corrupt:  # a field out of range (the client's prepare refuses these first; the ring must too)
        i = len(reqs) // 2
        r = reqs[i]
        reqs[i] = P.Copy(r.id, -1, 0, 0, 0) if type(r) is not P.Fence else P.Fence(r.id, 2**32)
    results = []
    marks = {r.id: object() for r in reqs}  # what each pending entry is: the same for both
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        for push in ("native", "python"):
            srv = Ring.create(Path(d) / push, 64, 64)
            cli = Ring.attach(Path(d) / push)
            try:
                pending = dict(marks)
                outstanding: dict[int, Any] = {}
                args = (reqs, 0, _KINDS, room, after, pending, outstanding, _Sums)
                try:
                    got = cli.outbox.push_requests(*args) if push == "native" else _py_push_requests(cli.outbox, *args)
                except (OverflowError, TypeError, ValueError, struct.error):
                    got = None
                descs = srv.pop_many().tobytes()
                results.append((got, descs, {k: (v[0], type(v[1]), v[1] if type(v[1]) is bool else v[1].chain, v[2]) for k, v in outstanding.items()}))
            finally:
                cli.close()
                srv.close()
    assert results[0] == results[1]
    got, descs, noted = results[0]
    if got is None:  # refused: nothing published, nothing noted
        assert corrupt and descs == b"" and not noted
        return
    taken, used, published = got
    want = sum(descriptors_of(r) for r in reqs[:taken])
    assert used == published == want <= room and len(descs) == 64 * used
    if taken < len(reqs):  # it stopped at the first request that did not fit
        assert want + descriptors_of(reqs[taken]) > room
    d = np.frombuffer(descs, REQUEST_DTYPE)
    if used:
        assert bool(d["flags"][0] & FLAG_AFTER) == bool(after) and (not after or int(d["arg2"][0]) == after)
    assert set(noted) == {r.id for r in reqs[:taken] if type(r) is not P.Wait}
    at = 0
    for r in reqs[:taken]:  # a verified copy_many: FLAG_SUM on each of its pieces, noted as a chain of sums
        k = descriptors_of(r)
        if type(r) is P.CopyV:
            assert ((d["flags"][at : at + k] & FLAG_SUM) != 0).tolist() == [r.sums] * k
            assert noted[r.id][1:3] == ((_Sums, True) if r.sums else (bool, False))
        at += k


@given(_requests(), st.integers(-1, 10), st.integers(0, 16), st.booleans(), st.integers(1, 8))
def test_fitting_is_the_longest_prefix_that_takes_the_ring_within_its_room(
        reqs: list[P.Request], room: int, in_flight: int, graphs: bool, chain: int) -> None:
    """`RingLink.fitting` (what an event-loop client pushes of its held requests) is the
    longest run from the first request that all take the ring (`takes`) and whose
    descriptors (`descriptors_of`) fit in the room together: the rule it inlines for
    plain requests is the same one."""
    if chain < 8:  # a request the ring does not take, somewhere
        reqs.insert(chain % (len(reqs) + 1), P.Ping(99))
    link = RingLink.__new__(RingLink)  # (only its credits and limits: no ring needed)
    link.sub = PySubmission({}, Pending, lambda *a: None)
    link.sub.credits, link.in_flight, link.graphs = room + in_flight, in_flight, graphs
    link.longest = {P.CopyV: chain, P.ChecksumV: room + in_flight}
    used, want = 0, 0
    for r in reqs:
        if not link.takes(r) or used + descriptors_of(r) > room:
            break
        used += descriptors_of(r)
        want += 1
    assert link.fitting(reqs) == want
    assert link.fitting(deque(reqs)) == want  # (what the client passes: its held deque)


class _Finished:
    """A pending request that records how it was finished."""

    log: list[tuple[int, Any, Any]] = []

    def __init__(self, rid: int) -> None:
        self.rid = rid

    def _finish(self, value: Any, error: Any) -> None:
        self.log.append((self.rid, value, error))


_completion = st.tuples(st.integers(1, 6), st.sampled_from([0, 0, 0, -3, 5]), _U64, st.integers(0, 3))


@given(st.data(), st.dictionaries(st.integers(1, 6), st.tuples(st.sampled_from([True, False, "sums"]), st.integers(1, 4))),
       st.sets(st.integers(1, 6)), st.booleans())
def test_pop_finished_native_matches_python(data: st.DataObject, noted: dict[int, tuple[Any, int]], gone: set[int], gather: bool) -> None:
    """The native reap (`Queue.pop_finished`) and its pure-Python twin finish the same lone
    successes and (given `array`) the same whole gathered answers, in the same order, with
    the same values, free the same descriptors, and hand back the same runs for everything
    else (failures, part of an answer, ids not outstanding)."""
    from transfer.ring import Sums as Gather  # (the real one: it gathers values)
    from transfer.ring._client import _new_words

    # Completions come in runs of one id (a checksum_many's, a verified copy_many's ranges),
    # often exactly as long as the request noted under that id answers.
    comps = []
    for rid, status, result, flags in data.draw(st.lists(_completion, max_size=12)):
        n = noted[rid][1] if rid in noted and data.draw(st.booleans()) else data.draw(st.integers(1, 4))
        comps += [(rid, status, (result + j) % (1 << 64), flags) for j in range(n)]
    results = []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        for impl in ("native", "python"):
            srv = Ring.create(Path(d) / impl, 64, 64)
            cli = Ring.attach(Path(d) / impl)
            try:
                arr = np.zeros(len(comps), COMPLETION_DTYPE)
                for i, (rid, status, result, flags) in enumerate(comps):
                    arr[i] = (rid, status, result, flags, 0)
                assert srv.push_many(arr) == len(comps)
                outstanding: dict[int, Any] = {rid: (_Finished(rid), Gather() if a == "sums" else a, k) for rid, (a, k) in noted.items()}
                pending: dict[int, Any] = {rid: e[0] for rid, e in outstanding.items() if rid not in gone}
                _Finished.log = []
                args = (outstanding, pending, _new_words if gather else None)
                total, freed, rest = cli.inbox.pop_finished(*args) if impl == "native" else _py_pop_finished(cli.inbox, *args)
                log = [(rid, v.tolist() if isinstance(v, np.ndarray) else v, e) for rid, v, e in _Finished.log]
                results.append((total, freed, rest, log, sorted(outstanding), sorted(pending)))
            finally:
                cli.close()
                srv.close()
    assert results[0] == results[1]
    total, freed, rest, log, left, _ = results[0]
    assert total == len(comps) and sum(run[5] for run in rest) + sum(noted[rid][1] if noted[rid][0] == "sums" else 1 for rid, _, _ in log) == total
    at = 0
    for rid, value, error in log:  # each finished once, as a success, with its value if it answers one
        assert error is None and rid not in left
        answers, took = noted[rid]
        if answers == "sums":  # the whole answer, from one run of its completions in a row
            assert gather and value == [c[2] for c in comps[at : at + took]] and all(c[0] == rid and c[1] == 0 for c in comps[at : at + took])
            at += took
        else:
            assert answers in (True, False) and (value is None) == (answers is False)
            at += 1
    assert freed == sum(noted[rid][1] for rid, _, _ in log)


def test_pop_finished_array_must_give_room_for_the_answer() -> None:
    """A whole gathered answer is finished into array(n) only when that gives n writable
    words: anything else is an error, not a short or silent answer; without `array`, the
    run goes back to the caller's general path."""
    from transfer.ring import Sums as Gather

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        cases = ((None, "rest"), (lambda n: np.empty(n + 1, np.uint64), ValueError),  # too long
                 (lambda n: np.empty(n, np.uint64)[::-1], ValueError), (lambda n: bytes(8 * n), BufferError))  # strided, read-only
        for k, (array, want) in enumerate(cases):
            srv = Ring.create(Path(d) / str(k), 64, 64)
            cli = Ring.attach(Path(d) / str(k))
            try:
                arr = np.zeros(3, COMPLETION_DTYPE)
                for i in range(3):
                    arr[i] = (7, 0, 100 + i, 0, 0)
                assert srv.push_many(arr) == 3
                p = _Finished(7)
                _Finished.log = []
                outstanding: dict[int, Any] = {7: (p, Gather(True), 3)}
                if want == "rest":
                    total, freed, rest = cli.inbox.pop_finished(outstanding, {7: p}, array)
                    assert (total, freed, [r[5] for r in rest], _Finished.log) == (3, 0, [3], []) and 7 in outstanding
                else:
                    with pytest.raises(want):
                        cli.inbox.pop_finished(outstanding, {7: p}, array)
                    assert _Finished.log == [] and 7 in outstanding  # nothing finished with a bad answer
            finally:
                cli.close()
                srv.close()


# --- checksum64: the extension's sum and NumPy's ---------------------------------------------
@given(st.binary(max_size=4200), st.integers(0, 15), st.sampled_from(["bytes", "u8", "u4", "strided"]))
def test_checksum64_native_matches_numpy(raw: bytes, skip: int, form: str) -> None:
    """`checksum64` (native where built) gives NumPy's value for any length, any start
    offset (unaligned words), any buffer kind, a strided array's bytes in C order too; and
    a long buffer, summed without the GIL, the same."""
    from oracles.arith import checksum64 as _py_checksum64
    from transfer._checksum import checksum64

    data: bytes | np.ndarray = raw[skip:]
    if form == "u8":
        data = np.frombuffer(raw, np.uint8)[skip:]
    elif form == "u4":
        data = np.frombuffer(raw[: len(raw) // 4 * 4], np.uint32)
    elif form == "strided":
        data = np.frombuffer(raw, np.uint8)[skip::3]
    in_order = data if isinstance(data, bytes) else np.ascontiguousarray(data).tobytes()
    assert checksum64(data) == _py_checksum64(data) == _py_checksum64(in_order)
    big = np.frombuffer(raw * (70_000 // max(1, len(raw)) + 1), np.uint8)[skip:]
    assert checksum64(big) == _py_checksum64(big)


# --- the client's reap: a checksum_many's completions gathered per id ---------------------------
class _Inbox:
    """Completions as `Queue.pop_runs` hands them over, one reap's worth at a time."""

    def __init__(self, reaps: list[list[tuple[int, int, int, int, int]]]) -> None:
        self.reaps = reaps

    def pop_runs(self, key: int, value: int, clean: int) -> list[tuple[object, ...]]:
            return group_runs(self.reaps.pop(0) if self.reaps else [], key, value, clean)


@given(st.data())
def test_reap_matches_completion_by_completion(data: st.DataObject) -> None:
    """`RingLink.reap` takes a run of one id's completions at once (`pop_runs`); what it finishes,
    with what, and the credits it gives back are what taking them one by one gives, however
    the completions interleave (a hostile daemon), split across reaps, fail, or come in surplus."""
    from transfer import errors as E
    from transfer.ring import RingLink, Sums as _Sums

    kinds = data.draw(st.lists(st.one_of(st.just(0), st.integers(1, 6)), min_size=1, max_size=5))  # 0: a checksum; k: k ranges
    # A verified copy_many's k ranges (a chain of sums): its first failure ends it and frees the rest.
    chains = [k > 0 and data.draw(st.booleans()) for k in kinds]
    comps = []
    for rid, k in enumerate(kinds, 1):
        for j in range(max(k, 1) + data.draw(st.integers(0, 1))):  # sometimes one completion too many
            status = data.draw(st.sampled_from([0, 0, 0, 404]))
            comps.append((rid, status, rid * 100 + j, data.draw(st.sampled_from([0, 1])) if status else 0, 0))
    comps = data.draw(st.permutations(comps)) if data.draw(st.booleans()) else comps
    cuts = sorted(data.draw(st.lists(st.integers(0, len(comps)), max_size=3)))
    reaps = [comps[a:b] for a, b in zip([0, *cuts], [*cuts, len(comps)])]

    def fresh() -> tuple[RingLink, dict[int, Pending]]:
        link = object.__new__(RingLink)
        link.outstanding, link.early = {}, {}
        pending = {rid: Pending(rid, lambda *a: None) for rid in range(1, len(kinds) + 1)}
        link.sub = PySubmission(pending, Pending, lambda *a: None)
        for rid, k in enumerate(kinds, 1):
            link.outstanding[rid] = (pending[rid], _Sums(chains[rid - 1]) if k else True, max(k, 1))
        link.in_flight = sum(max(k, 1) for k in kinds)
        return link, pending

    link, pending = fresh()
    made = dict(pending)  # (reap takes the finished ones out of `pending`)
    link._inbox = _Inbox([list(r) for r in reaps])
    # (The pure-Python reap over the scripted runs: the native one is held to it above.)
    link._pop_finished = functools.partial(_py_pop_finished, link._inbox)
    unobserved: list[Pending] = []
    assert sum(link.reap(pending, unobserved) for _ in reaps) == len(comps)

    # The model: one completion at a time, as the daemon's order gives them.
    want_in_flight = sum(max(k, 1) for k in kinds)
    got: dict[int, list[int]] = {}
    done: dict[int, tuple[object, int, int]] = {}
    for rid, status, result, flags, _ in comps:
        k = kinds[rid - 1]
        if rid in done:
            continue  # late: nothing outstanding under that id
        if chains[rid - 1] and status:
            want_in_flight -= k - len(got.get(rid, []))
            done[rid] = (None, status, flags)
            continue
        want_in_flight -= 1
        if not k:
            done[rid] = (result, status, flags)
            continue
        got.setdefault(rid, []).append((result, status, flags))
        if len(got[rid]) == k:
            first = next(((s, f) for _, s, f in got[rid] if s), (0, 0))
            done[rid] = ([r for r, _, _ in got[rid]], *first)
    assert link.in_flight == want_in_flight
    for rid in range(1, len(kinds) + 1):
        p = made[rid]
        if rid not in done:
            assert rid in link.outstanding and not p._done
            continue
        assert rid not in link.outstanding
        value, status, flags = done[rid]
        if status and flags:  # the full error follows on the socket: it stays pending for it
            assert not p._done and rid in pending
        elif status:
            assert p._done and isinstance(p._error, E.TransferError) and p in unobserved
        else:
            assert p._done and p._error is None
            if kinds[rid - 1]:
                assert p._value.dtype == np.uint64 and p._value.tolist() == value
            else:
                assert p._value == value


@pytest.mark.parametrize("chain", [False, True])
def test_a_socket_error_ahead_of_its_completions_frees_exactly_their_credits(chain: bool) -> None:
    """A failed checksum_many's or verified copy_many's error may arrive on the socket before
    its completions: the credits they hold come back as those completions arrive, however
    many the daemon sends (a checksum_many, one per range it still owed; a verified copy_many,
    one for the whole chain), and no more."""
    from transfer.ring import RingLink, Sums as _Sums

    link = object.__new__(RingLink)
    link.outstanding, link.early = {}, {}
    link.sub = PySubmission({}, Pending, lambda *a: None)
    p = Pending(1, lambda *a: None)
    sums = _Sums(chain)
    sums.values.append(5)  # one range already answered
    link.outstanding[1] = (p, sums, 4)
    link.in_flight = 3
    link.answered_early(1)
    comps = [(1, 404, 0, 1, 0)] if chain else [(1, 0, 6, 0, 0), (1, 404, 0, 1, 0), (1, 0, 7, 0, 0)]
    link._inbox = _Inbox([comps])
    link._pop_finished = functools.partial(_py_pop_finished, link._inbox)
    assert link.reap({}, []) == len(comps)
    assert link.in_flight == 0 and not link.early


def test_a_layout_drift_between_python_and_the_extension_fails_the_import() -> None:
    """transfer/ring/_layout.py and native/layout.h declare the ring's layout; the import
    compares what the extension was built with against the Python declarations, and any
    difference (a field moved, an opcode renumbered, a flag or a kind) names itself."""
    from transfer import _native
    from transfer.ring import _layout

    built = _native.layout()
    _layout.check_native(built)  # as built: the same
    for key, value in (("desc.nbytes", 40), ("op.FENCE", 9), ("FLAG_SUM", 8), ("kind.COPYV", 2), ("desc_size", 72)):
        with pytest.raises(ImportError, match=re.escape(key)):
            _layout.check_native({**built, key: value})
    with pytest.raises(ImportError, match="kind.EXTRA"):
        _layout.check_native({**built, "kind.EXTRA": 8})
