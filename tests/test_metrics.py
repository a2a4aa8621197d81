"""Metrics: the class alone, its HTTP endpoint scraped for real, and transferd --metrics-port."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import transfer
from transfer.addressing import SegmentKind
from transfer.server._metrics import LATENCY_BUCKETS, Metrics, bench
from transfer.testing import start_daemon


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_counters_histograms_gauges() -> None:
    m = Metrics(process=False)
    m.request_done("copy", 3e-5)
    m.request_done("copy", 0.2, n=3)
    m.request_done("fill", 20.0)  # beyond the last bucket: +Inf
    m.bytes_moved("host", 100)
    m.bytes_moved(SegmentKind.HOST, 50)  # same label as "host"
    m.bytes_moved((SegmentKind.DEVICE, SegmentKind.HOST), 7)
    m.error(204)
    m.error(204)
    m.error(999999)
    m.batch(1)
    m.batch(300)
    m.set_gauges(sessions=2, segments=5)
    m.set_gauges(queued=4)
    m.set_gauges(device_bytes=1 << 20)
    s = samples(m.render().decode())
    assert s[("transfer_requests_total", (("op", "copy"),))] == 4
    assert s[("transfer_requests_total", (("op", "fill"),))] == 1
    assert s[("transfer_request_seconds_bucket", (("le", "5e-05"), ("op", "copy")))] == 1
    assert s[("transfer_request_seconds_bucket", (("le", "0.25"), ("op", "copy")))] == 4
    assert s[("transfer_request_seconds_bucket", (("le", "10.0"), ("op", "fill")))] == 0
    assert s[("transfer_request_seconds_bucket", (("le", "+Inf"), ("op", "fill")))] == 1
    assert s[("transfer_request_seconds_count", (("op", "copy"),))] == 4
    assert s[("transfer_request_seconds_sum", (("op", "copy"),))] == pytest.approx(3e-5 + 0.6)
    assert s[("transfer_bytes_moved_total", (("kind", "host"),))] == 150
    assert s[("transfer_bytes_moved_total", (("kind", "device->host"),))] == 7
    assert s[("transfer_errors_total", (("code", "204"), ("name", "OutOfBounds")))] == 2
    assert s[("transfer_errors_total", (("code", "999999"), ("name", "Unknown")))] == 1
    assert s[("transfer_batch_size_bucket", (("le", "1.0"),))] == 1
    assert s[("transfer_batch_size_bucket", (("le", "256.0"),))] == 1
    assert s[("transfer_batch_size_bucket", (("le", "1024.0"),))] == 2
    assert s[("transfer_batch_size_sum", ())] == 301
    assert s[("transfer_sessions", ())] == 2
    assert s[("transfer_segments", ())] == 5
    assert s[("transfer_queued", ())] == 4
    assert s[("transfer_device_bytes", ())] == 1 << 20
    assert m.requests("copy") == 4 and m.errors(204) == 2 and m.bytes_total("host") == 150
    # Buckets are cumulative and end at the count.
    copy_buckets = [s[("transfer_request_seconds_bucket", (("le", repr(float(b))), ("op", "copy")))] for b in LATENCY_BUCKETS]
    assert copy_buckets == sorted(copy_buckets)


def test_private_registries_do_not_collide() -> None:
    a, b = Metrics(), Metrics()
    a.request_done("copy", 1e-4)
    assert m_requests(b) == 0 and m_requests(a) == 1
    assert not any(name.startswith("transfer_") for name in REGISTRY._names_to_collectors)  # noqa: SLF001


def m_requests(m: Metrics) -> float:
    return samples(m.render().decode()).get(("transfer_requests_total", (("op", "copy"),)), 0)


def test_stats_source_is_exported_and_a_failing_one_does_not_break_scrapes() -> None:
    m = Metrics(process=False)
    m.set_stats_source(lambda: {"daemon": {"frames": 12, "sessions": 1, "uptime_s": 1.5, "flag": True, "name": "x"}})
    s = samples(m.render().decode())
    assert s[("transfer_daemon_frames", ())] == 12 and s[("transfer_daemon_uptime_s", ())] == 1.5
    assert ("transfer_daemon_flag", ()) not in s and ("transfer_daemon_name", ()) not in s

    def broken() -> dict:
        raise RuntimeError("dict changed size during iteration")

    m.set_stats_source(broken)
    assert "transfer_requests_total" in m.render().decode()


def test_http_endpoint_is_scraped_for_real() -> None:
    m = Metrics()
    port = m.start_http(0)
    try:
        m.request_done("checksum", 1e-3, n=5)
        m.error(201)
        text = scrape(f"http://127.0.0.1:{port}/metrics")
        s = samples(text)
        assert s[("transfer_requests_total", (("op", "checksum"),))] == 5
        assert s[("transfer_errors_total", (("code", "201"), ("name", "UnknownSegment")))] == 1
        assert s[("transfer_process_resident_memory_bytes", ())] > 0  # the process collector rides along
        with pytest.raises(RuntimeError):
            m.start_http(0)
    finally:
        m.stop_http()


def test_hot_path_is_cheap() -> None:
    """Per-call cost in ns (printed with -s); generous bounds so a busy CI box passes."""
    ns = bench(50_000)
    print("metrics ns/call:", ns)
    for name in ("request_done", "bytes_moved", "error", "batch", "set_gauges"):
        assert ns[name] < 3000, (name, ns)
    # Plain counters beat prometheus_client's locked objects.
    assert ns["request_done"] < ns["prometheus_client counter+histogram"]


def test_transferd_metrics_port(shm_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    wd = tmp_path / "run"
    wd.mkdir(mode=0o700)
    d = start_daemon(["--backend", "numpy", "--metrics-port", str(port)], workdir=wd, shm_dir=shm_dir)
    try:
        with transfer.connect(d.endpoint) as c:
            seg = c.segment(1 << 16)
            buf = c.alloc(1 << 16)
            c.copy(buf, seg).result()
            s = samples(scrape(f"http://127.0.0.1:{port}/metrics"))
            assert s[("transfer_daemon_sessions", ())] == 1
            assert s[("transfer_daemon_segments", ())] == 2
            assert s[("transfer_daemon_device_bytes", ())] == 1 << 16
            assert s[("transfer_daemon_requests", ())] >= 3
            assert s[("transfer_process_resident_memory_bytes", ())] > 0
        # The endpoint is loopback only by default.
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) == 0
    finally:
        assert d.stop() == 0


def test_daemon_counts_requests_bytes_and_errors(daemon_factory) -> None:
    """The live daemon's own counters, scraped over HTTP after real traffic."""
    import socket
    import urllib.request

    import numpy as np

    import transfer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = daemon_factory("--metrics-port", str(port))
    with transfer.connect(d.endpoint) as c:
        seg = c.segment(1 << 20)
        buf = c.alloc(1 << 20)
        for _ in range(5):
            c.copy(buf, seg).result()
        with pytest.raises(transfer.OutOfBounds):
            c.copy(buf.va + 1, seg.va, 1 << 20).result()
        c.compute("checksum", [seg.tensor(1 << 20, np.uint8)]).result()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    def value(prefix: str) -> float:
        lines = [ln for ln in text.splitlines() if ln.startswith(prefix)]
        assert lines, f"no {prefix} in metrics"
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)
    assert value('transfer_requests_total{op="copy"') >= 5
    assert value('transfer_requests_total{op="compute"') >= 1
    assert value('transfer_errors_total{code="204"') >= 1
    assert value("transfer_bytes_moved_total") >= 6 << 20
