"""The CPU device process without the daemon: the ceiling of `transfer`'s device process.

`bench/graphs.py` puts the MLP through the daemon: receiving, planning, answering, and a
CPU device's kernels in the device's own process (`backends/_devproc.py`). This script
drives that same process directly, through the NumPy backend's `begin_steps` (the call the
daemon's worker makes), `--slots` runs in flight, against the same kernels in this process.
No daemon, planning or reply is in it: the gap between this ratio and graphs.py's is what
the daemon's loop costs, and the gap between this ratio and 1.0 is what the process costs
(one message each way per run, and pickling).

    python bench/compute_process.py [--batch 64] [--seconds 4] [--reps 3] [--slots 4] [--json PATH]
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
        os.environ[_v] = "1"  # one BLAS thread on each side, as bench/graphs.py's default

import argparse
import collections
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from transfer.addressing import SegmentKind
from transfer.backends import NumpyBackend, Span
from transfer.kernels import FAILED, REGISTRY, TensorRef

sys.path.insert(0, str(Path(__file__).resolve().parent))
import graphs as G  # noqa: E402  (bench/graphs.py: the MLP, its weights and its kernels)


class Device:
    """The MLP's weights, intermediates and `slots` input/output pairs in one buffer of the
    NumPy backend (a memfd its device process maps), and each slot's run as the steps a
    planned graph's stretch sends (`kernels.run_steps`' form)."""

    def __init__(self, batch: int, slots: int) -> None:
        self.backend = NumpyBackend(1)
        ws = G.make_weights()
        sizes = G.SIZES
        mids = [(batch, n) for n in sizes[1:-1] for _ in range(2)]
        shapes = [w.shape for w in ws] + mids + [(batch, sizes[0]), (batch, sizes[-1])] * slots
        offs = np.cumsum([0] + [int(np.prod(sh)) * 4 for sh in shapes])
        self.mem = self.backend.alloc(int(offs[-1]), 0)
        self.views = [np.ndarray(sh, np.float32, self.mem, int(o)) for sh, o in zip(shapes, offs)]
        refs = [(TensorRef(0, "float32", tuple(sh)), Span(SegmentKind.DEVICE, self.mem, int(o), int(np.prod(sh)) * 4))
                for sh, o in zip(shapes, offs)]
        for v, w in zip(self.views, ws):
            v[...] = w
        nw, nm = len(ws), len(mids)
        lin = REGISTRY.lookup("linear", ("float32",) * 4, "cpu")
        relu = REGISTRY.lookup("relu", ("float32",) * 2, "cpu")
        self.inputs = [self.views[nw + nm + 2 * s] for s in range(slots)]
        self.outputs = [self.views[nw + nm + 2 * s + 1] for s in range(slots)]
        self.steps: list[list[Any]] = []
        for s in range(slots):
            x, y = refs[nw + nm + 2 * s], refs[nw + nm + 2 * s + 1]
            steps, h = [], x
            for k in range(0, nw, 2):
                if k + 2 == nw:
                    steps.append((len(steps), lin, [h, refs[k], refs[k + 1]], [y], {}, (), None))
                    break
                pre, act = refs[nw + k], refs[nw + k + 1]
                steps.append((len(steps), lin, [h, refs[k], refs[k + 1]], [pre], {}, (), None))
                steps.append((len(steps), relu, [pre], [act], {}, (len(steps) - 1,), None))
                h = act
            self.steps.append(steps)

    def begin(self, s: int) -> Callable[[], None]:
        wait = self.backend.begin_steps(self.steps[s], set(), 0)

        def end() -> None:
            for state, value, _ in wait():
                if state == FAILED:
                    raise value
        return end

    def close(self) -> None:
        self.backend.close()


def _separate(dev: Device, xs: list[np.ndarray], secs: float) -> float:
    """Runs/s with the device process kept busy: each finished slot refilled and sent again."""
    slots = len(dev.steps)
    inflight = collections.deque((s, dev.begin(s)) for s in range(slots))
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < secs:
        s, end = inflight.popleft()
        end()
        dev.inputs[s][...] = xs[n % len(xs)]
        inflight.append((s, dev.begin(s)))
        n += 1
    rate = n / (time.perf_counter() - t)
    for _, end in inflight:
        end()
    return rate


def _in_process(run: Any, xs: list[np.ndarray], batch: int, secs: float) -> float:
    y = np.empty((batch, G.SIZES[-1]), np.float32)
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < secs:
        run(xs[n % len(xs)], y)
        n += 1
    return n / (time.perf_counter() - t)


def measure(batch: int, seconds: float, reps: int, slots: int) -> dict[str, Any]:
    """Check the device process's outputs against this process's (untimed), then runs/s on
    each side, `reps` times in turn."""
    xs = [G._MLP.batch_of(i, batch) for i in range(slots)]
    run = G.kernels_mlp(batch, G.make_weights())
    dev = Device(batch, slots)
    try:
        want = np.empty((batch, G.SIZES[-1]), np.float32)
        ends = []
        for s in range(slots):
            dev.inputs[s][...] = xs[s]
            ends.append(dev.begin(s))
        err = 0.0
        for s, end in enumerate(ends):
            end()
            run(xs[s], want)
            err = max(err, float(np.abs(dev.outputs[s] - want).max()))
        _separate(dev, xs, min(1.0, seconds))  # warm both sides
        sep, inp = [], []
        for _ in range(reps):
            sep.append(_separate(dev, xs, seconds))
            inp.append(_in_process(run, xs, batch, seconds))
    finally:
        dev.close()
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
