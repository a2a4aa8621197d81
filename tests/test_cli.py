"""transferd as a user runs it: flags, refusals, clean exits."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import transfer
from transfer import backends
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


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here: auto may pick it")
def test_auto_backend_says_why_it_chose_numpy(daemon_factory: Any, capfd: pytest.CaptureFixture[str]) -> None:
    d = daemon_factory("--backend", "auto", "--log-level", "INFO")
    assert d.ready["backend"] == "numpy"
    assert d.ready["backend_reason"] == "auto: CuPy is not installed (pip install 'transfer[gpu]')"
    with transfer.connect(d.endpoint) as c:
        c.fence()
    assert d.stop() == 0
    err = capfd.readouterr().err  # the daemon's log (it inherits our stderr)
    assert "backend numpy: auto: CuPy is not installed" in err
    assert "(backend numpy: auto: CuPy is not installed" in err  # the serving line says it too


def test_auto_warns_when_cupy_is_installed_but_unusable(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Importing the module imports no CuPy: that is probe()'s job.
    from transfer.backends._cupy import CupyBackend

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "cupy" else real(name, *a))
    monkeypatch.setattr(CupyBackend, "probe", staticmethod(lambda: (False, "CUDARuntimeError: cudaErrorInsufficientDriver")))
    with caplog.at_level(logging.INFO, logger="transfer.backends"):
        backend, why = backends.select_backend("auto")
        with pytest.raises(RuntimeError, match="no usable CUDA device .*InsufficientDriver"):
            backends.select_backend("cupy")
    assert backend.name == "numpy" and why == "auto: CuPy is installed but unusable (CUDARuntimeError: cudaErrorInsufficientDriver)"
    (rec,) = [r for r in caplog.records if r.name == "transfer.backends"]
    assert rec.levelno == logging.WARNING and why in rec.getMessage()
