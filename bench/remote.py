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

The channels a remote ring could take, 64-byte round trips in the same rounds: plain
TCP with Python at both ends (`python_tcp`; the data channel's bridges are C), and NIXL
notifications echoed between two agents (`nixl_notif`; polled from Python, as they can
only be: NIXL's wheel ships no C API).

And one 64 B request at a time (a copy between two daemon buffers, and a 64 B READ of the
producer's memory) on the session's data channel (its ring carried over tcp: the daemon's
native worker serves the copy), the same copy from a session without one (`ring=False`:
the control socket and the event loop), against pyzmq's own REQ/REP round trip of 64 B to
an echoing process on loopback tcp, alternated in one run: p50 and p99.

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


def tcp_echo(port: int, ready: Any) -> None:
    """Plain TCP from Python: what a channel whose ends are Python costs (64-byte messages)."""
    with socket.create_server(("127.0.0.1", port)) as srv:
        ready.set()
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while msg := conn.recv(64, socket.MSG_WAITALL):
                conn.sendall(msg)


def notif_echo(conn: Any) -> None:
    """NIXL notifications echoed, polled from Python (NIXL's wheel has no C API to do it natively)."""
    from transfer.transport._nixl import NixlEndpoint

    ep = NixlEndpoint("bench-notif-echo", progress="none")
    conn.send(ep.metadata)
    peer = ep.add_peer(conn.recv())
    conn.send("ready")
    while True:
        for msgs in ep.get_notifs().values():
            for msg in msgs:
                ep.send_notif(peer, msg)
                if msg == b"q":
                    ep.close()
                    return


def start_echo(ctx: Any, target: Any) -> tuple[int, Any]:
    """A free loopback port and an echo process serving it, ready when this returns."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = ctx.Event()
    proc = ctx.Process(target=target, args=(port, ready), daemon=True)
    proc.start()
    ready.wait(30)
    return port, proc


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
        assert c._ring is not None and c._ring.channel is not None, "no data channel"
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

        zport, echo = start_echo(ctx, reqrep_echo)
        req = zmq.Context.instance().socket(zmq.REQ)
        req.connect(f"tcp://127.0.0.1:{zport}")
        payload = bytes(64)
        other = c.alloc(4096)

        def zmq_one() -> None:
            req.send(payload)
            req.recv()

        def copy_one() -> None:
            c.copy(other, dev, 64).result()

        plain = transfer.connect(endpoint, name="bench-remote-socket", ring=False)
        pa, pb = plain.alloc(4096), plain.alloc(4096)

        def socket_one() -> None:
            plain.copy(pb, pa, 64).result()

        def read_one() -> None:
            c.copy(other, seg, 64).result()

        # The channels a data channel could have been: a TCP socket (here with Python at both
        # ends; the bridge is C), and NIXL notifications (Python polls them).
        tport, techo = start_echo(ctx, tcp_echo)
        tcp = socket.create_connection(("127.0.0.1", tport))
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def tcp_one() -> None:
            tcp.sendall(payload)
            tcp.recv(64, socket.MSG_WAITALL)

        from transfer.transport._nixl import NixlEndpoint

        na, nb = ctx.Pipe()
        necho = ctx.Process(target=notif_echo, args=(nb,), daemon=True)
        necho.start()
        pinger = NixlEndpoint("bench-notif-ping", progress="none")
        npeer = pinger.add_peer(na.recv())
        na.send(pinger.metadata)
        assert na.recv() == "ready"

        def notif_one(msg: bytes = payload) -> None:
            pinger.send_notif(npeer, msg)
            while not pinger.get_notifs():
                pass

        rt: dict[str, list[float]] = {"transfer_copy": [], "transfer_copy_socket": [], "transfer_read": [], "pyzmq_reqrep": [],
                                      "python_tcp": [], "nixl_notif": []}
        ways = {"pyzmq_reqrep": zmq_one, "transfer_copy": copy_one, "transfer_copy_socket": socket_one, "transfer_read": read_one,
                "python_tcp": tcp_one, "nixl_notif": notif_one}
        for fn in ways.values():
            round_trips(fn, 200)  # (warm)
        for _ in range(5):
            for name, fn in ways.items():
                rt[name] += round_trips(fn, 400)
        plain.close()
        tcp.close()
        techo.join(10)
        notif_one(b"q")
        necho.join(10)
        pinger.close()
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
