"""Nothing outlives its owners: client kill -9, daemon kill -9 and restart, SIGTERM, silence."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

import _workers
import transfer
from conftest import BRISK_TIMEOUT_S, draining, segment_files
from transfer import protocol as P
from transfer.testing import memfds, stop_process


def wait_until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_killed_client_is_reclaimed_and_others_unaffected(daemon, shm_dir: Path, tmp_path: Path) -> None:
    ready = str(tmp_path / "victim.pid")
    victim = mp.get_context("spawn").Process(target=_workers.streamer, args=(daemon.endpoint, ready))
    victim.start()
    with transfer.connect(daemon.endpoint) as survivor:
        seg = survivor.segment(1 << 20)
        seg.buffer[:] = 42
        buf = survivor.alloc(1 << 20)
        _workers.wait_for_file(ready)
        base = survivor.stats()["daemon"]["requests"]
        wait_until(lambda: survivor.stats()["daemon"]["requests"] >= base + 100, 30, "the victim to stream")
        assert survivor.stats()["daemon"]["sessions"] == 2
        os.kill(victim.pid, signal.SIGKILL)
        victim.join()
        # The survivor keeps working while the daemon reclaims the victim (pidfd: promptly).
        for _ in range(50):
            survivor.copy(buf, seg).result()
        wait_until(lambda: survivor.stats()["daemon"]["sessions"] == 1, 5, "victim's session to end")
        st = survivor.stats()["daemon"]
        assert st["segments"] == 2  # only the survivor's segment and buffer remain
        assert st["device_bytes"] == 1 << 20
        assert survivor.checksum(buf).result() == transfer.checksum64(seg.buffer)
    assert segment_files(shm_dir) == []


def test_killed_daemon_fails_a_blocked_client_promptly(daemon) -> None:
    c = transfer.connect(daemon.endpoint)
    seg = c.segment(1 << 20)
    stop_process(daemon.pid)  # every thread: the request below can only block
    pending = c.checksum(seg)
    threading.Timer(0.3, lambda: os.kill(daemon.pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(transfer.ConnectionLost, match="exited"):
        pending.result()
    assert time.monotonic() - t0 < 3
    with pytest.raises(transfer.ConnectionLost):
        c.copy(seg, seg)  # the client stays failed, clearly
    c.close()
    daemon.proc.wait()


def test_silent_daemon_times_out_without_pid_watch(daemon_factory) -> None:
    """Over tcp the client cannot watch the daemon's pid: heartbeats bound the wait."""
    d = daemon_factory()
    with transfer.connect(d.endpoint, liveness_timeout=1.0, watch_daemon_pid=False) as c:
        seg = c.segment(4096)
        stop_process(d.pid)
        try:
            t0 = time.monotonic()
            with pytest.raises(transfer.ConnectionLost, match="not answered"):
                c.checksum(seg).result()
            assert time.monotonic() - t0 < 4
        finally:
            os.kill(d.pid, signal.SIGCONT)


def test_daemon_kill_and_restart_leaves_nothing(daemon, shm_dir: Path) -> None:
    # A peer that registers but never collects its segments' memfds: only the daemon
    # holds that memory when it dies.
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon.endpoint)
    s.send(P.encode_requests([P.Hello(1, P.VERSION, "raw", 0, b""), P.RegisterHost(2, 1 << 20), P.RegisterHost(3, 1 << 20)]))
    got = []
    while len(got) < 3:
        got += P.decode_replies(s.recv())
    assert all(r.error is None for r in got)
    assert segment_files(shm_dir) == []  # memfds: no files, ever
    held = set(memfds(daemon.pid))
    assert len(held) == 2  # held by the daemon alone
    s.close(0)
    daemon.kill()
    assert not held & set(memfds())  # the memory died with its only holder (nothing here maps it)
    daemon.restart()
    assert segment_files(shm_dir) == []
    names = os.listdir(shm_dir)
    assert len([n for n in names if n.endswith(".lock")]) == 1  # the dead one's lock...
    assert len([n for n in names if ".fds." in n]) == 1  # ...and its fd socket were swept
    with transfer.connect(daemon.endpoint) as c:
        assert c.checksum(c.segment(4096)).result() == transfer.checksum64(np.zeros(4096, np.uint8))


def test_killed_client_leaves_no_memory_anywhere(daemon, shm_dir: Path, tmp_path: Path) -> None:
    """kill -9 a client holding segments and a ring: the daemon lets go, and the memory is gone."""
    ready = str(tmp_path / "victim.pid")
    victim = mp.get_context("spawn").Process(target=_workers.streamer, args=(daemon.endpoint, ready))
    victim.start()
    with transfer.connect(daemon.endpoint, ring=True) as survivor:
        seg = survivor.segment(1 << 16)
        mine = set(memfds())
        _workers.wait_for_file(ready)
        held = set(memfds(daemon.pid))
        assert len(held - mine) >= 3  # the victim's three segments
        os.kill(victim.pid, signal.SIGKILL)
        victim.join()
        wait_until(lambda: survivor.stats()["daemon"]["sessions"] == 1, 5, "victim's session to end")
        wait_until(lambda: set(memfds(daemon.pid)) <= mine, 5, "the daemon to let go of the victim's memory")
        assert survivor.checksum(seg).result() == transfer.checksum64(bytes(1 << 16))
    wait_until(lambda: segment_files(shm_dir) == [], 5, "the sessions' files to go")


def test_restarted_daemon_does_not_know_old_sessions(daemon) -> None:
    c = transfer.connect(daemon.endpoint, connect_timeout=5)
    seg = c.segment(4096)
    daemon.restart()
    t0 = time.monotonic()
    # The old daemon's exit (its pid watched) or the new one's answer: never NoSession.
    with pytest.raises((transfer.SessionClosed, transfer.ConnectionLost)) as info:
        c.checksum(seg).result(timeout=10)
    assert not isinstance(info.value, transfer.NoSession)
    assert time.monotonic() - t0 < 10
    c.close()


def _streaming_client(daemon) -> tuple:  # type: ignore[no-untyped-def]
    """A client with a 256 MiB segment (every page written) and a device buffer its size,
    already defined: the copies a test sends next are on the ring, published before any signal."""
    c = transfer.connect(daemon.endpoint)
    n = 256 << 20
    seg = c.segment(n)
    buf = c.alloc(n)
    seg.buffer[::4096] = 1
    c.copy(buf, seg, 4096).result()
    return c, seg, buf


def test_sigterm_finishes_in_flight_work_then_exits_zero(daemon_factory, shm_dir: Path) -> None:
    """What was sent before SIGTERM is done, and the daemon exits 0 as soon as it is: not when
    its grace (here 60 s, past the wait below) runs out, as it did when the last answers came
    from a pass the session's idle task did not hear of."""
    daemon = daemon_factory("--shutdown-grace", "60")
    c, seg, buf = _streaming_client(daemon)
    pend = [c.copy(buf, seg) for _ in range(4)]  # a second or so of memcpy
    cks = c.checksum(buf)
    daemon.proc.send_signal(signal.SIGTERM)  # (whenever it lands, what was sent before it is done)
    for p in pend:
        assert p.result(timeout=30) is None
    assert cks.result(timeout=30) == transfer.checksum64(seg.buffer)
    assert daemon.proc.wait(30) == 0
    assert segment_files(shm_dir) == []
    assert not Path(daemon.endpoint[len("ipc://") :]).exists()
    c.close()


def test_a_second_sigterm_during_the_drain_changes_nothing(daemon, shm_dir: Path) -> None:
    """An impatient operator's second SIGTERM (or SIGINT) while the daemon drains: the drain
    and the cleanup go on, and it exits 0 with nothing left behind (trio's receiver used to
    re-deliver it into the default action once it closed, before the cleanup)."""
    c, seg, buf = _streaming_client(daemon)
    pend = [c.copy(buf, seg) for _ in range(8)]  # 2 GiB of memcpy: the drain takes a while
    daemon.proc.send_signal(signal.SIGTERM)
    draining(daemon.endpoint)  # (a new hello is refused: the drain has begun)
    daemon.proc.send_signal(signal.SIGTERM)
    daemon.proc.send_signal(signal.SIGINT)
    for p in pend:
        assert p.result(timeout=30) is None
    assert daemon.proc.wait(30) == 0
    assert segment_files(shm_dir) == []
    assert not Path(daemon.endpoint[len("ipc://") :]).exists()
    c.close()


def test_silent_session_is_reclaimed(brisk_daemon, shm_dir: Path) -> None:
    daemon = brisk_daemon
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon.endpoint)
    # pid 0: no pid watch, so only the session timeout can reclaim it.
    s.send(P.encode_requests([P.Hello(1, P.VERSION, "silent", 0, b""), P.Alloc(2, 1 << 20, -1), P.RegisterHost(3, 4096)]))
    got = []
    while len(got) < 3:
        got += P.decode_replies(s.recv())
    with transfer.connect(daemon.endpoint) as watcher:
        assert watcher.stats()["daemon"]["segments"] == 2
        wait_until(lambda: watcher.stats()["daemon"]["segments"] == 0, 8, "silent session reclaim")
        assert watcher.stats()["daemon"]["device_bytes"] == 0
    assert segment_files(shm_dir) == []
    s.close(0)


def test_idle_client_keeps_its_session(brisk_daemon) -> None:
    with transfer.connect(brisk_daemon.endpoint) as c:
        seg = c.segment(4096)
        time.sleep(1.5 * BRISK_TIMEOUT_S)  # idle past the session timeout: heartbeats keep it
        assert c.checksum(seg).result() == transfer.checksum64(np.zeros(4096, np.uint8))


def test_closed_sessions_leave_no_watcher_behind(daemon) -> None:
    """A long-lived producer opening many sessions must not leak a pidfd per session."""
    fds = lambda: len(os.listdir(f"/proc/{daemon.pid}/fd"))  # noqa: E731
    with transfer.connect(daemon.endpoint):
        pass
    base = fds()
    for _ in range(30):
        with transfer.connect(daemon.endpoint) as c:
            c.fence()
    wait_until(lambda: fds() <= base + 2, 5, "the daemon's descriptors to return to baseline")


def test_a_daemon_started_for_a_test_dies_with_its_parent(tmp_path: Path) -> None:
    """transfer.testing's daemons are children of a test or a benchmark: one killed outright
    (a timeout's SIGKILL) must not leave its daemon running (PR_SET_PDEATHSIG)."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from transfer.testing import run_daemon\n"
        "with run_daemon(['--backend', 'numpy']) as d:\n"
        "    print(d.pid, flush=True)\n"
        "    time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, f"daemon {pid} outlived its parent"
        time.sleep(0.05)
