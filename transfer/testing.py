"""Run a real `transferd` process for tests, benchmarks and embedding.

`run_daemon()` is what `transfer-bench` and the test suite use: a separate
process on a private temporary ipc:// endpoint, stopped (SIGTERM, then
SIGKILL) and cleaned up on exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

__all__ = ["DaemonProcess", "loopback_endpoint", "memfds", "run_daemon", "start_daemon", "stop_process"]


@dataclass
class DaemonProcess:
    endpoint: str
    proc: subprocess.Popen[bytes]
    workdir: Path
    shm_dir: Path
    args: list[str] = field(default_factory=list)
    #: The daemon's `--ready` line (backend, why that backend, instance, ...).
    ready: dict[str, Any] = field(default_factory=dict)
    #: Where its stderr (its log) goes; None: this process's stderr.
    log: Path | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (graceful drain), then SIGKILL if it overstays; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, timeout: float = 15.0) -> "DaemonProcess":
        """A new daemon on the same endpoint and shm directory (after a crash, say)."""
        self.kill()
        new = _spawn(self.endpoint, self.workdir, self.shm_dir, self.args, timeout, self.log)
        self.proc, self.ready = new.proc, new.ready
        return self


def _die_with(parent: int) -> Callable[[], None]:
    """A child's first step: SIGTERM when the thread that started it dies (Linux prctl), so
    a test or benchmark killed outright leaves no daemon behind; gone already: exit."""

    def arm() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return  # not Linux: the caller's cleanup is all there is
        if os.getppid() != parent:
            os._exit(1)

    return arm


def _spawn(endpoint: str, workdir: Path, shm_dir: Path, args: Sequence[str], timeout: float, log: Path | None = None) -> DaemonProcess:
    cmd = [sys.executable, "-m", "transfer.cli.transferd", "--endpoint", endpoint, "--shm-dir", str(shm_dir), "--ready", *args]
    err = open(log, "ab") if log is not None else None
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, preexec_fn=_die_with(os.getpid()))
    finally:
        if err is not None:
            err.close()  # (the child has its own)
    assert proc.stdout is not None
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"transferd did not become ready within {timeout}s")
    line = proc.stdout.readline()
    sel.close()
    try:
        ready = json.loads(line)
        assert ready.get("event") == "ready"
    except (ValueError, AssertionError):
        proc.wait(5)
        said = f"; its log ends: {log.read_text(errors='replace')[-2000:]}" if log is not None and log.exists() else ""
        raise RuntimeError(f"transferd failed to start (exit {proc.returncode}): {line!r}{said}") from None
    return DaemonProcess(endpoint, proc, workdir, shm_dir, list(args), ready, log)


def loopback_endpoint() -> str:
    """`tcp://127.0.0.1:<a port free now>`: a tcp endpoint for a daemon, as remote clients reach it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def start_daemon(
    args: Sequence[str] = (),
    *,
    workdir: Path | None = None,
    shm_dir: Path | None = None,
    timeout: float = 20.0,
    log: Path | None = None,
) -> DaemonProcess:
    """Start transferd on `ipc://<private tmp dir>/transferd.sock`; the caller stops it. `log`:
    a file its stderr (its log, the startup line) goes to, instead of this process's stderr."""
    wd = Path(workdir or tempfile.mkdtemp(prefix="transferd-"))
    os.chmod(wd, 0o700)
    shm = Path(shm_dir) if shm_dir is not None else Path("/dev/shm")
    return _spawn(f"ipc://{wd}/transferd.sock", wd, shm, list(args), timeout, log)


@contextlib.contextmanager
def run_daemon(args: Sequence[str] = (), **kwargs: object) -> Iterator[DaemonProcess]:
    """A daemon for the duration of the block; nothing of it remains afterwards."""
    owns_dir = kwargs.get("workdir") is None
    d = start_daemon(args, **kwargs)  # type: ignore[arg-type]
    try:
        yield d
    finally:
        d.stop()
        if owns_dir:
            shutil.rmtree(d.workdir, ignore_errors=True)


def memfds(pid: int | str = "self", *, maps: bool = True) -> list[str]:
    """The transfer memfds a process holds: open fds, and (`maps`) its mappings of them."""
    out = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("/memfd:transfer."):
            out.append(target)
    if maps:
        with open(f"/proc/{pid}/maps") as f:
            out += [ln.split(None, 5)[5].strip() for ln in f if "/memfd:transfer." in ln]
    return sorted(out)


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP `pid` and wait until every thread of it has stopped.

    A stop is delivered asynchronously: until then a thread on another core (a
    daemon's ring worker, spinning) may still answer a request the caller meant
    to leave waiting."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                states.append(Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass  # a thread that just exited
        if states and all(s in "tT" for s in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} did not stop within {timeout} s: thread states {states}")
        time.sleep(0.001)
