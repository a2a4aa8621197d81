"""A client cannot crash the daemon by truncating the memory behind its segment or ring.

Security item "Crash by SIGBUS": a client that shrinks the file behind a mapping
the daemon reads makes the daemon's next access raise SIGBUS, which kills it and
every other tenant with it. The daemon now maps only sealed memfds
(F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) handed over a Unix socket, so every
way a hostile client has of reaching the memory (the fd it received, /proc/self/fd,
/proc/self/map_files, the daemon's /proc/<pid>/fd) ends in EPERM.

The hostile clients are real processes (a script run with the test's Python).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import transfer

_HOSTILE = textwrap.dedent(
    r"""
    import errno, json, os, sys, time
    import numpy as np
    import transfer

    endpoint, what, daemon_pid = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def mapping_of(addr):
        with open("/proc/self/maps") as f:
            for line in f:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= addr < hi:
                    return lo, hi
        raise SystemExit(f"no mapping holds {addr:#x}")

    def truncate_all(addr):
        # Every route this process has to the memory behind the mapping at `addr`.
        out = {}
        lo, hi = mapping_of(addr)
        routes = [f"/proc/self/map_files/{lo:x}-{hi:x}"]
        for d in ("/proc/self/fd", f"/proc/{daemon_pid}/fd"):
            for name in os.listdir(d):
                p = f"{d}/{name}"
                try:
                    target = os.readlink(p)
                except OSError:
                    continue
                if "memfd:" in target or "transfer." in target:
                    routes.append(p)
        try:
            st = os.stat(routes[0])
            want = (st.st_dev, st.st_ino)
        except OSError:
            want = None
        for p in routes:
            try:
                fd = os.open(p, os.O_RDWR)
            except OSError as exc:
                out[p] = f"open: {errno.errorcode.get(exc.errno, exc.errno)}"
                continue
            st = os.fstat(fd)
            if want is not None and (st.st_dev, st.st_ino) != want:
                os.close(fd)
                continue  # other memory (another segment, a lock file): not the one we test
            try:
                os.ftruncate(fd, 0)
                out[p] = "truncated"
            except OSError as exc:
                out[p] = errno.errorcode.get(exc.errno, str(exc.errno))
            finally:
                os.close(fd)
        return out

    with transfer.connect(endpoint, ring=(what == "ring")) as c:
        seg = c.segment(1 << 20)
        seg.buffer[:] = 7
        if what == "segment":
            addr = seg.buffer.ctypes.data
        else:
            mm = c._ring.ring._mm
            view = np.frombuffer(mm, np.uint8)
            addr = view.ctypes.data
            del view
        tried = truncate_all(addr)
        print(json.dumps({"tried": tried}), flush=True)
        if what == "ring":
            # Wake the daemon's ring loop: it reads the ring header now.
            os.write(c._ring.bell_fd, b"\0")
            time.sleep(0.3)
        if what == "ring" and any(v == "truncated" for v in tried.values()):
            os._exit(3)  # pushing a descriptor would touch the ring here first (SIGBUS in us)
        try:
            cks = c.checksum(seg).result(10)  # the daemon reads the segment now
        except transfer.TransferError as exc:
            print(json.dumps({"error": repr(exc)}), flush=True)
            os._exit(4)
        print(json.dumps({"checksum": cks, "expect": transfer.checksum64(np.full(1 << 20, 7, np.uint8))}), flush=True)
    """
)


def _run_hostile(tmp_path: Path, endpoint: str, what: str, daemon_pid: int) -> list[dict]:
    script = tmp_path / "hostile.py"
    script.write_text(_HOSTILE)
    proc = subprocess.run(
        [sys.executable, str(script), endpoint, what, str(daemon_pid)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(transfer.__file__).parents[1])},
    )
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    if not lines:
        raise AssertionError(f"hostile client failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return lines


@pytest.mark.parametrize("what", ["segment", "ring"])
def test_truncating_its_memory_cannot_kill_the_daemon(what: str, daemon, tmp_path: Path) -> None:
    with transfer.connect(daemon.endpoint, ring=True) as other:
        mine = other.segment(1 << 16)
        mine.buffer[:] = np.arange(1 << 16, dtype=np.uint64).view(np.uint8)[: 1 << 16]
        expect = transfer.checksum64(mine.buffer)
        assert other.checksum(mine).result(10) == expect

        lines = _run_hostile(tmp_path, daemon.endpoint, what, daemon.pid)
        tried = lines[0]["tried"]
        if not tried or all(v.startswith("open:") for v in tried.values()):
            pytest.skip(f"no route to the memory from a client here: {tried}")
        time.sleep(0.5)  # the daemon notices the client's exit and releases its session

        # The daemon survives, and the other tenant keeps getting correct answers.
        assert daemon.alive(), f"the daemon died (exit {daemon.proc.returncode}); the client tried {tried}"
        for _ in range(20):
            assert other.checksum(mine).result(10) == expect
        # Every route was refused by the seals; the hostile client's own request worked too.
        assert "truncated" not in tried.values(), tried
        assert "EPERM" in tried.values(), tried
        assert set(tried.values()) <= {"EPERM", "open: EACCES", "open: EPERM", "open: ENOENT"}, tried
        assert len(lines) == 2 and lines[1]["checksum"] == lines[1]["expect"]
