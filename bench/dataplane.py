"""The data plane's own targets, measured in one run (issue 15; docs/benchmarks.md).

Each figure comes from real daemons (`transferd` processes) and real clients,
and each is compared with a baseline measured in the same run:

* **copy_many of 4 KiB pieces**, one producer, 4 vectors in flight: requests/s
  on the ring (native workers), on the ring served by the event loop
  (`--no-ring-workers`) and on the socket; contiguous pieces (a batch of
  consecutive items, which the data plane merges) and strided ones (every
  piece its own memmove).
* **Isolation**: one session's 64 B round trips (p50/p99) alone, and while
  another session copies 128 MiB pieces without pause; with workers and
  without.
* **The producer API**: client CPU per item of a `SlotPool` cycle (acquire,
  write through a view, submit, release as completions come) against a plain
  `copy()` of the same bytes from a segment.

    python bench/dataplane.py [--json bench/results/dataplane.json] [--seconds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import transfer
from transfer.testing import start_daemon

S = 4096


def _daemon(*extra: str) -> Any:
    wd = Path(tempfile.mkdtemp(prefix="dp-bench-"))
    shm = Path("/dev/shm") / f"dp-bench-{os.getpid()}-{len(extra)}-{time.monotonic_ns()}"
    shm.mkdir(mode=0o700)
    d = start_daemon(["--backend", "numpy", *extra], workdir=wd, shm_dir=shm)
    d._cleanup = (wd, shm)  # type: ignore[attr-defined]
    return d


def _stop(d: Any) -> None:
    d.stop()
    for p in d._cleanup:
        shutil.rmtree(p, ignore_errors=True)


def copy_many_rate(endpoint: str, ring: bool, pieces: int, strided: bool, seconds: float) -> float:
    """Requests (pieces) per second of 4 KiB copy_many vectors, 4 in flight."""
    with transfer.connect(endpoint, ring=None if ring else False) as c:
        span = pieces * S * (2 if strided else 1)
        seg = c.segment(4 * span)
        seg.ndarray((4 * span,), np.uint8)[:] = 1
        dev = c.alloc(4 * pieces * S)
        # Defined (one awaited request) before the timed loop: the steady state is measured, and
        # the blocking client is on the ring from the first vector (docs/ring.md, "Routing").
        c.fill(dev, 8, 0).result()
        offs = np.arange(pieces, dtype=np.uint64) * np.uint64(S)
        soffs = offs * np.uint64(2) if strided else offs
        sizes = np.full(pieces, S, np.uint64)
        inflight: list[Any] = []
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            slot = n % 4
            if len(inflight) == 4:
                inflight.pop(0).result()
            inflight.append(c.copy_many(dev.va + slot * pieces * S + offs, seg.va + slot * span + soffs, sizes))
            n += 1
        for p in inflight:
            p.result()
        return n * pieces / (time.perf_counter() - t0)


def isolation(endpoint: str, seconds: float) -> dict[str, float]:
    """64 B round trips of one session, alone and beside a session copying 128 MiB pieces."""
    out: dict[str, float] = {}
    with transfer.connect(endpoint) as small:
        s = small.segment(4096)

        def trips(n: int) -> np.ndarray:
            lat = np.empty(n)
            for i in range(n):
                t = time.perf_counter()
                small.copy(s.va + 64, s.va, 64).result(timeout=30)
                lat[i] = time.perf_counter() - t
            return lat * 1e6

        trips(500)
        alone = trips(3000)
        out["alone_p50_us"], out["alone_p99_us"] = float(np.percentile(alone, 50)), float(np.percentile(alone, 99))
        stop = threading.Event()
        moved = [0]

        def neighbour() -> None:
            n = 128 << 20
            with transfer.connect(endpoint) as big:
                seg = big.segment(2 * n)
                seg.ndarray((2 * n,), np.uint8)[:] = 1
                while not stop.is_set():
                    big.copy(seg.va + n, seg.va, n).result(timeout=60)
                    moved[0] += n

        t = threading.Thread(target=neighbour)
        t.start()
        time.sleep(0.5)
        t0 = time.perf_counter()
        beside = trips(3000)
        dt = time.perf_counter() - t0
        stop.set()
        t.join()
        out["beside_p50_us"], out["beside_p99_us"] = float(np.percentile(beside, 50)), float(np.percentile(beside, 99))
        out["neighbour_gbs"] = moved[0] / 1e9 / max(dt, 1e-9)
    return out


def pool_vs_copy(endpoint: str, nbytes: int, seconds: float) -> dict[str, float]:
    """Client CPU seconds per item: a SlotPool cycle vs copy() from a segment (4 slots in flight)."""
    out: dict[str, float] = {}
    with transfer.connect(endpoint) as c:
        dev = c.alloc(4 * nbytes)
        pool = c.pool(nbytes, slots=4)
        seg = c.segment(4 * nbytes)
        views = [seg.ndarray((nbytes,), np.uint8, offset=i * nbytes) for i in range(4)]
        for name in ("copy", "pool"):
            n = 0
            inflight: list[Any] = []
            c0, t0 = time.process_time(), time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                i = n % 4
                if name == "pool":
                    slot = pool.acquire(timeout=30)
                    slot.ndarray((nbytes,), np.uint8)[:8] = n & 0xFF
                    slot.submit(dev.va + i * nbytes)
                else:
                    if len(inflight) == 4:
                        inflight.pop(0).result()
                    views[i][:8] = n & 0xFF
                    inflight.append(c.copy(dev.va + i * nbytes, seg.va + i * nbytes, nbytes))
                n += 1
            if name == "pool":
                pool.drain()
            for p in inflight:
                p.result()
            out[f"{name}_cpu_us_per_item"] = (time.process_time() - c0) / n * 1e6
            out[f"{name}_items_per_s"] = n / (time.perf_counter() - t0)
        pool.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    res: dict[str, Any] = {"machine": {"cpus": os.cpu_count()}, "copy_many": {}, "isolation": {}, "pool": {}}
    workers, loop = _daemon("--ring-workers"), _daemon("--no-ring-workers")
    try:
        for label, ep, ring in (("ring-workers", workers.endpoint, True), ("ring-event-loop", loop.endpoint, True), ("socket", workers.endpoint, False)):
            for pieces in (1024, 64):
                for strided in (False, True):
                    key = f"{label} {pieces}x4KiB {'strided' if strided else 'contiguous'}"
                    r = copy_many_rate(ep, ring, pieces, strided, args.seconds)
                    res["copy_many"][key] = r
                    print(f"copy_many {key:42s} {r / 1e6:6.3f} M req/s", flush=True)
        for label, ep in (("ring-workers", workers.endpoint), ("ring-event-loop", loop.endpoint)):
            r = isolation(ep, args.seconds)
            res["isolation"][label] = r
            print(f"isolation {label:16s} " + "  ".join(f"{k} {v:.1f}" for k, v in r.items()), flush=True)
        for nbytes in (4096, 1 << 20):
            r = pool_vs_copy(workers.endpoint, nbytes, args.seconds)
            res["pool"][str(nbytes)] = r
            print(f"pool vs copy {nbytes:8d} B  " + "  ".join(f"{k} {v:.1f}" for k, v in r.items()), flush=True)
    finally:
        _stop(workers)
        _stop(loop)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
