"""Prometheus metrics for the daemon, cheap enough for the request path.

`Metrics` owns a private `prometheus_client.CollectorRegistry` (never the
global one, so several daemons or tests in one process do not collide).

Three sources, one exposition (docs/operations.md lists every family):

* **The request path** (`request_done`, `requests_histogram`, `bytes_moved`,
  `error`, `batch`) does not touch prometheus_client objects at all: it bumps
  plain Python numbers in slots bound on first use of each label (one dict
  lookup, one or two integer adds, a `bisect` for histograms).
  prometheus_client's own ``Counter.labels(...).inc()`` takes a lock per call
  and costs several times more (see `bench()`).
* **The daemon's Stats counters** (`set_source`) are read when someone
  scrapes and exported under the names in `STATS_FAMILIES`: counters as
  counters ending in `_total`, levels as gauges, units in the names. A Stats
  key that is neither there nor in `STATS_NOT_EXPORTED` is not exported
  (tests/test_metrics.py fails on it), so a new counter cannot slip out
  under an unconventional name.
* **Per-client series** (`SessionSeries`): bounded cardinality, folded from
  the sessions' own counters at scrape time; the request path pays nothing.

Threading: call the request-path methods and `session_ended` from the
daemon's trio thread. A scrape runs on the HTTP server's thread; it reads,
and it folds per-client series under a lock that only `session_ended` also
takes. A scrape racing an update can see a count one request stale, never a
torn or decreasing value (each slot is a Python int, replaced atomically).
"""

from __future__ import annotations

import bisect
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .. import errors as E
from .._version import __version__
from ..protocol import VERSION
from ._metrics_http import DEFAULT_MAX_CONNECTIONS, DEFAULT_TIMEOUT_S, MetricsHTTP

__all__ = ["Metrics", "SessionSeries", "LATENCY_BUCKETS", "BATCH_BUCKETS", "STATS_FAMILIES", "STATS_NOT_EXPORTED", "OTHER"]

#: Request latency buckets (seconds): 10 µs .. 10 s.
LATENCY_BUCKETS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)
#: Batch size buckets (requests per frame / per ring batch): powers of 4 up to the default max_batch.
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 16, 64, 256, 1024, 4096, 16384, 65536)

_PREFIX = "transfer"

#: Daemon Stats key -> (family name after the namespace, "counter" or "gauge", help).
#: Counter names end in `_total` (prometheus_client writes the suffix); units are in the names.
STATS_FAMILIES: dict[str, tuple[str, str, str]] = {
    "frames": ("frames_total", "counter", "Control-socket frames received"),
    "bad_frames": ("bad_frames_total", "counter", "Frames refused before any request was decoded"),
    "requests": ("requests_received_total", "counter", "Requests received on every path (socket, ring, native worker), control requests included"),
    "native_requests": ("native_requests_total", "counter", "Ring requests a native worker executed (also in requests_received_total)"),
    "ring_handovers": ("ring_handovers_total", "counter", "Ring descriptors a native worker handed to the event loop"),
    "fused_checksums": ("fused_checksums_total", "counter", "Checksums a native worker answered from the sum of the copy that read or wrote their range"),
    "shared_copies": ("shared_copies_total", "counter", "Large copies a native worker shared, chunk by chunk, with the daemon's copy helpers"),
    "ring_worker_sleeps": ("ring_worker_sleeps_total", "counter", "Times a native worker found its ring idle past its spin and slept on the futex"),
    "sessions_reaped": ("sessions_reaped_total", "counter", "Sessions the daemon ended: client died, went silent, or broke its ring"),
    "passes": ("passes_total", "counter", "Scheduler passes run"),
    "waves": ("waves_total", "counter", "Hazard-free waves executed"),
    "ops": ("ops_total", "counter", "Planned ops executed (a run of copies planned as one vector is one op)"),
    "pipelined_passes": ("pipelined_passes_total", "counter", "Passes queued on a GPU lane behind one still running"),
    "nixl_posts": ("nixl_posts_total", "counter", "NIXL transfers posted (one per peer and direction per wave)"),
    "nixl_reposts": ("nixl_reposts_total", "counter", "NIXL posts of a request kept from an earlier post (a producer's repeated transfer)"),
    "nixl_descs": ("nixl_descriptors_total", "counter", "NIXL descriptors posted"),
    "nixl_bytes": ("nixl_bytes_total", "counter", "Bytes moved by NIXL (RDMA) transfers"),
    "nixl_failures": ("nixl_failures_total", "counter", "NIXL transfers that failed"),
    "fds_passed": ("fds_passed_total", "counter", "Segment and ring memfds handed to clients"),
    "fds_refused": ("fds_refused_total", "counter", "fd-socket requests refused (bad token, wrong peer)"),
    "fds_evicted": ("fds_evicted_total", "counter", "fd-socket peers closed before sending a token, to make room (a flood)"),
    "connections_refused": ("connections_refused_total", "counter", "control connections closed as accepted: the connection cap was reached"),
    "connections_idle_closed": ("connections_idle_closed_total", "counter", "control connections with no live session closed after silence"),
    "sessions": ("sessions", "gauge", "Open sessions"),
    "rings": ("rings", "gauge", "Open shared-memory request rings"),
    "ring_workers": ("ring_workers", "gauge", "Running native ring workers"),
    "segments": ("segments", "gauge", "Live segments (host, device and remote)"),
    "queued_requests": ("queued_requests", "gauge", "Requests queued across sessions, not yet taken by a pass"),
    "device_bytes": ("device_allocated_bytes", "gauge", "Device memory allocated by sessions"),
    "pinned_bytes": ("host_pinned_bytes", "gauge", "Host memory page-locked for DMA"),
    "nixl_peers": ("nixl_peers", "gauge", "Connected NIXL peers (remote producers)"),
}
#: Stats keys deliberately not exported, and why: each would duplicate a labelled family.
STATS_NOT_EXPORTED: dict[str, str] = {
    "errors": "the sum of transfer_errors_total over its labels",
    "bytes_moved": "the sum of transfer_moved_bytes_total over its labels",
    "uptime_s": "time() - transfer_process_start_time_seconds",
    "devices": "per device: transfer_device_queued_bytes and transfer_device_batches_total",
}

#: The per-client series that gathers every client without a label of its own. Client names
#: are sanitized to [A-Za-z0-9_.:@/-], so no client can be called this.
OTHER = "(other)"
_LABEL_CHARS = re.compile(r"[^A-Za-z0-9_.:@/-]")


def client_label(name: str) -> str:
    """A client name (hello's `client`, from the wire) as a label value: safe characters, short."""
    return _LABEL_CHARS.sub("_", name)[:64] or "unnamed"


class _Hist:
    """A histogram as plain numbers: per-bucket counts (non-cumulative), sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last slot is +Inf
        self.sum = 0.0

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for b, c in zip((*self.bounds, float("inf")), self.counts):
            acc += c
            out.append(("+Inf" if b == float("inf") else repr(float(b)), acc))
        return out


class SessionStatsLike(Protocol):
    @property
    def bytes_moved(self) -> int: ...
    @property
    def requests(self) -> int: ...
    @property
    def errors(self) -> int: ...


class SessionLike(Protocol):
    """What `SessionSeries` reads of a session (`server._session.Session` is one)."""

    @property
    def id(self) -> int: ...
    @property
    def client(self) -> str: ...
    @property
    def stats(self) -> SessionStatsLike: ...
    @property
    def running(self) -> bool: ...


@dataclass
class _Client:
    """A client name with live sessions: their number, its rank, its series if labeled."""

    live: int = 0
    #: Bytes its sessions moved while it had live ones: the rank for a label.
    rank: int = 0
    #: [bytes, requests, errors] of its series; None: counted in (other).
    values: list[int] | None = None
    #: `values` as the last scrape showed them (or as the series started).
    shown: list[int] | None = None


class SessionSeries:
    """Per-client counters whose label count stays bounded, however many sessions come and go.

    Sessions are grouped by their client name (hello's `client`: `connect(name=...)`,
    default `pid<N>`). At most `limit` names with a live session hold a label of their
    own: the first ones seen while a slot is free, then, after each scrape, the `limit`
    names whose sessions moved the most bytes. Everything else is counted in the
    `(other)` series. A name whose last session ended keeps its series for one more
    scrape, so its last increments are seen (at most `limit` such: beyond, the
    increments no scrape has shown go to `(other)`). So each family has at most
    2 * limit + 1 series.

    Every increment is counted in exactly one series, and no series ever decreases:
    a name that loses its label stops (what it moves next goes to `(other)`), and
    one that gets a label back goes on from where it stopped (the last `RETIRED`
    names are remembered; an older one starts again at 0, which Prometheus reads
    as a counter reset). So `rate()` and `increase()` summed across the series are
    right; a raw sum is not (a series that stopped no longer adds to it).
    """

    #: Stopped series remembered, so a name that comes back goes on instead of resetting.
    RETIRED = 1024

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        #: session id -> [client label, bytes, requests, errors] as last folded
        self._seen: dict[int, list[Any]] = {}
        #: Names with a live session.
        self._clients: dict[str, _Client] = {}
        self._other = [0, 0, 0]
        #: Labeled names whose last session ended, oldest first: (final values, values last shown).
        self._lingering: dict[str, tuple[list[int], list[int]]] = {}
        #: Stopped series' last values, oldest first (at most RETIRED).
        self._retired: dict[str, list[int]] = {}
        self._slots = 0  # labeled names with a live session

    # --- the trio thread -----------------------------------------------------------------------
    def ended(self, session: SessionLike) -> None:
        """A session ended (after its last request was accounted): fold what it did last."""
        if self.limit <= 0:
            return
        with self._lock:
            rec = self._seen.get(session.id)
            if rec is None:  # never scraped while it lived
                rec = self._track(session)
            del self._seen[session.id]
            self._fold_one(session, rec)
            label = rec[0]
            c = self._clients[label]
            c.live -= 1
            if c.live:
                return
            del self._clients[label]
            if c.values is not None:
                self._slots -= 1
                assert c.shown is not None
                if len(self._lingering) < self.limit:
                    self._lingering[label] = (c.values, c.shown)
                else:  # a burst of endings between scrapes: (other) takes what no scrape showed
                    for k in range(3):
                        self._other[k] += c.values[k] - c.shown[k]
                    self._retire(label, c.shown)

    # --- the scrape (HTTP thread) ----------------------------------------------------------------
    def collect(self, sessions: Iterable[SessionLike]) -> tuple[list[tuple[str, list[int]]], list[int]]:
        """Fold the live sessions; return ([(label, [bytes, requests, errors])], (other)'s);
        then drop the series of ended names and move labels to the heaviest names."""
        with self._lock:
            for s in sessions:
                if not s.running:
                    continue  # ending: `ended` folds it (it may already have)
                rec = self._seen.get(s.id)
                if rec is None:
                    rec = self._track(s)
                self._fold_one(s, rec)
            out: list[tuple[str, list[int]]] = []
            for name, c in self._clients.items():
                if c.values is not None:
                    c.shown = list(c.values)
                    out.append((name, c.shown))
            out.extend((name, list(v)) for name, (v, _) in self._lingering.items())
            for name, (v, _) in self._lingering.items():
                self._retire(name, v)
            self._lingering.clear()
            other = list(self._other)
            self._rebalance()
            return out, other

    # --- inside the lock -------------------------------------------------------------------------
    def _track(self, s: SessionLike) -> list[Any]:
        label = client_label(s.client)
        c = self._clients.get(label)
        if c is None:
            c = self._clients[label] = _Client()
            if self._slots < self.limit:
                if label in self._lingering:  # back before its last values were shown: go on
                    c.values, c.shown = self._lingering.pop(label)
                    self._slots += 1
                else:
                    self._label(c, self._resume(label))
        c.live += 1
        rec = self._seen[s.id] = [label, 0, 0, 0]
        return rec

    def _fold_one(self, s: SessionLike, rec: list[Any]) -> None:
        st = s.stats
        b, r, e = st.bytes_moved, st.requests, st.errors
        db, dr, de = b - rec[1], r - rec[2], e - rec[3]
        rec[1], rec[2], rec[3] = b, r, e
        c = self._clients[rec[0]]
        c.rank += db
        v = c.values if c.values is not None else self._other
        v[0] += db
        v[1] += dr
        v[2] += de

    def _rebalance(self) -> None:
        """Labels go to the `limit` live names that moved the most bytes (holders win ties)."""
        if len(self._clients) <= self._slots:
            return  # every live name holds a label
        ranked = sorted(self._clients.items(), key=lambda nc: (-nc[1].rank, nc[1].values is None, nc[0]))
        keep = {name for name, _ in ranked[: self.limit]}
        for name, c in ranked:
            if c.values is not None and name not in keep:
                self._retire(name, c.values)  # just shown by this scrape
                c.values = c.shown = None
                self._slots -= 1
        for name, c in ranked:
            if c.values is None and name in keep:
                self._label(c, self._resume(name))

    def _label(self, c: _Client, values: list[int]) -> None:
        c.values, c.shown = values, list(values)
        self._slots += 1

    def _retire(self, label: str, values: list[int]) -> None:
        """Remember a stopped series' values (always what a scrape showed last)."""
        self._retired.pop(label, None)
        self._retired[label] = values
        if len(self._retired) > self.RETIRED:
            del self._retired[next(iter(self._retired))]

    def _resume(self, label: str) -> list[int]:
        return self._retired.pop(label) if label in self._retired else [0, 0, 0]


class Metrics:
    """The daemon's metrics. Create one per Server; `start_http` to expose it."""

    def __init__(self, *, process: bool = True, namespace: str = _PREFIX, session_series: int = 16) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.ns = namespace
        self._ops: dict[str, _Hist] = {}
        self._bytes: dict[str, list[Any]] = {}  # device kind -> [label, total]
        self._errors: dict[int, list[Any]] = {}  # code -> [name, count]
        self._batch = _Hist(BATCH_BUCKETS)
        self.sessions = SessionSeries(session_series)
        self._stats_source: Callable[[], dict[str, Any]] | None = None
        self._sessions_source: Callable[[], Iterable[SessionLike]] | None = None
        #: The HTTP listener while `start_http` serves (its counters: `MetricsHTTP`).
        self.http: MetricsHTTP | None = None
        self.registry.register(_Collector(self))
        if process:
            ProcessCollector(namespace=namespace, registry=self.registry)

    # --- request path (trio thread) ----------------------------------------------------------
    def request_done(self, op: str, seconds: float, n: int = 1) -> None:
        """`n` requests of operation `op` finished, each after `seconds` (arrival to reply)."""
        h = self._ops.get(op)
        if h is None:
            h = self._ops[op] = _Hist(LATENCY_BUCKETS)
        h.counts[bisect.bisect_left(h.bounds, seconds)] += n
        h.sum += seconds * n

    @staticmethod
    def latency_bounds() -> tuple[float, ...]:
        """The request-latency buckets (the native data plane keeps its histograms in them)."""
        return LATENCY_BUCKETS

    def requests_histogram(self, op: str, counts: Sequence[int], seconds: float) -> None:
        """Requests of `op` timed elsewhere (a native worker), as per-bucket counts in `latency_bounds()` (and +Inf)."""
        h = self._ops.get(op)
        if h is None:
            h = self._ops[op] = _Hist(LATENCY_BUCKETS)
        for i, c in enumerate(counts):
            h.counts[i] += c
        h.sum += seconds

    def bytes_moved(self, device: str, n: int) -> None:
        """`n` bytes of requests' work (copied, filled, read) ran on a device of kind `device` (cpu, gpu)."""
        slot = self._bytes.get(device)
        if slot is None:
            slot = self._bytes[device] = [str(device), 0]
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
        """A frame (or a ring batch) of `n` requests."""
        h = self._batch
        h.counts[bisect.bisect_left(h.bounds, n)] += 1
        h.sum += n

    def session_ended(self, session: SessionLike) -> None:
        """Fold an ending session's last counts into its client's series (`SessionSeries`)."""
        self.sessions.ended(session)

    def set_source(self, stats: Callable[[], dict[str, Any]] | None, sessions: Callable[[], Iterable[SessionLike]] | None = None) -> None:
        """Where a scrape reads the daemon's Stats counters and its live sessions. Both run
        on the HTTP thread: they must only read (no folding, no mutation)."""
        self._stats_source = stats
        self._sessions_source = sessions

    # --- exposition -------------------------------------------------------------------------
    def render(self) -> bytes:
        """The text exposition format (what a scrape returns)."""
        return generate_latest(self.registry)

    def start_http(
        self, port: int, addr: str = "127.0.0.1", *, max_connections: int = DEFAULT_MAX_CONNECTIONS, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> int:
        """Serve /metrics from one thread, at most `max_connections` at once, each closed `timeout_s`
        after its accept (`MetricsHTTP`); returns the bound port (port 0 picks one)."""
        if self.http is not None:
            raise RuntimeError("metrics HTTP server already running")
        http = MetricsHTTP(self.registry, port, addr, max_connections=max_connections, timeout_s=timeout_s)
        bound = http.start()
        self.http = http
        return bound

    def stop_http(self) -> None:
        if self.http is not None:
            self.http.stop()
            self.http = None

    # --- reading back (tests) -----------------------------------------------------------------
    def requests(self, op: str) -> int:
        h = self._ops.get(op)
        return sum(h.counts) if h else 0

    def errors(self, code: int) -> int:
        slot = self._errors.get(code)
        return int(slot[1]) if slot else 0

    def bytes_total(self, device: str) -> int:
        slot = self._bytes.get(device)
        return int(slot[1]) if slot else 0


class _Collector(Collector):
    def __init__(self, m: Metrics) -> None:
        self.m = m

    def collect(self) -> Iterator[Metric]:
        m, ns = self.m, self.m.ns
        lat = HistogramMetricFamily(
            f"{ns}_request_duration_seconds",
            "Requests completed, by operation: seconds from arrival to answer (a pass: from the oldest queued request; a native worker: from the peek that took it)",
            labels=["op"],
        )
        for op, h in list(m._ops.items()):
            lat.add_metric([op], h.buckets(), h.sum)
        yield lat
        byt = CounterMetricFamily(f"{ns}_moved_bytes_total", "Bytes requests copied, filled or read, by the kind of device that did the work", labels=["device"])
        for label, total in list(m._bytes.values()):
            byt.add_metric([label], total)
        yield byt
        err = CounterMetricFamily(f"{ns}_errors_total", "Failed requests, by wire error code", labels=["code", "name"])
        for code, (name, count) in list(m._errors.items()):
            err.add_metric([str(code), name], count)
        yield err
        bat = HistogramMetricFamily(f"{ns}_batch_size_requests", "Requests per control-socket frame or per ring batch taken")
        bat.add_metric([], m._batch.buckets(), m._batch.sum)
        yield bat
        info = GaugeMetricFamily(f"{ns}_build_info", "This daemon's version and wire protocol (value 1)", labels=["version", "protocol"])
        info.add_metric([__version__, str(VERSION)], 1)
        yield info
        yield from self._stats(ns)
        yield from self._sessions(ns)

    def _stats(self, ns: str) -> Iterator[Metric]:
        src = self.m._stats_source
        if src is None:
            return
        try:
            stats = dict(src())
        except Exception:  # a scrape racing a mutation: skip this round, never fail the scrape
            return
        for key, (name, kind, help_) in STATS_FAMILIES.items():
            value = stats.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"{ns}_{name}", help_, value=value)
        devices = stats.get("devices")
        if isinstance(devices, list):
            queued = GaugeMetricFamily(f"{ns}_device_queued_bytes", "Bytes of work queued on each virtual device", labels=["device", "kind"])
            done = CounterMetricFamily(f"{ns}_device_batches_total", "Work units (a wave's share, a pipelined pass) each virtual device completed", labels=["device", "kind"])
            for d in devices:
                labels = [str(d["index"]), str(d["kind"])]
                queued.add_metric(labels, d["queued_bytes"])
                done.add_metric(labels, d["batches"])
            yield queued
            yield done

    def _sessions(self, ns: str) -> Iterator[Metric]:
        m = self.m
        if m.sessions.limit <= 0:
            return
        try:
            live = list(m._sessions_source()) if m._sessions_source is not None else []
        except Exception:
            live = []
        rows, other = m.sessions.collect(live)
        fams = [
            CounterMetricFamily(f"{ns}_session_{what}_total", f"{help_}, by client name (at most {m.sessions.limit} named; the rest in {OTHER!r})", labels=["client"])
            for what, help_ in (("moved_bytes", "Bytes sessions' requests copied, filled or read"), ("requests", "Requests sessions sent"), ("errors", "Sessions' failed requests"))
        ]
        for label, values in [*rows, (OTHER, other)]:
            for fam, v in zip(fams, values):
                fam.add_metric([label], v)
        yield from fams


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
            self.stats = type("st", (), {"bytes_moved": i, "requests": i, "errors": 0})()

    live = [_S(i) for i in range(1, sessions + 1)]
    m = Metrics(process=False)
    m.set_source(lambda: {}, lambda: live)
    t0 = time.perf_counter()
    for r in range(rounds):
        for s in live:
            s.stats.bytes_moved += s.id * r
        m.render()
    return round((time.perf_counter() - t0) / rounds * 1e3, 2)


if __name__ == "__main__":
    for k, v in bench().items():
        print(f"{k:40s} {v:8.1f} ns/call")
    print(f"{'scrape, 1024 sessions':40s} {bench_scrape():8.2f} ms")
