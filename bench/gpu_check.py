"""The prepared GPU check's measuring parts (bench/gpu_check.sh runs them, each under its own
timeout) and its verdict: the targets of the GPU data-plane and compute work, met or not.

    python bench/gpu_check.py bench   --out bench/results/gpu-DATE.json    # transfer-bench's gpu mode
    python bench/gpu_check.py remote  --out bench/results/gpu-DATE.json    # remote producers into GPU memory
    python bench/gpu_check.py fake    --out bench/results/device-fake.json # the same questions on a CPU,
                                                                           # through the fake CUDA driver
    python bench/gpu_check.py targets --out bench/results/gpu-DATE.json [--graphs G.json]

`bench` runs host-to-device and device-to-host at 64 KiB..64 MiB against a CuPy pinned copy
(the native device workers, and a second daemon with them off), two producers copying and
normalizing, and 64 B round trips; it writes the JSON as soon as it has it. `fake` is the CPU
rehearsal: a daemon on the stream simulation whose device memory is tests/fakecuda's, 64 B
host-to-device round trips against host-to-host ones on the same daemon, and 100,000 device
copies through the ring with the event loop's device requests and the daemon's CPU counted.
`remote` has a producer on loopback tcp whose batch the daemon READs straight into device
memory, checksummed, against a raw NIXL agent READing into device memory of its own (skipped,
and said so, where NIXL is not installed). `targets` adds {"targets": {name: {"value",
"target", "met"}}, "gpu": name} to the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


# --- the GPU benchmark ------------------------------------------------------------------------
def bench(out: Path, sizes: list[int], reps: int, rep_s: float) -> None:
    from transfer._bench import gpu

    def line(s: str) -> None:
        print(s, flush=True)

    result = gpu.run(sizes, reps=reps, rep_s=rep_s, compute_sizes=[s for s in sizes if 1 << 20 <= s <= 16 << 20], line=line)
    doc = _load(out)
    doc.update({"gpu_mode": result, "gpu": result["device"]["gpu"],
                "command": f"python bench/gpu_check.py bench --sizes {','.join(map(str, sizes))} --reps {reps} --rep-seconds {rep_s}"})
    _write(out, doc)


def share(out: Path, tenants: int, reps: int, rep_s: float) -> None:
    from transfer._bench import share as share_mode

    result = share_mode.run(tenants, reps=reps, rep_s=rep_s, line=lambda s: print(s, flush=True))
    doc = _load(out)
    doc["share"] = result
    _write(out, doc)


# --- remote producers into device memory ------------------------------------------------------
def remote(out: Path, backend: str, sizes: list[int], reps: int) -> None:
    """A producer on loopback tcp whose batch the daemon READs straight into a device buffer
    (registered with NIXL as VRAM on a GPU; the stream simulation's host-backed device memory
    as DRAM on a CPU), checksummed, against a raw NIXL agent READing the same bytes into device
    memory of its own, alternated in one run."""
    from transfer.transport import _nixl as N

    doc = _load(out)
    if not N.available():
        doc["remote"] = {"skipped": "NIXL is not installed (carry its wheel: pip download --no-deps nixl-cu12==1.5.1)"}
        _write(out, doc)
        print(doc["remote"]["skipped"], flush=True)
        return
    import numpy as np

    import transfer
    from transfer.testing import loopback_endpoint, run_daemon

    xp: Any = np
    if backend == "cupy":
        import cupy as xp
    biggest = max(sizes)
    src = np.random.default_rng(0).integers(0, 256, biggest, dtype=np.uint8)
    endpoint = loopback_endpoint()
    rows: list[dict[str, Any]] = []
    with run_daemon(["--endpoint", endpoint, "--allow-insecure-tcp", "--backend", backend]), \
            transfer.connect(endpoint, name="gpu-check-remote") as c:
        seg, dev = c.register_remote(src), c.alloc(biggest)
        kind = c.stats()["daemon"]["devices"][dev.device]["kind"]
        c.copy(dev, seg).result()
        assert c.checksum(dev).result() == transfer.checksum64(src), "a remote READ into device memory landed wrong"
        raw = N.NixlEndpoint("gpu-check-raw", progress="none")
        try:
            peer = raw.add_peer(c._remote.ep.metadata)
            dst = xp.ones(biggest, dtype=xp.uint8)
            if backend == "cupy":
                reg = raw.register_address(int(dst.data.ptr), biggest, owner=dst, mem="VRAM", dev_id=int(dst.device.id))
            else:
                reg = raw.register(dst)
            src_addr = int(src.ctypes.data)

            def raw_read(size: int) -> float:
                t0 = time.perf_counter()
                x = raw.read(peer, [(reg.addr, size)], [(src_addr, size)], local_mem=reg.mem_type)
                x.wait(30)
                x.release()
                return time.perf_counter() - t0

            def ours(size: int) -> float:
                t0 = time.perf_counter()
                c.copy(dev, seg, size).result()
                return time.perf_counter() - t0

            raw_read(biggest)
            got = bytes(xp.asnumpy(dst)) if backend == "cupy" else dst.tobytes()
            assert transfer.checksum64(got) == transfer.checksum64(src), "the raw READ into device memory landed wrong"
            for size in sizes:
                t_ours, t_raw = [], []
                for _ in range(reps):  # (alternated: both see the same machine)
                    t_ours.append(ours(size))
                    t_raw.append(raw_read(size))
                a, b = statistics.median(t_ours), statistics.median(t_raw)
                rows.append({"size": size, "transfer_gbps": round(size / a / 1e9, 3), "raw_gbps": round(size / b / 1e9, 3),
                             "vs_raw": round(b / a, 3), "reps": reps})
                print(f"remote READ into {kind} memory, {size >> 10} KiB: transfer {rows[-1]['transfer_gbps']} GB/s, "
                      f"raw NIXL {rows[-1]['raw_gbps']} GB/s ({rows[-1]['vs_raw']}x)", flush=True)
        finally:
            raw.close()
        c.free(dev)
        c.free(seg)
    doc["remote"] = {"backend": backend, "device_kind": kind, "checksummed": True, "rows": rows,
                     "command": f"python bench/gpu_check.py remote --backend {backend} --sizes {','.join(map(str, sizes))} --reps {reps}"}
    _write(out, doc)


# --- the CPU rehearsal through the fake driver -------------------------------------------------
def _cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of a process's threads: all of them, and the fake driver's engine thread
    (the stand-in for the GPU, not the daemon's work)."""
    out = {"all": 0.0, "engine": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        secs = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        out["all"] += secs
        if name == "fakecuda-engine":
            out["engine"] += secs
    return out


def fake(out: Path, rounds: int, copies: int) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import fakecuda  # the test suite's fake driver, built here

    import numpy as np

    import transfer
    from transfer.testing import run_daemon

    report = Path(tempfile.mkdtemp(prefix="gpu-check-")) / "fakecuda.report"
    os.environ.update({"TRANSFER_CUDA_DRIVER": str(fakecuda.build()), "FAKECUDA_REPORT": str(report)})
    doc: dict[str, Any] = {"command": f"python bench/gpu_check.py fake --rounds {rounds} --copies {copies}", "cpus": os.cpu_count()}
    with run_daemon(["--backend", "streamsim"]) as d:
        doc["data_plane"] = d.ready["data_plane"]
        with transfer.connect(d.endpoint, deferred=False) as c:
            seg, other, dev = c.segment(1 << 20), c.segment(1 << 20), c.alloc(1 << 20)
            seg.buffer[:] = 7

            def round_trips(dst: int) -> dict[str, float]:
                t = []
                for k in range(rounds + rounds // 10):
                    t0 = time.perf_counter()
                    c.copy(dst, seg.va, 64).result()
                    if k >= rounds // 10:
                        t.append(time.perf_counter() - t0)
                t.sort()
                return {"p50_us": round(t[len(t) // 2] * 1e6, 2), "p99_us": round(t[len(t) * 99 // 100] * 1e6, 2)}

            # alternated, so that both see the same machine
            h2d, h2h = [], []
            for _ in range(3):
                h2d.append(round_trips(dev.va))
                h2h.append(round_trips(other.va))
            doc["latency_64B"] = {
                "h2d_fake": {"p50_us": statistics.median(r["p50_us"] for r in h2d), "p99_us": statistics.median(r["p99_us"] for r in h2d), "reps": h2d},
                "h2h": {"p50_us": statistics.median(r["p50_us"] for r in h2h), "p99_us": statistics.median(r["p99_us"] for r in h2h), "reps": h2h},
            }
            print(f"64 B round trip through the fake driver: h2d p50 {doc['latency_64B']['h2d_fake']['p50_us']} us "
                  f"(h2h {doc['latency_64B']['h2h']['p50_us']} us)", flush=True)
            before = c.stats()["daemon"]
            cpu0, t0 = _cpu_seconds(d.pid), time.perf_counter()
            n = 64 << 10
            slots = (1 << 20) // n
            window = []
            for k in range(copies):
                window.append(c.copy(dev.va + (k % slots) * n, seg.va + (k % slots) * n, 64))
                if len(window) >= 256:
                    for p in window:
                        p.result()
                    window.clear()
            for p in window:
                p.result()
            cpu1, wall = _cpu_seconds(d.pid), time.perf_counter() - t0
            cpu = cpu1["all"] - cpu0["all"] - (cpu1["engine"] - cpu0["engine"])
            after = c.stats()["daemon"]
            doc["stream"] = {
                "copies": copies, "in_flight": 256, "seconds": round(wall, 3),
                "device_native_requests": after["device_native_requests"] - before["device_native_requests"],
                "python_device_requests": after["python_device_requests"] - before["python_device_requests"],
                "ring_handovers": after["ring_handovers"] - before["ring_handovers"],
                "daemon_cpu_us_per_copy": round(cpu / copies * 1e6, 3),
                "fake_engine_cpu_us_per_copy": round((cpu1["engine"] - cpu0["engine"]) / copies * 1e6, 3),
            }
            print(f"{copies} device copies: {doc['stream']}", flush=True)
            assert c.checksum(dev.va, 64).result() == transfer.checksum64(np.full(64, 7, np.uint8))
    doc["fake_report"] = fakecuda.report(report)
    _write(out, doc)


# --- the verdict -----------------------------------------------------------------------------------
def _row(rows: list[dict[str, Any]], part: str, method: str, size: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["part"] == part and r["method"] == method and r["size"] == size), None)


def targets(out: Path, graphs: Path | None) -> None:
    doc = _load(out)
    t: dict[str, dict[str, Any]] = {}

    def add(name: str, value: Any, target: str, met: bool | None) -> None:
        t[name] = {"value": value, "target": target, "met": bool(met) if value is not None else False}

    rows = doc.get("gpu_mode", {}).get("rows", [])
    lat = {r["method"]: r for r in rows if r["part"] == "latency"}
    tl = lat.get("transfer")
    add("h2d 64 B p50 us", tl and tl["p50_us"], "<= 15", tl and tl["p50_us"] <= 15)
    add("h2d 64 B p99 us", tl and tl["p99_us"], "<= 40", tl and tl["p99_us"] <= 40)
    for part in ("h2d", "d2h"):
        for size, floor in ((1 << 20, 0.95), (4 << 20, 0.95), (16 << 20, 0.98), (64 << 20, 0.98)):
            r = _row(rows, part, "transfer", size)
            p = _row(rows, part, "cupy-pinned", size)
            if r is None or p is None:
                add(f"{part} {size >> 20} MiB vs pinned", None, f">= {floor}", False)
                continue
            worst = min(a / b for a, b in zip(r["gbps_reps"], p["gbps_reps"]) if b) if p["gbps_reps"] else None
            each = 0.9 if floor == 0.95 else floor
            add(f"{part} {size >> 20} MiB vs pinned", {"median": r["vs_pinned"], "worst_rep": worst and round(worst, 3)},
                f">= {floor} (no rep below {each})", r["vs_pinned"] >= floor and (worst is None or worst >= each))
    for size in (1 << 20, 4 << 20, 16 << 20):
        r = _row(rows, "h2d+normalize", "transfer", size)
        add(f"h2d+normalize 2 producers {size >> 20} MiB vs two processes", r and r["vs_pinned"], ">= 0.9", r and r["vs_pinned"] >= 0.9)
    if graphs is not None and graphs.exists():
        g = json.loads(graphs.read_text())
        for row in g.get("mlp", []):
            if row["batch"] <= 256:
                add(f"MLP batch {row['batch']} vs in-process CuPy", round(row["daemon_vs_in_process"], 3), ">= 1.0", row["daemon_vs_in_process"] >= 1.0)
            if row["batch"] == 1:
                add("MLP batch 1 runs/s", round(row["daemon_per_s"]), ">= 4000", row["daemon_per_s"] >= 4000)
        doc["graphs"] = g
    share = doc.get("share")
    srow = {r["method"].split(" ")[0]: r for r in share["rows"]} if share else {}
    tr = srow.get("transfer")
    add("share mode 4 tenants vs four processes", tr and tr["vs_processes"], ">= 1.2", tr and tr["vs_processes"] >= 1.2)
    add("share mode fairness index", tr and tr["fairness"], ">= 0.95", tr and tr["fairness"] >= 0.95)
    p99 = share and share["latency"]["beside_bulk"]["p99_us"]
    add("latency tenant 64 B p99 us beside 256 MiB copies", p99 and round(p99, 1), "<= 150", p99 and p99 <= 150)
    rem = doc.get("remote") or {}
    for r in rem.get("rows", []) if rem.get("backend") == "cupy" else []:
        add(f"remote READ into GPU memory {r['size'] >> 10} KiB vs raw NIXL", r["vs_raw"], ">= 1.0", r["vs_raw"] >= 1.0)
    doc["targets"] = t
    _write(out, doc)
    met = sum(v["met"] for v in t.values())
    print(f"targets met: {met} of {len(t)}")
    for name, v in t.items():
        print(f"  {'MET ' if v['met'] else 'miss'} {name}: {v['value']} (target {v['target']})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("bench", "share", "remote", "fake", "targets"))
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write (or add to)")
    ap.add_argument("--sizes", default=",".join(str(s) for s in (64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rep-seconds", type=float, default=0.3)
    ap.add_argument("--rounds", type=int, default=5000, help="fake: 64 B round trips per repetition")
    ap.add_argument("--copies", type=int, default=100_000, help="fake: device copies streamed")
    ap.add_argument("--graphs", type=Path, help="targets: bench/graphs.py's JSON (the MLP targets)")
    ap.add_argument("--backend", default="cupy", help="remote: the daemon's backend (cupy on a GPU, streamsim to rehearse on a CPU)")
    args = ap.parse_args(argv)
    if args.part == "bench":
        bench(args.out, [int(s) for s in args.sizes.split(",")], args.reps, args.rep_seconds)
    elif args.part == "share":
        share(args.out, 4, args.reps, max(args.rep_seconds, 1.0))
    elif args.part == "remote":
        remote(args.out, args.backend, [int(s) for s in args.sizes.split(",")], args.reps)
    elif args.part == "fake":
        fake(args.out, args.rounds, args.copies)
    else:
        targets(args.out, args.graphs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
