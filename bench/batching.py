"""Batching and compute figures for the scheduler (issue: server batching, compute on VAs).

Same run, same daemon, real processes:

(a) 10,000 copies of 4 KiB: one request at a time (submit, wait) versus the same
    copies batched in frames (the daemon plans, cuts waves and merges contiguous
    copies) versus one vector request (copy_many).
(b) normalize on a 256x3x224x224 uint8 batch: through transfer (NumPy backend, one
    CPU device; and split over two CPU devices) versus NumPy called directly in
    this process (the same formula, and the naive one a user would write).

Every result is checked (bytes or values) before it is timed again.

    python bench/batching.py [--json bench/results/batching.json] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np

import transfer
from transfer.testing import run_daemon

MEAN = [123.675, 116.28, 103.53]
STD = [58.395, 57.12, 57.375]


def timed(fn: Callable[[], object], reps: int) -> list[float]:
    fn()  # warm-up, excluded
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def copies(c: transfer.Client, reps: int, n: int = 10_000, size: int = 4096) -> list[dict]:
    seg = c.segment(n * size)
    seg.buffer[:] = np.random.default_rng(0).integers(0, 256, n * size, dtype=np.uint8)
    buf = c.alloc(n * size)
    back = c.segment(n * size)
    offs = np.arange(n, dtype=np.uint64) * size
    scattered = np.random.default_rng(1).permutation(n).astype(np.uint64) * size

    def one_at_a_time() -> None:
        for i in range(n):
            c.copy(buf.va + i * size, seg.va + i * size, size).result()

    def batched(order: np.ndarray) -> Callable[[], None]:
        def run() -> None:
            with c.batch():
                for o in order.tolist():
                    c.copy(buf.va + o, seg.va + o, size)
            c.fence()

        return run

    def vector() -> None:
        c.copy_many(buf.va + offs, seg.va + offs, np.full(n, size, np.uint64)).result()

    def verify() -> None:
        c.copy(back, buf).result()
        assert np.array_equal(back.buffer, seg.buffer), "copy results differ"
        c.fill(buf, buf.nbytes, 0).result()

    rows = []
    for name, fn in [
        ("one at a time", one_at_a_time),
        ("batched frame, contiguous", batched(offs)),
        ("batched frame, scattered", batched(scattered)),
        ("copy_many (one vector request)", vector),
    ]:
        fn()
        verify()
        times = timed(fn, reps if name != "one at a time" else max(2, reps // 2))
        med = statistics.median(times)
        rows.append({"case": "10k x 4 KiB copies", "method": name, "median_s": med, "min_s": min(times), "max_s": max(times), "rps": n / med})
    base = rows[0]["median_s"]
    for r in rows:
        r["speedup_vs_one_at_a_time"] = base / r["median_s"]
    return rows


def normalize(c2: transfer.Client, reps: int) -> list[dict]:
    shape = (256, 3, 224, 224)
    n = int(np.prod(shape))
    x_np = np.random.default_rng(2).integers(0, 256, shape, dtype=np.uint8)
    mean = np.float32(MEAN).reshape(1, 3, 1, 1)
    std = np.float32(STD).reshape(1, 3, 1, 1)
    want = (x_np.astype(np.float32) - mean) / std

    seg = c2.segment(n)
    seg.ndarray(shape, np.uint8)[...] = x_np
    out = c2.segment(n * 4)
    y = out.ndarray(shape, np.float32)
    params = {"mean": MEAN, "std": STD}

    def via_transfer_one() -> None:
        c2.compute("normalize", [seg.tensor(shape, np.uint8)], [out.tensor(shape, np.float32)], params, device=0).result()

    def via_transfer_split() -> None:
        half = shape[0] // 2
        hs = (half, *shape[1:])
        ps = [
            c2.compute("normalize", [seg.tensor(hs, np.uint8, offset=k * half * 3 * 224 * 224)], [out.tensor(hs, np.float32, offset=k * half * 3 * 224 * 224 * 4)], params, device=k)
            for k in (0, 1)
        ]
        for p in ps:
            p.result()

    y_np = np.empty(shape, np.float32)
    scale, shift = (1 / std).astype(np.float32), (mean / std).astype(np.float32)

    def numpy_same_kernel() -> None:
        np.multiply(x_np, scale, out=y_np, casting="unsafe")
        np.subtract(y_np, shift, out=y_np)

    def numpy_naive() -> None:
        globals()["_sink"] = (x_np.astype(np.float32) - mean) / std

    rows = []
    for name, fn, check in [
        ("numpy in-process, naive (astype - mean) / std", numpy_naive, None),
        ("numpy in-process, fused kernel", numpy_same_kernel, y_np),
        ("transfer, 1 CPU device", via_transfer_one, y),
        ("transfer, batch split over 2 CPU devices", via_transfer_split, y),
    ]:
        fn()
        if check is not None:
            np.testing.assert_allclose(check, want, rtol=1e-5, atol=1e-4)
            check[...] = 0
        times = timed(fn, reps)
        med = statistics.median(times)
        rows.append({"case": "normalize 256x3x224x224 u8->f32", "method": name, "median_s": med, "min_s": min(times), "max_s": max(times), "images_per_s": shape[0] / med})
    base = rows[0]["median_s"]
    for r in rows:
        r["speedup_vs_numpy_naive"] = base / r["median_s"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows: list[dict] = []
    with run_daemon(["--backend", "numpy", "--devices", "2"]) as d:
        with transfer.connect(d.endpoint) as c:
            rows += copies(c, args.reps)
            rows += normalize(c, args.reps)
            stats = c.stats()["daemon"]
    for r in rows:
        extra = r.get("speedup_vs_one_at_a_time", r.get("speedup_vs_numpy_naive"))
        rate = r.get("rps") or r.get("images_per_s")
        unit = "req/s" if "rps" in r else "img/s"
        print(f"{r['case']:34s} {r['method']:48s} {r['median_s'] * 1e3:9.1f} ms  {rate:12,.0f} {unit}  x{extra:6.2f}")
    print(f"daemon: {stats['passes']} passes, {stats['waves']} waves, {stats['ops']} ops")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        machine = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(), "numpy": np.__version__}
        args.json.write_text(json.dumps({"machine": machine, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
