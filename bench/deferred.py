"""Deferred creation versus eager calls (issue: deferred creation), same run, same daemon.

The workload of tests/test_deferred.py, repeated: allocate 3 buffers, describe 2
tensors, configure 1 operator plan, copy in, compute, copy out, wait, free the
buffers. Deferred (the default) answers create/configure calls in the client;
eager (`deferred=False`) sends and waits for each. Results are checked every
iteration.

    python bench/deferred.py [--iterations 1000] [--json bench/results/deferred.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import transfer
from transfer.testing import run_daemon


def run(endpoint: str, deferred: bool, iterations: int) -> dict:
    with transfer.connect(endpoint, deferred=deferred) as c:
        host = c.segment(2 * 4096)
        x = host.ndarray((32, 32), np.float32)
        x[:] = np.arange(1024, dtype=np.float32).reshape(32, 32)
        want = x * 2 + 1
        out = host.ndarray((32, 32), np.float32, offset=4096)
        st0 = c.stats()["session"]
        frames0 = c.frames_sent
        calls = 0
        t0 = time.perf_counter()
        for _ in range(iterations):
            a, b, scratch = c.alloc(4096), c.alloc(4096), c.alloc(4096)
            ta, tb = c.tensor(a, (32, 32), np.float32), c.tensor(b, (32, 32), np.float32)
            plan = c.plan("scale_add", {"a": 2.0, "b": 1.0})
            c.copy(a, host.va, 4096)
            c.compute(plan, [ta], [tb])
            c.copy(host.va + 4096, b.va, 4096)
            c.fill(scratch, 16, 0)
            c.fence()
            for buf in (a, b, scratch):
                c.free(buf)
            calls += 14  # 3 alloc, 2 tensor, 1 plan, 2 copy, compute, fill, fence, 3 free
            if not np.array_equal(out, want):
                raise SystemExit("wrong result")
            out[:] = 0
        elapsed = time.perf_counter() - t0
        frames = c.frames_sent - frames0
        st1 = c.stats()["session"]
    return {
        "mode": "deferred" if deferred else "eager",
        "iterations": iterations,
        "seconds": elapsed,
        "calls_per_s": calls / elapsed,
        "iterations_per_s": iterations / elapsed,
        "frames_sent": frames,
        "frames_per_iteration": frames / iterations,
        "blocking_round_trips_per_iteration": (st1["blocking"] - st0["blocking"] - 1) / iterations,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=1000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with run_daemon(["--backend", "numpy"]) as d:
        rows = [run(d.endpoint, True, args.iterations), run(d.endpoint, False, args.iterations)]
    print(f"{'mode':9s} {'wall s':>8s} {'iter/s':>8s} {'calls/s':>9s} {'frames/iter':>12s} {'blocking RT/iter':>17s}")
    for r in rows:
        print(f"{r['mode']:9s} {r['seconds']:8.2f} {r['iterations_per_s']:8.0f} {r['calls_per_s']:9.0f} {r['frames_per_iteration']:12.2f} {r['blocking_round_trips_per_iteration']:17.2f}")
    print(f"deferred is {rows[1]['seconds'] / rows[0]['seconds']:.1f}x faster, with {rows[1]['frames_sent'] / rows[0]['frames_sent']:.1f}x fewer messages")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"results": rows}, indent=2))


if __name__ == "__main__":
    main()
