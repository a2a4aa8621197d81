"""What one request costs the client: submission, the wait, and the round trip.

One sync client on a real daemon's ring (the default route), 64-byte copies:

* **submit**: the `copy(...)` call alone, one request in flight;
* **wait**: its `result()`, which reaps the completion;
* **round trip**: both, p50 and p99;
* **result, already complete**: `result()` called after the completion is in (the reap
  alone, without waiting).

Medians over `--rounds` rounds of `--n` requests. `--baseline DIR` also measures a checkout
of another commit (its native extension built), in alternating runs of this same script, so
both see the same phases of a noisy machine:

    python bench/submit.py [--n 2000] [--rounds 3] [--runs 3] [--baseline DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def measure(n: int, rounds: int) -> dict[str, float]:
    """The figures of one run, in microseconds (this process, the transfer it imports)."""
    import transfer
    from transfer.testing import run_daemon

    ns = time.perf_counter_ns
    sub: list[int] = []
    wait: list[int] = []
    rt: list[int] = []
    done: list[int] = []
    with run_daemon() as d, transfer.connect(d.endpoint) as c:
        seg = c.segment(1 << 16)
        va = seg.va
        c.fence()
        for _ in range(n):  # warm up: caches, the worker's spin, the branch predictors
            c.copy(va + 4096, va, 64).result()
        for _ in range(rounds):
            for _ in range(n):
                t0 = ns()
                p = c.copy(va + 4096, va, 64)
                t1 = ns()
                p.result()
                t2 = ns()
                sub.append(t1 - t0)
                wait.append(t2 - t1)
                rt.append(t2 - t0)
            for _ in range(n // 8):
                p = c.copy(va + 4096, va, 64)
                time.sleep(100e-6)  # the completion is in by now
                t0 = ns()
                p.result()
                done.append(ns() - t0)
    rt.sort()

    def us(xs: list[int]) -> float:
        return round(statistics.median(xs) / 1000, 2)

    return {"submit_us": us(sub), "wait_us": us(wait), "rt_p50_us": us(rt),
            "rt_p99_us": round(rt[len(rt) * 99 // 100] / 1000, 2), "result_when_complete_us": us(done)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="requests per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3, help="alternating runs per tree (with --baseline)")
    ap.add_argument("--baseline", type=Path, help="a checkout of another commit to measure alongside")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child run: print one JSON line
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.n, args.rounds)))
        return
    here = Path(__file__).resolve().parent.parent
    trees = {"this": here, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    for _ in range(args.runs):
        for name, root in trees.items():
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", "--n", str(args.n), "--rounds", str(args.rounds)],
                                 cwd=root, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}, capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name].append(row)
            print(f"{name:9s}", "  ".join(f"{k} {v:6.2f}" for k, v in row.items()), flush=True)
    result: dict[str, Any] = {"command": " ".join(["python bench/submit.py", *sys.argv[1:]]), "runs": runs}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
