"""`transferd top`: what each tenant is doing now, read from the daemon's metrics endpoint and
refreshed in place (like `nvidia-smi -l` or `htop`): per client bytes/s, requests/s and errors,
the daemon's sessions, rings and queued requests, and each device's queue and batches/s.

    transferd top                    # the endpoint the daemon's settings name (TRANSFER_METRICS_PORT, --config)
    transferd top --url http://127.0.0.1:9100/metrics --interval 2
    transferd top --once             # two scrapes an interval apart, one table, exit (scripts)
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from .._units import fmt_bytes

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, timeout: float = 5.0) -> Samples:
    """The endpoint's samples: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as r:
        text = r.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def _by(samples: Samples, name: str, *labels: str) -> dict[tuple[str, ...], float]:
    """`name`'s samples by the values of `labels` (those that have them all)."""
    out = {}
    for (n, pairs), v in samples.items():
        if n == name:
            have = dict(pairs)
            if all(k in have for k in labels):
                out[tuple(have[k] for k in labels)] = v
    return out


def _rate(now: dict[tuple[str, ...], float], before: dict[tuple[str, ...], float], dt: float) -> dict[tuple[str, ...], float]:
    return {k: max(0.0, v - before.get(k, 0.0)) / dt for k, v in now.items()}


def frame(before: Samples, now: Samples, dt: float, url: str) -> Any:
    """The view of two scrapes `dt` seconds apart: a rich renderable."""
    from rich.console import Group
    from rich.table import Table

    moved = _by(now, "transfer_session_moved_bytes_total", "client")
    rate_b = _rate(moved, _by(before, "transfer_session_moved_bytes_total", "client"), dt)
    reqs = _by(now, "transfer_session_requests_total", "client")
    rate_r = _rate(reqs, _by(before, "transfer_session_requests_total", "client"), dt)
    errs = _by(now, "transfer_session_errors_total", "client")
    rate_e = _rate(errs, _by(before, "transfer_session_errors_total", "client"), dt)

    def gauge(name: str) -> str:
        v = now.get((name, ()))
        return "-" if v is None else f"{v:,.0f}"

    head = (f"transferd at {url}: {gauge('transfer_sessions')} sessions, {gauge('transfer_rings')} rings, "
            f"{gauge('transfer_queued_requests')} requests queued, every {dt:.1f} s")
    tenants = Table(title=head, title_justify="left", header_style="bold")
    for col in ("client", "bytes/s", "requests/s", "errors/s", "errors", "moved"):
        tenants.add_column(col, justify="left" if col == "client" else "right", no_wrap=True)
    for client in sorted(moved, key=lambda c: -rate_b.get(c, 0.0)):
        tenants.add_row(client[0], fmt_bytes(int(rate_b.get(client, 0.0))) + "/s", f"{rate_r.get(client, 0.0):,.0f}",
                        f"{rate_e.get(client, 0.0):,.1f}", f"{errs.get(client, 0.0):,.0f}", fmt_bytes(int(moved[client])))
    devices = Table(header_style="bold")
    for col in ("device", "kind", "queued", "batches/s"):
        devices.add_column(col, justify="left" if col in ("device", "kind") else "right", no_wrap=True)
    queued = _by(now, "transfer_device_queued_bytes", "device", "kind")
    batches = _rate(_by(now, "transfer_device_batches_total", "device", "kind"), _by(before, "transfer_device_batches_total", "device", "kind"), dt)
    for key in sorted(queued, key=lambda k: int(k[0]) if k[0].isdigit() else 0):
        devices.add_row(key[0], key[1], fmt_bytes(int(queued[key])), f"{batches.get(key, 0.0):,.1f}")
    return Group(tenants, devices)


def _default_url(config: Path | None) -> str:
    from .. import _settings as S

    resolved = S.resolve({}, None, config)
    port, addr = resolved["metrics_port"], resolved["metrics_addr"]
    if not port:
        raise SystemExit("transferd top: the daemon's settings name no metrics port (start it with --metrics-port N, "
                         "and give the same here: TRANSFER_METRICS_PORT=N, --config, or --url)")
    return f"http://{addr}:{port}/metrics"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="transferd top", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="the daemon's metrics endpoint (default: from its settings: metrics_addr, metrics_port)")
    ap.add_argument("--config", type=Path, help="the daemon's settings file, to find its metrics endpoint")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes (default 1)")
    ap.add_argument("--once", action="store_true", help="two scrapes an interval apart, print one view, exit")
    args = ap.parse_args(argv)
    if not args.interval > 0:
        ap.error("--interval must be more than 0")
    url = args.url or _default_url(args.config)
    from rich.console import Console
    from rich.live import Live

    console = Console()
    try:
        before, t0 = scrape(url), time.monotonic()
        if args.once:
            time.sleep(args.interval)
            now = scrape(url)
            console.print(frame(before, now, time.monotonic() - t0, url))
            return 0
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(args.interval)
                now, t1 = scrape(url), time.monotonic()
                live.update(frame(before, now, t1 - t0, url), refresh=True)
                before, t0 = now, t1
    except (urllib.error.URLError, OSError) as exc:
        print(f"transferd top: cannot read {url}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
