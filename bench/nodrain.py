"""A producer that never drains: examples/mlp_forward.py's loop, timed, with how many of its
graph runs took the ring.

The first run carries the graph's definition over the socket; every later one is a ring
descriptor only if the client may push behind a pending socket request (`FLAG_AFTER`,
docs/ring.md). The outputs of the last runs are checked against NumPy.

    python bench/nodrain.py --batch 64 --seconds 3
    PYTHONPATH=<another tree> python bench/nodrain.py ...   # the same loop against another commit
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

import transfer

from _examples import load as load_example  # (bench/ is the script's directory: on sys.path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--slots", type=int, default=4, help="runs in flight")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.slots < 1 or args.seconds <= 0:
        ap.error("--batch and --slots must be at least 1, --seconds positive")
    m = load_example("mlp_forward")
    ws = m.make_weights()
    xs = [m.batch_of(i, args.batch) for i in range(4)]
    with transfer.serve_in_process() as daemon, transfer.connect(daemon.endpoint) as c:
        g = m.build(c, m.upload_weights(c, ws), args.batch)
        nin, nout = args.batch * m.SIZES[0] * 4, args.batch * m.SIZES[-1] * 4
        seg, out = c.segment(args.slots * nin), c.segment(args.slots * nout)
        pending: list[Any] = [None] * args.slots
        pushed = c._ring.pushed if c._ring is not None else 0
        i, t0 = 0, time.perf_counter()
        while i % 16 or time.perf_counter() - t0 < args.seconds:
            s = i % args.slots
            if pending[s] is not None:
                pending[s].result()  # the slot is free again (no drain: the others stay in flight)
            seg.ndarray((args.batch, m.SIZES[0]), np.float32, offset=s * nin)[...] = xs[i % 4]
            pending[s] = c.run_graph(g, [seg.at(s * nin)], [out.at(s * nout)])
            i += 1
        on_ring = c._ring.pushed - pushed if c._ring is not None else 0
        c.fence()
        elapsed = time.perf_counter() - t0
        err = 0.0
        for k in range(max(0, i - args.slots), i):
            y = out.ndarray((args.batch, m.SIZES[-1]), np.float32, offset=(k % args.slots) * nout)
            err = max(err, float(np.abs(y - m.reference(xs[k % 4], ws)).max()))
    if err > 1e-3:
        raise SystemExit(f"the graph's outputs disagree with NumPy (max abs error {err:.2e})")
    print(json.dumps({"batch": args.batch, "slots": args.slots, "runs": i, "runs_per_s": round(i / elapsed, 1),
                      "runs_on_ring": on_ring, "max_abs_error": err}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
