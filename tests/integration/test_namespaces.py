"""A producer in containers that share only the socket directory with the daemon: its own
PID, IPC, mount, network and UTS namespaces (`unshare`), an empty `/dev/shm` of its own, the
daemon's socket directory the one thing in common (it holds the endpoint and, with
`--shm-dir` there, the fd socket: memory travels as memfds over it). It registers memory,
copies and checks, is isolated from the other tenant, and its session is reclaimed through
its real pid when it is killed. docs/operations.md, "Containers"."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import transfer
from transfer.testing import start_daemon

from conftest import FAST

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="needs root and unshare(1) to make namespaces")

PRODUCER = textwrap.dedent("""
    import os, sys, numpy as np, transfer
    endpoint, foreign, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    assert os.listdir("/dev/shm") == [], os.listdir("/dev/shm")  # nothing of the daemon's here
    with transfer.connect(endpoint, name="contained") as c:
        seg, dev = c.segment(1 << 20), c.alloc(1 << 20)
        data = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
        seg.buffer[:] = data
        c.copy(dev, seg, 1 << 20).result()
        back = c.segment(1 << 20)
        c.copy(back, dev, 1 << 20).result()
        assert np.array_equal(back.buffer, data) and c.checksum(dev).result() == transfer.checksum64(data)
        try:
            c.copy(seg.va, foreign, 64).result()
            raise SystemExit("read another tenant's memory")
        except transfer.NotOwner:
            pass
        print("ok pid", os.getpid(), flush=True)
        if mode == "hold":
            sys.stdin.read()  # until killed
""")


def _contained(*args: str, stdin: int | None = None) -> subprocess.Popen[str]:
    """The producer in namespaces of its own, with an empty private /dev/shm."""
    inner = f"mount -t tmpfs none /dev/shm && exec {sys.executable} -c \"$0\" \"$@\""
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--ipc", "--net", "--uts", "--kill-child",
           "sh", "-c", inner, PRODUCER, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=stdin, text=True)


def test_a_producer_that_shares_only_the_socket_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    log = tmp_path / "transferd.log"
    d = start_daemon([*FAST, "--shm-dir", str(run), "--log-level", "INFO"], workdir=run, log=log)
    try:
        with transfer.connect(d.endpoint, name="host-tenant") as host:
            mine = host.segment(4096)
            p = _contained(d.endpoint, str(mine.va), "once")
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            assert out.startswith("ok pid "), out
            assert int(out.split()[2]) < 100  # (its own pid namespace: a small number)
            # Killed with memory registered: reclaimed through its real pid, nothing left.
            p = _contained(d.endpoint, str(mine.va), "hold", stdin=subprocess.PIPE)
            assert p.stdout is not None and p.stdout.readline().startswith("ok pid ")
            p.kill()  # unshare --kill-child: the producer dies with it
            p.wait(30)
            while host.stats()["daemon"]["sessions"] != 1:
                host.fence()
            assert host.stats()["daemon"]["segments"] == 1  # the host tenant's only
    finally:
        d.stop()
    text = log.read_text()
    assert "its process is pid" in text and "ended: client pid" in text, text[-3000:]
