"""Remote sessions' data channels: a session's ring carried over TCP (docs/ring.md, "Remote rings").

A real `transferd` with a tcp endpoint on loopback; the clients are this process, raw
sockets that play a hostile peer, and a client process that is killed. Nothing here needs
NIXL: the requests copy between the daemon's own buffers, which its ring worker serves.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transfer
from transfer import protocol as P
from transfer.ring._channel import ACK, HELLO, hello
from conftest import FAST, tcp_daemon, wait_for
from transfer.server._config import CHANNEL_WAITING
from transfer.testing import DaemonProcess, loopback_endpoint, start_daemon

pytestmark = pytest.mark.timeout(120)

def _daemon(extra: list[str] = []) -> Iterator[tuple[DaemonProcess, str]]:
    yield from tcp_daemon(["--allow-insecure-tcp", *extra], "chan")


@pytest.fixture(scope="module")
def daemon() -> Iterator[tuple[DaemonProcess, str]]:
    yield from _daemon()


def _daemon_stats(endpoint: str) -> dict[str, Any]:
    with transfer.connect(endpoint, ring=False) as c:
        return dict(c.stats()["daemon"])


def _awaited_channel(c: transfer.Client, capacity: int = 64) -> Any:
    """A session that asked for a channel and has not connected it: its port and key."""
    return c._run(c._op_call(P.OpenChannel, capacity))


def test_a_tcp_session_takes_its_data_channel_and_the_worker_serves_it(daemon: tuple[DaemonProcess, str]) -> None:
    before = _daemon_stats(daemon[1])
    with transfer.connect(daemon[1], name="channel") as c:
        link = c._ring
        assert link is not None and link.channel is not None, "a tcp session gets its ring over a data channel"
        n = 1 << 20
        src, dst = c.alloc(n), c.alloc(n)
        c.fill(src, n, 7).result()
        c.copy(dst, src).result()
        want = transfer.checksum64(np.full(n, 7, np.uint8))
        assert c.checksum(dst).result() == want
        offs = np.arange(0, n, 4096, dtype=np.uint64)
        sizes = np.full(len(offs), 4096, np.uint64)
        c.copy_many(dst.va + offs, src.va + offs, sizes).result()
        sums = c.checksum_many(dst.va + offs, sizes).result()
        assert list(sums) == [transfer.checksum64(np.full(4096, 7, np.uint8))] * len(offs)
        sent = link.channel.counters()["sent"]
        assert sent >= 2 * len(offs), "the descriptors went over the channel"
    after = _daemon_stats(daemon[1])
    assert after["channels_opened"] > before["channels_opened"]
    # Served by the session's native worker, not handed to the event loop.
    assert after["native_requests"] - before["native_requests"] >= len(offs)
    assert after["ring_handovers"] == before["ring_handovers"]


def test_a_failed_request_on_the_channel_gets_its_error(daemon: tuple[DaemonProcess, str]) -> None:
    with transfer.connect(daemon[1]) as c:
        assert c._ring is not None and c._ring.channel is not None
        buf = c.alloc(4096)
        with pytest.raises(transfer.OutOfBounds):
            c.copy(buf, buf.at(4000), 200).result()
        with pytest.raises(transfer.UnknownSegment):
            c.copy(buf, (0x7FFF << 40), 64).result()
        c.fill(buf, 4096, 3).result()  # the session goes on
        assert c.checksum(buf).result() == transfer.checksum64(np.full(4096, 3, np.uint8))


@pytest.fixture(scope="module")
def loop_daemon() -> Iterator[tuple[DaemonProcess, str]]:
    """Rings served by the event loop (no native workers): the Python half of every rule."""
    yield from _daemon(["--no-ring-workers"])


@pytest.mark.parametrize("served", ["worker", "loop"])
def test_a_socket_frame_waits_for_the_descriptors_pushed_before_it(request: pytest.FixtureRequest, served: str) -> None:
    """Ring requests travel on the data channel, a compute on the control socket: two
    connections, so the compute's frame can reach the daemon before the fills pushed ahead
    of it. Its RingMark says how many came first, and the daemon waits for them (without
    the mark, a compute overtook its fills by the second round)."""
    endpoint = request.getfixturevalue("daemon" if served == "worker" else "loop_daemon")[1]
    n = 64 << 10
    with transfer.connect(endpoint) as c:
        assert c._ring is not None and c._ring.channel is not None
        buf = c.alloc(n)
        c.fill(buf, n, 0).result()
        for i in range(1, 101):
            for v in range(40):
                c.fill(buf, n, (i + v) & 0xFF)  # not waited for: pushed, on their way
            got = c.compute("checksum", [buf.tensor(n, np.uint8)]).result()
            assert got == transfer.checksum64(np.full(n, (i + 39) & 0xFF, np.uint8)), f"round {i}: the compute overtook the fills"


def test_a_mark_ahead_of_what_was_pushed_holds_only_its_own_session(daemon: tuple[DaemonProcess, str]) -> None:
    """A frame whose RingMark names descriptors not pushed yet waits for them; the daemon and
    its other sessions do not."""
    with transfer.connect(daemon[1]) as c, transfer.connect(daemon[1]) as other:
        buf = c.alloc(4096)
        c.fill(buf, 4096, 1).result()
        core = c._core
        with c._lock:
            mark = core.new(P.RingMark, core.sub.pushed + 3)[0]
            core.pending.pop(mark.id)
            fence, held = core.new(P.Fence, 0)
            c._send([mark, fence])
        obuf = other.alloc(64)
        other.fill(obuf, 64, 2).result()  # served meanwhile
        assert other.checksum(obuf).result() == transfer.checksum64(np.full(64, 2, np.uint8))
        for v in (3, 4, 5):  # the three descriptors it named: then the frame goes
            c.fill(buf, 4096, v)
        held.result(timeout=60)
        assert c.checksum(buf).result() == transfer.checksum64(np.full(4096, 5, np.uint8))


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("fill"), st.integers(0, 3), st.integers(0, 8191), st.integers(0, 8192), st.integers(0, 255)),
        st.tuples(st.just("copy"), st.integers(0, 3), st.integers(0, 8191), st.integers(0, 3), st.integers(0, 8191),
                  st.integers(0, 8192)),
    ),
    min_size=1, max_size=12,
)


def _run(c: transfer.Client, bufs: list[Any], ops: list[tuple[Any, ...]]) -> list[Any]:
    """Each op's outcome (None, or its error's class), then every buffer's checksum."""
    out: list[Any] = []
    pend = []
    for op in ops:
        if op[0] == "fill":
            _, b, off, n, v = op
            pend.append(c.fill(bufs[b].va + off, n, v))
        else:
            _, d, doff, s, soff, n = op
            pend.append(c.copy(bufs[d].va + doff, bufs[s].va + soff, n))
    for p in pend:
        try:
            p.result()
            out.append(None)
        except transfer.TransferError as exc:
            out.append(type(exc))
    return out + [c.checksum(b).result() for b in bufs]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_the_channel_and_the_socket_give_the_same_answers_and_bytes(daemon: tuple[DaemonProcess, str], ops: list[tuple[Any, ...]]) -> None:
    """The same requests through a data channel (the worker) and through the control socket
    (the Python pass): the same outcomes and the same memory."""
    results = []
    for ring in (None, False):
        with transfer.connect(daemon[1], ring=ring) as c:
            assert (c._ring is not None) == (ring is None)
            bufs = [c.alloc(8192) for _ in range(4)]
            results.append(_run(c, bufs, ops))
    assert results[0] == results[1]


def test_hostile_channel_connections_are_closed_and_the_daemon_serves_on(daemon: tuple[DaemonProcess, str]) -> None:
    endpoint = daemon[1]
    before = _daemon_stats(endpoint)
    with transfer.connect(endpoint, ring=False) as victim:
        info = _awaited_channel(victim)
        sid = victim.session_id

        def answer(data: bytes) -> bytes:
            with socket.create_connection(("127.0.0.1", info.port), timeout=30) as s:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                got = b""
                while chunk := s.recv(64):
                    got += chunk
                return got

        assert answer(os.urandom(HELLO.size)) == b""  # noise
        assert answer(HELLO.pack(b"NOTMAGIC", sid, info.key)) == b""  # the wrong magic
        assert answer(hello(sid, bytes(16))) == b""  # this session, the wrong key
        assert answer(hello(sid + 1000, info.key)) == b""  # the key, another session's id
        assert answer(hello(sid, info.key)[:-1]) == b""  # cut short
        # The right hello: accepted once; then garbage for descriptors. The daemon checks
        # each as a local ring's: its worker hands the impossible to the pass, which answers.
        with socket.create_connection(("127.0.0.1", info.port), timeout=30) as s:
            s.sendall(hello(sid, info.key))
            assert s.recv(len(ACK), socket.MSG_WAITALL) == ACK
            assert answer(hello(sid, info.key)) == b"", "a key is good for one connection"
            s.sendall(os.urandom(64 * 40 + 17))
        # The victim's session either goes on or was ended for a broken ring; the daemon serves.
        with transfer.connect(endpoint) as c:
            buf = c.alloc(4096)
            c.fill(buf, 4096, 1).result()
            assert c.checksum(buf).result() == transfer.checksum64(np.ones(4096, np.uint8))
    after = _daemon_stats(endpoint)
    assert after["channels_refused"] - before["channels_refused"] >= 6
    assert daemon[0].alive()


def test_silent_connections_cannot_hold_the_listener(daemon: tuple[DaemonProcess, str]) -> None:
    """At most CHANNEL_WAITING connections wait for their hello; one more is closed as it
    comes. A client's own channel still connects once they have gone."""
    endpoint = daemon[1]
    with transfer.connect(endpoint, ring=False) as probe:
        port = _awaited_channel(probe).port
    before = _daemon_stats(endpoint)["channels_busy"]
    silent = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(CHANNEL_WAITING)]
    try:
        wait_for(lambda: _daemon_stats(endpoint)["channels_busy"] > before or _extra_is_closed(port), "the extra connection closed", timeout=30)
    finally:
        for s in silent:
            s.close()
    # Gone: their handshakes end (EOF), and a real client connects its channel.
    with transfer.connect(endpoint) as c:
        assert c._ring is not None and c._ring.channel is not None
        buf = c.alloc(64)
        c.fill(buf, 64, 9).result()


def _extra_is_closed(port: int) -> bool:
    """One connection beyond the waiting ones: closed by the daemon at once (EOF), or not."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.settimeout(1.0)
        try:
            return s.recv(1) == b""
        except (TimeoutError, socket.timeout):
            return False
        except ConnectionResetError:
            return True


_KILLED_CLIENT = """
import sys, transfer
c = transfer.connect(sys.argv[1], name="doomed")
assert c._ring is not None and c._ring.channel is not None
buf = c.alloc(1 << 20)
c.fill(buf, 1 << 20, 5).result()
print("ready", c.session_id, flush=True)
sys.stdin.read()
"""


def test_a_killed_client_s_session_and_channel_go(daemon: tuple[DaemonProcess, str]) -> None:
    endpoint = daemon[1]
    base = _daemon_stats(endpoint)["sessions"]
    p = subprocess.Popen([sys.executable, "-c", _KILLED_CLIENT, endpoint], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("ready"), line
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    wait_for(lambda: _daemon_stats(endpoint)["sessions"] <= base, "the session reaped", timeout=30)  # reaped (its heartbeats stopped)
    assert daemon[0].alive()
    with transfer.connect(endpoint) as c:
        buf = c.alloc(64)
        c.fill(buf, 64, 1).result()


def test_a_drain_answers_everything_the_channel_carried() -> None:
    """SIGTERM with fills in flight on a data channel: each is done, or fails with a clear
    error (what reached the daemon after its cut, or was still on its way); none is left
    waiting, and the daemon exits cleanly. The client's close then knows the session is
    over (it waited out its reply timeout, 5 s, before)."""
    for d, endpoint in _daemon():
        c = transfer.connect(endpoint, name="drained")
        try:
            assert c._ring is not None and c._ring.channel is not None
            n = 4 << 20
            buf = c.alloc(n)
            c.fill(buf, n, 0).result()
            pend = [c.fill(buf, n, i & 0xFF) for i in range(1, 51)]
            d.proc.send_signal(signal.SIGTERM)
            done = failed = 0
            for p in pend:
                try:
                    p.result(timeout=60)
                    done += 1
                except (transfer.ShuttingDown, transfer.SessionClosed, transfer.ConnectionLost):
                    failed += 1
            assert done + failed == len(pend)
            assert d.proc.wait(60) == 0
            wait_for(lambda: c._ring.channel.ended, "the channel's end", timeout=30)  # (its end reaches the client)
            c.close()  # knows the session is over: sends no Close to a daemon that is gone
            assert isinstance(c._core.broken, transfer.SessionClosed)
        finally:
            c.close()


def test_the_daemon_going_fails_what_waits_on_the_channel(tmp_path: Path) -> None:
    """A daemon killed under a session: its channel ends, and the client fails what it
    submits with a clear error instead of waiting for ever."""
    shm = Path("/dev/shm") / f"transfer-chan-{uuid.uuid4().hex[:8]}"
    shm.mkdir(mode=0o700)
    endpoint = loopback_endpoint()
    d = start_daemon([*FAST, "--endpoint", endpoint, "--allow-insecure-tcp"], workdir=tmp_path, shm_dir=shm)
    try:
        c = transfer.connect(endpoint, name="left")
        try:
            assert c._ring is not None and c._ring.channel is not None
            buf = c.alloc(4096)
            c.fill(buf, 4096, 1).result()
            d.kill()
            with pytest.raises((transfer.SessionClosed, transfer.DaemonUnavailable, transfer.ConnectionLost)):
                for _ in range(100000):  # (until the channel's end reaches the client)
                    c.fill(buf, 4096, 2).result(timeout=30)
        finally:
            c.close()
    finally:
        if d.alive():
            d.kill()
        shutil.rmtree(shm, ignore_errors=True)
