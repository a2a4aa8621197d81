"""transferd as a user runs it: flags, refusals, clean exits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import transfer
from transfer.testing import start_daemon


def transferd(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "transfer.cli.transferd", *args], capture_output=True, text=True, timeout=timeout)


def test_refuses_unauthenticated_tcp_off_loopback(tmp_path: Path) -> None:
    r = transferd("--endpoint", "tcp://0.0.0.0:5999", "--shm-dir", str(tmp_path))
    assert r.returncode == 1 and "only allowed on loopback" in r.stderr


def test_refuses_a_second_daemon_on_a_live_endpoint(daemon) -> None:
    r = transferd("--endpoint", daemon.endpoint, "--shm-dir", str(daemon.shm_dir))
    assert r.returncode == 1 and "already listening" in r.stderr
    with transfer.connect(daemon.endpoint) as c:  # the first one is untouched
        c.fence()


def test_loopback_tcp_endpoint_serves(shm_dir: Path, tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    wd = tmp_path / "w"
    wd.mkdir()
    d = start_daemon(["--endpoint", f"tcp://127.0.0.1:{port}", "--allow-insecure-tcp", "--backend", "numpy"], workdir=wd, shm_dir=shm_dir)
    try:
        with transfer.connect(f"tcp://127.0.0.1:{port}") as c:
            buf = c.alloc(4096)
            c.fill(buf, 4096, 1).result()
            assert c.checksum(buf).result() == transfer.checksum64(b"\x01" * 4096)
    finally:
        assert d.stop() == 0


def test_help_lists_the_flags() -> None:
    r = transferd("--help")
    assert r.returncode == 0 and "--backend" in r.stdout and "--shm-dir" in r.stdout
