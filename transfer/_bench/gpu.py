"""The `gpu` mode: host-to-device from a registered segment, against CuPy's own copies.

Four parts, each in one run so the ratios compare like with like:

1. **Host to device**, one producer, 64 KiB..256 MiB. Every method sends
   batches in groups of about 8 MiB (`plan`: one batch per group from
   8 MiB up), keeps `depth` groups in flight through as many slots, stamps
   fresh contents into each batch (one word per 4 KiB page) before sending
   it, and copies it into a device slot:

   * `transfer`: the producer stamps its shared-memory segment and sends a
     copy request (ring); the daemon's ring worker (`--backend cupy`) queues
     the copy through the CUDA driver, a DMA from the producer's pages,
     page-locked in place, and answers once its event has passed;
   * `transfer-python`: the same through a second daemon with
     `--no-device-workers`: the event loop's Python pass issues the copy;
   * `cupy-pinned`: `cudaMemcpyAsync` from page-locked memory the process
     allocated (`cupy.cuda.alloc_pinned_memory`): what a process that owns
     the GPU gets at best;
   * `cupy-pageable`: the same from an ordinary NumPy array.

2. **Device to host**, the same sizes and methods, the other way (no stamps:
   the device slots do not change).

3. **Two producers and compute** (1 MiB..64 MiB): two processes, each
   copying uint8 image batches (N, 4, 64, 64) to the device and normalizing
   them to float32 there with the same kernel (`transfer.kernels`'
   normalize, on CuPy).

4. **Latency**: one 64-byte host-to-device copy at a time, its round trip
   (p50, p99): `transfer`'s `copy(...).result()` into a device buffer, against
   `cudaMemcpyAsync` and a stream synchronize in this process. The fixed cost
   of one request on the GPU path.

After every repetition (untimed, so that no check drains the pipeline the
baselines keep full), up to `verify_slots` of `transfer`'s slots, spread over
all of them, are checked: the daemon's checksum of a device slot's first MiB
must equal the producer's of its host slot, which holds the stamp of the last
group sent through it (stamps change every page: a stale or torn copy shows).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .common import STAMP_STRIDE_WORDS, BenchFailure, fmt_size
from . import latency as _lat
from .report import nvidia_smi

METHODS = ("transfer", "transfer-python", "cupy-pinned", "cupy-pageable")
#: The compute part's methods (two producer processes each: the Python pass is left out).
COMPUTE_METHODS = ("transfer", "cupy-pinned", "cupy-pageable")
LABELS = {
    "transfer": "transfer: daemon DMA from the producer's segment",
    "transfer-python": "transfer with --no-device-workers: the Python pass issues each copy",
    "cupy-pinned": "CuPy memcpyAsync from pinned memory (in process)",
    "cupy-pageable": "CuPy memcpyAsync from pageable memory (in process)",
}
MEAN, STD = [123.7, 116.3, 103.5, 127.5], [58.4, 57.1, 57.4, 64.0]
#: One image of the compute part: RGBA 64x64, uint8.
IMAGE = (4, 64, 64)
IMAGE_BYTES = 4 * 64 * 64
#: Bytes of a slot a verification checksums on both sides (from its start).
VERIFY_BYTES = 1 << 20
#: The latency part: round trips per method (after a tenth as many to warm up), of the latency
#: mode's copy size.
LATENCY_ROUNDS = 2000


def available() -> tuple[bool, str]:
    try:
        from ..backends._cupy import CupyBackend
    except ImportError as e:
        return False, f"gpu: CuPy not installed (pip install 'transfer[gpu]'): {e}"
    ok, why = CupyBackend.probe()
    return (True, "") if ok else (False, f"gpu: no usable CUDA device ({why})")


def plan(size: int, depth: int) -> tuple[int, int]:
    """(slots, group): batches are sent in groups of `group` (about 8 MiB: several small
    batches share a round trip), `depth` groups in flight, at most 2 GiB of slots."""
    group = max(1, (8 << 20) // size)
    groups = max(2, min(depth, (2 << 30) // (size * group)))
    return groups * group, group


def _stamp(slot: np.ndarray, seq: int) -> None:
    words = slot.view(np.uint64)
    words[::STAMP_STRIDE_WORDS] = seq


# --- one timed loop, whatever the method --------------------------------------------------------
def _timed(step: Callable[[int], int], drain: Callable[[], None], seconds: float) -> tuple[int, float]:
    """Run `step(group number)` (returns bytes sent) until `seconds` pass, then `drain`; (bytes, elapsed)."""
    sent, seq = 0, 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while True:
        sent += step(seq)
        seq += 1
        if time.perf_counter() >= end:
            break
    drain()
    return sent, time.perf_counter() - t0


def _cupy_loop(kind: str, size: int, depth: int, compute: bool, seconds: float, reps: int, d2h: bool = False) -> list[float]:
    import cupy as cp

    from ..kernels import REGISTRY

    slots, group = plan(size, depth)
    groups = slots // group
    if kind == "cupy-pinned":
        mem = cp.cuda.alloc_pinned_memory(size * slots)
        host = np.frombuffer(mem, np.uint8, size * slots)
    else:
        host = np.ones(size * slots, np.uint8)
    host[:] = 7
    dev = cp.empty(size * slots, cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    events: list[Any] = [None] * groups
    kernel = REGISTRY.lookup("normalize", ("uint8", "float32"), "gpu") if compute else None
    n = size // IMAGE_BYTES
    out = cp.empty((slots, n, *IMAGE), cp.float32) if compute else None
    params = {"mean": MEAN, "std": STD}

    def step(seq: int) -> int:
        g = seq % groups
        if events[g] is not None:
            events[g].synchronize()
        for k in range(g * group, (g + 1) * group):
            if d2h:
                cp.cuda.runtime.memcpyAsync(host.ctypes.data + k * size, dev.data.ptr + k * size, size, 2, stream.ptr)
                continue
            _stamp(host[k * size : (k + 1) * size], seq)
            cp.cuda.runtime.memcpyAsync(dev.data.ptr + k * size, host.ctypes.data + k * size, size, 1, stream.ptr)
            if kernel is not None and out is not None:  # both are there with compute
                with stream:
                    kernel.run([dev[k * size : (k + 1) * size].reshape(n, *IMAGE)], [out[k]], params, cp)
        ev = cp.cuda.Event(block=False, disable_timing=True)
        ev.record(stream)
        events[g] = ev
        return size * group

    rates = []
    for r in range(reps + 1):
        sent, dt = _timed(step, stream.synchronize, seconds)
        if r:  # the first is warm-up
            rates.append(sent / dt / 1e9)
    return rates


def _transfer_loop(endpoint: str, size: int, depth: int, compute: bool, seconds: float, reps: int, verify_slots: int,
                   d2h: bool = False) -> list[float]:
    import transfer

    slots, group = plan(size, depth)
    groups = slots // group
    with transfer.connect(endpoint, ring=True) as c:
        seg = c.segment(size * slots)
        dev = c.alloc(size * slots)
        host = seg.buffer
        host[:] = 7
        n = size // IMAGE_BYTES
        out = c.alloc(4 * size * slots) if compute else None
        pending: list[Any] = [None] * groups
        params = {"mean": MEAN, "std": STD}

        def step(seq: int) -> int:
            g = seq % groups
            if pending[g] is not None:
                pending[g].result(60)  # answers come in order: the group's last answers for it
            with c.batch():
                for k in range(g * group, (g + 1) * group):
                    if d2h:
                        p = c.copy(seg.va + k * size, dev.va + k * size, size)
                        continue
                    _stamp(host[k * size : (k + 1) * size], seq)
                    p = c.copy(dev.va + k * size, seg.va + k * size, size)
                    if out is not None:
                        x = transfer.TensorRef(dev.va + k * size, "uint8", (n, *IMAGE))
                        y = transfer.TensorRef(out.va + 4 * k * size, "float32", (n, *IMAGE))
                        p = c.compute("normalize", [x], [y], params)
            pending[g] = p
            return size * group

        def drain() -> None:
            for p in pending:
                if p is not None:
                    p.result(60)
            c.fence()

        def verify() -> None:
            """Every slot holds what its producer last stamped (checked between reps, untimed)."""
            w = min(size, VERIFY_BYTES)  # stamps change every page: a window shows a stale or torn copy
            for k in range(0, slots, max(1, slots // verify_slots) if verify_slots else slots):
                got = c.checksum(dev.va + k * size, w).result(60)
                if got != transfer.checksum64(host[k * size : k * size + w]):
                    raise BenchFailure(f"transfer gpu: device slot {k} does not match the producer's bytes")

        rates = []
        for r in range(reps + 1):
            sent, dt = _timed(step, drain, seconds)
            verify()
            if r:
                rates.append(sent / dt / 1e9)
        return rates


def _latency(method: str, endpoint: str, rounds: int) -> list[float]:
    """Round trips (seconds) of one host-to-device copy of the latency mode's size at a time:
    `transfer` is the latency mode's own loop (its daemon here runs CuPy, so `alloc` is GPU
    memory, checked after the loop), the baselines a copy and a synchronize here."""
    import cupy as cp

    if method.startswith("transfer"):
        return _lat._transfer(endpoint, None, rounds, rounds // 10)
    pinned = cp.cuda.alloc_pinned_memory(4096) if method == "cupy-pinned" else None
    host = np.frombuffer(pinned, np.uint8, 4096) if pinned is not None else np.zeros(4096, np.uint8)
    dev_mem = cp.empty(4096, cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)

    def one() -> None:
        cp.cuda.runtime.memcpyAsync(dev_mem.data.ptr, host.ctypes.data, _lat.NBYTES, 1, stream.ptr)
        stream.synchronize()

    return _lat._timed(one, rounds, rounds // 10)


def _child(method: str, endpoint: str, size: int, depth: int, compute: bool, seconds: float, reps: int,
           verify_slots: int, barrier: Any, conn: Any) -> None:
    try:
        barrier.wait(120)
        if method == "transfer":
            rates = _transfer_loop(endpoint, size, depth, compute, seconds, reps, verify_slots)
        else:
            rates = _cupy_loop(method, size, depth, compute, seconds, reps)
        conn.send(("ok", rates))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _run_processes(n: int, method: str, endpoint: str, size: int, depth: int, compute: bool, seconds: float,
                   reps: int, verify_slots: int) -> list[float]:
    """`n` producer processes (spawned: CUDA does not survive fork) at once; GB/s summed per rep."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n)
    pipes, procs = [], []
    for _ in range(n):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(method, endpoint, size, depth, compute, seconds, reps, verify_slots, barrier, send), daemon=True)
        p.start()
        pipes.append(recv)
        procs.append(p)
    try:
        results = []
        for recv in pipes:
            if not recv.poll(600):
                raise BenchFailure(f"gpu {method}: a producer did not report within 600 s")
            status, value = recv.recv()
            if status != "ok":
                raise BenchFailure(f"gpu {method}: a producer failed: {value}")
            results.append(value)
        return [sum(r[i] for r in results) for i in range(reps)]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def run(sizes: list[int], *, depth: int = 8, reps: int = 3, rep_s: float = 0.4, verify_slots: int = 16,
        compute_sizes: list[int] | None = None, line: Callable[[str], None] = print,
        daemon_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """The three parts; rows of {part, method, size, producers, gbps, gbps_reps, vs_pinned}
    (the latency part: p50_us, p99_us, mean_us, rounds instead of the rates)."""
    import cupy as cp

    from ..testing import run_daemon

    rows: list[dict[str, Any]] = []
    args = ["--backend", "cupy", "--size-threshold", "0"]
    # (the daemons' logs go to files: not through the progress lines)
    with tempfile.TemporaryDirectory(prefix="transfer-bench-gpu-") as logs, \
            run_daemon(args, log=Path(logs) / "transferd.log", **(daemon_args or {})) as d, \
            run_daemon([*args, "--no-device-workers"], log=Path(logs) / "transferd-python.log", **(daemon_args or {})) as dp:
        endpoints = {"transfer": d.endpoint, "transfer-python": dp.endpoint}
        for part, d2h in (("h2d", False), ("d2h", True)):
            for size in sizes:
                got: dict[str, list[float]] = {}
                for method in METHODS:
                    if method in endpoints:
                        got[method] = _transfer_loop(endpoints[method], size, depth, False, rep_s, reps, verify_slots, d2h)
                    else:
                        got[method] = _cupy_loop(method, size, depth, False, rep_s, reps, d2h)
                    cp.get_default_memory_pool().free_all_blocks()
                rows += _rows(part, got, size, 1, depth)
                line(f"gpu {part} " + _summary(rows[-len(METHODS):]))
        for size in compute_sizes if compute_sizes is not None else [s for s in sizes if 1 << 20 <= s <= 64 << 20]:
            if size % IMAGE_BYTES:
                continue
            got = {m: _run_processes(2, m, d.endpoint, size, depth, True, rep_s, reps, verify_slots) for m in COMPUTE_METHODS}
            rows += _rows("h2d+normalize", got, size, 2, depth)
            line("gpu h2d+normalize, 2 producers " + _summary(rows[-len(COMPUTE_METHODS):]))
        lat = {m: _lat._stats(_latency(m, endpoints.get(m, d.endpoint), LATENCY_ROUNDS)) for m in METHODS}
        rows += [{"part": "latency", "method": m, "size": _lat.NBYTES, "producers": 1, **st,
                  "vs_pinned": round(lat["cupy-pinned"]["p50_us"] / st["p50_us"], 3)} for m, st in lat.items()]
        line(f"gpu latency, {_lat.NBYTES} B one at a time: " + ", ".join(f"{m} p50 {st['p50_us']:.1f} us p99 {st['p99_us']:.1f}" for m, st in lat.items()))
    config = {"depth": depth, "reps": reps, "rep_seconds": rep_s, "verify_slots": verify_slots,
              "groups": {fmt_size(s): dict(zip(("slots", "group"), plan(s, depth))) for s in sizes}}
    return {"rows": rows, "device": describe(), "config": config}


def _rows(part: str, got: dict[str, list[float]], size: int, producers: int, depth: int) -> list[dict[str, Any]]:
    pinned = statistics.median(got["cupy-pinned"])
    slots, group = plan(size, depth)
    return [
        {"part": part, "method": m, "size": size, "producers": producers, "groups_in_flight": slots // group, "group": group,
         "gbps": round(statistics.median(r), 3), "gbps_reps": [round(x, 3) for x in r],
         "vs_pinned": round(statistics.median(r) / pinned, 3) if pinned else None}
        for m, r in got.items()
    ]


def _summary(rows: list[dict[str, Any]]) -> str:
    size = fmt_size(rows[0]["size"])
    return f"{size:>8}: " + ", ".join(f"{r['method']} {r['gbps']:.2f} GB/s ({r['vs_pinned']:.2f}x)" for r in rows)


def describe() -> dict[str, Any]:
    """The device, driver and CUDA versions the numbers belong to."""
    import cupy as cp

    rt = cp.cuda.runtime
    props = rt.getDeviceProperties(0)
    name = props["name"]
    return {
        "gpu": name.decode() if isinstance(name, bytes) else str(name),
        "nvidia_smi": nvidia_smi(),  # the driver's own version (the runtime gives the CUDA version it supports)
        "driver_version": rt.driverGetVersion(),
        "runtime_version": rt.runtimeGetVersion(),
        "cupy": cp.__version__,
        "devices": rt.getDeviceCount(),
        "cpu_count": os.cpu_count(),
    }


def render(result: dict[str, Any]) -> Any:
    from rich.table import Table

    dev = result["device"]
    t = Table(title=f"gpu mode: {dev['gpu']}, driver {dev['driver_version']}, CUDA runtime {dev['runtime_version']}, CuPy {dev['cupy']}")
    for col in ("part", "producers", "size", "method", "GB/s", "vs pinned"):
        t.add_column(col, justify="right" if col in ("producers", "size", "GB/s", "vs pinned") else "left")
    for r in result["rows"]:
        rate = f"{r['gbps']:.2f}" if "gbps" in r else f"p50 {r['p50_us']:.1f} µs"  # the latency part: a round trip
        t.add_row(r["part"], str(r["producers"]), fmt_size(r["size"]), r["method"], rate, f"{r['vs_pinned']:.2f}x")
    return t
