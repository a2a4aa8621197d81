#!/usr/bin/env python3
"""Soak: client processes transfer and verify while a killer SIGKILLs them.

    python bench/soak.py --clients 4 --seconds 60 --kill-every 2

N client processes each loop (bounded in rounds and time): write random bytes
into a shared-memory segment, copy them to a device buffer, checksum that in
the daemon, copy them back into a second segment, and compare both. Every
`--kill-every` seconds a random client is SIGKILLed and a new one spawned.

At the end, after every client has exited, the daemon must hold no session,
no segment and no device byte; its --shm-dir must hold nothing but its lock
file; every surviving client must have seen zero checksum or byte mismatches;
and the daemon's RSS must be back near its baseline. Prints a summary table;
exits 1 if any check failed. Everything runs on this host over ipc://.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import transfer  # noqa: E402
from transfer.testing import memfds, start_daemon  # noqa: E402

SLOT = 4  # per-process counters: transfers, bytes, failures, clean exit
MiB = 1 << 20


def worker(endpoint: str, slot: int, counters: Any, deadline: float, seed: int, max_rounds: int, cap: int, pace: float) -> None:
    """One client; writes its counts into `counters[slot*SLOT:]` (lock-free: it is the only writer)."""
    rng = np.random.default_rng(seed)
    base = slot * SLOT
    with transfer.connect(endpoint, name=f"soak{slot}") as c:
        seg = c.segment(cap)
        back = c.segment(cap)
        buf = c.alloc(cap)
        for _ in range(max_rounds):
            if time.time() > deadline:
                break
            n = int(rng.integers(1, cap))
            off = int(rng.integers(0, cap - n + 1))
            data = seg.ndarray((n,), np.uint8, offset=off)
            data[:] = rng.integers(0, 256, n, dtype=np.uint8)
            want = transfer.checksum64(data)
            c.copy(buf.va, seg.va + off, n)
            cks = c.checksum(buf.va, n)
            c.copy(back.va, buf.va, n)
            c.fence()
            ok = cks.result() == want and np.array_equal(back.ndarray((n,), np.uint8), data)
            counters[base + 0] += 1
            counters[base + 1] += 2 * n
            if not ok:
                counters[base + 2] += 1
            if pace:
                time.sleep(pace)
    counters[base + 3] = 1


@dataclass
class Summary:
    clients: int
    seconds: float
    kill_every: float
    spawned: int = 0
    kills: int = 0
    survivors: int = 0
    transfers: int = 0
    bytes: int = 0
    failures: int = 0
    bad_exits: int = 0
    leaked_files: list[str] = field(default_factory=list)
    daemon_sessions: int = -1
    daemon_segments: int = -1
    daemon_device_bytes: int = -1
    daemon_exit: int | None = None
    rss_baseline: int = 0
    rss_peak: int = 0
    rss_final: int = 0
    rss_slack: int = 0
    elapsed_s: float = 0.0

    @property
    def leaks(self) -> int:
        return len(self.leaked_files) + max(self.daemon_segments, 0) + (self.daemon_device_bytes > 0)

    @property
    def ok(self) -> bool:
        return (
            self.failures == 0
            and self.bad_exits == 0
            and self.leaks == 0
            and self.daemon_sessions == 0
            and self.daemon_exit == 0
            and self.rss_final <= self.rss_baseline + self.rss_slack
        )

    def table(self) -> str:
        rows = [
            ("clients (concurrent)", self.clients),
            ("client processes spawned", self.spawned),
            ("kills (SIGKILL)", self.kills),
            ("clean survivors", self.survivors),
            ("transfers verified", self.transfers),
            ("bytes moved", f"{self.bytes / MiB:,.1f} MiB"),
            ("checksum/byte failures", self.failures),
            ("unexpected client exits", self.bad_exits),
            ("leaks (files + segments + device)", f"{self.leaks} (files {len(self.leaked_files)}, segments {self.daemon_segments}, device bytes {self.daemon_device_bytes})"),
            ("daemon sessions at end", self.daemon_sessions),
            ("daemon RSS baseline / peak / final", f"{self.rss_baseline / MiB:.1f} / {self.rss_peak / MiB:.1f} / {self.rss_final / MiB:.1f} MiB (allowed final <= {(self.rss_baseline + self.rss_slack) / MiB:.1f})"),
            ("daemon exit code", self.daemon_exit),
            ("elapsed", f"{self.elapsed_s:.1f} s"),
            ("verdict", "PASS" if self.ok else "FAIL"),
        ]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def _rss(proc: psutil.Process) -> int:
    try:
        return proc.memory_info().rss
    except psutil.Error:
        return 0


def run(
    clients: int = 4,
    seconds: float = 30.0,
    kill_every: float = 2.0,
    *,
    seed: int = 0,
    cap: int = 1 * MiB,
    max_rounds: int = 1_000_000,
    pace: float = 0.001,
    rss_slack: int = 32 * MiB,
    log: Any = None,
) -> Summary:
    """Run the soak; returns a Summary (`.ok` says whether every check passed)."""
    say = log or (lambda *a: None)
    rnd = random.Random(seed)
    t_start = time.monotonic()
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    shm_dir = base / f"transfer-soak-{uuid.uuid4().hex[:8]}"
    shm_dir.mkdir(mode=0o700)
    workdir = Path(tempfile.mkdtemp(prefix="transfer-soak-"))
    summary = Summary(clients, seconds, kill_every, rss_slack=rss_slack)
    daemon = start_daemon(["--backend", "numpy", "--heartbeat", "0.2", "--session-timeout", "2"], workdir=workdir, shm_dir=shm_dir)
    ctx = mp.get_context("spawn")
    max_procs = clients + int(seconds / kill_every) + 2 if kill_every > 0 else clients
    counters = ctx.RawArray("q", max_procs * SLOT)
    procs: dict[int, Any] = {}  # slot -> Process
    killed: set[int] = set()
    stop_sampling = threading.Event()
    try:
        dproc = psutil.Process(daemon.pid)
        # Baseline after one warm-up session, so first-use allocations are not counted as growth.
        with transfer.connect(daemon.endpoint) as c:
            s = c.segment(cap)
            b = c.alloc(cap)
            c.copy(b, s).result()
        time.sleep(0.3)
        summary.rss_baseline = summary.rss_peak = _rss(dproc)

        def sample() -> None:
            while not stop_sampling.wait(0.1):
                summary.rss_peak = max(summary.rss_peak, _rss(dproc))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        deadline_wall = time.time() + seconds
        deadline = time.monotonic() + seconds

        def spawn() -> None:
            slot = summary.spawned
            p = ctx.Process(target=worker, args=(daemon.endpoint, slot, counters, deadline_wall, seed * 1000 + slot, max_rounds, cap, pace), daemon=True)
            p.start()
            procs[slot] = p
            summary.spawned += 1

        for _ in range(clients):
            spawn()
        next_kill = time.monotonic() + kill_every if kill_every > 0 else float("inf")
        while time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= next_kill and summary.spawned < max_procs:
                live = [s for s, p in procs.items() if s not in killed and p.is_alive()]
                if live:
                    victim = rnd.choice(live)
                    os.kill(procs[victim].pid, signal.SIGKILL)
                    killed.add(victim)
                    summary.kills += 1
                    say(f"t={time.monotonic() - t_start:5.1f}s killed client {victim} (pid {procs[victim].pid})")
                    spawn()
                next_kill += kill_every
        for slot, p in procs.items():
            p.join(timeout=30)
            if p.is_alive():  # bounded: a hung client is a failure, not a hang
                p.kill()
                p.join()
                summary.bad_exits += 1
            elif slot not in killed:
                if p.exitcode == 0 and counters[slot * SLOT + 3] == 1:
                    summary.survivors += 1
                else:
                    summary.bad_exits += 1
                    say(f"client {slot} exited with {p.exitcode}")
        for slot in procs:
            summary.transfers += counters[slot * SLOT + 0]
            summary.bytes += counters[slot * SLOT + 1]
            if slot not in killed:
                summary.failures += counters[slot * SLOT + 2]
        # Every client is gone: the daemon must have released everything (pidfd: promptly).
        # The checker has no ring: its session is released after its Close is answered, and a
        # ring's mapping holds a memfd the check below would count as the clients' leak.
        with transfer.connect(daemon.endpoint, ring=False) as c:
            t_end = time.monotonic() + 15
            while True:
                st = c.stats()["daemon"]
                if (st["sessions"] == 1 and st["segments"] == 0) or time.monotonic() > t_end:
                    break
                time.sleep(0.05)
            summary.daemon_sessions = st["sessions"] - 1
            summary.daemon_segments = st["segments"]
            summary.daemon_device_bytes = st["device_bytes"]
        # While it lives the daemon keeps its lock, fd socket and rings' doorbell there; segments
        # and rings are memfds, so a leak would show as a memfd the daemon still holds.
        summary.leaked_files = sorted(n for n in os.listdir(shm_dir) if not n.endswith(".lock") and ".fds." not in n)
        summary.leaked_files += [f"memfd held by the daemon: {m}" for m in memfds(dproc.pid, maps=False)]
        time.sleep(0.3)
        summary.rss_final = min(_rss(dproc) for _ in range(3) if time.sleep(0.1) is None)
        stop_sampling.set()
        summary.rss_peak = max(summary.rss_peak, summary.rss_final)
    finally:
        stop_sampling.set()
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join()
        summary.daemon_exit = daemon.stop()
        leftovers = sorted(os.listdir(shm_dir))
        if leftovers:  # after a clean stop even the lock file must be gone
            summary.leaked_files = sorted(set(summary.leaked_files) | {f"after stop: {n}" for n in leftovers})
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
        summary.elapsed_s = time.monotonic() - t_start
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--kill-every", type=float, default=2.0, help="seconds between SIGKILLs (0 = never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--segment-mib", type=float, default=1.0, help="each client's segment/buffer size")
    p.add_argument("--pace", type=float, default=0.001, help="seconds each client sleeps per round (CPU courtesy)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON too")
    a = p.parse_args(argv)
    if a.clients < 1 or a.seconds <= 0:
        p.error("--clients must be >= 1 and --seconds > 0")
    s = run(a.clients, a.seconds, a.kill_every, seed=a.seed, cap=int(a.segment_mib * MiB), pace=a.pace, log=lambda m: print(m, file=sys.stderr))
    print(s.table())
    if a.json:
        print(json.dumps({**asdict(s), "leaks": s.leaks, "ok": s.ok}))
    return 0 if s.ok else 1


if __name__ == "__main__":
    sys.exit(main())
