"""Hostile clients: none can take the daemon down, exhaust it, or act in another's name.

Each test runs a real transferd and real client processes or sockets, and
names the item of the issue it proves (docs/security.md lists them).
"""

from __future__ import annotations

import os
import socket as pysocket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

import transfer
from transfer import protocol as P

BIG = P.Limits(max_frame_bytes=1 << 30, max_batch=1 << 24)


def raw(endpoint: str, routing_id: bytes | None = None, timeout_ms: int = 5000) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, timeout_ms)
    if routing_id is not None:
        s.setsockopt(zmq.ROUTING_ID, routing_id)
    s.connect(endpoint)
    return s


def call(s: zmq.Socket, *reqs: P.Request) -> list[P.Reply]:
    """Send one frame, collect the replies to every request in it (in any number of frames)."""
    s.send(P.encode_requests(reqs))
    want = {r.id for r in reqs}
    out: dict[int, P.Reply] = {}
    while want - out.keys():
        for r in P.decode_replies(s.recv(), BIG):
            out[r.id] = r
    return [out[r.id] for r in reqs]


def ok(reply: P.Reply) -> object:
    assert reply.error is None, reply.error
    return reply.result


def hello(s: zmq.Socket, name: str = "raw", pid: int = 0) -> dict:
    (r,) = call(s, P.Hello(1, P.VERSION, name, pid, b""))
    return ok(r)  # type: ignore[return-value]


# --- 2: a guest's Unregister/Free detaches it; the owner's memory and quota stay ----------------
def test_guest_free_detaches_and_leaves_the_owner_alone(daemon_factory) -> None:
    d = daemon_factory("--max-host-bytes-per-session", "64KiB", "--max-device-bytes-per-session", "64KiB")
    with transfer.connect(d.endpoint) as owner, transfer.connect(d.endpoint) as guest:
        seg = owner.segment(64 << 10)
        buf = owner.alloc(64 << 10)
        owner.fill(buf, 64 << 10, 7).result()
        shared_seg = guest.attach(owner.share(seg))
        shared_buf = guest.attach(owner.share(buf))
        guest.fill(shared_seg, 16, 1).result()  # the guest may use it while attached
        # The guest "frees" the owner's segment and buffer: it only detaches.
        guest._call(P.Unregister, shared_seg.va)
        guest._call(P.Free, shared_buf.va)
        with pytest.raises(transfer.NotOwner):
            guest.fill(shared_seg, 16, 2).result()
        with pytest.raises(transfer.NotOwner):
            guest.checksum(shared_buf, 16).result()
        # The owner's memory still works...
        owner.fill(seg, 64 << 10, 5).result()
        assert (seg.buffer == 5).all()
        assert owner.checksum(buf).result() == transfer.checksum64(np.full(64 << 10, 7, np.uint8))
        # ...and its quota accounting is unchanged: it is still full for the owner,
        with pytest.raises(transfer.QuotaExceeded):
            owner.segment(4096)
        # and the guest gained no credit from "freeing" what was never its own.
        guest.segment(64 << 10)
        with pytest.raises(transfer.QuotaExceeded):
            guest.segment(4096)
        assert owner.stats()["daemon"]["segments"] == 3


# --- 7: a session's identity comes from the transport, never from the client's routing id --------
def test_ipc_client_cannot_forge_a_curve_identity(daemon_factory, tmp_path: Path) -> None:
    from transfer.cli._keys import keygen

    keys = tmp_path / "curve"
    keygen(keys, ["good"])
    with pysocket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tcp = f"tcp://127.0.0.1:{port}"
    d = daemon_factory("--endpoint", tcp, "--curve-dir", str(keys))
    with transfer.connect(tcp, server_key=str(keys / "server.key"), client_keys=str(keys / "clients" / "good.key_secret")) as remote:
        rseg = remote.alloc(4096)
        remote.fill(rseg, 4096, 3).result()
        victim = raw(d.endpoint, routing_id=b"victim")
        hello(victim, "victim")
        (r,) = call(victim, P.Alloc(2, 4096, -1))
        vva = ok(r)["va"]  # type: ignore[index]
        # A local client whose routing id looks like the CURVE socket's prefix, and one
        # that is the CURVE prefix plus the victim's routing id.
        for rid in (b"\x01forged", b"\x01victim"):
            s = raw(d.endpoint, routing_id=rid)
            # It has no session: it cannot reach the victim's (or the remote client's).
            (r,) = call(s, P.Fill(5, vva, 16, 1))
            assert r.error is not None and r.error.code == transfer.NoSession.code
            hello(s, "forger")
            # It is a local session: it may open a ring (CURVE sessions may not)...
            (r,) = call(s, P.OpenRing(2, 64))
            assert ok(r)["capacity"] >= 64  # type: ignore[index]
            # ...and it still cannot touch the victim's buffer.
            (r,) = call(s, P.Fill(3, vva, 16, 1))
            assert r.error is not None and r.error.code == transfer.NotOwner.code
            ok(call(s, P.Close(4))[0])
            s.close(0)
        # The CURVE session and the victim are unaffected; a CURVE session has no ring.
        assert remote.checksum(rseg).result() == transfer.checksum64(np.full(4096, 3, np.uint8))
        with pytest.raises(transfer.RingUnavailable):
            remote._call(P.OpenRing, 64)
        (r,) = call(victim, P.Checksum(6, vva, 16))
        assert ok(r) == transfer.checksum64(np.zeros(16, np.uint8))
        victim.close(0)


# --- 10: the documented limits are the ones a client meets ---------------------------------------
def test_too_many_requests_in_one_frame_is_batch_too_large(daemon_factory) -> None:
    d = daemon_factory("--max-frame-bytes", "16MiB", "--max-bin", "4MiB")
    s = raw(d.endpoint)
    hello(s)
    n = P.Limits().max_batch + 1
    s.send(P.encode_requests([P.Ping(i + 2) for i in range(n)]))
    replies = P.decode_replies(s.recv(), BIG)
    assert len(replies) == 1 and replies[0].error is not None
    assert replies[0].error.code == transfer.BatchTooLarge.code, replies[0].error
    ok(call(s, P.Ping(2))[0])  # the session still works
    s.close(0)


# --- 9: the daemon binds only in a directory that is private to its user ------------------------
def _transferd(*args: str, timeout: float = 20.0) -> tuple[int | None, str, str]:
    """Run transferd with --ready: (exit code or None if it came up and served, stdout, stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "transfer.cli.transferd", "--ready", "--backend", "numpy", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "ready", or "" when it exits
    if line:
        proc.terminate()
        out, err = proc.communicate(timeout=timeout)
        return None, line + out, err
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o755])
def test_socket_directory_others_can_reach_is_refused(tmp_path: Path, shm_dir: Path, mode: int) -> None:
    d = tmp_path / "sockdir"
    d.mkdir()
    os.chmod(d, mode)
    code, _, err = _transferd("--endpoint", f"ipc://{d}/d.sock", "--shm-dir", str(shm_dir))
    assert code == 1, err
    assert "refusing to bind" in err and str(d) in err and f"{mode:04o}" in err
    assert not (d / "d.sock").exists()


def test_socket_directory_of_another_user_is_refused(tmp_path: Path, shm_dir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory another user owns")
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    code, _, err = _transferd("--endpoint", f"ipc://{d}/d.sock", "--shm-dir", str(shm_dir))
    assert code == 1 and "belongs to uid 65534" in err, err


def test_socket_directory_the_daemon_creates_is_private(tmp_path: Path, shm_dir: Path) -> None:
    os.chmod(tmp_path, 0o700)
    d = tmp_path / "new" / "dir"
    old = os.umask(0)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "transfer.cli.transferd", "--ready", "--backend", "numpy", "--endpoint", f"ipc://{d}/d.sock", "--shm-dir", str(shm_dir)],
            stdout=subprocess.PIPE, text=True,
        )
    finally:
        os.umask(old)
    try:
        assert proc.stdout is not None and "ready" in proc.stdout.readline()
        assert (d.stat().st_mode & 0o777) == 0o700
    finally:
        proc.terminate()
        assert proc.wait(20) == 0


# --- 6: compute work is bounded by the memory that backs it, and long work leaves the loop -------
def filled(endpoint: str, nbytes: int, value: int) -> tuple[zmq.Socket, int]:
    """A raw session (ids 1-3 used) with a daemon buffer of `nbytes` bytes set to `value`."""
    s = raw(endpoint)
    hello(s)
    (r,) = call(s, P.Alloc(2, nbytes, -1))
    va = ok(r)["va"]  # type: ignore[index]
    (r,) = call(s, P.Fill(3, va, nbytes, value))
    ok(r)
    return s, va


def test_compute_extents_are_bounded_by_their_segment(daemon) -> None:
    s, va = filled(daemon.endpoint, 1 << 20, 5)

    def checksum(rid: int, shape: list[int], strides: list[int] | None) -> P.Reply:
        (r,) = call(s, P.Compute(rid, "checksum", [transfer.TensorRef(va, "uint8", tuple(shape), None if strides is None else tuple(strides))], [], {}))
        return r

    t0 = time.monotonic()
    # 2**33 elements over one byte (stride 0): refused at once, nothing runs on the loop.
    r = checksum(4, [1 << 33], [0])
    assert r.error is not None and r.error.code == transfer.InvalidField.code, r
    assert "more than its segment" in r.error.message
    # Dims whose product is absurd are refused by validation.
    r = checksum(5, [1 << 40, 1 << 40], [0, 0])
    assert r.error is not None and r.error.code == transfer.InvalidField.code, r
    r = checksum(6, [(1 << 20) + 1], [0])
    assert r.error is not None and r.error.code == transfer.InvalidField.code, r
    assert time.monotonic() - t0 < 1.0
    # Broadcasting within the segment's size is allowed (and counted as element work).
    r = checksum(7, [1 << 20], [0])
    assert ok(r) == transfer.checksum64(np.full(1 << 20, 5, np.uint8))
    r = checksum(8, [1 << 10, 1 << 10], [0, 1])
    assert ok(r) == transfer.checksum64(np.full(1 << 20, 5, np.uint8))
    s.close(0)


def test_checksum_vectors_from_a_raw_client_are_checked(daemon) -> None:
    """ChecksumV as a hostile client may send it: empty, a range past its segment's end, a
    segment that does not exist; each gets its answer or a clear error, and the daemon keeps
    serving."""
    s, va = filled(daemon.endpoint, 1 << 16, 7)
    u = lambda *xs: np.array(xs, np.uint64)  # noqa: E731
    empty, good, past, foreign = call(
        s,
        P.ChecksumV(4, u(), u()),
        P.ChecksumV(5, u(va, va + 100), u(100, 1 << 15)),
        P.ChecksumV(6, u(va, va + (1 << 16) - 8), u(8, 9)),  # the second range runs past the end
        P.ChecksumV(7, u(va, 0xABC << 40), u(8, 8)),  # a segment that does not exist
    )
    assert ok(empty) == b""
    want = [transfer.checksum64(np.full(100, 7, np.uint8)), transfer.checksum64(np.full(1 << 15, 7, np.uint8))]
    assert np.frombuffer(ok(good), "<u8").tolist() == want  # type: ignore[arg-type]
    assert past.error is not None and past.error.code == transfer.OutOfBounds.code, past
    assert foreign.error is not None and foreign.error.code == transfer.UnknownSegment.code, foreign
    (r,) = call(s, P.Checksum(8, va, 8))
    assert ok(r) == transfer.checksum64(np.full(8, 7, np.uint8))
    s.close(0)


# --- 3: hello/close cycles return every id; a refused hello leaves nothing behind ----------------
def test_hello_close_cycles_never_exhaust_segment_ids(daemon_factory) -> None:
    # Each hello reserves 4 Mi ids: the 16.7 Mi id space holds four sessions' arenas at once.
    d = daemon_factory("--arena-ids", str(1 << 22))
    t0 = time.monotonic()
    for i in range(24):
        s = raw(d.endpoint)
        for _ in range(200):  # a closed session's arenas go when its task ends, a moment after Close's reply
            (r,) = call(s, P.Hello(1, P.VERSION, f"cycle{i}", 0, b""))
            if r.error is None or r.error.code != transfer.QuotaExceeded.code:
                break
            time.sleep(0.01)
        ok(r)
        (r,) = call(s, P.Alloc(2, 4096, -1))
        ok(r)
        ok(call(s, P.Close(3))[0])
        s.close(0)
    assert time.monotonic() - t0 < 5.0  # an arena costs one table entry, not one per id
    with transfer.connect(d.endpoint) as c:
        c.fill(c.alloc(4096), 4096, 1).result()
        assert c.stats()["daemon"]["sessions"] == 1


def test_a_refused_hello_leaves_nothing_behind(daemon_factory) -> None:
    # Three devices of 4 Mi ids each: one session's arenas fit in the space, a second's do not.
    d = daemon_factory("--devices", "3", "--arena-ids", str(1 << 22))
    first = raw(d.endpoint)
    hello(first, "first")
    s = raw(d.endpoint)
    for attempt in range(3):
        (r,) = call(s, P.Hello(1, P.VERSION, "refused", os.getpid(), b""))
        assert r.error is not None and r.error.code == transfer.QuotaExceeded.code, r
        (r,) = call(s, P.Ping(2))
        assert r.error is not None and r.error.code == transfer.NoSession.code, r
    (r,) = call(first, P.Stats(2))
    assert ok(r)["daemon"]["sessions"] == 1  # type: ignore[index]
    ok(call(first, P.Close(3))[0])
    # The first session's ids come back (its task releases them just after the Close
    # reply), and the refused hellos took none: a new one fits.
    for _ in range(100):
        (r,) = call(s, P.Hello(1, P.VERSION, "now", 0, b""))
        if r.error is None or r.error.code != transfer.QuotaExceeded.code:
            break
        time.sleep(0.02)
    ok(r)
    (r,) = call(s, P.Stats(2))
    assert ok(r)["daemon"]["sessions"] == 1  # type: ignore[index]
    s.close(0)
    first.close(0)


# --- 8: shutdown answers every accepted request, or fails it with ShuttingDown -------------------
def test_shutdown_answers_every_request_even_past_its_grace(daemon_factory) -> None:
    import signal

    d = daemon_factory("--shutdown-grace", "0.3")
    s = raw(d.endpoint, timeout_ms=10000)
    hello(s)
    n = 32 << 20
    a, b = (ok(r)["va"] for r in call(s, P.Alloc(2, n, -1), P.Alloc(3, n, -1)))  # type: ignore[index]
    # 400 copies of 32 MiB onto the same buffer: one wave each, seconds of work in all.
    ids = list(range(10, 410))
    for k in range(0, len(ids), 100):
        s.send(P.encode_requests([P.Copy(i, a, b, n) for i in ids[k : k + 100]]))
    time.sleep(0.2)
    d.proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    s.send(P.encode_requests([P.Copy(1000, a, b, 16), P.Ping(1001)]))  # during the drain
    got: dict[int, P.Reply] = {}
    deadline = time.monotonic() + 20
    while len(got) < len(ids) + 2 and time.monotonic() < deadline:
        for r in P.decode_replies(s.recv(), BIG):
            got[r.id] = r
    assert set(got) == {*ids, 1000, 1001}, f"{len(ids) + 2 - len(got)} requests got no reply"
    codes = [None if r.error is None else r.error.code for r in got.values()]
    assert set(codes) <= {None, transfer.ShuttingDown.code}, set(codes)
    assert codes.count(None) >= 1 and codes.count(transfer.ShuttingDown.code) >= 2
    assert got[1000].error is not None and got[1000].error.code == transfer.ShuttingDown.code
    assert got[1001].error is not None and got[1001].error.code == transfer.ShuttingDown.code
    # Answered in order: what ran came first, then what the grace cut off.
    done = [i for i in ids if got[i].error is None]
    assert done == ids[: len(done)]
    assert d.proc.wait(20) == 0
    s.close(0)


# --- 4: connections and sessions are bounded by the fd limit; the daemon never aborts ------------
_HOLDER = """
import os, sys, zmq
from transfer import protocol as P
ep, idle, hellos = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ctx = zmq.Context(); ctx.set(zmq.MAX_SOCKETS, 4096)
socks = []
for i in range(idle):
    s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.connect(ep); socks.append(s)
codes = {}
for i in range(hellos):
    s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.setsockopt(zmq.RCVTIMEO, 5000); s.connect(ep); socks.append(s)
    s.send(P.encode_requests([P.Hello(1, P.VERSION, "h", os.getpid(), b"")]))
    try:
        (r,) = P.decode_replies(s.recv())
        k = "ok" if r.error is None else r.error.code
    except zmq.Again:
        k = "none"
    codes[k] = codes.get(k, 0) + 1
print(codes, flush=True)
sys.stdin.read()
"""


def test_idle_connections_and_hellos_cannot_exhaust_descriptors(tmp_path: Path, shm_dir: Path) -> None:
    import resource

    os.chmod(tmp_path, 0o700)
    ep = f"ipc://{tmp_path}/d.sock"

    def low_soft_limit() -> None:  # like a shell's default ulimit -n, with room under the hard limit
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 2048))

    log = open(tmp_path / "transferd.log", "w+")
    d = subprocess.Popen(
        [sys.executable, "-m", "transfer.cli.transferd", "--ready", "--backend", "numpy", "--endpoint", ep,
         "--shm-dir", str(shm_dir), "--log-level", "INFO", "--heartbeat", "5", "--session-timeout", "60", "--max-sessions", "100"],
        stdout=subprocess.PIPE, stderr=log, text=True, preexec_fn=low_soft_limit,
    )
    holders = []
    try:
        assert d.stdout is not None and "ready" in d.stdout.readline()
        # Four processes: 560 idle connections and 160 hellos that give a pid (a pidfd each),
        # within the connection cap (766 at this fd limit: see below).
        holders = [
            subprocess.Popen([sys.executable, "-c", _HOLDER, ep, "140", "40"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for _ in range(4)
        ]
        results = [h.stdout.readline() for h in holders]  # type: ignore[union-attr]
        assert d.poll() is None, (tmp_path / "transferd.log").read_text()[-2000:]
        counts = [eval(r) for r in results]  # {'ok': n, 302: m}: every hello answered
        assert sum(c.get("ok", 0) for c in counts) == 100, results
        assert sum(c.get(transfer.QuotaExceeded.code, 0) for c in counts) == 60, results  # the session limit
        # A good client is served, or refused clearly; the daemon is alive.
        try:
            with transfer.connect(ep, connect_timeout=5.0) as c:
                c.fill(c.alloc(4096), 4096, 1).result()
        except transfer.QuotaExceeded as exc:
            assert "session limit" in str(exc)
        assert d.poll() is None
    finally:
        for h in holders:
            h.stdin.close()  # type: ignore[union-attr]
            h.wait(20)
        d.terminate()
        code = d.wait(30)
        log.close()
    err = (tmp_path / "transferd.log").read_text()
    assert code == 0, err[-2000:]
    # Raised from 256 to the hard limit, and shared out (`_config.fd_budget`).
    assert "fd limit 2048: at most 100 sessions, 766 connections, 488 shared-memory segments, 222 uncollected memfds" in err


# --- 5: a client that never reads its replies: bounded backlog, then its session ends ----------
def test_a_client_that_never_reads_is_cut_off_and_memory_stays_bounded(daemon_factory) -> None:
    psutil = pytest.importorskip("psutil")
    d = daemon_factory("--max-reply-backlog", "1MiB")
    proc = psutil.Process(d.pid)
    with transfer.connect(d.endpoint) as good:
        seg = good.segment(4096)
        rss0 = proc.memory_info().rss
        s = raw(d.endpoint)
        s.setsockopt(zmq.RCVHWM, 1)  # it buffers almost nothing: the daemon's side fills
        hello(s, "never-reads")
        # 65,536-request frames of fences (each reply ~10 bytes, a frame's ~650 KiB), never read;
        # and frames of stats: a frame gets at most 16 answered.
        fences = P.encode_requests([P.Fence(i + 2) for i in range(60000)])
        stats = P.encode_requests([P.Stats(i + 2) for i in range(20000)])
        deadline = time.monotonic() + 20
        sent = 0
        while time.monotonic() < deadline and good.stats()["daemon"]["sessions"] > 1:
            s.send(fences if sent % 2 else stats)
            sent += 1
            assert good.checksum(seg.va, 4096).result(5) == transfer.checksum64(np.zeros(4096, np.uint8))
        assert good.stats()["daemon"]["sessions"] == 1, f"the non-reading session survived {sent} frames"
        grown = proc.memory_info().rss - rss0
        assert grown < 96 << 20, f"daemon RSS grew by {grown >> 20} MiB"
        assert proc.is_running() and good.copy(seg.va, seg.va + 64, 64).result(5) is None
        s.close()


def test_a_frame_of_stats_is_answered_a_bounded_number_of_times(daemon_factory) -> None:
    d = daemon_factory()
    s = raw(d.endpoint)
    hello(s)
    replies = call(s, *[P.Stats(i + 2) for i in range(100)])
    answered = [r for r in replies if r.error is None]
    refused = [r for r in replies if r.error is not None]
    assert len(answered) == 16 and all(type(r.error) is transfer.QuotaExceeded for r in refused)
    s.close()


# --- one frame never ends the daemon -------------------------------------------------------------
@pytest.mark.parametrize("pid", [P.PID_MAX + 1, 1 << 31, (1 << 32) - 1])
def test_a_hello_naming_an_impossible_pid_is_refused_and_the_daemon_serves_on(daemon, pid: int) -> None:
    """A pid beyond any the kernel hands out is refused by the codec (InvalidField naming the
    field), before any use: it once reached os.pidfd_open, whose OverflowError ended the daemon."""
    s = raw(daemon.endpoint)
    (r,) = call(s, P.Hello(1, P.VERSION, "pid", pid, b""))
    assert type(r.error) is transfer.InvalidField and "Hello.pid" in str(r.error), r
    s.close()
    s = raw(daemon.endpoint)
    hello(s, pid=P.PID_MAX)  # the largest possible pid is a pid: the session opens
    s.close()
    assert daemon.alive()
    with transfer.connect(daemon.endpoint) as c:
        c.fill(c.alloc(4096), 4096, 1).result()


def test_a_fault_in_one_session_task_ends_that_session_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every session's tasks run in the daemon's one nursery; an exception no check foresaw in
    one of them (here: the pid watcher's) ends that session, never the daemon. In-process, so
    the fault can be injected where no client could reach it."""
    import transfer.server._front as front

    real = os.pidfd_open
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)

    def broken(pid: int, *flags: int) -> int:
        if pid == other.pid:
            raise RuntimeError("injected")
        return real(pid, *flags)

    monkeypatch.setattr(front.os, "pidfd_open", broken)
    with transfer.serve_in_process(backend="numpy", shm_dir=tmp_path) as d:
        s = raw(d.endpoint)
        hello(s, "faulty", pid=other.pid)  # its pid watcher fails
        with transfer.connect(d.endpoint, name="bystander") as c:
            def sessions() -> int:
                return int(c.stats()["daemon"]["sessions"])
            deadline = time.monotonic() + 30
            while sessions() != 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert sessions() == 1  # the faulty session ended; this one serves on
            c.fill(c.alloc(4096), 4096, 1).result()
        s.close()
    other.communicate(b"")
