"""What one message costs the thread that owns a zmq socket under trio (`SocketPump`).

An echo server answers a DEALER that keeps one 38-byte message in flight (the size of a
one-copy request frame). Each server is its own process; the client measures the round
trip, and the server's main-thread CPU time (`/proc/PID/task/PID/stat`) is divided by the
messages answered:

* ``plain``: a blocking pyzmq loop (recv_multipart, send_multipart): the floor;
* ``pump``: `SocketPump.run` under trio, answering from `on_message` (the daemon's inline
  passes), this tree or `--baseline DIR`'s;
* ``pump-task``: the same, answering from a second task after a checkpoint (the daemon's
  session tasks, which send while the pump is parked);
* ``transferd``: the daemon itself, a 64-byte `copy(...).result()` over the socket
  (`ring=False`): everything a socket request costs the daemon's thread.

Rounds alternate the servers, so each sees the same phases of a noisy machine:

    python bench/pump_cost.py [--seconds 2] [--rounds 3] [--baseline DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

from _proc import main_thread_cpu_s, started_from  # (bench/ is the script's directory: on sys.path)

_PAYLOAD = b"x" * 38


def _server(kind: str, endpoint: str, tree: str | None) -> None:
    if tree:
        sys.path.insert(0, tree)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    if kind == "plain":
        while True:
            parts = sock.recv_multipart()
            if parts[1] == b"stop":
                return
            sock.send_multipart(parts)

    import trio

    from transfer.transport._zmq import SocketPump

    async def main() -> None:
        pump = SocketPump(sock)
        done = trio.Event()
        to_answer, answers = trio.open_memory_channel[list[bytes]](1024)

        def on_message(parts: list[bytes]) -> None:
            if parts[1] == b"stop":
                done.set()
            elif kind == "pump":
                pump.send_nowait(parts)
            else:
                to_answer.send_nowait(parts)

        async def answer() -> None:
            async for parts in answers:
                await trio.lowlevel.checkpoint()
                pump.send_nowait(parts)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump.run, on_message)
            nursery.start_soon(answer)
            await done.wait()
            nursery.cancel_scope.cancel()

    trio.run(main)


def _measure(kind: str, tree: str | None, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        endpoint = f"ipc://{d}/echo.sock"
        p = mp.get_context("spawn").Process(target=_server, args=(kind, endpoint, tree))
        p.start()
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        try:
            for _ in range(2000):  # warm up (and wait for the server)
                s.send(_PAYLOAD)
                s.recv()
            assert p.pid is not None
            cpu0, n, rtts = main_thread_cpu_s(p.pid), 0, []
            t_end = time.perf_counter() + seconds
            while (t := time.perf_counter()) < t_end:
                s.send(_PAYLOAD)
                s.recv()
                rtts.append(time.perf_counter() - t)
                n += 1
            cpu = main_thread_cpu_s(p.pid) - cpu0
            s.send(b"stop")
            p.join(10)
        finally:
            if p.is_alive():
                p.kill()
            s.close()
            ctx.term()
    return {"server": kind, "tree": tree or "this", "messages": n, "server_cpu_us": cpu / n * 1e6,
            "rtt_p50_us": statistics.median(rtts) * 1e6}


def _measure_daemon(tree: str | None, seconds: float) -> dict[str, Any]:
    """A real transferd from `tree` (started there, its Python first on PYTHONPATH: `-m` puts the
    working directory first), one socket request in flight."""
    import transfer
    from transfer.testing import run_daemon

    where = started_from(tree, os.pathsep.join(filter(None, (tree, os.environ.get("PYTHONPATH"))))) if tree else contextlib.nullcontext()
    with where, run_daemon(["--backend", "numpy"]) as d, transfer.connect(d.endpoint, ring=False) as c:
        seg, dev = c.segment(1 << 16), c.alloc(1 << 16)
        for _ in range(2000):
            c.copy(dev.va, seg.va, 64).result()
        pid = d.proc.pid
        cpu0, n, rtts = main_thread_cpu_s(pid), 0, []
        t_end = time.perf_counter() + seconds
        while (t := time.perf_counter()) < t_end:
            c.copy(dev.va, seg.va, 64).result()
            rtts.append(time.perf_counter() - t)
            n += 1
        cpu = main_thread_cpu_s(pid) - cpu0
    return {"server": "transferd", "tree": tree or "this", "messages": n, "server_cpu_us": cpu / n * 1e6,
            "rtt_p50_us": statistics.median(rtts) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="a checkout of another commit: its SocketPump too")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    servers: list[tuple[str, str | None, str]] = [("plain", None, "plain"), ("pump", here, "pump"), ("pump-task", here, "pump-task"),
                                                  ("transferd", here, "transferd")]
    if args.baseline:
        base = str(args.baseline.resolve())
        servers += [("pump", base, "baseline pump"), ("pump-task", base, "baseline pump-task"), ("transferd", base, "baseline transferd")]
    rows = []
    for _ in range(args.rounds):
        for kind, tree, label in servers:
            r = _measure_daemon(tree, args.seconds) if kind == "transferd" else _measure(kind, tree, args.seconds)
            r["label"] = label
            rows.append(r)
            print(f"{label:20s} server thread {r['server_cpu_us']:6.1f} us/message   round trip p50 {r['rtt_p50_us']:6.1f} us", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
                                         "command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
