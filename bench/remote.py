"""Remote-segment copies through transferd vs raw NIXL READs, same sizes, same run.

usage: .venv/bin/python bench/remote.py [--reps 15] [--out bench/results/remote.json]

Three processes on this host:

* this process is the *producer*: it owns a 64 MiB NumPy buffer, registered
  with its NIXL agent and, through `Client.register_remote`, with transferd;
* `transferd` (tcp://127.0.0.1, --allow-insecure-tcp, numpy backend) pulls from
  it: `client.copy(device_buffer, remote_segment, size).result()` is a control
  round trip plus ONE NIXL READ posted by the daemon on a worker thread;
* a *raw NIXL* initiator (spawned) loads the same producer metadata and does
  `read(); wait()` of the same sizes into its own registered buffer: the floor.

Two figures per size (median of --reps; 1 GB = 1e9 B):

* `latency`: one copy at a time, each waited (request -> completion seen by
  the requester), against one raw READ at a time;
* `stream`: a burst of copies (count x size, at most 64 MiB) sent in one frame
  and fenced (the daemon posts them as ONE transfer), against the raw initiator
  posting the same burst as one READ transfer per copy, each waited.

And one 64 B request at a time over the same tcp control socket (a copy between two daemon
buffers, and a 64 B READ of the producer's memory), against pyzmq's own REQ/REP round trip
of 64 B to an echoing process on loopback tcp, alternated in one run: p50 and p99.

UCX_TLS is inherited (unset: `cma` for same-host RMA). Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = [64 << 10, 1 << 20, 64 << 20]
BUF = 64 << 20


def burst(size: int) -> int:
    return max(1, min(256, BUF // size))


def raw_initiator(conn, metadata: bytes, descs: bytes, sizes: list[int], reps: int) -> None:
    from transfer.transport._nixl import NixlEndpoint, check_ranges_within, decode_descs

    ep = NixlEndpoint(f"bench-raw-{os.getpid()}", progress="none")  # an initiator: as the daemon's agent
    peer = ep.add_peer(metadata)
    remote = decode_descs(descs)
    raddr = int(remote.ranges[0, 0])
    dst = np.ones(BUF, np.uint8)  # fault the pages in
    reg = ep.register(dst)

    def read(size: int, count: int = 1) -> float:
        t0 = time.perf_counter()
        for i in range(count):
            rem = [(raddr + i * size, size)]
            check_ranges_within(remote.ranges, rem)
            x = ep.read(peer, [(reg.addr + i * size, size)], rem)
            x.wait(30)
            x.release()
        return time.perf_counter() - t0

    read(1 << 20)  # wire-up
    out = {}
    for size in sizes:
        lat = [read(size) for _ in range(reps)]
        stream = [read(size, burst(size)) for _ in range(reps)]
        out[size] = {"latency_s": statistics.median(lat), "stream_s": statistics.median(stream)}
    conn.send(out)
    conn.recv()
    ep.close()


def reqrep_echo(port: int, ready: Any) -> None:
    import zmq

    s = zmq.Context.instance().socket(zmq.REP)
    s.bind(f"tcp://127.0.0.1:{port}")
    ready.set()
    while True:
        msg = s.recv()
        s.send(msg)
        if msg == b"q":
            break
    s.close(0)


def round_trips(one: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        one()
        out.append(time.perf_counter() - t0)
    return out


def _p(samples: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(samples) * 1e6, q)), 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "remote.json")
    args = ap.parse_args()

    import transfer
    from transfer.testing import run_daemon

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    daemon_args = ["--endpoint", endpoint, "--allow-insecure-tcp", "--backend", "numpy"]
    src = np.random.default_rng(0).integers(0, 256, BUF, dtype=np.uint8)
    results: dict = {}
    with run_daemon(daemon_args), transfer.connect(endpoint, name="bench-remote") as c:
        seg = c.register_remote(src)
        dev = c.alloc(BUF)
        c.copy(dev, seg).result()  # wire-up, and verify once
        assert c.checksum(dev).result() == transfer.checksum64(src), "data mismatch"

        # Raw NIXL first (its own process), so the two never overlap.
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        p = ctx.Process(target=raw_initiator, args=(b, c._remote.ep.metadata, seg._reg.descs_bytes, SIZES, args.reps))
        p.start()
        raw = a.recv()
        a.send("quit")
        p.join()

        def one(size: int) -> float:
            t0 = time.perf_counter()
            c.copy(dev, seg, size).result()
            return time.perf_counter() - t0

        def many(size: int) -> float:
            n = burst(size)
            t0 = time.perf_counter()
            with c.batch():
                for i in range(n):
                    c.copy(dev.at(i * size), seg.at(i * size), size)
            c.fence()
            return time.perf_counter() - t0

        posts0 = c.stats()["daemon"]["nixl_posts"]
        for size in SIZES:
            lat = statistics.median([one(size) for _ in range(args.reps)])
            stream = statistics.median([many(size) for _ in range(args.reps)])
            n = burst(size)
            r = raw[size]
            results[size] = {
                "size": size,
                "burst": n,
                "transfer_latency_us": lat * 1e6,
                "raw_latency_us": r["latency_s"] * 1e6,
                "transfer_latency_gbps": size / lat / 1e9,
                "raw_latency_gbps": size / r["latency_s"] / 1e9,
                "latency_ratio": r["latency_s"] / lat,
                "transfer_stream_gbps": n * size / stream / 1e9,
                "raw_stream_gbps": n * size / r["stream_s"] / 1e9,
                "stream_ratio": r["stream_s"] / stream,
            }
        stats = c.stats()["daemon"]

        # 64 B round trips: transfer's control socket against pyzmq's REQ/REP, alternated.
        import zmq

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            zport = s.getsockname()[1]
        ready = ctx.Event()
        echo = ctx.Process(target=reqrep_echo, args=(zport, ready), daemon=True)
        echo.start()
        ready.wait(30)
        req = zmq.Context.instance().socket(zmq.REQ)
        req.connect(f"tcp://127.0.0.1:{zport}")
        payload = bytes(64)
        other = c.alloc(4096)

        def zmq_one() -> None:
            req.send(payload)
            req.recv()

        def copy_one() -> None:
            c.copy(other, dev, 64).result()

        def read_one() -> None:
            c.copy(other, seg, 64).result()

        rt: dict[str, list[float]] = {"transfer_copy": [], "transfer_read": [], "pyzmq_reqrep": []}
        for fn in (zmq_one, copy_one, read_one):
            round_trips(fn, 200)  # (warm)
        for _ in range(5):
            rt["pyzmq_reqrep"] += round_trips(zmq_one, 400)
            rt["transfer_copy"] += round_trips(copy_one, 400)
            rt["transfer_read"] += round_trips(read_one, 400)
        req.send(b"q")
        req.recv()
        req.close(0)
        echo.join(10)
        round_trip = {k: {"p50_us": _p(v, 50), "p99_us": _p(v, 99), "rounds": len(v)} for k, v in rt.items()}
        round_trip["copy_vs_pyzmq"] = round(round_trip["pyzmq_reqrep"]["p50_us"] / round_trip["transfer_copy"]["p50_us"], 3)
        c.free(other)
        c.free(dev)
        c.free(seg)

    print(f"transfer (tcp control, NIXL READ by the daemon) vs raw NIXL READ; UCX_TLS={os.environ.get('UCX_TLS', '(unset)')}; reps {args.reps}")
    print(f"{'size':>8} | {'transfer us':>11} {'raw us':>8} {'ratio':>6} | {'burst':>5} {'transfer GB/s':>13} {'raw GB/s':>9} {'ratio':>6}")
    for r in results.values():
        print(
            f"{_fmt(r['size']):>8} | {r['transfer_latency_us']:11.1f} {r['raw_latency_us']:8.1f} {r['latency_ratio']:6.2f} | "
            f"{r['burst']:5d} {r['transfer_stream_gbps']:13.2f} {r['raw_stream_gbps']:9.2f} {r['stream_ratio']:6.2f}"
        )
    print(f"daemon NIXL posts during the measured part: {stats['nixl_posts'] - posts0}")
    print("64 B, one at a time (p50 / p99 us): " + ", ".join(f"{k} {v['p50_us']} / {v['p99_us']}" for k, v in round_trip.items()
                                                            if isinstance(v, dict))
          + f"; pyzmq REQ/REP p50 / transfer's copy p50: {round_trip['copy_vs_pyzmq']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "bench": "remote",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "ucx_tls": os.environ.get("UCX_TLS"),
        "reps": args.reps,
        "command": "python bench/remote.py " + " ".join(sys.argv[1:]),
        "ratio_is": "raw time / transfer time (1.0 = as fast as raw NIXL)",
        "results": list(results.values()),
        "round_trip_64B": round_trip,
    }
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


def _fmt(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


if __name__ == "__main__":
    main()
