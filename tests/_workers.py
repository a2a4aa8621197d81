"""Code that runs in separate client processes during integration tests."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import transfer


def producer(endpoint: str, seed: int, rounds: int) -> None:
    """Stream batches of random sizes; verify every byte both ways; exit 0 only if all matched."""
    rng = np.random.default_rng(seed)
    with transfer.connect(endpoint, name=f"producer{seed}") as c:
        cap = 4 << 20
        seg = c.segment(cap)
        back = c.segment(cap)
        buf = c.alloc(cap)
        for r in range(rounds):
            n = int(rng.integers(1, cap))
            off = int(rng.integers(0, cap - n + 1))
            data = seg.ndarray((n,), np.uint8, offset=off)
            data[:] = rng.integers(0, 256, n, dtype=np.uint8)
            c.copy(buf.va, seg.va + off, n)
            cks = c.checksum(buf.va, n)
            c.copy(back.va, buf.va, n)
            c.fence()
            if cks.result() != transfer.checksum64(data):
                sys.exit(f"checksum mismatch in round {r}")
            if not np.array_equal(back.ndarray((n,), np.uint8), data):
                sys.exit(f"bytes differ in round {r}")
    sys.exit(0)


def streamer(endpoint: str, ready_path: str) -> None:
    """Hold segments and stream copies until killed."""
    with transfer.connect(endpoint, name="victim") as c:
        segs = [c.segment(1 << 20) for _ in range(3)]
        buf = c.alloc(1 << 20)
        with open(ready_path, "w") as f:
            f.write(str(os.getpid()))
        i = 0
        while True:
            segs[i % 3].buffer[:8] = i % 251
            c.copy(buf, segs[i % 3])
            if i % 64 == 0:
                c.fence()
            i += 1


def wait_for_file(path: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) or os.path.getsize(path) == 0:
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.02)


def device_streamer(endpoint: str, ready_path: str) -> None:
    """Stream host-to-device ring copies, many in flight, until killed."""
    with transfer.connect(endpoint, name="device-victim", deferred=False) as c:
        seg = c.segment(8 << 20)
        bufs = [c.alloc(8 << 20) for _ in range(2)]
        seg.buffer[:] = 7
        c.copy(bufs[0], seg, 8 << 20).result()
        with open(ready_path, "w") as f:
            f.write(str(os.getpid()))
        i = 0
        while True:
            c.copy(bufs[i % 2], seg, 8 << 20)
            if i % 16 == 15:
                c.fence()
            i += 1
