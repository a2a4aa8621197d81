#!/usr/bin/env python3
"""Hostile-tenant soak: attacker processes beside a good client, against one real transferd.

    PYTHONPATH=$PWD python bench/hostile_soak.py --seconds 600 --json bench/results/hostile-soak.json
    PYTHONPATH=$PWD python bench/hostile_soak.py --seconds 30 --attacks fuzz,forged_va,churn --plot /tmp/h.png

Starts one `transferd` (numpy backend, private ipc endpoint, its own shm dir, small quotas,
a metrics endpoint on a free port of 127.0.0.1, soft RLIMIT_NOFILE at `--daemon-nofile`,
like a default shell's `ulimit -n 1024`), two good clients (ring=True and ring=False) and
`--procs` attacker processes. Each attacker slot runs one bounded episode of one attack
(bench/_hostile/attacks.py; by default all but those in BREAKING: fuzzed frames, forged and stale VAs, hello/close churn, a
silent-connection flood, unread-reply floods, resource hogs and guest misuse, ring abuse,
hostile compute, zero-stride compute, truncating a segment's or ring's file, clients
SIGKILLed mid-request, every integer field and hello pid at its declared extremes, silent
and garbage peers of the fd socket, idle and slowloris metrics connections, names squatted
in the shm dir, a fake daemon's broken replies against a real client, and its replies with
one number at an integer width's end), then the next;
a random attacker is SIGKILLed every `--kill-every` seconds as well. Everything is
bounded in count and time and stays on this machine.

A monitor samples the daemon every second: RSS, open fds, threads, CPU, and from a
Stats request sessions, segments, device bytes, rings; the files in its shm dir; and one
scrape of its metrics endpoint (a scrape refused while a flood holds every connection is
counted, not a failure).

It checks, and exits 1 unless all hold:
* the daemon never died or stopped answering (a wedge: Stats unanswered for `--wedge-s`);
* the good clients succeeded 100 % (every round verified by checksum64 / read-back; some
  rounds register and free a segment, so the fd socket's floods are felt);
* no attack was served something it must not be (`VIOLATION:*` counts);
* at the end, after every attacker and good client is gone: sessions 0 (the monitor's
  aside), segments 0, device bytes 0, rings 0, only the lock and fd socket in the shm dir
  (once the names the squat attack listed are removed), fds back within `--fd-slack` of
  the baseline, RSS within `--rss-slack-mib`, a metrics scrape answered, no attacker
  process left alive;
* the drain under ring load: a ring client pushes `DRAIN_COPIES` checksummed copies, then
  SIGTERM: every one completes with the right bytes, a request made once the drain is seen
  (a new hello answered ShuttingDown) fails ShuttingDown on the ring and on the socket, the
  daemon exits 0 and leaves an empty shm dir.

Output: a summary table; `--json FILE` adds the 1 s time series, 10 s windows of the
good clients' p50/p99 and success, and each attack's counts; `--plot FILE` (matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import zmq

ROOT = Path(__file__).resolve().parent.parent
for _p in (str(ROOT), str(ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _hostile.attacks import ATTACKS, run_attack
from _hostile.good import good_client
from _hostile.tally import read_tallies

import transfer
from transfer import protocol as P
from transfer.testing import DaemonProcess, start_daemon

MiB = 1 << 20
#: Attacks that find a bug not fixed yet (tests/integration/test_hostile_soak.py DISABLED says which, and
#: why): left out of a run unless named, or `--attacks all`.
BREAKING: tuple[str, ...] = ()
DAEMON_ARGS = [
    "--backend", "numpy", "--heartbeat", "0.2", "--session-timeout", "2",
    "--max-segments-per-session", "64", "--max-host-bytes-per-session", "64MiB",
    "--max-device-bytes-per-session", "64MiB", "--max-device-bytes", "512MiB",
]  # fmt: skip


@dataclass
class Config:
    seconds: float = 600.0
    procs: int = 5
    attacks: tuple[str, ...] = tuple(k for k in ATTACKS if k not in BREAKING)
    kill_every: float = 3.0
    episode: tuple[float, float] = (3.0, 8.0)
    seed: int = 0
    daemon_nofile: int = 1024
    wedge_s: float = 10.0
    fd_slack: int = 16
    rss_slack_mib: float = 64.0
    good_pace: float = 0.002


@dataclass
class Result:
    config: dict[str, Any]
    failures: list[str] = field(default_factory=list)
    daemon: dict[str, Any] = field(default_factory=dict)
    series: list[dict[str, Any]] = field(default_factory=list)
    good: dict[str, Any] = field(default_factory=dict)
    attacks: dict[str, Any] = field(default_factory=dict)
    leaks: dict[str, Any] = field(default_factory=dict)
    drain: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures


# --- the daemon ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """start_daemon inherits our stderr: point fd 2 at a file while it spawns."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(fd, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def _free_port() -> int:
    """A port of 127.0.0.1 free now (bound, then closed): the daemon's metrics endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str, timeout: float = 2.0) -> str:
    """One GET of the metrics endpoint: "ok", or why not ("HTTP 503", "timeout", ...)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return "ok" if r.status == 200 and b"transfer_" in r.read() else f"HTTP {r.status} without transfer_ series"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (TimeoutError, socket.timeout):
        return "timeout"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return "timeout" if isinstance(reason, (TimeoutError, socket.timeout)) else type(reason).__name__


class Monitor(threading.Thread):
    """Samples the daemon once a second; its own session's Stats give the daemon's counters,
    and one scrape a sample its metrics endpoint (`scrapes`: outcome -> count)."""

    def __init__(self, daemon: DaemonProcess, t0: float, period: float = 1.0, metrics_url: str = "") -> None:
        super().__init__(name="monitor", daemon=True)
        self.daemon_ = daemon
        self.t0, self.period = t0, period
        self.metrics_url = metrics_url
        self.scrapes: Counter[str] = Counter()
        self.proc = psutil.Process(daemon.pid)
        self.samples: list[dict[str, Any]] = []
        self.stop_ = threading.Event()
        self.last_answer = time.monotonic()
        self.client: transfer.Client | None = None

    def stats(self, timeout: float = 3.0) -> dict[str, Any] | None:
        try:
            if self.client is None:
                self.client = transfer.connect(self.daemon_.endpoint, name="monitor", ring=False, connect_timeout=timeout, liveness_timeout=timeout)
            st = self.client._run(self.client._op_stats(), timeout)["daemon"]
            self.last_answer = time.monotonic()
            return st  # type: ignore[no-any-return]
        except transfer.TransferError:
            with contextlib.suppress(Exception):
                if self.client is not None:
                    self.client.close()
            self.client = None
            return None

    def sample(self) -> dict[str, Any]:
        s: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 2)}
        try:
            with self.proc.oneshot():
                s["rss"] = self.proc.memory_info().rss
                s["threads"] = self.proc.num_threads()
                s["cpu_s"] = round(sum(self.proc.cpu_times()[:2]), 2)
        except psutil.Error:
            s["rss"] = s["threads"] = s["cpu_s"] = None
        s["fds"] = _fds(self.daemon_.pid)
        with contextlib.suppress(OSError):
            s["shm_files"] = len(os.listdir(self.daemon_.shm_dir))
        st = self.stats() if self.daemon_.alive() else None
        for k in ("sessions", "segments", "device_bytes", "rings", "errors", "requests"):
            s[k] = None if st is None else st.get(k)
        if self.metrics_url and self.daemon_.alive():
            s["scrape"] = scrape(self.metrics_url)
            self.scrapes[s["scrape"]] += 1
        return s

    def run(self) -> None:
        while not self.stop_.wait(self.period):
            self.samples.append(self.sample())

    def wedged_for(self) -> float:
        return time.monotonic() - self.last_answer

    def close(self) -> None:
        self.stop_.set()
        self.join(10)
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
            self.client = None


# --- the run ---------------------------------------------------------------------------------------
def run(cfg: Config, log: Any = None) -> Result:
    say = log or (lambda *a: None)
    metrics_port = _free_port()
    daemon_args = [*DAEMON_ARGS, "--metrics-port", str(metrics_port)]
    res = Result(config={**cfg.__dict__, "attacks": list(cfg.attacks), "daemon_args": daemon_args})
    rnd = random.Random(cfg.seed)
    t_start = time.monotonic()
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    shm_dir = base / f"transfer-hostile-{uuid.uuid4().hex[:8]}"
    shm_dir.mkdir(mode=0o700)
    workdir = Path(tempfile.mkdtemp(prefix="transfer-hostile-"))
    tallies = workdir / "tallies"
    tallies.mkdir()
    # Started as from a shell with `ulimit -n 1024` (the soft limit; the hard one is the
    # machine's): the daemon raises its soft limit to the hard one and sizes its limits from it.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if cfg.daemon_nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(cfg.daemon_nofile, hard), hard))
    try:
        with _stderr_to(workdir / "daemon.stderr"):
            daemon = start_daemon(daemon_args, workdir=workdir, shm_dir=shm_dir)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    ctx = mp.get_context("spawn")
    monitor = Monitor(daemon, t_start, metrics_url=f"http://127.0.0.1:{metrics_port}/metrics")
    slots: list[dict[str, Any]] = []
    goods: list[Any] = []
    spawned: list[Any] = []
    episodes: Counter[str] = Counter()
    killed: Counter[str] = Counter()
    hung: Counter[str] = Counter()
    died_at: float | None = None
    try:
        # Baseline after one warm-up session, so first-use allocations do not count as growth.
        with transfer.connect(daemon.endpoint) as c:
            s, b = c.segment(1 * MiB), c.alloc(1 * MiB)
            c.copy(b, s).result()
            c.compute("sum", [s.tensor((16,), np.float32)], [s.tensor((), np.float32, offset=64)]).result()
        time.sleep(0.3)
        base_sample = monitor.sample()
        res.daemon["baseline"] = base_sample
        monitor.start()
        deadline = time.time() + cfg.seconds
        stop_at = time.monotonic() + cfg.seconds
        for i, ring in enumerate((True, False)):
            p = ctx.Process(target=good_client, args=(daemon.endpoint, daemon.pid, str(tallies), i, ring, deadline + 1, cfg.seed * 100 + i),
                            kwargs={"pace": cfg.good_pace}, daemon=True)
            p.start()
            goods.append(p)
        kinds = list(cfg.attacks)
        n_ep = 0

        def start_episode(slot: int) -> dict[str, Any]:
            nonlocal n_ep
            kind = kinds[n_ep % len(kinds)] if kinds else ""
            n_ep += 1
            length = rnd.uniform(*cfg.episode)
            end = min(time.time() + length + 5, deadline)  # +5: a spawned process's start-up
            out = tallies / f"attack-{n_ep:05d}-{kind}.json"
            p = ctx.Process(target=run_attack, args=(kind, daemon.endpoint, str(shm_dir), daemon.pid, str(out), length, deadline, cfg.seed * 100_000 + n_ep),
                            kwargs={"metrics_port": metrics_port}, daemon=True)
            p.start()
            spawned.append(p)
            episodes[kind] += 1
            # clients killed mid-request: midkill episodes die young, by SIGKILL
            kill_at = time.monotonic() + rnd.uniform(1.5, 3.5) if kind == "midkill" else None  # start-up ~1 s
            return {"proc": p, "kind": kind, "end": end, "kill_at": kill_at, "born": time.monotonic(), "out": out, "tally_at": None}

        if kinds:
            slots = [start_episode(i) for i in range(cfg.procs)]
        next_kill = time.monotonic() + cfg.kill_every if cfg.kill_every > 0 else float("inf")
        while time.monotonic() < stop_at:
            time.sleep(0.05)
            if not daemon.alive():
                died_at = time.monotonic() - t_start
                say(f"t={died_at:5.1f}s the daemon died: exit {daemon.proc.returncode}")
                break
            if monitor.wedged_for() > cfg.wedge_s + 10:
                say(f"t={time.monotonic() - t_start:5.1f}s the daemon has not answered Stats for {monitor.wedged_for():.0f}s: stopping")
                break
            now = time.monotonic()
            for i, sl in enumerate(slots):
                p = sl["proc"]
                if sl["kill_at"] is not None and now >= sl["kill_at"] and p.is_alive():
                    sl["kill_at"] = None
                    os.kill(p.pid, signal.SIGKILL)
                    killed[sl["kind"]] += 1
                if not p.is_alive():
                    p.join()
                    slots[i] = start_episode(i)
                elif time.time() > sl["end"] + 15:  # an attacker stuck past its episode: note it, kill it
                    hung[sl["kind"]] += 1
                    p.kill()
            # Only attackers past their start-up (their tally has existed for 1 s, timed from when it
            # appeared: the file's own times move with every flush) are killed mid-attack.
            for sl in slots:
                if sl["tally_at"] is None and sl["out"].exists():
                    sl["tally_at"] = now
            grown = [sl for sl in slots if now - sl["born"] > 2.5 and sl["tally_at"] is not None and now - sl["tally_at"] > 1.0]
            if now >= next_kill and grown:
                sl = rnd.choice(grown)
                if sl["proc"].is_alive() and sl["proc"].exitcode is None:
                    sl["kill_at"] = sl["born"] = float("inf")
                    os.kill(sl["proc"].pid, signal.SIGKILL)
                    killed[sl["kind"]] += 1
                next_kill += cfg.kill_every
        say(f"t={time.monotonic() - t_start:5.1f}s stopping attackers")
        for sl in slots:  # episodes end by themselves by the deadline; stragglers are killed
            sl["proc"].join(max(0.0, min(sl["end"], deadline) + 15 - time.time()))  # as the main loop: 15 s of grace
            if sl["proc"].is_alive():
                hung[sl["kind"]] += 1 if daemon.alive() and died_at is None else 0
                sl["proc"].kill()
                sl["proc"].join()
        for p in goods:
            p.join(30)
            if p.is_alive():
                res.failures.append("a good client did not stop by itself within 30 s")
                p.kill()
                p.join()
        res.daemon["died_at_s"] = died_at
        res.leaks["squatted_names_removed"] = _remove_squatted(tallies, shm_dir)
        wedged = monitor.wedged_for() if daemon.alive() else 0.0
        _collect(res, tallies, episodes, killed, hung, monitor)
        if not daemon.alive():
            res.failures.append(f"the daemon died at t={died_at}s: exit {daemon.proc.returncode} ({_signame(daemon.proc.returncode)})")
        elif wedged > cfg.wedge_s:
            res.failures.append(f"the daemon stopped answering (no Stats reply for {wedged:.0f}s)")
        elif max((s["t"] for s in monitor.samples if s.get("sessions") is None), default=None) is not None:
            gaps = [s["t"] for s in monitor.samples if s.get("sessions") is None]
            res.daemon["stats_unanswered_at"] = gaps
        if daemon.alive():
            _leaks(res, cfg, daemon, monitor, base_sample, spawned + goods)
        monitor.close()
        res.daemon["metrics_scrapes"] = dict(monitor.scrapes)
        if daemon.alive():
            drain_under_ring_load(res, daemon)
    finally:
        monitor.stop_.set()
        for p in spawned + goods:
            if p.is_alive():
                p.kill()
                p.join()
        exit_code = daemon.stop()
        res.daemon["exit_code"] = exit_code
        res.daemon["exit"] = _signame(exit_code)
        if exit_code != 0 and not any("daemon died" in f for f in res.failures):
            res.failures.append(f"the daemon's SIGTERM exit was {exit_code} ({_signame(exit_code)})")
        left = sorted(os.listdir(shm_dir))
        res.leaks["shm_after_stop"] = left
        if left:
            res.failures.append(f"{len(left)} file(s) left in the shm dir after the daemon stopped: {left[:5]}")
        with contextlib.suppress(OSError):
            err = (workdir / "daemon.stderr").read_text(errors="replace")
            res.daemon["stderr_tail"] = err[-4000:]
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
        res.series = monitor.samples
        res.elapsed_s = round(time.monotonic() - t_start, 1)
    return res


def _signame(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return f"exit {code}"


def _pct(xs: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(xs, q)) * 1e3, 3) if len(xs) else None


def _collect(res: Result, tallies: Path, episodes: Counter[str], killed: Counter[str], hung: Counter[str], monitor: Monitor) -> None:
    """Sum the attackers' tallies; read the good clients' rounds into windows."""
    per: dict[str, Counter[str]] = defaultdict(Counter)
    notes: dict[str, list[str]] = defaultdict(list)
    pids: list[int] = []
    for t in read_tallies(tallies):
        per[t["kind"]].update(t["counts"])
        notes[t["kind"]].extend(t["notes"][:5])
        pids.append(t["pid"])
    res.leaks["worker_pids"] = pids
    for kind in sorted(set(episodes) | {k for k in per if not k.startswith("good")}):
        c = per.get(kind, Counter())
        res.attacks[kind] = {"episodes": episodes[kind], "sigkilled": killed[kind], "hung": hung[kind], "counts": dict(sorted(c.items())), "notes": notes[kind][:10]}
        bugs = {k: n for k, n in c.items() if k.startswith("attacker_bug")}
        if bugs:
            res.daemon.setdefault("attacker_bugs", {})[kind] = bugs  # the harness's own problem, shown, not fatal
        v = {k: n for k, n in c.items() if k.startswith("VIOLATION")}
        if v:
            res.failures.append(f"attack {kind} was served what it must not be: {v}")
        if hung[kind]:
            res.failures.append(f"{hung[kind]} {kind} attacker(s) hung past their episode (daemon unresponsive to them?)")
    rows: list[list[Any]] = []
    for f in sorted(tallies.glob("good-*.jsonl")):
        for line in f.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    rows.sort(key=lambda r: r[0])
    res.good["clients"] = {k: dict(v) for k, v in per.items() if k.startswith("good")}
    if not rows:
        res.failures.append("the good clients recorded no round")
        return
    t0 = rows[0][0]
    lat = np.array([r[2] for r in rows if r[1]])
    ok = sum(1 for r in rows if r[1])
    res.good.update(rounds=len(rows), ok=ok, failed=len(rows) - ok, success_rate=ok / len(rows),
                    p50_ms=_pct(lat, 50), p99_ms=_pct(lat, 99), max_ms=_pct(lat, 100),
                    failures_by_class=dict(Counter(r[4] for r in rows if not r[1])),
                    first_failures=[{"t": round(r[0] - t0, 2), "kind": r[3], "error": r[4]} for r in rows if not r[1]][:10])
    windows = []
    for w in range(int((rows[-1][0] - t0) // 10) + 1):
        sel = [r for r in rows if w * 10 <= r[0] - t0 < (w + 1) * 10]
        wl = np.array([r[2] for r in sel if r[1]])
        windows.append({"t": w * 10, "rounds": len(sel), "success_rate": (sum(1 for r in sel if r[1]) / len(sel)) if sel else None,
                        "p50_ms": _pct(wl, 50), "p99_ms": _pct(wl, 99)})
    res.good["windows"] = windows
    if ok < len(rows):
        res.failures.append(f"good clients: {len(rows) - ok} of {len(rows)} rounds failed {res.good['failures_by_class']}")


def _remove_squatted(tallies: Path, shm_dir: Path) -> int:
    """Remove what squat episodes left in the shm dir (a SIGKILLed one cannot clean up).

    Each squat episode lists a path in its `.created` manifest before it makes it, so this
    removes exactly those names, and only in the shm dir; the leak check after it still
    requires the dir to hold nothing but the daemon's lock and fd socket. (Ignoring "names
    the squat attack is known to create" instead would also hide a daemon file that
    happened to take such a name.) Returns how many paths were still there."""
    removed = 0
    for manifest in tallies.glob("*.created"):
        for line in set(manifest.read_text().splitlines()):
            path = Path(line)
            if path.parent != shm_dir or not path.name.lstrip(".").startswith("transfer."):
                continue
            try:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
                removed += 1
            except FileNotFoundError:
                continue
    return removed


def _leaks(res: Result, cfg: Config, daemon: DaemonProcess, monitor: Monitor, base: dict[str, Any], procs: list[Any]) -> None:
    """Everyone but the monitor is gone: the daemon must hold nothing of theirs."""
    monitor.stop_.set()
    monitor.join(10)
    end = time.monotonic() + 20
    st: dict[str, Any] | None = None
    while time.monotonic() < end:  # sessions of killed clients are reaped by pidfd / heartbeat timeout
        st = monitor.stats()
        if st is not None and st["sessions"] <= 1 and st["segments"] == 0 and st.get("rings", 0) == 0:
            break
        time.sleep(0.2)
    time.sleep(0.5)
    L = res.leaks
    if st is None:
        res.failures.append("no Stats answer while checking for leaks")
        return
    L.update(sessions=st["sessions"] - 1, segments=st["segments"], device_bytes=st["device_bytes"], rings=st.get("rings"))
    for k in ("sessions", "segments", "device_bytes", "rings"):
        if L[k]:
            res.failures.append(f"leak: {L[k]} {k} still held by the daemon after every client left")
    files = sorted(os.listdir(daemon.shm_dir))
    L["shm_files_running"] = files
    # While it runs, the daemon keeps its lock and its fd socket (`.fds.<random>`).
    unexpected = [f for f in files if not (f.endswith(".lock") or ".fds." in f)]
    if unexpected:
        res.failures.append(f"leak: {len(unexpected)} unexpected file(s) in the shm dir while running: {unexpected[:5]}")
    if monitor.metrics_url:  # the floods' connections closed with their processes: the endpoint answers again
        outcome, end = scrape(monitor.metrics_url), time.monotonic() + 10
        while outcome != "ok" and time.monotonic() < end:
            time.sleep(0.5)
            outcome = scrape(monitor.metrics_url)
        L["metrics_scrape_at_end"] = outcome
        if outcome != "ok":
            res.failures.append(f"the metrics endpoint did not answer a scrape after every attacker left: {outcome}")
    now = monitor.sample()
    L["fds_baseline"], L["fds_final"] = base["fds"], now["fds"]
    L["rss_baseline_mib"], L["rss_final_mib"] = round(base["rss"] / MiB, 1), round(now["rss"] / MiB, 1)
    L["rss_peak_mib"] = round(max([s["rss"] or 0 for s in monitor.samples] + [now["rss"]]) / MiB, 1)
    L["threads_baseline"], L["threads_final"] = base["threads"], now["threads"]
    if now["fds"] > base["fds"] + cfg.fd_slack:
        res.failures.append(f"leak: the daemon holds {now['fds']} fds, baseline {base['fds']} (+{cfg.fd_slack} allowed)")
    if now["rss"] > base["rss"] + cfg.rss_slack_mib * MiB:
        res.failures.append(f"RSS grew from {L['rss_baseline_mib']} to {L['rss_final_mib']} MiB (+{cfg.rss_slack_mib} allowed)")
    alive = []
    for pid in L.get("worker_pids", []) + [p.pid for p in procs]:
        with contextlib.suppress(psutil.Error):
            pr = psutil.Process(pid)
            if pid != daemon.pid and pr.status() != psutil.STATUS_ZOMBIE and any("multiprocessing" in a for a in pr.cmdline()):
                alive.append(pid)
    # The daemon's own CPU device processes (kernels/_process.py) are its to close, at its stop.
    zombies = [c.pid for c in psutil.Process().children(recursive=True)
               if c.pid != daemon.pid and not any("resource_tracker" in a or "transfer.kernels._process" in a for a in _cmdline(c))]
    L["workers_alive"], L["children_left"] = sorted(set(alive)), zombies
    if alive or zombies:
        res.failures.append(f"processes left: workers {sorted(set(alive))}, children {zombies}")


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


# --- the drain under ring load ---------------------------------------------------------------------
DRAIN_COPIES, DRAIN_COPY_BYTES = 50, 4 * MiB
#: Copies of 32 MiB another session queues on the socket before the signal: they keep the
#: daemon draining (about 0.4 s on 2 cores, within its 10 s grace) while the drain is seen
#: and the late requests are made.
DRAIN_HOLD_COPIES = 100


class DrainHolder:
    """A raw session with copies queued when the signal comes. It pings while the drain goes
    on (refused, but heard), so the session timeout does not end it early."""

    def __init__(self, endpoint: str) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.next_id = 1 << 32  # above the copies' ids

    def _until(self, *ids: int, timeout: float = 10.0) -> list[P.Reply | None]:
        """Read replies until those to `ids` are in (the others are the queued copies')."""
        got: dict[int, P.Reply] = {}
        end = time.monotonic() + timeout
        while len(got) < len(ids) and (left := end - time.monotonic()) > 0 and self.sock.poll(int(left * 1000) + 1):
            got.update((r.id, r) for r in P.decode_replies(self.sock.recv()) if r.id in ids)
        return [got.get(i) for i in ids]

    def start(self) -> str:
        """Hello, two buffers, the copies; returns "" once the daemon has read them, else why not."""
        self.sock.send(P.encode_requests([P.Hello(1, P.VERSION, "drain-holder", os.getpid(), b"")]))
        (r,) = self._until(1)
        if r is None or r.error is not None:
            return f"hello: {r and r.error}"
        self.sock.send(P.encode_requests([P.Alloc(2, 32 * MiB, -1), P.Alloc(3, 32 * MiB, -1)]))
        a, b = self._until(2, 3)
        if a is None or b is None or a.error is not None or b.error is not None:
            return f"alloc: {a and a.error} {b and b.error}"
        self.sock.send(P.encode_requests([P.Copy(10 + i, a.result["va"], b.result["va"], 32 * MiB, 0) for i in range(DRAIN_HOLD_COPIES)]))
        self.sock.send(P.encode_requests([P.Ping(5)]))  # a frame of its own: answered once the copies are taken
        return "" if self._until(5)[0] is not None else "no answer to the ping behind the copies"

    def ping(self) -> None:
        self.next_id += 1
        self.sock.send(P.encode_requests([P.Ping(self.next_id)]))

    def close(self) -> None:
        self.sock.close(0)


def _hello_refused(endpoint: str, timeout: float) -> bool | None:
    """A new hello: True if answered ShuttingDown (the drain has begun), False if served, None if unanswered."""
    s: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(endpoint)
        s.send(P.encode_requests([P.Hello(1, P.VERSION, "drain-probe", os.getpid(), b"")]))
        if not s.poll(int(timeout * 1000)):
            return None
        (r,) = P.decode_replies(s.recv())
        if isinstance(r.error, transfer.ShuttingDown):
            return True
        s.send(P.encode_requests([P.Close(2)]))
        return False
    finally:
        s.close(0)


def _late(submit: Any) -> str:
    """A request made after the drain was seen: "ShuttingDown" is the only right answer."""
    try:
        submit().result(30)
        return "served"
    except transfer.TransferError as exc:
        return type(exc).__name__


def drain_under_ring_load(res: Result, daemon: DaemonProcess) -> None:
    """SIGTERM while a ring client's copies are in flight (what was published before the signal
    is served), then requests on the ring and the socket once the drain is seen (ShuttingDown);
    the daemon exits 0. Records `res.drain`; a failure fails the soak."""
    D = res.drain
    signalled: list[float] = []
    try:
        _drain(D, daemon, signalled)
    except transfer.TransferError as exc:
        D["error"] = f"{type(exc).__name__}: {exc}"
    if signalled:  # (else the run's own stop signals it, and checks its exit)
        try:
            D["exit_code"] = daemon.proc.wait(60)
        except subprocess.TimeoutExpired:
            D["exit_code"] = None
        D["signal_to_exit_s"] = round(time.monotonic() - signalled[0], 2)
    _judge_drain(res)


def _drain(D: dict[str, Any], daemon: DaemonProcess, signalled: list[float]) -> None:
    """The drain's clients and signal (`drain_under_ring_load`); `signalled` gets when SIGTERM was sent."""
    with contextlib.ExitStack() as stack:
        ring = stack.enter_context(transfer.connect(daemon.endpoint, name="drain-ring", ring=True, liveness_timeout=30))
        sock = stack.enter_context(transfer.connect(daemon.endpoint, name="drain-socket", ring=False, liveness_timeout=30))
        holder = DrainHolder(daemon.endpoint)
        stack.callback(holder.close)
        D["ring"] = ring.ring
        src, dst = ring.segment(DRAIN_COPY_BYTES), ring.segment(DRAIN_COPY_BYTES)
        late_ring, late_sock = ring.segment(4096), sock.segment(4096)
        src.buffer[:] = np.random.default_rng(0).integers(0, 256, DRAIN_COPY_BYTES, np.uint8)
        want = transfer.checksum64(src.buffer)
        D["holder"] = holder.start() or "ok"
        pending = [ring.copy(dst, src, DRAIN_COPY_BYTES) for _ in range(DRAIN_COPIES)]
        ring.poll()  # reap what completed already: the rest were in flight at the signal
        D["in_flight_at_signal"] = sum(not p.done() for p in pending)
        signalled.append(time.monotonic())
        daemon.proc.send_signal(signal.SIGTERM)
        seen = False
        while not seen and daemon.alive() and time.monotonic() - signalled[0] < 20:
            seen = bool(_hello_refused(daemon.endpoint, 2.0))
            holder.ping()
        D["drain_seen_after_s"] = round(time.monotonic() - signalled[0], 3) if seen else None
        if seen:  # (made after the drain began, so after the signal: ShuttingDown, on either path)
            D["late_ring"] = _late(lambda: ring.fill(late_ring, 4096, 1))
            D["late_socket"] = _late(lambda: sock.fill(late_sock, 4096, 1))
        failed: Counter[str] = Counter()
        for p in pending:
            try:
                p.result(60)
            except transfer.TransferError as exc:
                failed[type(exc).__name__] += 1
        D["copies_ok"], D["copies_failed"] = DRAIN_COPIES - sum(failed.values()), dict(failed)
        D["bytes_match"] = transfer.checksum64(dst.buffer) == want


def _judge_drain(res: Result) -> None:
    D, fail = res.drain, res.failures.append
    if "error" in D:
        fail(f"drain: {D['error']}")
    if not D.get("ring"):
        fail("drain: the drain's client got no ring")
    if D.get("copies_ok") != DRAIN_COPIES or not D.get("bytes_match"):
        fail(f"drain: {D.get('copies_ok')} of {DRAIN_COPIES} ring copies published before SIGTERM completed "
             f"{D.get('copies_failed')}, bytes match: {D.get('bytes_match')}")
    if D.get("drain_seen_after_s") is None:
        fail(f"drain: no new hello was answered ShuttingDown after SIGTERM (holder: {D.get('holder')})")
    for k in ("late_ring", "late_socket"):
        if k in D and D[k] != "ShuttingDown":
            fail(f"drain: a request made after the drain began ({k}) got {D[k]}, not ShuttingDown")
    if "exit_code" in D and D["exit_code"] != 0:
        fail(f"drain: the daemon's exit after SIGTERM was {D['exit_code']}")


# --- report ----------------------------------------------------------------------------------------
def table(res: Result) -> str:
    g, L, d = res.good, res.leaks, res.daemon
    series = res.series
    rss = [s["rss"] for s in series if s.get("rss")]
    fds = [s["fds"] for s in series if s.get("fds", -1) >= 0]
    rows: list[tuple[str, Any]] = [
        ("run", f"{res.elapsed_s} s, {res.config['procs']} attacker slots, attacks: {', '.join(res.config['attacks'])}"),
        ("daemon", f"died at t={d['died_at_s']} s" if d.get("died_at_s") is not None else "alive through the run"),
        ("daemon SIGTERM exit", d.get("exit")),
        ("good rounds (ok / all)", f"{g.get('ok', 0)} / {g.get('rounds', 0)}  = {100 * g.get('success_rate', 0):.3f} %"),
        ("good latency p50 / p99 / max", f"{g.get('p50_ms')} / {g.get('p99_ms')} / {g.get('max_ms')} ms"),
        ("good failures by class", g.get("failures_by_class", {})),
        ("good p99 per 10 s", " ".join(str(w["p99_ms"]) for w in g.get("windows", []))),
        ("daemon RSS min / max / last", f"{min(rss, default=0) / MiB:.1f} / {max(rss, default=0) / MiB:.1f} / {(rss[-1] if rss else 0) / MiB:.1f} MiB"),
        ("daemon fds min / max / last", f"{min(fds, default=-1)} / {max(fds, default=-1)} / {fds[-1] if fds else -1}"),
        ("daemon threads max", max((s["threads"] or 0 for s in series), default=0)),
        ("leaks at the end", {k: L[k] for k in ("sessions", "segments", "device_bytes", "rings", "fds_baseline", "fds_final", "rss_baseline_mib", "rss_final_mib") if k in L}),
        ("metrics scrapes (monitor)", d.get("metrics_scrapes", {})),
        ("squatted names removed", L.get("squatted_names_removed")),
        ("drain under ring load", _drain_row(res.drain)),
        ("shm files after stop", L.get("shm_after_stop")),
    ]
    for kind, a in res.attacks.items():
        top = sorted(a["counts"].items(), key=lambda kv: -kv[1])[:8]
        rows.append((f"attack {kind}", f"{a['episodes']} ep, {a['sigkilled']} killed: " + ", ".join(f"{k}={v}" for k, v in top)))
    if d.get("attacker_bugs"):
        rows.append(("attacker bugs (harness)", d["attacker_bugs"]))
    rows.append(("verdict", "PASS" if res.ok else "FAIL"))
    w = max(len(k) for k, _ in rows)
    out = "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
    if res.failures:
        out += "\n\nfailures:\n" + "\n".join(f"  - {f}" for f in res.failures)
    return out


def _drain_row(D: dict[str, Any]) -> str:
    if not D:
        return "not run"
    return (f"{D.get('copies_ok')}/{DRAIN_COPIES} ring copies ok ({D.get('in_flight_at_signal')} in flight at SIGTERM), "
            f"bytes match {D.get('bytes_match')}; drain seen after {D.get('drain_seen_after_s')} s; late ring/socket: "
            f"{D.get('late_ring')}/{D.get('late_socket')}; exit {D.get('exit_code')} {D.get('signal_to_exit_s')} s after SIGTERM")


def plot(res: Result, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in res.series]
    fig, ax = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    ax[0].plot(t, [(s["rss"] or 0) / MiB for s in res.series])
    ax[0].set_ylabel("daemon RSS (MiB)")
    ax[1].plot(t, [s["fds"] for s in res.series])
    ax[1].set_ylabel("daemon open fds")
    w = res.good.get("windows", [])
    ax[2].step([x["t"] for x in w], [x["p99_ms"] or 0 for x in w], where="post")
    ax[2].set_ylabel("good p99 per 10 s (ms)")
    ax[2].set_xlabel("seconds")
    fig.suptitle("hostile-tenant soak: " + ("PASS" if res.ok else "FAIL"))
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--procs", type=int, default=5, help="attacker processes at once")
    p.add_argument("--attacks", default="survivable",
                   help=f"comma list, 'all', or 'survivable' (the default: all but {', '.join(BREAKING)}); from: {', '.join(ATTACKS)}")
    p.add_argument("--exclude", default="", help="comma list of attacks to leave out")
    p.add_argument("--kill-every", type=float, default=3.0, help="seconds between SIGKILLs of a random attacker (0 = never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--daemon-nofile", type=int, default=1024, help="the soft RLIMIT_NOFILE the daemon starts with, as after `ulimit -n N` (0 = inherit)")
    p.add_argument("--wedge-s", type=float, default=10.0, help="Stats unanswered this long = the daemon is wedged")
    p.add_argument("--json", metavar="FILE", help="write the result (time series, windows, attack counts)")
    p.add_argument("--plot", metavar="FILE", help="plot RSS, fds and p99 over time (needs matplotlib)")
    a = p.parse_args(argv)
    if a.attacks == "all":
        kinds = list(ATTACKS)
    elif a.attacks == "survivable":
        kinds = [k for k in ATTACKS if k not in BREAKING]
    else:
        kinds = [k for k in a.attacks.split(",") if k]
    kinds = [k for k in kinds if k not in a.exclude.split(",")]
    unknown = [k for k in kinds if k not in ATTACKS]
    if unknown or a.seconds <= 0:
        p.error(f"unknown attacks {unknown}" if unknown else "--seconds must be > 0")
    cfg = Config(seconds=a.seconds, procs=a.procs, attacks=tuple(kinds), kill_every=a.kill_every, seed=a.seed,
                 daemon_nofile=a.daemon_nofile, wedge_s=a.wedge_s)
    res = run(cfg, log=lambda m: print(m, file=sys.stderr))
    print(table(res))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({**res.__dict__, "ok": res.ok}, indent=1, default=str))
    if a.plot:
        try:
            plot(res, a.plot)
        except ImportError:
            print("--plot needs matplotlib", file=sys.stderr)
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
