"""Prometheus metrics for the daemon, cheap enough for the request path.

`Metrics` owns a private `prometheus_client.CollectorRegistry` (never the
global one, so several daemons or tests in one process do not collide).

Three sources, one exposition (docs/operations.md lists every family):

* **The request path** (`request_done`, `requests_histogram`, `bytes_moved`,
  `error`, `batch`) does not touch prometheus_client objects at all: it bumps
  plain Python numbers in slots bound on first use of each label (one dict
  lookup, one or two integer adds, a `bisect` for histograms).
  prometheus_client's own ``Counter.labels(...).inc()`` takes a lock per call
  and costs several times more.
* **The daemon's Stats counters** (`set_source`) are read when someone
  scrapes and exported under the names in `STATS_FAMILIES`: counters as
  counters ending in `_total`, levels as gauges, units in the names. A Stats
  key that is neither there nor in `STATS_NOT_EXPORTED` is not exported
  (tests/integration/test_metrics.py fails on it), so a new counter cannot slip out
  under an unconventional name.
* **Per-client series** (`_metrics_series.SessionSeries`): bounded cardinality,
  folded from the sessions' own counters at scrape time; the request path pays
  nothing.

Threading: call the request-path methods and `session_ended` from the
daemon's trio thread. A scrape runs on the HTTP server's thread; it reads,
and it folds per-client series under a lock that only `session_ended` also
takes. A scrape racing an update can see a count one request stale, never a
torn or decreasing value (each slot is a Python int, replaced atomically).
"""

from __future__ import annotations

import bisect
from typing import Any, Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .. import errors as E
from .._version import __version__
from ..protocol import VERSION
from ._metrics_http import DEFAULT_MAX_CONNECTIONS, DEFAULT_TIMEOUT_S, MetricsHTTP
from ._metrics_series import OTHER, SessionLike, SessionSeries

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
    "ring_client_wakes": ("ring_client_wakes_total", "counter", "Completions a native worker pushed to a client asleep on them (a futex wake each)"),
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
    "channels_opened": ("channels_opened_total", "counter", "remote sessions' data channels connected (their rings over TCP)"),
    "channels_refused": ("channels_refused_total", "counter", "data-channel connections closed for a hello that proved no waiting session"),
    "channels_busy": ("channels_busy_total", "counter", "data-channel connections closed as accepted: the handshake cap was reached"),
    "sessions": ("sessions", "gauge", "Open sessions"),
    "rings": ("rings", "gauge", "Open shared-memory request rings"),
    "ring_workers": ("ring_workers", "gauge", "Running native ring workers"),
    "device_native_requests": ("device_native_requests_total", "counter", "Ring copies and fills of GPU memory a native worker queued through the CUDA driver"),
    "python_device_requests": ("python_device_requests_total", "counter", "Copies and fills of GPU memory the Python pass served (no CUDA driver, a handover, a socket request)"),
    "device_unpinned_copies": ("device_unpinned_copies_total", "counter", "Worker device copies from host memory that was not page-locked (staged by the driver)"),
    "device_faults": ("device_faults_total", "counter", "Ring requests that failed on a device (CUDA) error"),
    "device_queue_waits": ("device_queue_waits_total", "counter", "Waits of ring workers at their bound on copies queued ahead on a GPU (--device-queue-bytes)"),
    "graph_plans_reused": ("graph_plans_reused_total", "counter", "Graph runs that reused an earlier run's plan (same VAs, no segment freed since)"),
    "native_graph_runs": ("native_graph_runs_total", "counter", "Graph runs a ring worker ran itself on its thread (a kept plan: no event loop)"),
    "graph_captures": ("graph_captures_total", "counter", "GPU graph runs captured into a CUDA graph (once per kept run)"),
    "graph_capture_failures": ("graph_capture_failures_total", "counter", "GPU graph runs that could not be captured (then launched kernel by kernel)"),
    "graph_replays": ("graph_replays_total", "counter", "GPU graph runs launched as one captured CUDA graph"),
    "graph_eager_runs": ("graph_eager_runs_total", "counter", "GPU graph runs a worker launched kernel by kernel (their capture failed)"),
    "device_batches_pipelined": ("device_batches_pipelined_total", "counter", "Batches of device work a worker answered once their events passed, with the next batch queued behind them"),
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
            for what, help_ in (("moved_bytes", "Bytes sessions' requests copied, filled or read"), ("requests", "Requests sessions sent"),
                                ("errors", "Sessions' failed requests"),
                                ("device_seconds", "Device time of sessions' work the ring workers did: device work timed by events on the worker's stream, and CPU graph runs' kernels"))
        ]
        scale = (1, 1, 1, 1e-9)  # (device time is counted in nanoseconds)
        for label, values in [*rows, (OTHER, other)]:
            for fam, v, k in zip(fams, values, scale):
                fam.add_metric([label], v * k)
        yield from fams
