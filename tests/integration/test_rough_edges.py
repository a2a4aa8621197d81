"""What a new user hit first: each rough edge, as that user meets it, against a real daemon."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import transfer


@pytest.fixture
def daemon(shared_daemon: Any) -> Any:
    """This module's tests share one daemon (`conftest.shared_daemon`) but those that take
    `daemon_factory` (a restart, a shared-memory directory to look at)."""
    return shared_daemon


# --- endpoints ----------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint, words", [
    ("foo", "the scheme is required"), ("/run/transferd.sock", "the scheme is required"), ("ipc://", "needs a socket path"),
    ("tcp://127.0.0.1", "is not tcp://HOST:PORT"), ("icp:///x", "unknown scheme 'icp'"),
    ("ipc://tmp/x", "relative path 'tmp/x'.*ipc:///tmp/x"), ("", "the endpoint is empty"),
])
def test_an_endpoint_without_a_scheme_is_a_clear_error(endpoint: str, words: str) -> None:
    with pytest.raises(ValueError, match=f"bad endpoint: .*{words}"):
        transfer.connect(endpoint)

    async def main() -> None:
        async with transfer.open_client(endpoint):
            pass

    with pytest.raises(ValueError, match="bad endpoint"):
        trio.run(main)


@pytest.mark.parametrize("opener", ["sync", "trio", "asyncio"])
def test_an_endpoint_that_is_not_a_string_is_a_clear_error(opener: str) -> None:
    """connect(5555) is a TypeError that says what an endpoint is, not an AttributeError."""
    with pytest.raises(TypeError, match=r"bad endpoint: 5555 \(int\) is not a string"):
        if opener == "sync":
            transfer.connect(5555)  # type: ignore[arg-type]
        else:
            async def main() -> None:
                open_ = transfer.open_client if opener == "trio" else transfer.open_asyncio_client
                async with open_(5555):  # type: ignore[arg-type]
                    pass

            if opener == "trio":
                trio.run(main)
            else:
                import asyncio

                asyncio.run(main())


def test_a_stale_socket_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "transferd.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # bound, never listening: what a daemon killed with -9 leaves
    t0 = time.monotonic()
    with pytest.raises(transfer.DaemonUnavailable, match="stale socket"):
        transfer.connect(f"ipc://{path}", connect_timeout=5.0)
    assert time.monotonic() - t0 < 1.0  # not the 5 s hello timeout


# --- shapes and allocations ---------------------------------------------------------------------
def test_a_negative_shape_names_the_dimension(daemon: Any) -> None:
    with transfer.connect(daemon.endpoint) as c:
        seg = c.segment(4096)
        msg = r"shape \(2, -3\): dimension 1 is -3; every dimension must be 0 or more"
        with pytest.raises(transfer.InvalidField, match=msg):
            seg.ndarray((2, -3), np.uint8)
        with pytest.raises(transfer.InvalidField, match=msg):
            seg.tensor((2, -3), np.uint8)
        with pytest.raises(transfer.InvalidField, match=msg):
            c.tensor(seg, (2, -3))
        with c.pool(4096, slots=1) as pool, pool.acquire() as slot:
            with pytest.raises(transfer.InvalidField, match=msg):
                slot.ndarray((2, -3))


def test_running_out_of_buffer_ids_says_what_to_do(daemon_factory: Any) -> None:
    d = daemon_factory("--arena-ids", "4")
    with transfer.connect(d.endpoint) as c:
        bufs = [c.alloc(64) for _ in range(4)]
        with pytest.raises(transfer.QuotaExceeded, match=r"already holds 4 device buffers on device \d+.*--arena-ids") as info:
            c.alloc(64)
        assert "free ids" not in str(info.value) and "arena on device" not in str(info.value)
        c.free(bufs[0])
        c.alloc(64)  # a freed id is reused


# --- pools ---------------------------------------------------------------------------------------
def _failing_submit(pool: Any, dst: Any) -> None:
    slot = pool.acquire(timeout=10)
    slot.ndarray(8)[:] = 1
    slot.submit(to=dst.va + dst.nbytes - 4, nbytes=8)  # runs past the buffer: fails in the daemon


def test_a_failed_submit_reaped_by_acquire_still_fails_drain(daemon: Any) -> None:
    with transfer.connect(daemon.endpoint) as c:
        dst = c.segment(4096)
        pool = c.pool(4096, slots=1)
        _failing_submit(pool, dst)
        pool.acquire(timeout=10).release()  # the failed slot came back here, unlooked-at
        with pytest.raises(transfer.OutOfBounds):
            pool.drain()
        pool.drain()  # reported once
        _failing_submit(pool, dst)
        assert pool.in_flight in (0, 1)
        time.sleep(0.2)
        assert pool.in_flight == 0  # reaped by the property, not seen by anyone yet
        with pytest.raises(transfer.OutOfBounds):
            pool.close()  # the segment is freed all the same
        assert pool.segment._shm is None


def test_pool_drain_reports_every_failure_once_in_order(daemon: Any) -> None:
    with transfer.connect(daemon.endpoint) as c:
        dst = c.segment(4096)
        with pytest.raises(transfer.OutOfBounds) as info:
            with c.pool(4096, slots=2) as pool:
                _failing_submit(pool, dst)
                _failing_submit(pool, dst)
        assert any("1 more submit(s) from this pool also failed" in n for n in getattr(info.value, "__notes__", []))


def test_trio_pool_close_raises_a_failed_submit(daemon: Any) -> None:
    async def main() -> None:
        async with transfer.open_client(daemon.endpoint) as c:
            dst = await c.segment(4096)
            pool = await c.pool(4096, slots=1)
            slot = await pool.acquire()
            slot.submit(to=dst.va + 4092, nbytes=8)
            (await pool.acquire()).release()
            with pytest.raises(transfer.OutOfBounds):
                await pool.close()

    trio.run(main)


# --- a daemon that goes away ---------------------------------------------------------------------
def test_a_restarted_daemon_gives_session_closed_not_no_session(daemon_factory: Any) -> None:
    daemon = daemon_factory()  # (its own: it restarts it)
    # watch_daemon_pid=False: as a client on another host would, it learns from the new daemon.
    with transfer.connect(daemon.endpoint, ring=False, watch_daemon_pid=False) as c:
        seg = c.segment(4096)
        daemon.restart()
        with pytest.raises((transfer.SessionClosed, transfer.ConnectionLost)) as info:
            c.fill(seg, 4096, 1).result(timeout=10)
        assert not isinstance(info.value, transfer.NoSession)
        with pytest.raises(transfer.SessionError, match="no longer has session"):
            c.fence()  # and every later call says the same


@pytest.mark.parametrize("ring", [False, True])
def test_a_daemon_shutting_down_never_reads_as_no_session(daemon_factory: Any, ring: bool) -> None:
    for _ in range(3):
        d = daemon_factory()
        with transfer.connect(d.endpoint, ring=ring) as c:
            seg = c.segment(4096)
            d.stop()
            with pytest.raises((transfer.SessionClosed, transfer.ConnectionLost, transfer.ShuttingDown)) as info:
                for _ in range(1000):
                    c.fill(seg, 4096, 1).result(timeout=15)
            assert not isinstance(info.value, transfer.NoSession)


# --- the trio client's errors are plain exceptions -----------------------------------------------
def _trio_raises(body: Any, endpoint: str) -> BaseException:
    async def main() -> None:
        async with transfer.open_client(endpoint) as c:
            await body(c)

    try:
        trio.run(main)
    except BaseException as exc:  # noqa: BLE001 - the point is what type arrives
        return exc
    raise AssertionError("nothing raised")


def test_trio_client_errors_are_not_exception_groups(daemon: Any, tmp_path: Path) -> None:
    async def bad_request(c: Any) -> None:
        await c.fill(0x1234 << 40, 8, 0)

    async def user_error(c: Any) -> None:
        raise KeyError("mine")

    async def unobserved(c: Any) -> None:
        c.fill(0x1234 << 40, 8, 0)
        await c.fence()

    for body, cls in ((bad_request, transfer.UnknownSegment), (user_error, KeyError), (unobserved, transfer.UnknownSegment)):
        exc = _trio_raises(body, daemon.endpoint)
        assert type(exc) is cls, repr(exc)
    exc = _trio_raises(user_error, f"ipc://{tmp_path}/nobody.sock")
    assert type(exc) is transfer.DaemonUnavailable, repr(exc)


def test_trio_client_sees_its_daemon_die_as_a_plain_error(daemon_factory: Any) -> None:
    d = daemon_factory()

    async def body(c: Any) -> None:
        seg = await c.segment(4096)
        d.kill()
        for _ in range(1000):
            await c.fill(seg, 4096, 1)
            await trio.sleep(0.01)

    exc = _trio_raises(body, d.endpoint)
    assert isinstance(exc, (transfer.ConnectionLost, transfer.SessionClosed)) and not isinstance(exc, BaseExceptionGroup), repr(exc)


@pytest.mark.parametrize("flavor", ["sync", "trio", "asyncio"])
def test_a_clean_close_counts_no_error(daemon: Any, flavor: str) -> None:
    """Closing a session normally is not a failure: the daemon's error counts (and so
    `transfer_errors_total` and the per-client `transfer_session_errors_total`) do not move,
    whichever client closes, with or without a ring."""
    with transfer.connect(daemon.endpoint, ring=False) as watcher:
        before = watcher.stats()["daemon"]["errors"]
        for ring in (True, False):
            if flavor == "sync":
                with transfer.connect(daemon.endpoint, ring=ring) as c:
                    c.segment(4096)
            else:
                async def session() -> None:
                    opener = transfer.open_client if flavor == "trio" else transfer.open_asyncio_client
                    async with opener(daemon.endpoint, ring=ring) as c:
                        await c.segment(4096)

                if flavor == "trio":
                    trio.run(session)
                else:
                    import asyncio

                    asyncio.run(session())
        watcher.fence()
        assert watcher.stats()["daemon"]["errors"] == before


def test_another_users_daemon_is_a_clear_error_at_once(daemon: Any) -> None:
    """A client of another uid than the daemon's gets, at once, a DaemonUnavailable that
    names the directory in its way, its owner, and what to do: not a raw PermissionError,
    nor a wait for an answer that cannot come (its connect timeout is 10 minutes here: the
    child finishes well inside the minute it is given only if it never waits for it)."""
    import subprocess
    import sys

    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another user")
    code = (
        "import os, transfer\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "try:\n"
        f"    transfer.connect({daemon.endpoint!r}, connect_timeout=600.0)\n"
        "except transfer.TransferError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, cwd="/")
    assert out.returncode == 0, out.stderr
    name, message = out.stdout.split(" ", 1)
    assert name == "DaemonUnavailable", out.stdout
    assert "belongs to uid 0" in message and "run as the daemon's user" in message, message


def test_a_float_size_says_so_once(daemon: Any) -> None:
    """segment(1.5): the reason names the type and the value once each."""
    with transfer.connect(daemon.endpoint) as c:
        with pytest.raises(transfer.InvalidField) as err:
            c.segment(1.5)  # type: ignore[arg-type]
    assert str(err.value).endswith("RegisterHost.nbytes: expected `int`, got `float` (1.5)"), str(err.value)


def test_transferd_help_shows_sizes_as_written_and_names_keygen() -> None:
    """`transferd --help`: byte defaults as one writes them (16GiB), and the keygen verb."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "transfer.cli.transferd", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "transferd keygen DIR" in out.split("\n\n")[0]
    flat = " ".join(out.split())
    assert "TRANSFER_MAX_DEVICE_BYTES; default 16GiB]" in flat and "17179869184" not in flat


def test_quota_errors_name_their_flag_in_human_units(daemon_factory: Any) -> None:
    """A session's host quota, the daemon's device budget, and a deferred alloc's quota each
    say how much in binary units and which flag sets it."""
    d = daemon_factory("--max-host-bytes-per-session", "1MiB", "--max-device-bytes", "2MiB")
    with transfer.connect(d.endpoint, deferred=False) as c:
        c.segment(768 << 10)
        with pytest.raises(transfer.QuotaExceeded, match=r"--max-host-bytes-per-session\): 768 KiB in use \+ 512 KiB asked > 1 MiB"):
            c.segment(512 << 10)
        with pytest.raises(transfer.OutOfDeviceMemory, match=r"alloc of 3 MiB: the daemon's device budget \(--max-device-bytes\) has 2 MiB of 2 MiB left"):
            c.alloc(3 << 20)
    with transfer.connect(d.endpoint) as c:
        with pytest.raises(transfer.QuotaExceeded, match=r"3 MiB created at .*may hold, 2 MiB \(0 B in use\).*--max-device-bytes"):
            c.alloc(3 << 20)


def test_the_daemon_removes_the_socket_directories_it_created(tmp_path: Path) -> None:
    """A daemon asked to serve in directories that do not exist yet creates them (0700) and,
    once stopped, leaves nothing behind: neither its socket nor those directories. One that
    already existed stays."""
    from transfer.testing import start_daemon

    from conftest import FAST

    base = tmp_path / "run"
    base.mkdir(mode=0o700)
    sock = base / "a" / "b" / "transferd.sock"
    d = start_daemon([*FAST, "--endpoint", f"ipc://{sock}"], workdir=base)
    try:
        assert (sock.parent.stat().st_mode & 0o777) == 0o700
        with transfer.connect(f"ipc://{sock}") as c:
            c.fence()
    finally:
        assert d.stop() == 0
    assert base.exists() and list(base.iterdir()) == [], list(base.iterdir())


def test_a_normal_close_is_logged_at_info(tmp_path: Path) -> None:
    """At INFO the daemon logs a session's open and its client's close (docs/operations.md)."""
    import json
    import subprocess
    import sys

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    ep = f"ipc://{run}/transferd.sock"
    proc = subprocess.Popen([sys.executable, "-m", "transfer.cli.transferd", "--endpoint", ep, "--backend", "numpy", "--ready",
                             "--log-level", "INFO", "--log-json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and json.loads(proc.stdout.readline())["event"] == "ready"
        with transfer.connect(ep, name="closer") as c:
            sid = c.session_id
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    msgs = [json.loads(ln)["msg"] for ln in err.splitlines() if ln.startswith("{")]
    assert f"session {sid} opened by 'closer' (pid {os.getpid()})" in msgs, msgs
    assert f"session {sid} closed by its client" in msgs, msgs


@pytest.mark.parametrize("argv, words", [
    (["--reps", "0"], "argument --reps: '0': must be at least 1"),
    (["--rep-seconds", "-1"], "argument --rep-seconds: '-1': must be at least 0.01"),
    (["--producers", "abc"], "--producers 'abc': expected N, a list like 1,2,4"),
    (["--depth", "0"], "--depth '0': expected N"),
    (["--batch", "x"], "argument --batch: 'x' is not a whole number"),
])
def test_transfer_bench_refuses_bad_arguments_before_running(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Bad counts and durations are refused at once, with the flag and the value named: no run
    that silently uses a default (`--reps 0` ran 5) or fails after running."""
    from transfer.cli import bench

    try:
        rc = bench.main(argv)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    assert rc == 2 and words in capsys.readouterr().err


def test_transfer_bench_has_a_version(capsys: pytest.CaptureFixture[str]) -> None:
    from transfer.cli import bench

    with pytest.raises(SystemExit) as exc:
        bench.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("transfer-bench ")


def test_a_byte_budget_below_a_page_is_refused() -> None:
    """`--max-host-bytes 1.5K` is 1536 bytes: a budget that admits no segment, refused with
    what a size is, not accepted silently."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "transfer.cli.transferd", "--max-host-bytes", "1.5K", "--print-config"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "max_host_bytes = 1536 from flag --max-host-bytes: a budget below one page (4 KiB) admits nothing" in out.stderr, out.stderr


def test_the_benchmark_runs_from_the_folder_that_holds_the_checkout(tmp_path: Path) -> None:
    """From a folder holding a folder named `transfer` (the checkout, as `git clone` names it),
    the processes transfer-bench spawns still import the package, not that folder as a
    namespace package ("cannot import name 'checksum64' from 'transfer' (unknown location)")."""
    import subprocess
    import sys

    (tmp_path / "transfer").symlink_to(Path(transfer.__file__).resolve().parent.parent)
    bench = Path(sys.executable).parent / "transfer-bench"
    out = subprocess.run([str(bench), "--sizes", "4K", "--modes", "local", "--methods", "transfer", "--reps", "1",
                          "--rep-seconds", "0.05", "--no-progress"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
