#!/usr/bin/env python3
"""Shared-memory ring vs pyzmq DEALER/ROUTER ipc: round-trip latency and batched throughput.

Two processes on one host: this script (the client) and a server it spawns
(this script again, ``--serve-ring`` / ``--serve-zmq``). Both transports
carry the same bytes: 64-byte request descriptors (transfer._ring.REQUEST_DTYPE)
one way, 32-byte completions (COMPLETION_DTYPE) back, and the servers do the
same work (echo id, status 0, result = nbytes).

* ``latency``: one request, then wait for its completion; p50/p99 and
  requests/s over ``--n`` round trips.
* ``batch``: push 1000 descriptors at once, wait for their 1000 completions;
  descriptors/s over ``--batches`` batches.

Usage:  .venv/bin/python bench/ring_bench.py [--impl native|python|both] [--n 20000]
        [--batches 1000] [--spin 200e-6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from transfer._ring import COMPLETION_DTYPE, REQUEST_DTYPE, Ring, available_implementations

BATCH = 1000


def _complete(reqs: np.ndarray) -> np.ndarray:
    c = np.zeros(len(reqs), COMPLETION_DTYPE)
    c["id"] = reqs["id"]
    c["result"] = reqs["nbytes"]
    return c


# --- servers ----------------------------------------------------------------------------
def serve_ring(path: str, spin: float) -> None:
    with Ring.attach(path, role="server") as srv:
        while True:
            n = srv.wait(timeout=1.0, spin=spin)
            if n == 0:
                if srv.peer_closed:
                    return
                continue
            if n == 1:  # latency path: tuples, no NumPy
                r = srv.pop()
                srv.push((r[1], 0, r[4]), timeout=5.0)
            else:
                srv.push_many(_complete(srv.pop_many()), timeout=5.0)


def serve_zmq(addr: str) -> None:
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.linger = 0
    s.bind(addr)
    print("ready", flush=True)
    import struct

    struct_one = struct.Struct("<QiIQQ")  # id, status, (flags), result, aux  == COMPLETION_DTYPE bytes
    while True:
        ident, msg = s.recv_multipart(copy=True)
        if msg == b"stop":
            break
        if len(msg) == REQUEST_DTYPE.itemsize:
            # id at 8, nbytes at 32 (REQUEST_DTYPE offsets)
            rid, nbytes = int.from_bytes(msg[8:16], "little"), int.from_bytes(msg[32:40], "little")
            s.send_multipart([ident, struct_one.pack(rid, 0, 0, nbytes, 0)])
        else:
            reqs = np.frombuffer(msg, REQUEST_DTYPE)
            s.send_multipart([ident, _complete(reqs).tobytes()])
    s.close()
    ctx.term()


# --- clients ------------------------------------------------------------------------------
def _stats(ns: np.ndarray, wall: float, count: int) -> dict:
    us = ns / 1e3
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "per_s": count / wall}


def bench_ring(impl: str, n: int, batches: int, spin: float) -> dict:
    d = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path = d / f"ring-bench-{uuid.uuid4().hex[:8]}"
    out = {}
    with Ring.create(path, 4096, 4096, role="client", impl=impl) as cli:
        env = dict(os.environ, TRANSFER_RING=impl)
        server = subprocess.Popen([sys.executable, __file__, "--serve-ring", str(path), "--spin", str(spin)], env=env)
        try:
            cli.spin = spin
            # latency: one request, wait for its completion
            times = np.empty(n, np.int64)
            warm = min(2000, n)
            for i in range(-warm, n):
                t0 = time.perf_counter_ns()
                cli.push((1, i & 0xFFFFFFFF, 0x10000000000, 0x20000000000, 64))
                if cli.wait(timeout=5.0) == 0:
                    raise RuntimeError("ring server did not answer")
                c = cli.pop()
                t1 = time.perf_counter_ns()
                if i >= 0:
                    times[i] = t1 - t0
                assert c[0] == i & 0xFFFFFFFF and c[2] == 64
            out["latency"] = _stats(times, times.sum() / 1e9, n)
            # batched: push 1000, collect 1000 completions
            reqs = np.zeros(BATCH, REQUEST_DTYPE)
            reqs["op"] = 1
            reqs["nbytes"] = 64
            reqs["id"] = np.arange(BATCH)
            btimes = np.empty(batches, np.int64)
            for b in range(-10, batches):
                t0 = time.perf_counter_ns()
                if cli.push_many(reqs, timeout=5.0) != BATCH:
                    raise RuntimeError("ring full")
                got = 0
                while got < BATCH:
                    if cli.wait(timeout=5.0) == 0:
                        raise RuntimeError("ring server did not answer")
                    got += len(cli.pop_many())
                if b >= 0:
                    btimes[b] = time.perf_counter_ns() - t0
            out["batch"] = _stats(btimes, btimes.sum() / 1e9, batches * BATCH)
        finally:
            cli.close()
            server.wait(10)
            path.unlink(missing_ok=True)
    return out


def bench_zmq(n: int, batches: int) -> dict:
    import zmq

    tmp = tempfile.mkdtemp(prefix="ring-bench-")
    addr = f"ipc://{tmp}/zmq.sock"
    server = subprocess.Popen([sys.executable, __file__, "--serve-zmq", addr], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.connect(addr)
    out = {}
    try:
        desc = np.zeros(1, REQUEST_DTYPE)
        desc["op"], desc["nbytes"] = 1, 64
        times = np.empty(n, np.int64)
        warm = min(2000, n)
        for i in range(-warm, n):
            desc["id"] = i & 0xFFFFFFFF
            t0 = time.perf_counter_ns()
            s.send(desc.tobytes())
            c = np.frombuffer(s.recv(), COMPLETION_DTYPE)
            t1 = time.perf_counter_ns()
            if i >= 0:
                times[i] = t1 - t0
            assert c["id"][0] == i & 0xFFFFFFFF
        out["latency"] = _stats(times, times.sum() / 1e9, n)
        reqs = np.zeros(BATCH, REQUEST_DTYPE)
        reqs["op"], reqs["nbytes"], reqs["id"] = 1, 64, np.arange(BATCH)
        btimes = np.empty(batches, np.int64)
        for b in range(-10, batches):
            t0 = time.perf_counter_ns()
            s.send(reqs.tobytes())
            c = np.frombuffer(s.recv(), COMPLETION_DTYPE)
            if b >= 0:
                btimes[b] = time.perf_counter_ns() - t0
            assert len(c) == BATCH
        out["batch"] = _stats(btimes, btimes.sum() / 1e9, batches * BATCH)
        s.send(b"stop")
    finally:
        s.close()
        ctx.term()
        server.wait(10)
        try:
            os.unlink(f"{tmp}/zmq.sock")
        except FileNotFoundError:
            pass
        os.rmdir(tmp)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", default="both", choices=["native", "python", "both"])
    ap.add_argument("--n", type=int, default=20000, help="round trips for the latency test")
    ap.add_argument("--batches", type=int, default=1000, help="batches of 1000 for the throughput test")
    ap.add_argument("--spin", type=float, default=200e-6, help="seconds each side spins before sleeping")
    ap.add_argument("--no-zmq", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--serve-ring", help=argparse.SUPPRESS)
    ap.add_argument("--serve-zmq", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_ring:
        return serve_ring(a.serve_ring, a.spin)
    if a.serve_zmq:
        return serve_zmq(a.serve_zmq)

    impls = available_implementations() if a.impl == "both" else [a.impl]
    results: dict[str, dict] = {}
    for impl in impls:
        results[f"ring-{impl}"] = bench_ring(impl, a.n, a.batches, a.spin)
    if not a.no_zmq:
        results["zmq-ipc"] = bench_zmq(a.n, a.batches)

    print(f"# {platform.node()} {os.cpu_count()} cpus, python {platform.python_version()}, "
          f"n={a.n}, batches={a.batches}x{BATCH}, spin={a.spin * 1e6:.0f} us")
    print(f"{'transport':<14} {'rt p50 us':>10} {'rt p99 us':>10} {'req/s':>10} "
          f"{'batch p50 us':>13} {'batch p99 us':>13} {'desc/s':>12}")
    for name, r in results.items():
        lat, bat = r["latency"], r["batch"]
        print(f"{name:<14} {lat['p50_us']:>10.1f} {lat['p99_us']:>10.1f} {lat['per_s']:>10.0f} "
              f"{bat['p50_us']:>13.1f} {bat['p99_us']:>13.1f} {bat['per_s']:>12.0f}")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: v for k, v in vars(a).items() if k != "json"},
                                      "results": results}, indent=2, default=str))


if __name__ == "__main__":
    main()
