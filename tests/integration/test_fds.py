"""The daemon's fd socket (server/_fds.py): how clients collect the memfds behind their
segments and rings, and what a hostile or careless peer of that socket can do (nothing
that stalls or crashes the daemon, nothing that reaches another session's memory)."""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

import transfer
from transfer import errors as E
from transfer import protocol as P
from transfer.memory._shm import SEALS
from transfer.server._fds import FdChannel
from transfer.transport._fds import REFUSED, fetch_fd


@pytest.fixture
def daemon(daemon_factory):  # type: ignore[no-untyped-def]
    """Raw sessions here do not ping: a long session timeout keeps them while a test runs."""
    return daemon_factory("--session-timeout", "120")


class Raw:
    """A session spoken by hand, so tests hold the tokens themselves."""

    def __init__(self, endpoint: str, pid: int | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.next = 1
        self.info = self.call(P.Hello, P.VERSION, "raw", os.getpid() if pid is None else pid, b"")
        self.fd_socket = self.info["fd_socket"]

    def call(self, cls: type, *args: object) -> dict:
        rid, self.next = self.next, self.next + 1
        self.sock.send(P.encode_requests([cls(rid, *args)]))
        assert self.sock.poll(10_000), "no reply"
        (r,) = P.decode_replies(self.sock.recv())
        if r.error is not None:
            raise r.error
        return r.result

    def close(self) -> None:
        try:
            self.call(P.Close)
        finally:
            self.sock.close(0)


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(path)
    return s


def test_a_token_gives_one_sealed_memfd_once(daemon) -> None:
    raw = Raw(daemon.endpoint)
    try:
        info = raw.call(P.RegisterHost, 1 << 16)
        assert "path" not in info and len(info["token"]) == 16
        with pytest.raises(E.ProtocolError, match="unknown"):
            fetch_fd(raw.fd_socket, os.urandom(16))  # a wrong token
        fd = fetch_fd(raw.fd_socket, info["token"])
        try:
            assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == SEALS
            assert os.fstat(fd).st_size == 1 << 16
            for size in (0, 4096, 1 << 20):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, size)
            with pytest.raises(OSError):
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0)  # cannot even change the seals... (F_SEAL_SEAL)
            mm = mmap.mmap(fd, 1 << 16)
        finally:
            os.close(fd)
        mm[:] = bytes(range(256)) * 256
        assert raw.call(P.Checksum, info["va"], 1 << 16, 0) == transfer.checksum64(bytes(range(256)) * 256)
        mm.close()
        with pytest.raises(E.ProtocolError, match="already used"):
            fetch_fd(raw.fd_socket, info["token"])  # single use
        # A freed segment's token is dead too.
        other = raw.call(P.RegisterHost, 4096)
        raw.call(P.Unregister, other["va"])
        with pytest.raises(E.ProtocolError, match="unknown"):
            fetch_fd(raw.fd_socket, other["token"])
    finally:
        raw.close()


def test_another_process_cannot_take_a_sessions_memory(daemon, tmp_path: Path) -> None:
    raw = Raw(daemon.endpoint)
    try:
        info = raw.call(P.RegisterHost, 4096)
        script = tmp_path / "thief.py"
        script.write_text(textwrap.dedent("""
            import sys
            from transfer import errors as E
            from transfer.transport._fds import fetch_fd
            try:
                fetch_fd(sys.argv[1], bytes.fromhex(sys.argv[2]))
                print("GOT IT")
            except E.ProtocolError as exc:
                print("refused:", exc)
        """))
        out = subprocess.run(
            [sys.executable, str(script), raw.fd_socket, info["token"].hex()], capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": str(Path(transfer.__file__).parents[1])},
        ).stdout
        assert "refused" in out and "another process" in out, out
        # The owner still gets it: a stranger's try does not spend the token.
        os.close(fetch_fd(raw.fd_socket, info["token"]))
    finally:
        raw.close()
    # A token of an ended session is dead.
    raw = Raw(daemon.endpoint)
    token = raw.call(P.RegisterHost, 4096)["token"]
    raw.close()
    # Refused either way: "unknown" once the daemon has forgotten the session's tokens,
    # "session has ended" if the fetch comes between the session's end and that.
    with pytest.raises(E.ProtocolError, match="unknown|session has ended"):
        fetch_fd(raw.fd_socket, token)


def test_silent_and_garbage_peers_do_not_stall_the_daemon(daemon) -> None:
    with transfer.connect(daemon.endpoint) as good:
        path = good._core.fd_socket
        silent = [_connect(str(path)) for _ in range(FdChannel.MAX_WAITING + 8)]
        try:
            t0 = time.monotonic()
            for _ in range(5):  # every segment is collected from the same socket, right now
                seg = good.segment(1 << 16)
                seg.buffer[:] = 9
                assert good.checksum(seg).result(10) == transfer.checksum64(np.full(1 << 16, 9, np.uint8))
            assert time.monotonic() - t0 < FdChannel.TIMEOUT_S  # never waited behind the silent ones
            # Garbage: short, long, empty messages; each gets a refusal (or a close), nothing else.
            for junk in (b"\xff", b"x" * 17, b"\x00" * 4096, os.urandom(16)):
                s = _connect(str(path))
                s.send(junk)
                reply, fds, _, _ = socket.recv_fds(s, 256, 4)
                assert fds == [] and reply[:1] == REFUSED, reply
                s.close()
            s = _connect(str(path))
            s.close()  # connects and leaves at once
            # The silent peers are dropped by their deadline (or evicted): none waits forever.
            deadline = time.monotonic() + FdChannel.TIMEOUT_S + 5
            for s in silent:
                s.settimeout(max(0.1, deadline - time.monotonic()))
                assert s.recv(16) == b""
            st = good.stats()["daemon"]
            assert st["fds_passed"] == 5 + 2 * good.ring and st["fds_refused"] >= 4  # (a ring: its memfd and doorbell)
            assert daemon.alive()
        finally:
            for s in silent:
                s.close()


def test_uncollected_memfds_are_bounded_and_released(daemon) -> None:
    fds = lambda: len(os.listdir(f"/proc/{daemon.pid}/fd"))  # noqa: E731
    watcher = transfer.connect(daemon.endpoint, ring=False)  # (before the count: its own fds are in the base)
    watcher.fence()
    base = fds()
    raw = Raw(daemon.endpoint)
    try:
        tokens = [raw.call(P.RegisterHost, 4096)["token"] for _ in range(FdChannel.MAX_PER_SESSION)]
        with pytest.raises(E.QuotaExceeded, match="not collected"):
            raw.call(P.RegisterHost, 4096)
        with pytest.raises(E.QuotaExceeded, match="not collected"):
            raw.call(P.OpenRing, 64)
        os.close(fetch_fd(raw.fd_socket, tokens[0]))
        raw.call(P.RegisterHost, 4096)  # room again
        assert fds() > base + FdChannel.MAX_PER_SESSION
    finally:
        raw.close()
    # The raw session is reaped once silent (heartbeat timeout), and its memfds (and their
    # mappings' fds) close as its memory is released, after it leaves the count of sessions:
    # wait for both (the suite's timeout bounds it), not a clock.
    with watcher:
        while watcher.stats()["daemon"]["sessions"] > 1 or fds() > base + 2:
            watcher.fence()


def test_a_long_shm_dir_still_works(daemon_factory, tmp_path: Path) -> None:
    """sockaddr_un holds 108 bytes; a deeper shm dir is reached through /proc/self/fd."""
    top = Path(tempfile.mkdtemp(prefix="transfer-test-deep-" + "d" * 40, dir="/dev/shm"))  # (a name nobody can guess)
    deep = top / ("e" * 40)
    deep.mkdir(mode=0o700)
    try:
        d = daemon_factory("--shm-dir", str(deep))
        with transfer.connect(d.endpoint, ring=True) as c:
            assert len(str(c._core.fd_socket)) > 108
            seg = c.segment(4096)
            seg.buffer[:] = 1
            assert c.checksum(seg).result(10) == transfer.checksum64(np.ones(4096, np.uint8))
        d.stop()
    finally:
        import shutil

        shutil.rmtree(deep.parent, ignore_errors=True)


def test_the_client_refuses_unsealed_or_wrong_memory(tmp_path: Path) -> None:
    """What a hostile daemon could send instead of a sealed memfd: a client maps none of it."""
    from transfer.memory import ShmFile
    from transfer.memory._shm import new_memfd, seal

    def memfd(n: int, sealed: bool) -> int:
        fd = new_memfd("test")
        os.ftruncate(fd, n)
        if sealed:
            seal(fd)
        return fd

    with pytest.raises(E.InvalidField, match="not sealed"):
        ShmFile.attach(memfd(4096, sealed=False), 4096)  # the daemon could shrink it under us
    with pytest.raises(E.InvalidField, match="8192 bytes, expected 4096"):
        ShmFile.attach(memfd(8192, sealed=True), 4096)
    f = tmp_path / "plain"
    f.write_bytes(bytes(4096))
    with pytest.raises(E.InvalidField, match="not a sealed memfd"):
        ShmFile.attach(os.open(f, os.O_RDWR), 4096)  # a plain file: anyone could truncate it
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(E.InvalidField):
        ShmFile.attach(r, 4096)
    seg = ShmFile.attach(memfd(4096, sealed=True), 4096)  # the real thing maps
    seg.array[:] = 1
    seg.close()


def test_a_pid_is_matched_through_the_peers_pid_namespace() -> None:
    from transfer.server._fds import _same_process

    me = os.getpid()
    assert _same_process(me, me)
    with open(f"/proc/{me}/status") as f:
        (nspid,) = [int(ln.split()[-1]) for ln in f if ln.startswith("NSpid:")]
    assert _same_process(nspid, me)  # what a client in a container says in hello
    assert not _same_process(me + 1 if me + 1 != nspid else me + 2, me)


#: A same-uid process holding up to `n` silent connections to the fd socket, reconnecting each
#: one the daemon closes; it prints "ready" once it holds them all or the daemon's backlog is
#: full, then runs until stdin closes.
_FLOOD = textwrap.dedent("""
    import os, selectors, socket, sys, threading
    path, n = sys.argv[1], int(sys.argv[2])
    sel = selectors.DefaultSelector()
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    held, full = 0, False
    def connect():
        global held, full
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
        try:
            s.connect(path)
        except OSError:  # the backlog is full: try again at the next turn
            s.close()
            full = True
            return
        sel.register(s, selectors.EVENT_READ)
        held += 1
    announced = False
    while not done.is_set():
        while held < n:
            before = held
            connect()
            if held == before:
                break
        if (held >= n or full) and not announced:
            print("ready", flush=True)
            announced = True
        for key, _ in sel.select(0.01):  # a connection the daemon closed: replace it
            sel.unregister(key.fileobj)
            key.fileobj.close()
            held -= 1
""")


def test_a_flood_of_silent_handover_connections_starves_no_client(daemon) -> None:
    """One same-uid process holding hundreds of silent connections to the fd socket: every
    segment another client makes is still collected (its connect waits, bounded, while the
    backlog is full; the daemon evicts the flood's silent peers, never one mid-handover)."""
    with transfer.connect(daemon.endpoint, ring=False) as good:
        flood = subprocess.Popen([sys.executable, "-c", _FLOOD, str(good._core.fd_socket), "400"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert flood.stdout is not None and flood.stdout.readline().strip() == "ready"
            failed = 0
            for i in range(100):
                try:
                    seg = good.segment(4096)
                except transfer.ConnectionLost:
                    failed += 1
                    continue
                seg.buffer[:] = i % 251
                good.free(seg)
            assert failed == 0, f"{failed} of 100 segments could not be collected"
            assert daemon.alive()
        finally:
            flood.communicate("")


def test_a_client_watches_the_daemon_only_where_its_pid_names_it(daemon) -> None:
    """The daemon's pid from hello is its number in the daemon's pid namespace: a client
    watches it only when its fd socket's peer is that pid here (a producer in a namespace of
    its own must not watch a stranger with the same number)."""
    import os

    import transfer
    from transfer.transport._fds import daemon_pidfd

    with transfer.connect(daemon.endpoint) as c:
        path = c._core.fd_socket
        fd = daemon_pidfd(path, c.server_pid)
        os.close(fd)
        with pytest.raises(OSError, match="the daemon is pid"):
            daemon_pidfd(path, os.getpid())  # a pid that is not the daemon's
        c.fence()  # the bare connections left nothing behind that the daemon minds
        assert c.stats()["daemon"]["fds_refused"] == 0
