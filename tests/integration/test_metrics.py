"""Metrics: the class alone, per-client series, and real transferd processes scraped over HTTP.

The daemon tests parse the whole exposition with prometheus_client's own parser
and check Prometheus's naming conventions on everything it serves.
"""

from __future__ import annotations

import contextlib
import http.client
import re
import resource
import select
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from conftest import wait_for
import transfer
from transfer.server._metrics import LATENCY_BUCKETS, STATS_FAMILIES, STATS_NOT_EXPORTED, Metrics
from transfer.server._metrics_series import OTHER, SessionSeries, client_label
from transfer.server._metrics_http import DEFAULT_MAX_CONNECTIONS, MetricsHTTP
from transfer.testing import start_daemon

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
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
        return int(s.getsockname()[1])


def by_label(s: Samples, name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: v for (n, labels), v in s.items() if n == name}


def check_conventions(text: str) -> dict[str, str]:
    """Prometheus's naming rules on a whole exposition; returns {family: type}."""
    declared = re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M)
    names = [n for n, _ in declared]
    assert len(names) == len(set(names)), f"families declared twice: {sorted(n for n in names if names.count(n) > 1)}"
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name not in types, f"duplicate family {fam.name}"
        types[fam.name] = fam.type
        assert re.fullmatch(r"transfer_[a-z0-9_]+", fam.name), fam.name
        for s in fam.samples:
            if fam.type == "counter":
                assert s.name.endswith("_total"), f"counter sample {s.name} does not end in _total"
            elif fam.type == "histogram":
                assert s.name.endswith(("_bucket", "_sum", "_count")), s.name
            else:
                assert not s.name.endswith("_total"), f"{fam.type} {s.name} ends in _total"
        # Units are spelled out in full, in base units: seconds and bytes.
        assert not re.search(r"_(s|ms|us|ns|secs|kb|mb|kib|mib)(_total)?$", fam.name), f"{fam.name}: abbreviated unit"
        if "bytes" in fam.name:
            assert re.search(r"_bytes(_total)?$", fam.name), f"{fam.name}: the unit goes last"
        if fam.type == "histogram" and "duration" in fam.name:
            assert fam.name.endswith("_seconds"), fam.name
    # The old names are gone: every Stats counter once came out a second time as a gauge.
    assert not [n for n in types if n.startswith("transfer_daemon_")]
    for a, b in (("transfer_requests", "transfer_request_duration_seconds"), ("transfer_start_time_seconds", "transfer_process_start_time_seconds")):
        assert not (a in types and b in types), f"{a} duplicates {b}"
    return types


def documented_families() -> set[str]:
    """The metric names docs/operations.md's table lists (its first column)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    table = text.split("| metric | type | labels | what |", 1)[1].split("\n\n", 1)[0]
    return {n for row in table.splitlines()[2:] for n in re.findall(r"`(transfer_[a-z0-9_*]+)`", row.split("|")[1])}


def served_families(types: dict[str, str]) -> set[str]:
    """Families as their samples are named (a counter with its _total); the process collector's as one."""
    out = {f"{n}_total" if t == "counter" else n for n, t in types.items()}
    return {n for n in out if not n.startswith("transfer_process_")} | {"transfer_process_*"}


# --- the class alone ---------------------------------------------------------------------------
def test_counters_histograms_and_stats_families() -> None:
    m = Metrics(process=False)
    m.request_done("copy", 3e-5)
    m.request_done("copy", 0.2, n=3)
    m.request_done("fill", 20.0)  # beyond the last bucket: +Inf
    m.requests_histogram("copyv", [0, 2] + [0] * (len(LATENCY_BUCKETS) - 1), 4e-5)  # a native worker's fold
    m.bytes_moved("cpu", 100)
    m.bytes_moved("cpu", 50)
    m.bytes_moved("gpu", 7)
    m.error(204)
    m.error(204)
    m.error(999999)
    m.batch(1)
    m.batch(300)
    m.set_source(lambda: {"frames": 12, "sessions": 3, "device_bytes": 1 << 20, "uptime_s": 1.5, "errors": 3,
                          "devices": [{"index": 0, "kind": "cpu", "queued_bytes": 5, "batches": 9}], "flag": True, "name": "x"})
    text = m.render().decode()
    types = check_conventions(text)
    s = samples(text)
    dur = "transfer_request_duration_seconds"
    assert s[(f"{dur}_bucket", (("le", "5e-05"), ("op", "copy")))] == 1
    assert s[(f"{dur}_bucket", (("le", "0.25"), ("op", "copy")))] == 4
    assert s[(f"{dur}_bucket", (("le", "10.0"), ("op", "fill")))] == 0
    assert s[(f"{dur}_bucket", (("le", "+Inf"), ("op", "fill")))] == 1
    assert s[(f"{dur}_count", (("op", "copy"),))] == 4
    assert s[(f"{dur}_sum", (("op", "copy"),))] == pytest.approx(3e-5 + 0.6)
    assert s[(f"{dur}_bucket", (("le", "2.5e-05"), ("op", "copyv")))] == 2
    assert s[("transfer_moved_bytes_total", (("device", "cpu"),))] == 150
    assert s[("transfer_moved_bytes_total", (("device", "gpu"),))] == 7
    assert s[("transfer_errors_total", (("code", "204"), ("name", "OutOfBounds")))] == 2
    assert s[("transfer_errors_total", (("code", "999999"), ("name", "Unknown")))] == 1
    assert s[("transfer_batch_size_requests_bucket", (("le", "1.0"),))] == 1
    assert s[("transfer_batch_size_requests_bucket", (("le", "256.0"),))] == 1
    assert s[("transfer_batch_size_requests_bucket", (("le", "1024.0"),))] == 2
    assert s[("transfer_batch_size_requests_sum", ())] == 301
    # Stats keys: counters as counters, levels as gauges, renamed with their units.
    assert types["transfer_frames"] == "counter" and s[("transfer_frames_total", ())] == 12
    assert types["transfer_sessions"] == "gauge" and s[("transfer_sessions", ())] == 3
    assert s[("transfer_device_allocated_bytes", ())] == 1 << 20
    assert s[("transfer_device_queued_bytes", (("device", "0"), ("kind", "cpu")))] == 5
    assert s[("transfer_device_batches_total", (("device", "0"), ("kind", "cpu")))] == 9
    # Duplicates of labelled families, non-numbers and unknown keys stay out.
    assert not [k for k in s if "uptime" in k[0] or "flag" in k[0] or k[0] in ("transfer_name", "transfer_errors")]
    assert s[("transfer_build_info", (("protocol", "1"), ("version", transfer.__version__)))] == 1
    assert m.requests("copy") == 4 and m.errors(204) == 2 and m.bytes_total("cpu") == 150
    # Buckets are cumulative and end at the count.
    copy_buckets = [s[(f"{dur}_bucket", (("le", repr(float(b))), ("op", "copy")))] for b in LATENCY_BUCKETS]
    assert copy_buckets == sorted(copy_buckets) and copy_buckets[-1] <= 4


def test_every_stats_key_has_one_decision() -> None:
    assert not set(STATS_FAMILIES) & set(STATS_NOT_EXPORTED)
    names = [n for n, _, _ in STATS_FAMILIES.values()]
    assert len(names) == len(set(names))
    for name, kind, _ in STATS_FAMILIES.values():
        assert (kind == "counter") == name.endswith("_total"), name


def test_private_registries_do_not_collide() -> None:
    a, b = Metrics(), Metrics()
    a.request_done("copy", 1e-4)
    assert copies(b) == 0 and copies(a) == 1
    assert not any(name.startswith("transfer_") for name in REGISTRY._names_to_collectors)  # noqa: SLF001


def copies(m: Metrics) -> float:
    return samples(m.render().decode()).get(("transfer_request_duration_seconds_count", (("op", "copy"),)), 0)


def test_a_failing_source_does_not_break_scrapes() -> None:
    m = Metrics(process=False)

    def broken() -> Any:
        raise RuntimeError("dict changed size during iteration")

    m.set_source(broken, broken)
    m.request_done("copy", 1e-4)
    s = samples(m.render().decode())
    assert s[("transfer_request_duration_seconds_count", (("op", "copy"),))] == 1
    assert s[("transfer_session_moved_bytes_total", (("client", OTHER),))] == 0


def test_http_endpoint_is_scraped_for_real() -> None:
    m = Metrics()
    port = m.start_http(0)
    try:
        m.request_done("checksum", 1e-3, n=5)
        m.error(201)
        text = scrape(f"http://127.0.0.1:{port}/metrics")
        check_conventions(text)
        s = samples(text)
        assert s[("transfer_request_duration_seconds_count", (("op", "checksum"),))] == 5
        assert s[("transfer_errors_total", (("code", "201"), ("name", "UnknownSegment")))] == 1
        assert s[("transfer_process_resident_memory_bytes", ())] > 0  # the process collector rides along
        with pytest.raises(RuntimeError):
            m.start_http(0)
    finally:
        m.stop_http()


# --- the HTTP listener alone ------------------------------------------------------------------
def until_closed(sock: socket.socket, timeout: float = 30.0) -> bytes:
    """What the server sends before it closes `sock` (a reset counts as a close); fails after `timeout`."""
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the server did not close the connection within {timeout} s") from None
    return got


def ask(port: int, request: bytes) -> bytes:
    """One raw request; the whole response."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        return until_closed(s)


def test_listener_answers_one_request_per_connection() -> None:
    m = Metrics(process=False)
    m.request_done("copy", 1e-4)
    listener = MetricsHTTP(m.registry, 0)
    port = listener.start()
    try:
        for path in ("/metrics", "/", "/metrics?x=1"):
            assert samples(scrape(f"http://127.0.0.1:{port}{path}"))[("transfer_request_duration_seconds_count", (("op", "copy"),))] == 1
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=10)
        assert e.value.code == 404
        head = ask(port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200 OK\r\n") and head.endswith(b"\r\n\r\n") and b"Connection: close" in head
        assert ask(port, b"garbage\r\n\r\n").startswith(b"HTTP/1.0 400 ")
        assert ask(port, b"POST /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.0 405 ")
        assert ask(port, b"GET /" + b"x" * 10_000 + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.0 431 ")
    finally:
        listener.stop()
    assert listener.connections == 0


def test_listener_closes_silent_and_trickling_connections_at_their_deadline() -> None:
    listener = MetricsHTTP(Metrics(process=False).registry, 0, timeout_s=0.3)
    port = listener.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as silent:
            assert until_closed(silent) == b""
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:  # a byte at a time, never a whole head
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # closed between two bytes
                while not select.select([slow], [], [], 0.05)[0]:
                    slow.send(b"G")
            assert until_closed(slow) == b""
        assert listener.timed_out == 2
    finally:
        listener.stop()


def test_listener_refuses_beyond_its_cap_at_once() -> None:
    listener = MetricsHTTP(Metrics(process=False).registry, 0, max_connections=2, timeout_s=60)
    port = listener.start()
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
    try:
        # Accepted in order, so the third finds the two held: answered 503, closed long before any deadline.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as third:
            assert until_closed(third, timeout=30).startswith(b"HTTP/1.0 503 ")
        assert listener.refused == 1 and listener.accepted == 3 and listener.connections == 2
        for s in held:  # still open: nothing to read, no end of stream
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
        held.pop().close()  # a slot frees: the next one is served
        wait_for(lambda: listener.connections == 1, "the closed connection's slot", timeout=5.0)
        assert scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        for s in held:
            s.close()
        listener.stop()


_NO_FDS = """
import os, resource, sys, time
from prometheus_client import CollectorRegistry
from transfer.server._metrics_http import MetricsHTTP

listener = MetricsHTTP(CollectorRegistry(), 0, max_connections=8, timeout_s=60)
port = listener.start()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
lowest = os.dup(0)
os.close(lowest)
resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))  # no descriptor left for an accept
cpu, wall = time.process_time(), time.monotonic()
print(port, flush=True)
while listener.accept_errors < 5 and time.monotonic() < wall + 30:
    time.sleep(0.01)
cpu, wall = time.process_time() - cpu, time.monotonic() - wall
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print(listener.accept_errors, cpu, wall, flush=True)
sys.stdin.readline()
listener.stop()
"""


def test_listener_backs_off_when_out_of_descriptors() -> None:
    """EMFILE on accept pauses accepting (no spin, no crash); once descriptors are back, it serves."""
    child = subprocess.Popen([sys.executable, "-c", _NO_FDS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    waiting: list[socket.socket] = []
    try:
        port = int(child.stdout.readline())
        waiting = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
        for s in waiting:
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        errors, _cpu, _wall = child.stdout.readline().split()
        assert int(errors) >= 5, "accept never failed"
        for s in waiting:
            assert until_closed(s).startswith(b"HTTP/1.0 200 OK\r\n")
        child.stdin.write("stop\n")
        child.stdin.flush()
        assert child.wait(30) == 0
    finally:
        for s in waiting:
            s.close()
        if child.poll() is None:
            child.kill()
            child.wait()


# --- per-client series -------------------------------------------------------------------------
class FakeSession(SimpleNamespace):
    id: int
    client: str
    running: bool
    stats: SimpleNamespace


def fake(i: int, client: str) -> FakeSession:
    return FakeSession(id=i, client=client, running=True, stats=SimpleNamespace(bytes_moved=0, requests=0, errors=0, device_ns=0))


def series(ss: SessionSeries, live: list[FakeSession]) -> dict[str, list[int]]:
    rows, other = ss.collect(live)
    out = dict(rows)
    assert OTHER not in out and len(out) == len(rows), "a label twice"
    out[OTHER] = other
    return out


def test_session_series_stay_bounded_monotonic_and_complete() -> None:
    """Many sessions come and go; every scrape has at most 2N+1 series, no series ever
    decreases (one that stopped goes on from its last value when it comes back), and the
    increments the scrapes see add up to everything the sessions did."""
    n = 3
    ss = SessionSeries(n)
    rng = np.random.default_rng(7)
    live: list[FakeSession] = []
    last: dict[str, list[int]] = {}  # each label's value when a scrape last showed it
    total = [0, 0, 0, 0]  # what the sessions did
    counted = [0, 0, 0, 0]  # increments the scrapes saw
    shapes: set[int] = set()

    def look(live: list[FakeSession]) -> dict[str, list[int]]:
        now = series(ss, live)
        assert len(now) <= 2 * n + 1, now.keys()
        shapes.add(len(now))
        for label, v in now.items():
            before = last.get(label, [0, 0, 0, 0])
            assert all(a >= b for a, b in zip(v, before)), (label, before, v)
            for k in range(4):
                counted[k] += v[k] - before[k]
            last[label] = v
        return now

    next_id = 1
    for step in range(300):
        if len(live) < 25 and rng.random() < 0.6:
            live.append(fake(next_id, f"producer-{rng.integers(0, 40)}"))
            next_id += 1
        for s in live:
            db, dr = int(rng.integers(0, 1 << 20)), int(rng.integers(0, 5))
            de, dt = int(rng.random() < 0.1), int(rng.integers(0, 10**6))
            s.stats.bytes_moved += db
            s.stats.requests += dr
            s.stats.errors += de
            s.stats.device_ns += dt
            total[0] += db
            total[1] += dr
            total[2] += de
            total[3] += dt
        for _ in range(int(rng.integers(0, 3)) if rng.random() < 0.3 else 0):
            if live:
                gone = live.pop(int(rng.integers(0, len(live))))
                gone.running = False
                ss.ended(gone)
        if step % 3 == 0:
            look(live)
    for s in live:  # all at once: more endings than lingering series may show
        s.running = False
        ss.ended(s)
    final = look([])
    assert counted == total
    assert max(shapes) > n + 1  # ended names' series were shown beside the live ones
    assert series(ss, []) == {OTHER: final[OTHER]}  # ended names were shown once, then dropped


def test_session_series_label_the_heaviest_clients() -> None:
    ss = SessionSeries(2)
    a, b, c = fake(1, "light"), fake(2, "medium"), fake(3, "heavy")
    first = series(ss, [a, b, c])
    assert set(first) == {"light", "medium", OTHER}  # first come, while slots are free
    a.stats.bytes_moved, b.stats.bytes_moved, c.stats.bytes_moved = 10, 1000, 10**6
    second = series(ss, [a, b, c])
    assert second[OTHER][0] == 10**6  # counted where it was, then the labels move
    third = series(ss, [a, b, c])
    assert set(third) == {"medium", "heavy", OTHER}
    assert third["heavy"] == [0, 0, 0, 0] and third[OTHER][0] == 10**6  # a new series starts at 0
    # Two sessions of one name share its series; it outlives the first to end.
    d = fake(4, "medium")
    d.stats.bytes_moved = 5
    b.running = False
    ss.ended(b)
    assert series(ss, [a, c, d])["medium"][0] == 1000 + 5


def test_ended_series_show_once_and_overflow_goes_to_other() -> None:
    ss = SessionSeries(2)
    a, b = fake(1, "a"), fake(2, "b")
    series(ss, [a, b])
    for s in (a, b):
        s.stats.bytes_moved = 10
        s.running = False
        ss.ended(s)
    c, d = fake(3, "c"), fake(4, "d")
    c.stats.bytes_moved = d.stats.bytes_moved = 5
    assert series(ss, [c, d]) == {"a": [10, 0, 0, 0], "b": [10, 0, 0, 0], "c": [5, 0, 0, 0], "d": [5, 0, 0, 0], OTHER: [0, 0, 0, 0]}  # 2N+1
    # More labeled names end between two scrapes than may linger: (other) takes the rest.
    e, f = fake(5, "e"), fake(6, "f")
    for s in (c, d, e, f):
        s.stats.bytes_moved += 100
        s.running = False
        ss.ended(s)  # c, d linger; e, f got the freed slots, and end past the cap
    assert series(ss, []) == {"c": [105, 0, 0, 0], "d": [105, 0, 0, 0], OTHER: [200, 0, 0, 0]}
    # A name that comes back goes on from where its series stopped.
    a2 = fake(7, "a")
    a2.stats.bytes_moved = 1
    assert series(ss, [a2])["a"] == [11, 0, 0, 0]


def test_a_name_back_before_its_ended_series_was_shown_goes_on() -> None:
    ss = SessionSeries(2)
    x = fake(1, "x")
    x.stats.bytes_moved = 100
    assert series(ss, [x])["x"] == [100, 0, 0, 0]
    x.stats.bytes_moved = 150
    x.running = False
    ss.ended(x)  # lingers, its last 50 unseen
    x2 = fake(2, "x")
    x2.stats.bytes_moved = 20
    assert series(ss, [x2])["x"] == [170, 0, 0, 0]  # one series, still growing


def test_client_names_become_safe_labels() -> None:
    assert client_label("loader-0") == "loader-0"
    assert client_label("a b\n\"{}") == "a_b____"
    assert client_label("") == "unnamed"
    assert client_label(OTHER) != OTHER
    assert len(client_label("x" * 300)) == 64


def test_session_series_off() -> None:
    m = Metrics(process=False, session_series=0)
    m.set_source(None, lambda: [fake(1, "a")])
    assert "transfer_session_" not in m.render().decode()


# --- real daemons ------------------------------------------------------------------------------
def test_transferd_metrics_port(shm_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    wd = tmp_path / "run"
    wd.mkdir(mode=0o700)
    d = start_daemon(["--backend", "numpy", "--metrics-port", str(port)], workdir=wd, shm_dir=shm_dir)
    try:
        assert d.ready["metrics"] == f"http://127.0.0.1:{port}/metrics"
        with transfer.connect(d.endpoint) as c:
            seg = c.segment(1 << 16)
            buf = c.alloc(1 << 16)
            c.copy(buf, seg).result()
            s = samples(scrape(d.ready["metrics"]))
            assert s[("transfer_sessions", ())] == 1
            assert s[("transfer_segments", ())] == 2
            assert s[("transfer_device_allocated_bytes", ())] == 1 << 16
            assert s[("transfer_requests_received_total", ())] >= 3
            assert s[("transfer_process_resident_memory_bytes", ())] > 0
        # The endpoint is loopback only by default.
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) == 0
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("workers", [False, True], ids=["event-loop", "ring-workers"])
def test_daemon_scrape_follows_the_conventions(daemon_factory: Any, workers: bool) -> None:
    """Real traffic on every path, then the whole exposition parsed and checked: counters end
    in _total, units in names, no family twice, a latency histogram per operation, every Stats
    key accounted for, and the numbers agree with the daemon's own Stats."""
    port = free_port()
    d = daemon_factory("--metrics-port", str(port), *(["--ring-workers"] if workers else []))
    url = f"http://127.0.0.1:{port}/metrics"
    with transfer.connect(d.endpoint) as c, transfer.connect(d.endpoint, ring=False, name="socket-only") as s2:
        seg = c.segment(1 << 20)
        buf = c.alloc(1 << 20)
        for _ in range(5):
            c.copy(buf, seg).result()
        c.fill(buf, 4096, 1).result()
        c.checksum(buf).result()
        offs = np.arange(4, dtype=np.uint64) * 4096
        c.copy_many(buf.va + offs, seg.va + offs, np.full(4, 4096, np.uint64)).result()
        c.fence()
        with pytest.raises(transfer.OutOfBounds):
            c.copy(buf.va + 1, seg.va, 1 << 20).result()
        s2seg = s2.segment(1 << 16)
        s2.copy(s2seg.va + 64, s2seg.va, 64).result()
        s2.compute("checksum", [s2seg.tensor(1 << 16, np.uint8)]).result()
        s2.fence()
        stats = c.stats()["daemon"]
        if workers:
            assert stats["native_requests"] > 0
        # Native workers' counts are folded in once a second; wait until the scrape has them.
        text = ""

        def caught_up() -> bool:
            nonlocal text
            text = scrape(url)
            return samples(text).get(("transfer_native_requests_total", ()), 0) >= stats["native_requests"]

        wait_for(caught_up, "the native counts", timeout=5.0)
    assert set(stats) <= set(STATS_FAMILIES) | set(STATS_NOT_EXPORTED), set(stats) - set(STATS_FAMILIES) - set(STATS_NOT_EXPORTED)
    types = check_conventions(text)
    assert served_families(types) == documented_families()
    s = samples(text)
    for key, (name, kind, _) in STATS_FAMILIES.items():
        assert types.get(f"transfer_{name}".removesuffix("_total")) == kind, key
    ops = by_label(s, "transfer_request_duration_seconds_count", "op")
    for op in ("copy", "copyv", "fill", "checksum", "compute", "register_host", "define", "fence", "wait"):
        assert ops.get(op, 0) >= 1, (op, ops)
    assert ops["copy"] >= 6
    assert s[("transfer_errors_total", (("code", "204"), ("name", "OutOfBounds")))] == 1
    assert sum(by_label(s, "transfer_moved_bytes_total", "device").values()) >= 6 << 20
    # Per-client series: each client by its name, and together everything the daemon did.
    per_client = by_label(s, "transfer_session_moved_bytes_total", "client")
    assert per_client["socket-only"] == 64 + (1 << 16)
    assert per_client[f"pid{__import__('os').getpid()}"] >= 6 << 20 and per_client[OTHER] == 0
    assert sum(per_client.values()) == sum(by_label(s, "transfer_moved_bytes_total", "device").values())
    assert sum(by_label(s, "transfer_session_errors_total", "client").values()) == 1


def test_session_labels_stay_bounded_under_many_sessions(daemon_factory: Any) -> None:
    """20 named clients against --metrics-sessions 3: at most 2*3+1 label values per family,
    the heaviest clients get the labels, and the (other) series only grows."""
    port = free_port()
    d = daemon_factory("--metrics-port", str(port), "--metrics-sessions", "3")
    url = f"http://127.0.0.1:{port}/metrics"
    clients = [transfer.connect(d.endpoint, name=f"producer-{i:02d}", ring=False) for i in range(20)]
    try:
        for i, c in enumerate(clients):
            seg = c.segment(1 << 16)
            for _ in range(1 + i):  # producer-19 moves the most
                c.copy(seg.va + 4096, seg.va, 4096)
            c.fence()
        first = samples(scrape(url))
        second = samples(scrape(url))  # the labels moved to the heaviest after the first scrape
        for c in clients[:10]:
            c.close()
        wait_for(lambda: samples(scrape(url))[("transfer_sessions", ())] == 10, "sessions to end", timeout=5.0)
        third = samples(scrape(url))
    finally:
        for c in clients:
            c.close()
    for s in (first, second, third):
        for fam in ("moved_bytes", "requests", "errors"):
            labels = by_label(s, f"transfer_session_{fam}_total", "client")
            assert OTHER in labels and len(labels) <= 2 * 3 + 1, labels
    assert set(by_label(second, "transfer_session_moved_bytes_total", "client")) == {"producer-17", "producer-18", "producer-19", OTHER}
    others = [by_label(s, "transfer_session_moved_bytes_total", "client")[OTHER] for s in (first, second, third)]
    assert others == sorted(others) and others[0] > 0
    # What every client moved is in exactly one series at the first scrape.
    assert sum(by_label(first, "transfer_session_moved_bytes_total", "client").values()) == sum(4096 * (1 + i) for i in range(20))


def test_idle_metrics_connections_cannot_exhaust_the_daemons_descriptors(shm_dir: Path, tmp_path: Path) -> None:
    """Far more idle connections to the metrics port than its cap, under a 256-descriptor limit:
    the daemon holds at most the cap, closes every one (at once beyond the cap, at its deadline
    within it), keeps serving zmq clients, and a later scrape succeeds."""
    port = free_port()
    wd = tmp_path / "run"
    wd.mkdir(mode=0o700)
    d = start_daemon(["--backend", "numpy", "--metrics-port", str(port), "--metrics-timeout", "1"], workdir=wd, shm_dir=shm_dir)
    idle: list[socket.socket] = []
    try:
        # A shell's default limit, set after startup (the daemon raises its soft limit to the hard one).
        resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (256, resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE)[1]))
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(DEFAULT_MAX_CONNECTIONS + 300)]
        with transfer.connect(d.endpoint) as c:
            seg = c.segment(1 << 16)
            buf = c.alloc(1 << 16)
            c.copy(buf, seg).result()
            text = ""

            def scraped() -> bool:
                nonlocal text
                try:
                    text = scrape(d.ready["metrics"])
                except (OSError, http.client.HTTPException):  # 503 or closed while the idle ones hold the slots
                    return False
                return True

            wait_for(scraped, "a scrape", timeout=60)
            assert samples(text)[("transfer_sessions", ())] == 1
        for s in idle:
            got = until_closed(s)
            assert got == b"" or got.startswith(b"HTTP/1.0 503 "), got[:100]
        assert d.proc.poll() is None
    finally:
        for s in idle:
            s.close()
        assert d.stop() == 0


def test_transferd_top_shows_each_tenant_live(daemon_factory: Any) -> None:
    """`transferd top --once`: each named client's bytes/s and requests/s over the interval
    (the busy one above the idle one), from the metrics endpoint; no endpoint, a clear error."""
    import subprocess
    import sys
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = daemon_factory("--metrics-port", str(port), "--metrics-sessions", "8")
    url = f"http://127.0.0.1:{port}/metrics"
    with transfer.connect(d.endpoint, name="busy-loader") as busy, transfer.connect(d.endpoint, name="idle-loader") as idle:
        seg, buf = busy.segment(1 << 20), busy.alloc(1 << 20)
        idle.segment(4096)
        done = threading.Event()

        def work() -> None:
            while not done.is_set():
                busy.copy(buf, seg).result()

        t = threading.Thread(target=work)
        t.start()
        try:
            out = subprocess.run([sys.executable, "-m", "transfer.cli.transferd", "top", "--url", url, "--once", "--interval", "1"],
                                 capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "120"})
        finally:
            done.set()
            t.join()
    assert out.returncode == 0, out.stderr
    rows = {ln.split("│")[1].strip(): ln for ln in out.stdout.splitlines() if ln.startswith("│")}
    assert "busy-loader" in rows and "idle-loader" in rows, out.stdout
    assert "0 B/s" not in rows["busy-loader"] and "0 B/s" in rows["idle-loader"], out.stdout
    gone = subprocess.run([sys.executable, "-m", "transfer.cli.transferd", "top", "--url", "http://127.0.0.1:9/metrics", "--once"],
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "cannot read http://127.0.0.1:9/metrics" in gone.stderr


def test_the_grafana_dashboard_queries_what_the_daemon_serves(daemon_factory: Any) -> None:
    """deploy/grafana-dashboard.json: every metric its queries name is one a real daemon's
    scrape serves (a renamed metric would leave a panel empty), and every panel has a query."""
    import json
    import re

    port = free_port()
    d = daemon_factory("--metrics-port", str(port), "--metrics-sessions", "4")
    with transfer.connect(d.endpoint, name="graphed") as c:
        c.copy(c.alloc(4096), c.segment(4096), 4096).result()
        text = scrape(f"http://127.0.0.1:{port}/metrics")
    served = set(re.findall(r"^(transfer_[a-z0-9_]+)", text, flags=re.M))  # samples
    for family, kind in re.findall(r"^# TYPE (transfer_[a-z0-9_]+) (\w+)$", text, flags=re.M):  # families with none yet
        served |= {family, f"{family}_total"} if kind == "counter" else {family}
    dash = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert dash["panels"] and all(p["targets"] for p in dash["panels"])
    named = {n for e in exprs for n in re.findall(r"\b(transfer_[a-z0-9_]+)", e)}
    assert named and named <= served, sorted(named - served)
