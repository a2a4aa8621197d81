"""The `latency` mode: one small request, one in flight, its round trip, per method.

A producer (this process) hands 64 bytes over and waits until the consumer has
made its one copy of them, `rounds` times; the p50/p99 of those round trips is
what a request costs when nothing else is in flight. Methods:

* `transfer`: `copy(dev, seg, 64).result()` with the default blocking client
  (the shared-memory ring on the same host); `transfer-socket`: the same with
  `ring=False`; `transfer-trio`: `await copy(...)` with the trio client (ring);
  `transfer-asyncio`: the same with the asyncio client (ring).
  The consumer is the daemon, which copies in place.
* `shm-pipe`: the bytes in a shared-memory file, one byte over a pipe each way;
  the consumer process copies them into its buffer before it answers.
* `zmq-copy`: a PAIR socket over `ipc://` each way (`copy=True`).
* `torch-mp` (when PyTorch is installed): `torch.multiprocessing` queues; the
  consumer copies from the producer's shared tensor and answers on a queue.
* `iceoryx2` (when installed): the bytes in a sample loaned from a publish-subscribe
  service, sent, and an event to wake the consumer, which copies them out of the sample,
  releases it and answers with an event of its own.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import uuid
from typing import Any, Callable

import numpy as np

from .common import Spec, method_available

NBYTES = 64
METHODS = ("transfer", "transfer-socket", "transfer-trio", "transfer-asyncio", "shm-pipe", "iceoryx2", "zmq-copy", "torch-mp")


def _stats(samples: list[float]) -> dict[str, float]:
    """p50/p99 as the throughput cells compute theirs (runner._summarize: np.percentile)."""
    us = np.asarray(samples) * 1e6
    return {"p50_us": round(float(np.percentile(us, 50)), 2), "p99_us": round(float(np.percentile(us, 99)), 2),
            "mean_us": round(float(us.mean()), 2), "rounds": int(us.size)}


def _timed(one: Callable[[], None], rounds: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        one()
    out = []
    clock = time.perf_counter
    for _ in range(rounds):
        t = clock()
        one()
        out.append(clock() - t)
    return out


# --- transfer -------------------------------------------------------------------------------------
def _transfer(endpoint: str, ring: bool | None, rounds: int, warmup: int) -> list[float]:
    import transfer

    with transfer.connect(endpoint, ring=ring) as c:
        seg, dev = c.segment(4096), c.alloc(4096)
        seg.buffer[:NBYTES] = 7
        src, dst = seg.va, dev.va
        samples = _timed(lambda: c.copy(dst, src, NBYTES).result(), rounds, warmup)
        if c.checksum(dst, NBYTES).result() != transfer.checksum64(seg.buffer[:NBYTES]):
            raise RuntimeError("latency transfer: the device buffer does not hold the bytes")
        return samples


def _transfer_async(loop: str, endpoint: str, rounds: int, warmup: int) -> list[float]:
    """`await copy(...)` round trips with the trio or the asyncio client: one body, two loops."""
    import transfer

    opener = transfer.open_client if loop == "trio" else transfer.open_asyncio_client

    async def main() -> list[float]:
        async with opener(endpoint) as c:
            seg, dev = await c.segment(4096), await c.alloc(4096)
            seg.buffer[:NBYTES] = 7
            clock = time.perf_counter
            out = []
            for k in range(warmup + rounds):
                t = clock()
                await c.copy(dev.va, seg.va, NBYTES)
                if k >= warmup:
                    out.append(clock() - t)
            return out

    if loop == "trio":
        import trio

        return trio.run(main)
    import asyncio

    return asyncio.run(main())


# --- hand-rolled baselines: the consumer is a child process -----------------------------------------
def _shm_consumer(path: str, rd: int, wr: int) -> None:
    import mmap

    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 4096)
    src = np.frombuffer(m, np.uint8, NBYTES)
    dst = np.empty(NBYTES, np.uint8)
    while os.read(rd, 1) == b"g":
        np.copyto(dst, src)
        os.write(wr, b"k")


def _shm_pipe(rounds: int, warmup: int) -> list[float]:
    import mmap

    ctx = mp.get_context("fork")  # the child inherits the pipes' fds; it runs nothing but this loop
    fd, path = tempfile.mkstemp(prefix="transfer-bench-lat-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096)
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    p = ctx.Process(target=_shm_consumer, args=(path, r1, w2), daemon=True)
    p.start()
    try:
        return _timed(_ShmRound(m, w1, r2), rounds, warmup)
    finally:
        os.write(w1, b"q")
        p.join(10)
        m.close()
        for x in (fd, r1, w1, r2, w2):
            os.close(x)
        os.unlink(path)


class _ShmRound:
    """One round of the hand-rolled baseline: fresh bytes in shared memory, a byte each way."""

    def __init__(self, m: Any, wr: int, rd: int) -> None:
        self.m, self.wr, self.rd = m, wr, rd

    def __call__(self) -> None:
        self.m[0] ^= 1
        os.write(self.wr, b"g")
        os.read(self.rd, 1)


def _zmq_consumer(addr: str) -> None:
    import zmq

    s: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PAIR)
    s.connect(addr)
    dst = np.empty(NBYTES, np.uint8)
    while True:
        msg = s.recv(copy=True)
        if msg == b"q":
            break
        np.copyto(dst, np.frombuffer(msg, np.uint8))
        s.send(b"k")
    s.close(0)


def _zmq_copy(rounds: int, warmup: int) -> list[float]:
    import zmq

    d = tempfile.mkdtemp(prefix="transfer-bench-lat-")
    addr = f"ipc://{d}/pair"
    s: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PAIR)
    s.bind(addr)
    p = mp.get_context("spawn").Process(target=_zmq_consumer, args=(addr,), daemon=True)
    p.start()
    payload = bytes(NBYTES)
    try:
        def one() -> None:
            s.send(payload, copy=True)
            s.recv()

        return _timed(one, rounds, warmup)
    finally:
        s.send(b"q")
        p.join(10)
        s.close(0)
        shutil.rmtree(d, ignore_errors=True)


def _torch_consumer(q_in: Any, q_out: Any) -> None:
    import torch

    dst = torch.empty(NBYTES, dtype=torch.uint8)
    src = q_in.get()  # the producer's shared tensor, once (its storage is shared memory)
    q_out.put(True)
    while q_in.get() is not None:
        dst.copy_(src)
        q_out.put(True)


def _torch_mp(rounds: int, warmup: int) -> list[float]:
    import torch
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    q_in, q_out = ctx.SimpleQueue(), ctx.SimpleQueue()
    src = torch.zeros(NBYTES, dtype=torch.uint8).share_memory_()
    p = ctx.Process(target=_torch_consumer, args=(q_in, q_out), daemon=True)
    p.start()
    q_in.put(src)
    q_out.get()
    try:
        def one() -> None:
            src[0] ^= 1
            q_in.put(1)
            q_out.get()

        return _timed(one, rounds, warmup)
    finally:
        q_in.put(None)
        p.join(10)


# --- iceoryx2: publish-subscribe for the bytes, an event each way --------------------------------------
_IOX_QUIT = 1  # the ping event id that ends the consumer; 0 is "a sample is there"


def _iox_ports(spec: Spec, producer: bool) -> tuple[Any, list[Any], Any, Any]:
    """(node, [services], the data port, (notifier, listener)) for one side of the round trip."""
    import ctypes

    import iceoryx2 as iox

    from ._iceoryx import iox_event, iox_node

    node = iox_node(spec)
    data = (node.service_builder(iox.ServiceName.new(spec["service"] + "/data"))
            .publish_subscribe(ctypes.c_uint8 * NBYTES).max_publishers(1).max_subscribers(1)
            .history_size(0).subscriber_max_buffer_size(1).enable_safe_overflow(False).open_or_create())
    ping = iox_event(node, spec["service"] + "/ping", 1)
    pong = iox_event(node, spec["service"] + "/pong", 1)
    if producer:
        port = data.publisher_builder().max_loaned_samples(1).create()
        ends = (ping.notifier_builder().create(), pong.listener_builder().create())
    else:
        port = data.subscriber_builder().buffer_size(1).create()
        ends = (pong.notifier_builder().create(), ping.listener_builder().create())
    return node, [data, ping, pong], port, ends


def _iox_consumer(spec: Spec) -> None:
    import iceoryx2 as iox

    node, services, sub, (pong, ping) = _iox_ports(spec, producer=False)
    dst = np.empty(NBYTES, np.uint8)
    ppid = os.getppid()
    pong.notify()  # subscribed: the producer may start
    try:
        while True:
            acts = ping.timed_wait(iox.Duration.from_millis(500))
            if any(a.id.as_value == _IOX_QUIT for a in acts) or os.getppid() != ppid:
                break
            while (s := sub.receive()) is not None:
                np.copyto(dst, np.frombuffer(_bytes_at(s.payload_ptr), np.uint8))
                s.delete()  # released before the answer: the producer loans it again next round
                pong.notify()
    finally:
        for port in (pong, ping, sub):
            port.delete()
        del services, node


def _bytes_at(ptr: int) -> Any:
    """A writable ctypes view of ``NBYTES`` at ``ptr`` (a sample's payload), for NumPy."""
    import ctypes

    return (ctypes.c_uint8 * NBYTES).from_address(ptr)


def _iceoryx2(rounds: int, warmup: int) -> list[float]:
    import glob

    import iceoryx2 as iox

    from ._iceoryx import iox_spec

    root = tempfile.mkdtemp(prefix="tb-iox-")  # short: iceoryx2's unix sockets live here
    run_id = f"transfer-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    spec = iox_spec(root, run_id, f"{run_id}/latency")
    p = None
    node = services = pub = ping = pong = None
    try:
        node, services, pub, (ping, pong) = _iox_ports(spec, producer=True)
        p = mp.get_context("spawn").Process(target=_iox_consumer, args=(spec,), daemon=True)
        p.start()
        while not pong.timed_wait(iox.Duration.from_secs(1)):
            if not p.is_alive():
                raise RuntimeError(f"latency iceoryx2: the consumer died (exit code {p.exitcode})")
        src = np.zeros(NBYTES, np.uint8)

        def one() -> None:
            src[0] ^= 1
            s = pub.loan_uninit()
            np.copyto(np.frombuffer(_bytes_at(s.payload_ptr), np.uint8), src)
            s.assume_init().send()
            ping.notify()
            while not pong.blocking_wait():
                pass

        return _timed(one, rounds, warmup)
    finally:
        if ping is not None:
            ping.notify_with_custom_event_id(iox.EventId.new(_IOX_QUIT))
        if p is not None:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        for port in (pong, ping, pub):
            if port is not None:
                port.delete()
        del services, node
        for f in glob.glob(f"/dev/shm/{spec['prefix']}*"):  # what a killed consumer may leave
            with contextlib.suppress(OSError):
                os.unlink(f)
        shutil.rmtree(root, ignore_errors=True)


def run(methods: list[str], endpoint: str, *, rounds: int = 2000, warmup: int = 200,
        line: Callable[[str], None] = print) -> dict[str, Any]:
    """Round trips per method: {method: {p50_us, p99_us, mean_us, rounds}}, plus skips."""
    rows: dict[str, Any] = {}
    skipped: list[str] = []
    for m in methods:
        ok, why = method_available(m)
        if not ok:
            skipped.append(why)
            continue
        if m == "transfer":
            samples = _transfer(endpoint, None, rounds, warmup)
        elif m == "transfer-socket":
            samples = _transfer(endpoint, False, rounds, warmup)
        elif m in ("transfer-trio", "transfer-asyncio"):
            samples = _transfer_async(m.removeprefix("transfer-"), endpoint, rounds, warmup)
        elif m == "shm-pipe":
            samples = _shm_pipe(rounds, warmup)
        elif m == "zmq-copy":
            samples = _zmq_copy(rounds, warmup)
        elif m == "torch-mp":
            samples = _torch_mp(rounds, warmup)
        elif m == "iceoryx2":
            samples = _iceoryx2(rounds, warmup)
        else:
            raise ValueError(f"latency mode: no method {m!r} (choose from {', '.join(METHODS)})")
        rows[m] = _stats(samples)
        r = rows[m]
        line(f"latency {m:>16}: p50 {r['p50_us']:8.1f} µs  p99 {r['p99_us']:8.1f} µs  mean {r['mean_us']:8.1f} µs")
    return {"bytes": NBYTES, "rows": rows, "skipped": skipped}


def render(result: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"latency: one {result['bytes']}-byte request in flight, round trip")
    for col in ("method", "p50 µs", "p99 µs", "mean µs", "x shm-pipe (p50)"):
        t.add_column(col, justify="left" if col == "method" else "right")
    base = result["rows"].get("shm-pipe", {}).get("p50_us")
    for m, r in result["rows"].items():
        t.add_row(m, f"{r['p50_us']:.1f}", f"{r['p99_us']:.1f}", f"{r['mean_us']:.1f}",
                  f"{base / r['p50_us']:.2f}" if base else "-")
    return t
