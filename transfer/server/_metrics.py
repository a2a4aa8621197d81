"""Prometheus metrics for the daemon, cheap enough for the request path.

`Metrics` owns a private `prometheus_client.CollectorRegistry` (never the
global one, so several daemons or tests in one process do not collide).

The hot-path methods (`request_done`, `bytes_moved`, `error`, `batch`) do not
touch prometheus_client objects at all: they bump plain Python numbers in
slots bound on first use of each label (one dict lookup, one or two integer
adds, a `bisect` for histograms). A custom collector turns those numbers into
metric families only when someone scrapes. prometheus_client's own
``Counter.labels(...).inc()`` takes a lock per call and costs several times
more (see `bench()`; docs/operations.md has the figures).

Threading: call the hot-path methods from the daemon's trio thread (not from
worker threads). A scrape runs on the HTTP server's thread and only reads;
a scrape racing an update can see a count one request stale, never a torn
or decreasing value (each slot is a Python int, replaced atomically).
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Any, Callable, Hashable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from .. import errors as E

__all__ = ["Metrics", "LATENCY_BUCKETS", "BATCH_BUCKETS"]

#: Request latency buckets (seconds): 10 µs .. 10 s.
LATENCY_BUCKETS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)
#: Batch size buckets (requests per frame / per submission): powers of 4 up to the default max_batch.
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 16, 64, 256, 1024, 4096, 16384, 65536)

_PREFIX = "transfer"


class _Hist:
    """A histogram as plain numbers: per-bucket counts (non-cumulative), sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last slot is +Inf
        self.sum = 0.0

    def buckets(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for b, c in zip((*self.bounds, float("inf")), self.counts):
            acc += c
            out.append(("+Inf" if b == float("inf") else repr(float(b)), acc))
        return out


class _Op:
    """Pre-bound slots of one operation: request count (= histogram count) and latency."""

    __slots__ = ("hist",)

    def __init__(self) -> None:
        self.hist = _Hist(LATENCY_BUCKETS)


def _kind_label(kind: Hashable) -> str:
    if isinstance(kind, tuple):
        return "->".join(_kind_label(k) for k in kind)
    name = getattr(kind, "name", None)
    return (name if isinstance(name, str) else str(kind)).lower()


class Metrics:
    """The daemon's metrics. Create one per Server; `start_http` to expose it."""

    def __init__(self, *, process: bool = True, namespace: str = _PREFIX) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.ns = namespace
        self._ops: dict[str, _Op] = {}
        self._bytes: dict[Hashable, list[Any]] = {}  # key -> [label, total]
        self._errors: dict[int, list[Any]] = {}  # code -> [name, count]
        self._batch = _Hist(BATCH_BUCKETS)
        self.gauges: dict[str, float] = {"sessions": 0, "segments": 0, "queued": 0}
        self._stats_source: Callable[[], dict[str, Any]] | None = None
        self._http: Any = None
        self._http_thread: threading.Thread | None = None
        self.started = time.time()
        self.registry.register(_Collector(self))
        if process:
            ProcessCollector(namespace=namespace, registry=self.registry)

    # --- hot path (trio thread) -----------------------------------------------------------
    def request_done(self, op: str, seconds: float, n: int = 1) -> None:
        """`n` requests of operation `op` finished, each after `seconds` (arrival to reply)."""
        o = self._ops.get(op)
        if o is None:
            o = self._ops[op] = _Op()
        h = o.hist
        h.counts[bisect.bisect_left(h.bounds, seconds)] += n
        h.sum += seconds * n

    @staticmethod
    def latency_bounds() -> tuple[float, ...]:
        """The request-latency buckets (the native data plane keeps its histograms in them)."""
        return LATENCY_BUCKETS

    def requests_histogram(self, op: str, counts: list[int], seconds: float) -> None:
        """Requests of `op` counted elsewhere, as per-bucket counts in `latency_bounds()` (and +Inf)."""
        o = self._ops.get(op)
        if o is None:
            o = self._ops[op] = _Op()
        h = o.hist
        for i, c in enumerate(counts):
            h.counts[i] += c
        h.sum += seconds

    def bytes_moved(self, kind: Hashable, n: int) -> None:
        """`n` bytes copied; `kind` is a segment kind (str or SegmentKind) or a (dst, src) tuple."""
        slot = self._bytes.get(kind)
        if slot is None:
            slot = self._bytes[kind] = [_kind_label(kind), 0]
        slot[1] += n

    def error(self, code: int, n: int = 1) -> None:
        """A request failed with wire code `code`."""
        slot = self._errors.get(code)
        if slot is None:
            err = E.error_for_code(code, "")
            name = type(err).__name__ if err.code == code else "Unknown"
            slot = self._errors[code] = [name, 0]
        slot[1] += n

    def batch(self, n: int) -> None:
        """A frame (or a coalesced submission) of `n` requests."""
        h = self._batch
        h.counts[bisect.bisect_left(h.bounds, n)] += 1
        h.sum += n

    def set_gauges(self, sessions: int | None = None, segments: int | None = None, queued: int | None = None, **more: float) -> None:
        """Current levels; pass only what changed. Extra names become `transfer_<name>` gauges."""
        g = self.gauges
        if sessions is not None:
            g["sessions"] = sessions
        if segments is not None:
            g["segments"] = segments
        if queued is not None:
            g["queued"] = queued
        if more:
            g.update(more)

    def set_stats_source(self, fn: Callable[[], dict[str, Any]] | None) -> None:
        """Export ``fn()["daemon"]`` (the daemon's Stats counters) at scrape time, as-is."""
        self._stats_source = fn

    # --- exposition -------------------------------------------------------------------------
    def render(self) -> bytes:
        """The text exposition format (what a scrape returns)."""
        return generate_latest(self.registry)

    def start_http(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on a daemon thread; returns the bound port (port 0 picks one)."""
        from prometheus_client import start_http_server

        if self._http is not None:
            raise RuntimeError("metrics HTTP server already running")
        res = start_http_server(port, addr=addr, registry=self.registry)
        if isinstance(res, tuple):  # prometheus_client >= 0.17 returns (server, thread)
            self._http, self._http_thread = res
            return int(self._http.server_address[1])
        self._http = True  # older versions: no handle; cannot report an ephemeral port
        return port

    def stop_http(self) -> None:
        if self._http not in (None, True):
            self._http.shutdown()
            self._http.server_close()
        self._http = None

    # --- reading back (tests, stats) -----------------------------------------------------------
    def requests(self, op: str) -> int:
        o = self._ops.get(op)
        return sum(o.hist.counts) if o else 0

    def errors(self, code: int) -> int:
        slot = self._errors.get(code)
        return slot[1] if slot else 0

    def bytes_total(self, kind: Hashable) -> int:
        label = _kind_label(kind)
        return sum(v for lab, v in self._bytes.values() if lab == label)


class _Collector(Collector):
    def __init__(self, m: Metrics) -> None:
        self.m = m

    def collect(self) -> Iterator[Any]:
        m, ns = self.m, self.m.ns
        req = CounterMetricFamily(f"{ns}_requests", "Requests completed, by operation", labels=["op"])
        lat = HistogramMetricFamily(f"{ns}_request_seconds", "Request latency, arrival to reply, by operation", labels=["op"])
        for op, o in list(m._ops.items()):
            b = o.hist.buckets()
            req.add_metric([op], b[-1][1])
            lat.add_metric([op], b, o.hist.sum)
        yield req
        yield lat
        byt = CounterMetricFamily(f"{ns}_bytes_moved", "Bytes copied, by segment kind", labels=["kind"])
        per: dict[str, int] = {}
        for label, total in list(m._bytes.values()):
            per[label] = per.get(label, 0) + total
        for label, total in per.items():
            byt.add_metric([label], total)
        yield byt
        err = CounterMetricFamily(f"{ns}_errors", "Failed requests, by wire error code", labels=["code", "name"])
        for code, (name, count) in list(m._errors.items()):
            err.add_metric([str(code), name], count)
        yield err
        bat = HistogramMetricFamily(f"{ns}_batch_size", "Requests per frame (or per coalesced submission)")
        bat.add_metric([], m._batch.buckets(), m._batch.sum)
        yield bat
        help_ = {"sessions": "Open sessions", "segments": "Live segments (host + device)", "queued": "Frames queued across sessions (queue depth)"}
        for name, value in list(m.gauges.items()):
            yield GaugeMetricFamily(f"{ns}_{name}", help_.get(name, name.replace("_", " ")), value=value)
        yield GaugeMetricFamily(f"{ns}_start_time_seconds", "When this Metrics object was created (unix time)", value=m.started)
        src = m._stats_source
        if src is not None:
            try:
                daemon = dict(src().get("daemon", {}))
            except Exception:  # a scrape racing a mutation: skip this round, never fail the scrape
                daemon = {}
            for key, value in sorted(daemon.items()):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                yield GaugeMetricFamily(f"{ns}_daemon_{key}", f"Daemon Stats counter '{key}'", value=value)


def bench(n: int = 200_000) -> dict[str, float]:
    """ns per call of the hot-path methods, and of prometheus_client's own objects for contrast."""
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
            bm("host", 4096)

    def f3() -> None:
        er = m.error
        for _ in rng:
            er(204)

    def f4() -> None:
        b = m.batch
        for _ in rng:
            b(17)

    def f5() -> None:
        sg = m.set_gauges
        for _ in rng:
            sg(sessions=3, segments=10, queued=0)

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

    for name, fn in (("loop", f0), ("request_done", f1), ("bytes_moved", f2), ("error", f3), ("batch", f4), ("set_gauges", f5), ("prometheus_client counter+histogram", p1)):
        timeit(name, fn)
    base = out.pop("loop")
    return {k: round(v - base, 1) for k, v in out.items()}


if __name__ == "__main__":
    for k, v in bench().items():
        print(f"{k:40s} {v:8.1f} ns/call")
