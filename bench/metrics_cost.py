#!/usr/bin/env python3
"""What the daemon's metrics cost: ns per call of the request path's methods (beside
prometheus_client's own counter and histogram, for contrast), and ms per scrape with many
live sessions.

    python bench/metrics_cost.py [--calls 200000] [--sessions 1024] [--rounds 20]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

from prometheus_client import CollectorRegistry

from transfer.server._metrics import LATENCY_BUCKETS, Metrics


def bench(n: int = 200_000) -> dict[str, float]:
    """ns per call of the request-path methods, and of prometheus_client's own objects for contrast."""
    from prometheus_client import Counter, Histogram

    m = Metrics(process=False)
    out: dict[str, float] = {}

    def timeit(name: str, fn: Callable[[], None]) -> None:
        t0 = time.perf_counter_ns()
        fn()
        out[name] = (time.perf_counter_ns() - t0) / n

    rng = range(n)

    def f1() -> None:
        rd = m.request_done
        for _ in rng:
            rd("copy", 3e-5)

    def f2() -> None:
        bm = m.bytes_moved
        for _ in rng:
            bm("cpu", 4096)

    def f3() -> None:
        er = m.error
        for _ in rng:
            er(204)

    def f4() -> None:
        b = m.batch
        for _ in rng:
            b(17)

    def f0() -> None:
        for _ in rng:
            pass

    reg = CollectorRegistry()
    c = Counter("x", "x", ["op"], registry=reg).labels("copy")
    h = Histogram("y", "y", ["op"], registry=reg, buckets=LATENCY_BUCKETS).labels("copy")

    def p1() -> None:
        for _ in rng:
            c.inc()
            h.observe(3e-5)

    for name, fn in (("loop", f0), ("request_done", f1), ("bytes_moved", f2), ("error", f3), ("batch", f4), ("prometheus_client counter+histogram", p1)):
        timeit(name, fn)
    base = out.pop("loop")
    return {k: round(v - base, 1) for k, v in out.items()}


def bench_scrape(sessions: int = 1024, rounds: int = 20) -> float:
    """ms per scrape with `sessions` live sessions (the per-client fold and the exposition)."""

    class _S:
        def __init__(self, i: int) -> None:
            self.id, self.client, self.running = i, f"producer-{i}", True
            self.stats = type("st", (), {"bytes_moved": i, "requests": i, "errors": 0, "device_ns": 0})()

    live = [_S(i) for i in range(1, sessions + 1)]
    m = Metrics(process=False)
    m.set_source(lambda: {}, lambda: live)
    t0 = time.perf_counter()
    for r in range(rounds):
        for s in live:
            s.stats.bytes_moved += s.id * r
        m.render()
    return round((time.perf_counter() - t0) / rounds * 1e3, 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200_000, help="calls timed per method (default 200000)")
    p.add_argument("--sessions", type=int, default=1024, help="live sessions in the scrape (default 1024)")
    p.add_argument("--rounds", type=int, default=20, help="scrapes timed (default 20)")
    a = p.parse_args(argv)
    for k, v in bench(a.calls).items():
        print(f"{k:40s} {v:8.1f} ns/call")
    print(f"{f'scrape, {a.sessions} sessions':40s} {bench_scrape(a.sessions, a.rounds):8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
