"""Fixtures: a real transferd process per test, each with its own shm directory.

A private directory under /dev/shm makes leak checks exact: after the test,
it must hold nothing but (while the daemon lives) the daemon's lock file.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# The suite starts hundreds of Python processes (a daemon per test, client processes), each
# importing the package. Under PYTHONDONTWRITEBYTECODE (set on the CI image) every one of them
# compiled all of it again: about 0.4 s a process, a third of the suite's time. Bytecode is a
# cache keyed by each source's mtime, so writing it changes nothing a test can observe.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

import time  # noqa: E402

import zmq  # noqa: E402

import transfer  # noqa: E402
from transfer import protocol as P  # noqa: E402
from transfer.testing import DaemonProcess, loopback_endpoint, start_daemon  # noqa: E402

FAST = ["--heartbeat", "0.2", "--session-timeout", "2.0", "--backend", "numpy"]
#: Added to FAST for the tests that let a session idle past the timeout: each waits it out.
BRISK = ["--heartbeat", "0.1", "--session-timeout", "1.0"]
BRISK_TIMEOUT_S = 1.0


def segment_files(shm_dir: Path) -> list[str]:
    """Files in shm_dir other than what a live daemon keeps there for its whole life: its
    lock and its fd socket. Segments, rings and doorbells are memfds and pipes, handed over
    that socket: they have no file at all."""
    return sorted(n for n in leftovers(shm_dir) if ".fds." not in n)


def leftovers(shm_dir: Path) -> list[str]:
    """Everything in shm_dir but lock files: after a daemon stopped, this must be empty."""
    return sorted(n for n in os.listdir(shm_dir) if not n.endswith(".lock"))


def wait_for(cond: Any, what: str, timeout: float = 10.0, on_fail: Any = None) -> None:
    """Poll `cond()` (a counter, a state the daemon or client keeps: the event itself) until it
    holds; fail naming `what` (and `on_fail()`) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f": {on_fail()}" if on_fail else ""))
        time.sleep(0.02)


def tcp_daemon(args: list[str], prefix: str = "tcp") -> Iterator[tuple[DaemonProcess, str]]:
    """A daemon with a tcp endpoint on loopback (and its ipc one), in a shm dir of its own:
    (the daemon, the tcp endpoint). It must stop cleanly and leave no memory behind."""
    shm = Path("/dev/shm") / f"transfer-{prefix}-{uuid.uuid4().hex[:8]}"
    shm.mkdir(mode=0o700)
    wd = Path(tempfile.mkdtemp(prefix=f"transferd-{prefix}-"))
    endpoint = loopback_endpoint()
    d = start_daemon([*FAST, "--endpoint", endpoint, *args], workdir=wd, shm_dir=shm)
    try:
        yield d, endpoint
    finally:
        assert d.stop() == 0
        shutil.rmtree(wd, ignore_errors=True)
        left = [n for n in os.listdir(shm) if not n.endswith(".lock")]
        shutil.rmtree(shm, ignore_errors=True)
        assert left == [], "shared memory left behind"


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    d = base / f"transfer-test-{uuid.uuid4().hex[:8]}"
    d.mkdir(mode=0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(shm_dir: Path, tmp_path: Path) -> Iterator[DaemonProcess]:
    wd = tmp_path / "run"
    wd.mkdir(mode=0o700)
    d = start_daemon(FAST, workdir=wd, shm_dir=shm_dir)
    try:
        yield d
    finally:
        graceful = d.stop() == 0
    # A killed daemon leaves its lock and fd socket to the next one's sweep, never memory.
    assert (leftovers if graceful else segment_files)(shm_dir) == [], "files left behind"


@pytest.fixture
def brisk_daemon(shm_dir: Path, tmp_path: Path) -> Iterator[DaemonProcess]:
    """A daemon of its own that reclaims a session silent for BRISK_TIMEOUT_S."""
    wd = tmp_path / "brisk"
    wd.mkdir(mode=0o700)
    d = start_daemon([*FAST, *BRISK], workdir=wd, shm_dir=shm_dir)
    try:
        yield d
    finally:
        assert d.stop() == 0
    assert leftovers(shm_dir) == [], "files left behind"


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon for a module's tests that need nothing of their own (no flags, no stop, no
    counts of the whole daemon): each test's sessions are gone when it ends (a close is
    answered once the session's memory is released), so the next one starts from the same
    daemon state but for its counters. Starting a daemon costs ~0.4 s; most of a module's
    tests take less."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    shm = base / f"transfer-test-{uuid.uuid4().hex[:8]}"
    shm.mkdir(mode=0o700)
    wd = tmp_path_factory.mktemp("shared-daemon")
    wd.chmod(0o700)
    d = start_daemon(FAST, workdir=wd, shm_dir=shm)
    try:
        yield d
    finally:
        graceful = d.stop() == 0
        left = (leftovers if graceful else segment_files)(shm)
        shutil.rmtree(shm, ignore_errors=True)
    assert left == [], "files left behind"


@pytest.fixture
def daemon_factory(shm_dir: Path, tmp_path: Path) -> Iterator[object]:
    started: list[DaemonProcess] = []

    def make(*extra: str) -> DaemonProcess:
        wd = tmp_path / f"run{len(started)}"
        wd.mkdir(mode=0o700)
        d = start_daemon([*FAST, *extra], workdir=wd, shm_dir=shm_dir)
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop()


def _gpu_usable() -> tuple[bool, str]:
    try:
        from transfer.backends._cupy import CupyBackend
    except ImportError as exc:
        return False, f"CuPy not installed ({exc})"
    return CupyBackend.probe()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    usable, why = _gpu_usable()
    if usable:
        return
    skip = pytest.mark.skip(reason=f"no usable GPU: {why}")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


#: Backends the operator suite runs against: streamsim is a GPU's stream semantics in host RAM
#: (transfer/backends/_streamsim.py), so CPU-only CI checks the GPU code path's ordering too.
BACKENDS = ["numpy", "streamsim", pytest.param("cupy", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module", params=BACKENDS)
def backend_daemon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon per backend, shared by a module's tests: the operator suite runs against each.

    A GPU (simulated or real) gets all compute (`--size-threshold 0`, not size placement's
    CPU device for small work), so host operands are staged through its device memory."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    shm = base / f"transfer-test-{uuid.uuid4().hex[:8]}"
    shm.mkdir(mode=0o700)
    wd = tmp_path_factory.mktemp("run")
    wd.chmod(0o700)
    args = [a for a in FAST if a not in ("--backend", "numpy")]
    extra = ["--size-threshold", "0"] if request.param != "numpy" else []  # a GPU gets all the work
    d = start_daemon([*args, "--backend", request.param, *extra], workdir=wd, shm_dir=shm)
    try:
        yield d
    finally:
        graceful = d.stop() == 0
        try:
            # A killed daemon leaves its lock and fd socket to the next one's sweep, never memory.
            assert (leftovers if graceful else segment_files)(shm) == [], "files left behind"
        finally:
            shutil.rmtree(shm, ignore_errors=True)


def draining(endpoint: str, timeout: float = 30.0) -> None:
    """Return once the daemon refuses a new hello with ShuttingDown: its drain has begun."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(endpoint)
            s.send(P.encode_requests([P.Hello(1, P.VERSION, "probe", 0, b"")]))
            if not s.poll(5000):
                continue
            (r,) = P.decode_replies(s.recv())
            if isinstance(r.error, transfer.ShuttingDown):
                return
            s.send(P.encode_requests([P.Close(2)]))
        finally:
            s.close(0)
    raise AssertionError("the daemon never began to drain")
