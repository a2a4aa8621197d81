"""No name the daemon uses in a shared directory can be squatted, and a shm dir others could
tamper with is refused at startup.

The shm dir (default /dev/shm) is world-writable. The daemon keeps only its lock and its fd
socket there, both under unguessable names created exclusively; everything else a client
needs (segments, rings, both doorbells) is a descriptor handed over that socket.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq

import transfer
from transfer import protocol as P
from transfer.transport._fds import fetch_fd


def transferd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "transfer.cli.transferd", "--backend", "numpy", *args],
                          capture_output=True, text=True, timeout=60)


def instance_of(shm_dir: Path) -> str:
    (lock,) = [n for n in os.listdir(shm_dir) if n.endswith(".lock")]
    return lock.removeprefix("transfer.").removesuffix(".lock")


def test_names_derived_from_the_visible_instance_cannot_be_squatted(daemon, shm_dir: Path) -> None:
    """Anyone can read the daemon's instance id off its lock's name. Every name built on it
    that a client once depended on (the doorbell FIFO) or that looks like one is taken here
    first, as files, FIFOs and directories: ring clients still get their rings and are served."""
    inst = instance_of(shm_dir)
    squats = [shm_dir / f"transfer.{inst}.{suffix}" for suffix in ("bell", "ring-1", "ring-2", "fds", "seg-1")]
    for i, path in enumerate(squats):
        [lambda: path.write_bytes(b"squat"), lambda: os.mkfifo(path, 0o666), path.mkdir][i % 3]()
    try:
        _serve_ring_clients(daemon.endpoint)
    finally:
        for path in squats:
            path.rmdir() if path.is_dir() else path.unlink()


def _serve_ring_clients(endpoint: str) -> None:
    for kind in ("sync", "trio"):
        if kind == "sync":
            c = transfer.connect(endpoint, ring=True)
        else:
            from _clients import connect
            c = connect("trio", endpoint, ring=True)
        try:
            assert c.ring, "the client fell back to the socket"
            seg = c.segment(1 << 16)
            seg.buffer[:] = 3
            assert c.checksum(seg).result(10) == transfer.checksum64(np.full(1 << 16, 3, np.uint8))
        finally:
            c.close()


def test_a_client_cannot_block_the_daemon_through_its_doorbell(daemon_factory) -> None:
    """Each client's doorbell is an open file description of its own: one that makes its end
    blocking and fills the pipe changes nothing for the daemon (whose own writes must never
    block the loop that drains the pipe) or for any other client."""
    d = daemon_factory("--no-ring-workers", "--session-timeout", "120")  # the loop serves rings, on the doorbell
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(d.endpoint)

    def call(req: P.Request) -> object:
        s.send(P.encode_requests([req]))
        assert s.poll(10_000)
        (r,) = P.decode_replies(s.recv())
        assert r.error is None, r.error
        return r.result

    info = call(P.Hello(1, P.VERSION, "hostile", os.getpid(), b""))
    ring = call(P.OpenRing(2, 64))
    bell = fetch_fd(info["fd_socket"], ring["bell"])  # type: ignore[index]
    try:
        os.set_blocking(bell, False)
        try:
            while True:
                os.write(bell, b"\0" * 4096)
        except BlockingIOError:
            pass  # the pipe is full
        os.set_blocking(bell, True)  # its own description only
        for _ in range(3):
            with transfer.connect(d.endpoint, ring=True) as c:
                assert c.ring
                seg = c.segment(4096)
                for v in range(20):
                    c.fill(seg, 4096, v)
                assert c.checksum(seg).result(10) == transfer.checksum64(np.full(4096, 19, np.uint8))
        assert d.alive()
    finally:
        os.close(bell)
        s.close(0)


@pytest.mark.parametrize("mode", [0o777, 0o733, 0o770])
def test_a_shm_dir_others_may_write_without_the_sticky_bit_is_refused(tmp_path: Path, mode: int) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    os.chmod(shm, mode)
    r = transferd("--endpoint", f"ipc://{tmp_path}/s/d.sock", "--shm-dir", str(shm))
    assert r.returncode == 1 and f"mode {mode:04o}" in r.stderr and "sticky" in r.stderr, r.stderr
    assert os.listdir(shm) == []  # refused before anything was made there


def test_a_shm_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory another user owns")
    shm = tmp_path / "theirs"
    shm.mkdir(mode=0o1777)
    os.chmod(shm, 0o1777)
    os.chown(shm, 65534, 65534)
    r = transferd("--endpoint", f"ipc://{tmp_path}/s/d.sock", "--shm-dir", str(shm))
    assert r.returncode == 1 and "belongs to uid 65534" in r.stderr, r.stderr


def test_a_sticky_world_writable_shm_dir_is_used(tmp_path: Path) -> None:
    """/dev/shm's own shape (root's, mode 1777) is safe: others can create names there, but
    not remove or replace the daemon's."""
    shm = tmp_path / "sticky"
    shm.mkdir()
    os.chmod(shm, 0o1777)
    r = transferd("--endpoint", f"ipc://{tmp_path}/s/d.sock", "--shm-dir", str(shm), "--print-config")
    assert r.returncode == 0, r.stderr  # configuration alone: the check runs as the daemon starts, below
    from transfer.server._preflight import check_shm_dir

    assert check_shm_dir(shm).path == shm
