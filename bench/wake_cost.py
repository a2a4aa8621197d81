"""What one reply costs the thread that sends it, by how long the receiver has been idle.

The daemon answers each pass with one zmq send; libzmq hands the message to its I/O thread,
waking it when it sleeps. `nixl-raw`'s consumer answers each group with one pipe write,
waking the producer blocked on it. On a VM a wake-up of a thread on an idle vCPU can cost
the waker tens of microseconds of its own CPU (the interrupt to the other vCPU), so this
measures both, back to back and after a busy gap, as the sender's wall and CPU time:

    python bench/wake_cost.py [--n 500] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import time
from typing import Any, Callable

import zmq

GAPS_US = (0, 200, 1000)


def _dealer(endpoint: str) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)
    s.send(b"hello")
    while s.recv() != b"bye":
        pass
    ctx.destroy(linger=0)


def _reader(fd: int) -> None:
    while os.read(fd, 1) != b"q":
        pass


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _timed(send: Callable[[], object], n: int, gap_us: int) -> dict[str, float]:
    wall = cpu = 0.0
    for _ in range(n):
        if gap_us:
            _spin(gap_us * 1e-6)
        t, c = time.perf_counter(), time.thread_time()
        send()
        wall += time.perf_counter() - t
        cpu += time.thread_time() - c
    return {"gap_us": gap_us, "wall_us": wall / n * 1e6, "cpu_us": cpu / n * 1e6}


def zmq_send(transport: str, n: int) -> list[dict[str, float]]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    if transport == "tcp":
        endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    else:
        endpoint = f"ipc:///tmp/wake-cost-{os.getpid()}.sock"
        router.bind(endpoint)
    peer = mp.Process(target=_dealer, args=(endpoint,))
    peer.start()
    ident, _ = router.recv_multipart()
    events = int(zmq.EVENTS)

    def send() -> None:
        router.send_multipart([ident, b"x" * 100], zmq.NOBLOCK)
        router.getsockopt(events)  # as the daemon's pump does after each send

    try:
        return [_timed(send, n, gap) for gap in GAPS_US]
    finally:
        router.send_multipart([ident, b"bye"])
        peer.join(10)
        ctx.destroy(linger=0)


def pipe_write(n: int) -> list[dict[str, float]]:
    r, w = os.pipe()
    peer = mp.Process(target=_reader, args=(r,))
    peer.start()
    try:
        return [_timed(lambda: os.write(w, b"x"), n, gap) for gap in GAPS_US]
    finally:
        os.write(w, b"q")
        peer.join(10)
        os.close(r)
        os.close(w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=500, help="sends per gap")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    out: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                           "zmq tcp send": zmq_send("tcp", args.n), "zmq ipc send": zmq_send("ipc", args.n),
                           "pipe write": pipe_write(args.n)}
    for what in ("zmq tcp send", "zmq ipc send", "pipe write"):
        for row in out[what]:
            print(f"{what:13s} after {row['gap_us']:5.0f} us busy: {row['wall_us']:6.1f} us wall, {row['cpu_us']:6.1f} us CPU of the sender")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
