"""Physical limits measured in-process on one core: memcpy and read bandwidth."""

from __future__ import annotations

import statistics
from typing import Callable

import numpy as np

from .common import Bytes, now


def _time_op(fn: Callable[[], object], nbytes: int, budget_s: float, reps: int) -> list[float]:
    """GB/s samples of ``fn``; each sample runs ``fn`` enough times to last >= ~1 ms."""
    fn()  # warm-up (page faults, caches), excluded
    t0 = now()
    fn()
    one = max(now() - t0, 1e-7)
    inner = max(1, int(0.002 / one))
    samples: list[float] = []
    deadline = now() + budget_s
    while len(samples) < reps or (now() < deadline and len(samples) < 4 * reps):
        t0 = now()
        for _ in range(inner):
            fn()
        dt = now() - t0
        samples.append(nbytes * inner / dt / 1e9)
        if now() > deadline and len(samples) >= 3:
            break
    return samples


def measure_limits(size: int, checksum: Callable[[Bytes], int], budget_s: float = 0.3,
                   reps: int = 5) -> dict[str, dict[str, float]]:
    """{'limit:memcpy': {...}, 'limit:read': {...}, 'limit:checksum': {...}} for ``size`` bytes."""
    src = np.empty(size, np.uint8)
    src.view(np.uint64)[:] = np.arange(size // 8, dtype=np.uint64)
    dst = np.empty_like(src)
    u64 = src.view(np.uint64)
    ops = {
        "limit:memcpy": lambda: np.copyto(dst, src),
        "limit:read": lambda: np.add.reduce(u64),
        "limit:checksum": lambda: checksum(src),
    }
    out = {}
    for name, fn in ops.items():
        s = _time_op(fn, size, budget_s / len(ops), reps)
        med = statistics.median(s)
        out[name] = {"gbps": med, "min_gbps": min(s), "max_gbps": max(s), "reps": len(s),
                     "rps": med * 1e9 / size}
    return out
