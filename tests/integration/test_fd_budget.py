"""The daemon's file descriptors are shared out (`server._config.fd_budget`): each listener
and each kind of thing a client can make the daemon hold is refused at its own cap, so no
flood of one takes another's share, and libzmq never finds the table empty on an accept."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

import transfer
from transfer import protocol as P
from transfer.server._config import FDS_PER_SESSION, DaemonConfig, fd_budget


@given(st.integers(64, 1 << 21), st.integers(0, 2048), st.booleans())
def test_the_shares_fit_the_limit(nofile: int, max_sessions: int, metrics: bool) -> None:
    cfg = replace(DaemonConfig(), max_sessions=max_sessions, metrics_port=9100 if metrics else 0)
    b = fd_budget(cfg, nofile)
    assert min(b.sessions, b.connections, b.handover, b.offers, b.segments) >= 1
    assert b.connections >= b.sessions and b.metrics == (cfg.metrics_connections if metrics else 0)
    if not max_sessions and nofile >= 1024:  # (an operator's max_sessions may overcommit; auto never does)
        held = b.sessions * FDS_PER_SESSION + (b.connections - b.sessions) + b.offers + b.segments + b.handover + b.metrics
        assert held <= nofile


@pytest.fixture
def low_daemon(tmp_path: Path, shm_dir: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A daemon whose fd limit is 512 (soft and hard): 34 sessions, 172 connections, 48
    segments and 46 uncollected memfds (its log says so)."""
    import resource

    os.chmod(tmp_path, 0o700)
    ep = f"ipc://{tmp_path}/d.sock"
    log = open(tmp_path / "transferd.log", "w+")
    d = subprocess.Popen(
        [sys.executable, "-m", "transfer.cli.transferd", "--ready", "--backend", "numpy", "--endpoint", ep,
         "--shm-dir", str(shm_dir), "--log-level", "INFO", "--session-timeout", "60"],
        stdout=subprocess.PIPE, stderr=log, text=True, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512)),
    )
    try:
        assert d.stdout is not None and "ready" in d.stdout.readline()
        yield ep, d
    finally:
        d.terminate()
        code = d.wait(30)
        log.close()
    err = (tmp_path / "transferd.log").read_text()
    assert code == 0, err[-2000:]
    assert "fd limit 512: at most 34 sessions (sized from the fd limit), 172 connections, 48 shared-memory segments, 46 uncollected" in err


def test_segments_are_capped_daemon_wide_by_the_fd_limit(low_daemon: tuple[str, subprocess.Popen[str]]) -> None:
    """Each mapped segment holds a descriptor: past the daemon's share, RegisterHost gets
    QuotaExceeded (not a daemon that libzmq aborts); freeing one makes room."""
    ep, d = low_daemon
    with transfer.connect(ep, ring=False) as a, transfer.connect(ep, ring=False) as b:
        segs = [a.segment(4096) for _ in range(30)] + [b.segment(4096) for _ in range(18)]
        with pytest.raises(transfer.QuotaExceeded, match="shared-memory segments"):
            b.segment(4096)
        a.free(segs[0])
        b.segment(4096)
        assert d.poll() is None


def test_uncollected_memfds_are_capped_daemon_wide(low_daemon: tuple[str, subprocess.Popen[str]]) -> None:
    """A session may leave 64 memfds uncollected, but all sessions together only the daemon's
    share: then RegisterHost gets QuotaExceeded, and other clients are still served."""
    ep, d = low_daemon
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(ep)

    def call(req: P.Request) -> P.Reply:
        s.send(P.encode_requests([req]))
        assert s.poll(10_000)
        (r,) = P.decode_replies(s.recv())
        return r

    assert call(P.Hello(1, P.VERSION, "hoarder", os.getpid(), b"")).error is None
    errors = [call(P.RegisterHost(2 + i, 4096)).error for i in range(47)]
    assert errors[:46] == [None] * 46 and isinstance(errors[46], transfer.QuotaExceeded), errors[-2:]
    assert "not collected" in str(errors[46])
    with transfer.connect(ep, ring=False) as c:
        with pytest.raises(transfer.QuotaExceeded):
            c.segment(4096)  # the share is spent for everyone: refused, never a dead daemon
        c.fill(c.alloc(4096), 4096, 1).result()  # device memory holds no descriptor
    s.close(0)
    assert d.poll() is None


def test_idle_connections_without_a_session_are_closed(daemon_factory) -> None:
    """Connections that never say hello are closed after 2 x session_timeout of silence, so
    they cannot hold the connection cap; a session's connection is not (its client pings)."""
    d = daemon_factory("--session-timeout", "0.5", "--heartbeat", "0.1")
    ctx = zmq.Context.instance()
    idle = []
    for _ in range(20):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, -1)  # closed stays closed
        s.connect(d.endpoint)
        idle.append(s)
    with transfer.connect(d.endpoint) as c:
        session = c.session_id
        deadline = time.monotonic() + 60
        while c.stats()["daemon"]["connections_idle_closed"] < 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.stats()["daemon"]["connections_idle_closed"] >= 20
        c.fill(c.alloc(4096), 4096, 1).result()  # served, on the session it had all along
        assert c.session_id == session and c.stats()["session"]["id"] == session
    for s in idle:
        s.close(0)
