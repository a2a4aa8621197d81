"""How fast could the daemon's MLP graph go if a CPU device computed in a process of its own?
(issue 18: a feasibility measure for the next design step, not a measure of `transfer`.)

`bench/graphs.py` puts the MLP through the daemon at about 0.7x of in-process NumPy at batch
64: the daemon's compute worker shares one GIL with its event loop, and on 2 cores the two
hand it back and forth many times a run. This script measures the ceiling of the other
design: the same kernels (`transfer.kernels`, as `bench/graphs.py`'s "kernels" column) in a
separate process, fed batches through shared memory and told which slot to run over a pipe,
`--slots` runs in flight, against the same kernels in this process. No daemon, planning or
reply is in it: what a device process would cost beyond them is one pipe message each way.

    python bench/compute_process.py [--batch 64] [--seconds 4] [--reps 3] [--slots 4] [--json PATH]
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
        os.environ[_v] = "1"  # one BLAS thread on each side, as bench/graphs.py's default

import argparse
import json
import multiprocessing as mp
import statistics
import time
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import graphs as G  # noqa: E402  (bench/graphs.py: the MLP, its weights and its kernels)


def _device(conn: Connection, shm_name: str, batch: int, slots: int) -> None:
    """The compute process: run the MLP over the slot each message names, answer the slot."""
    shm = shared_memory.SharedMemory(name=shm_name)
    nin, nout = batch * G.SIZES[0], batch * G.SIZES[-1]
    buf = np.ndarray((slots, nin + nout), np.float32, shm.buf)
    run = G.kernels_mlp(batch, G.make_weights())
    try:
        while (s := conn.recv()) >= 0:
            run(buf[s, :nin].reshape(batch, -1), buf[s, nin:].reshape(batch, -1))
            conn.send(s)
    finally:
        del buf
        shm.close()


def _separate(conn: Connection, buf: np.ndarray, xs: list[np.ndarray], nin: int, secs: float) -> float:
    """Runs/s with the compute process busy: each answer's slot refilled and sent again."""
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < secs:
        s = conn.recv()
        buf[s, :nin] = xs[n % len(xs)].ravel()
        conn.send(s)
        n += 1
    return n / (time.perf_counter() - t)


def _in_process(run: Any, xs: list[np.ndarray], batch: int, secs: float) -> float:
    y = np.empty((batch, G.SIZES[-1]), np.float32)
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < secs:
        run(xs[n % len(xs)], y)
        n += 1
    return n / (time.perf_counter() - t)


def _drive(conn: Connection, buf: np.ndarray, batch: int, seconds: float, reps: int, slots: int) -> tuple[float, list[float], list[float]]:
    """Check the separate process's outputs against this one's (untimed), then time both in turn."""
    nin = batch * G.SIZES[0]
    xs = [G._MLP.batch_of(i, batch) for i in range(slots)]
    run = G.kernels_mlp(batch, G.make_weights())
    for s in range(slots):
        buf[s, :nin] = xs[s].ravel()
        conn.send(s)
    want = np.empty((batch, G.SIZES[-1]), np.float32)
    err = 0.0
    for _ in range(slots):
        s = conn.recv()
        run(xs[s], want)
        err = max(err, float(np.abs(buf[s, nin:].reshape(batch, -1) - want).max()))
        conn.send(s)
    _separate(conn, buf, xs, nin, min(1.0, seconds))  # warm both sides
    sep, inp = [], []
    for _ in range(reps):
        sep.append(_separate(conn, buf, xs, nin, seconds))
        inp.append(_in_process(run, xs, batch, seconds))
    for _ in range(slots):
        conn.recv()
    return err, sep, inp


def measure(batch: int, seconds: float, reps: int, slots: int) -> dict[str, Any]:
    """Runs/s in a separate process and in this one, `reps` times each in turn."""
    nin, nout = batch * G.SIZES[0], batch * G.SIZES[-1]
    shm = shared_memory.SharedMemory(create=True, size=slots * (nin + nout) * 4)
    buf = np.ndarray((slots, nin + nout), np.float32, shm.buf)
    here, there = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_device, args=(there, shm.name, batch, slots), daemon=True)
    proc.start()
    try:
        err, sep, inp = _drive(here, buf, batch, seconds, reps, slots)
        here.send(-1)
        proc.join(30)
    finally:
        del buf  # (the mapping closes only once no array views it)
        shm.close()
        shm.unlink()
        if proc.is_alive():
            proc.kill()
    ratios = [a / b for a, b in zip(sep, inp)]
    return {"batch": batch, "slots": slots, "max_abs_error": err, "separate_per_s": statistics.median(sep),
            "in_process_per_s": statistics.median(inp), "separate_vs_in_process": statistics.median(ratios),
            "separate_reps": sep, "in_process_reps": inp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    r = measure(args.batch, args.seconds, args.reps, args.slots)
    print(f"batch {r['batch']}: separate process {r['separate_per_s']:,.0f} runs/s, in-process "
          f"{r['in_process_per_s']:,.0f} runs/s, ratio {r['separate_vs_in_process']:.2f} "
          f"(max abs error {r['max_abs_error']:.1e})")
    if args.json:
        doc = {"command": "python bench/compute_process.py " + " ".join(sys.argv[1:]), "result": r}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
