"""Which threads of which processes spend the CPU of one transfer-bench cell, per request.

`bench/daemon_cpu.py` follows the daemon's main thread; this follows every thread of every
Python process on the machine (the daemon, producers, consumers, their zmq I/O threads)
while one cell runs, so two methods can be compared by where their CPU goes:

    python bench/cell_threads.py --method transfer --mode remote --size 1M [--json PATH]
    python bench/cell_threads.py --method nixl-raw --mode remote --size 1M

It runs `transfer-bench quick` for one cell, reads `/proc/PID/task/TID/stat` twice,
`--window` seconds apart once the cell is under way, and prints each busy thread's share of a
core and its CPU microseconds per request (the cell's requests/s as transfer-bench reports it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parent.parent


def _threads() -> dict[tuple[int, int], tuple[str, str, int]]:
    """(pid, tid) -> (command line, thread name, utime + stime ticks) of every Python thread."""
    out: dict[tuple[int, int], tuple[str, str, int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            if "python" not in cmd:
                continue
            for t in (d / "task").iterdir():
                stat = (t / "stat").read_text()
                name = stat[stat.index("(") + 1 : stat.rindex(")")] + (" (main)" if t.name == d.name else "")
                fields = stat.rsplit(")", 1)[1].split()
                out[(int(d.name), int(t.name))] = (cmd, name, int(fields[11]) + int(fields[12]))
        except OSError:
            continue
    return out


def _role(cmd: str) -> str:
    if "transfer.cli.transferd" in cmd:
        return "daemon"
    if "multiprocessing" in cmd:
        return "worker"  # a producer or consumer process of the bench
    return "bench"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="transfer")
    ap.add_argument("--mode", default="remote")
    ap.add_argument("--size", default="1M")
    ap.add_argument("--settle", type=float, default=4.0, help="seconds after the start before the window")
    ap.add_argument("--window", type=float, default=3.0, help="seconds measured")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    result = Path(tempfile.mkdtemp()) / "cell.json"
    bench = subprocess.Popen(
        [sys.executable, "-m", "transfer.cli.bench", "quick", "--modes", args.mode, "--sizes", args.size, "--methods",
         args.method, "--producers", "1", "--reps", "1", "--rep-seconds", str(args.settle + args.window + 1), "--no-progress",
         "--json", str(result)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(args.settle)
    before = _threads()
    t0 = time.monotonic()
    time.sleep(args.window)
    after = _threads()
    window = time.monotonic() - t0
    if bench.wait(timeout=300) != 0:
        raise SystemExit(f"transfer-bench failed (exit {bench.returncode})")
    cell = next(r for r in json.loads(result.read_text())["results"] if r["method"] == args.method)
    result.unlink()
    result.parent.rmdir()
    rps = float(cell["rps"])
    rows: list[dict[str, Any]] = []
    for key, (cmd, name, ticks) in after.items():
        if key in before and key[0] != os.getpid():
            cores = (ticks - before[key][2]) / _TICK / window
            if cores > 0.005:
                rows.append({"pid": key[0], "role": _role(cmd), "thread": name, "cores": round(cores, 3),
                             "cpu_us_per_request": round(cores * 1e6 / rps, 1)})
    rows.sort(key=lambda r: -r["cores"])
    print(f"{args.method} {args.mode} {args.size}: {cell['gbps']:.2f} GB/s, {rps:,.0f} requests/s")
    for r in rows:
        print(f"  {r['role']:7s} pid {r['pid']:7d} {r['thread']:23s} {r['cores']:5.2f} cores  {r['cpu_us_per_request']:7.1f} us/request")
    print(f"  all     {sum(r['cores'] for r in rows):5.2f} cores  {sum(r['cpu_us_per_request'] for r in rows):7.1f} us/request")
    if args.json:
        args.json.write_text(json.dumps({"method": args.method, "mode": args.mode, "size": args.size, "gbps": cell["gbps"],
                                         "rps": rps, "threads": rows}, indent=1))


if __name__ == "__main__":
    main()
