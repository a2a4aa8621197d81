"""Small requests through a real transferd: the shared-memory ring against zmq.

One run, one daemon process, the same requests (64-byte copies between two places
in one shared segment) over each path:

* round trip: submit one request, wait for its answer; p50/p90/p99 and requests/s;
* batched: 1024 requests submitted together, then wait for all; requests/s.

Paths: `ring` (Client(ring=True): the library's API), `ring-raw` (descriptors pushed
on the session's ring by hand: what the daemon itself adds to the ring's own cost),
`zmq` (Client(ring=False): one frame per request, or one frame per batch).

`--idle S`: then S seconds with two sessions' rings open and nothing to do, and the CPU
seconds the daemon (its ring workers, event loop and pump) used meanwhile: an idle daemon
should use next to none (its workers sleep on the ring's futex, its loop on the doorbell).

    .venv/bin/python bench/ring_daemon.py [--n 20000] [--batches 300] [--idle 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

import transfer
from transfer.ring import Op
from transfer.testing import run_daemon

SIZE = 64
BATCH = 1024


def _stats(lat_s: list[float]) -> dict[str, float]:
    a = np.asarray(lat_s) * 1e6
    return {
        "p50_us": round(float(np.percentile(a, 50)), 2),
        "p90_us": round(float(np.percentile(a, 90)), 2),
        "p99_us": round(float(np.percentile(a, 99)), 2),
        "requests_per_s": round(len(a) / (a.sum() / 1e6)),
    }


def _timed(fn: Callable[[int], None], n: int, warm: int) -> list[float]:
    for i in range(warm):
        fn(i)
    out = []
    clock = time.perf_counter
    for i in range(n):
        t0 = clock()
        fn(i)
        out.append(clock() - t0)
    return out


def _client_paths(client: transfer.Client, seg: Any, n: int, batches: int) -> dict[str, Any]:
    src, dst = seg.at(0), seg.at(1 << 16)
    rt = _timed(lambda i: client.copy(dst, src, SIZE).result(), n, n // 10)

    def batch(_: int) -> None:
        with client.batch():
            for k in range(BATCH):
                client.copy(seg.at((1 << 16) + k * SIZE), seg.at(k * SIZE), SIZE)
        client.fence()

    bt = _timed(batch, batches, max(1, batches // 10))
    return {"round_trip": _stats(rt), "batched_requests_per_s": round(BATCH * len(bt) / sum(bt)),
            "batch_p50_us": round(float(np.percentile(bt, 50)) * 1e6, 1)}


def _raw_paths(client: transfer.Client, seg: Any, n: int, batches: int) -> dict[str, Any]:
    """Descriptors straight on the session's ring (ids far above the client's own)."""
    ring = client._ring.ring  # type: ignore[union-attr]
    src, dst = seg.at(0), seg.at(1 << 16)
    base = 1 << 62

    def one(i: int) -> None:
        ring.push((Op.COPY, base + i, dst, src, SIZE, 0, 0, 0, 0, 0))
        while ring.wait(timeout=1.0) == 0:
            pass
        c = ring.pop()
        if c[1] != 0:
            raise RuntimeError(f"descriptor failed: {c}")

    rt = _timed(one, n, n // 10)
    descs = np.zeros(BATCH, ring.out_dtype)
    descs["op"] = Op.COPY
    descs["nbytes"] = SIZE
    descs["src"] = np.arange(BATCH, dtype=np.uint64) * SIZE + src
    descs["dst"] = np.arange(BATCH, dtype=np.uint64) * SIZE + dst
    counter = [base + n * 2]

    def batch(_: int) -> None:
        descs["id"] = np.arange(counter[0], counter[0] + BATCH, dtype=np.uint64)
        counter[0] += BATCH
        assert ring.push_many(descs, timeout=5.0) == BATCH
        got = 0
        while got < BATCH:
            ring.wait(timeout=1.0, need=BATCH - got)
            c = ring.pop_many()
            if c["status"].any():
                raise RuntimeError("a descriptor failed")
            got += len(c)

    bt = _timed(batch, batches, max(1, batches // 10))
    return {"round_trip": _stats(rt), "batched_requests_per_s": round(BATCH * len(bt) / sum(bt)),
            "batch_p50_us": round(float(np.percentile(bt, 50)) * 1e6, 1)}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _idle_cpu(daemon: Any, seconds: float) -> dict[str, Any]:
    """Two sessions with rings (their workers started by a request each), then `seconds` of
    nothing: the daemon's CPU seconds meanwhile (after a moment past the workers' spin)."""
    with transfer.connect(daemon.endpoint, ring=True) as a, transfer.connect(daemon.endpoint, ring=True) as b:
        for c in (a, b):
            s = c.segment(4096)
            c.copy(s.at(64), s.at(0), 64).result()
        time.sleep(0.3)
        before = _cpu_seconds(daemon.pid)
        time.sleep(seconds)
        used = _cpu_seconds(daemon.pid) - before
        for c in (a, b):  # and it still answers at once
            s = c.segment(4096)
            c.copy(s.at(64), s.at(0), 64).result(5)
    return {"seconds": seconds, "rings": 2, "cpu_s": round(used, 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000, help="round trips per path")
    ap.add_argument("--batches", type=int, default=300, help=f"batches of {BATCH} per path")
    ap.add_argument("--idle", type=float, default=0.0, metavar="S",
                    help="then S seconds of two open rings and nothing to do: the daemon's CPU meanwhile")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    results: dict[str, Any] = {}
    # Everything this run makes goes with it: the shm dir (tmpfs, as the daemon expects) and,
    # through run_daemon, the daemon's socket directory; a daemon leaves its lock file behind.
    shm_base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="ring-bench-shm-", dir=shm_base) as shm, \
            run_daemon(["--backend", "numpy"], shm_dir=Path(shm)) as daemon:
        with transfer.connect(daemon.endpoint, ring=True) as c:
            seg = c.segment(1 << 20)
            seg.buffer[:] = np.random.default_rng(1).integers(0, 256, seg.nbytes, dtype=np.uint8)
            results["ring"] = _client_paths(c, seg, args.n, args.batches)
            results["ring-raw"] = _raw_paths(c, seg, args.n, args.batches)
            ok = bytes(seg.buffer[1 << 16 : (1 << 16) + BATCH * SIZE]) == bytes(seg.buffer[: BATCH * SIZE])
        with transfer.connect(daemon.endpoint, ring=False) as c:  # (the default client takes the ring)
            seg = c.segment(1 << 20)
            results["zmq"] = _client_paths(c, seg, max(1, args.n // 4), max(1, args.batches // 2))
        idle = _idle_cpu(daemon, args.idle) if args.idle > 0 else None
    if not ok:
        print("copies did not land: results are void", file=sys.stderr)
        return 1
    meta = {
        "command": "python bench/ring_daemon.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "request_bytes": SIZE,
        "batch": BATCH,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg": os.getloadavg()[0],
    }
    print(f"ring vs zmq through transferd; {SIZE}-byte copies; load {meta['loadavg']:.1f}")
    print(f"{'path':10} {'rt p50 µs':>10} {'p90':>8} {'p99':>8} {'rt req/s':>10} {'batched req/s':>14}")
    for name, r in results.items():
        rt = r["round_trip"]
        print(f"{name:10} {rt['p50_us']:>10} {rt['p90_us']:>8} {rt['p99_us']:>8} {rt['requests_per_s']:>10} {r['batched_requests_per_s']:>14}")
    z = results["zmq"]
    ratio = {k: {"p50_vs_zmq": round(z["round_trip"]["p50_us"] / r["round_trip"]["p50_us"], 1),
                 "batched_vs_zmq": round(r["batched_requests_per_s"] / z["batched_requests_per_s"], 2)}
             for k, r in results.items() if k != "zmq"}
    print("speedup over zmq:", ratio)
    if idle is not None:
        print(f"idle: the daemon used {idle['cpu_s']:.3f} s of CPU in {idle['seconds']:.1f} s with {idle['rings']} rings open")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"meta": meta, "results": results, "vs_zmq": ratio, **({"idle": idle} if idle is not None else {})}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
