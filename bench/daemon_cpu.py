"""The daemon's own CPU time per request in one transfer-bench cell (remote mode).

Throughput on a shared 2-core VM swings by a tenth from run to run; the CPU time the
daemon's main thread spends per request swings far less, and it is what a change to the
request path changes. One run:

* runs `transfer-bench quick --modes MODE --sizes SIZE --methods transfer --producers 1
  --reps 1 --rep-seconds S` (this tree, or `--baseline DIR`'s);
* once the cell is under way, reads the main thread's CPU time (`/proc/PID/task/PID/stat`)
  and the daemon's request and pass counters (`stats()`, from a second client) twice,
  `--window` seconds apart;
* reports CPU microseconds per request and per pass, requests per pass, and the share of
  the window the thread was busy, beside the cell's GB/s.

`--baseline DIR` measures a checkout of another commit (its native extension built) in
alternating runs, so both see the same phases of a noisy machine:

    python bench/daemon_cpu.py [--mode remote] [--size 1M] [--runs 3] [--baseline DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _proc import main_thread_cpu_s  # (bench/ is the script's directory: on sys.path)


def _daemons() -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if b"transfer.cli.transferd" in (d / "cmdline").read_bytes():
                    out.add(int(d.name))
            except OSError:
                pass
    return out


def _counters(endpoint: str) -> tuple[int, int]:
    import transfer

    with transfer.connect(endpoint, name="daemon-cpu", ring=False) as c:
        d = c.stats()["daemon"]
    return int(d["requests"]), int(d["passes"])


def run(root: Path, mode: str, size: str, settle: float, window: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}
    before = _daemons()
    bench = subprocess.Popen(
        [sys.executable, "-m", "transfer.cli.bench", "quick", "--modes", mode, "--sizes", size, "--methods", "transfer",
         "--producers", "1", "--reps", "1", "--rep-seconds", str(settle + window + 2), "--no-progress"],
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        new: set[int] = set()
        while not new and time.monotonic() < deadline and bench.poll() is None:
            time.sleep(0.05)
            new = _daemons() - before
        if not new:
            raise RuntimeError("no transferd appeared")
        pid = min(new)
        endpoint = re.search(rb"--endpoint\0([^\0]+)", Path(f"/proc/{pid}/cmdline").read_bytes())
        if endpoint is None:
            raise RuntimeError("transferd has no --endpoint")
        time.sleep(settle)
        r0, p0 = _counters(endpoint.group(1).decode())
        c0, t0 = main_thread_cpu_s(pid), time.monotonic()
        time.sleep(window)
        r1, p1 = _counters(endpoint.group(1).decode())
        c1, t1 = main_thread_cpu_s(pid), time.monotonic()
        out, _ = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    if bench.returncode:
        raise RuntimeError(f"transfer-bench failed:\n{out}")
    cell = re.search(r"^\[1/1\].*?:\s+([\d.]+) GB/s", out, re.M)
    reqs, passes, cpu = r1 - r0, p1 - p0, c1 - c0  # (the measuring client's few control requests: noise)
    return {"gbps": float(cell.group(1)) if cell else None, "cpu_us_per_request": round(cpu / reqs * 1e6, 1),
            "cpu_us_per_pass": round(cpu / passes * 1e6, 1), "requests_per_pass": round(reqs / passes, 2),
            "busy": round(cpu / (t1 - t0), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="remote")
    ap.add_argument("--size", default="1M")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds after the daemon starts before the window")
    ap.add_argument("--window", type=float, default=3.0, help="seconds measured")
    ap.add_argument("--runs", type=int, default=3, help="alternating runs per tree")
    ap.add_argument("--baseline", type=Path, help="a checkout of another commit to measure alongside")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    here = Path(__file__).resolve().parent.parent
    trees = {"this": here, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in trees}
    for _ in range(args.runs):
        for name, root in trees.items():
            row = run(root, args.mode, args.size, args.settle, args.window)
            runs[name].append(row)
            print(f"{name:9s}", "  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    if args.json:
        result = {"command": " ".join(["python bench/daemon_cpu.py", *sys.argv[1:]]), "runs": runs}
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
