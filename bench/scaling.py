"""Remote producers against one daemon: calibrate a cost model on one, predict many, measure.

usage: .venv/bin/python bench/scaling.py [--producers 1,2,4] [--seconds 3] [--reps 2]
                                         [--out bench/results/scaling.json]

The deployment of docs/scaling.md on one host: `transferd` (tcp control on
127.0.0.1, --allow-insecure-tcp, numpy backend) and N producer processes, each
a *remote* producer as on another host: its batch buffer is registered with
its own NIXL agent (`register_remote`), its session is a tcp one (no ring, no
shared memory), and the daemon pulls every copy with a NIXL READ (UCX over
loopback: `cma`, a process_vm_readv by the daemon, where a real NIC would DMA).

Each producer sends groups of k copies of s bytes (one frame per group,
`batch()`), keeps `--depth` groups in flight, and runs for `--seconds`. Per
workload (s, k) the run records groups/s, bytes/s, and the CPU seconds the
daemon and the producers spent per group.

1. **Calibrate** (N = 1): fit per-request, per-frame and per-byte CPU costs,
   daemon and producer apart, by least squares over the workloads:
   cpu/group = a * k + f + b * k * s.
2. **Predict** N producers: groups/s = min(N x the one-producer rate (each
   producer's own pipeline), daemon loop 1 / its CPU per group (one trio
   thread: the control plane), host cores / total CPU per group (here
   every process shares this host's cores), line rate / bytes per group).
3. **Measure** N = 2, 4 and report the error of the prediction.

With `--channel`, each group's copies are between two of the daemon's buffers instead
(what a producer asks once its batch has landed): the session's data channel carries them
and its ring worker serves them, off the event loop (docs/ring.md, "Remote rings").

Writes JSON (the model's coefficients, each run, each prediction and its
error) and prints a table. docs/scaling.md reads it.

    .venv/bin/python bench/scaling.py --project bench/results/scaling.json --nic-gbits 200

projects the fitted daemon costs to a GPU host on a fabric (no measuring):
where one daemon saturates for a range of request sizes, by the same
formulas with a NIC's line rate and the copy engines' rate in place of this
host's cores (docs/scaling.md, "A cluster").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: (name, bytes per copy, copies per frame): control-plane bound to byte bound.
WORKLOADS: list[tuple[str, int, int]] = [
    ("req-4K", 4 << 10, 1),
    ("frame-4Kx32", 4 << 10, 32),
    ("mid-256Kx4", 256 << 10, 4),
    ("bulk-8M", 8 << 20, 1),
]
BUF = 16 << 20  # each producer's registered buffer (and its device buffer in the daemon)
TICKS = os.sysconf("SC_CLK_TCK")


def host_cpu() -> tuple[float, float]:
    """(busy, idle) CPU seconds of the whole host so far (from /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return (sum(v[:8]) - idle) / TICKS, idle / TICKS


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def producer(endpoint: str, rank: int, size: int, k: int, depth: int, seconds: float, ready: Any, go: Any, out: Any,
             channel: bool = False) -> None:
    import transfer

    src = np.random.default_rng(rank).integers(0, 256, BUF, dtype=np.uint8)
    with transfer.connect(endpoint, name=f"remote-{rank}") as c:
        seg = c.register_remote(src)
        dev = c.alloc(BUF)
        c.copy(dev, seg, 1 << 20).result()  # wire-up: the daemon's NIXL peer, the first READ
        if channel:  # copies between daemon buffers: the data channel carries them, the worker serves them
            assert c._ring is not None and c._ring.channel is not None, "no data channel"
            c.copy(dev, seg).result()
            seg, dev = dev, c.alloc(BUF)
        span = size * k
        slots = max(1, BUF // span)
        ready.put(rank)
        go.wait()
        inflight: deque[Any] = deque()
        groups = 0
        cpu0, t0 = time.process_time(), time.perf_counter()
        end = t0 + seconds
        while time.perf_counter() < end:
            base = (groups % slots) * span
            with c.batch():
                for i in range(k):
                    last = c.copy(dev.at(base + i * size), seg.at(base + i * size), size)
            inflight.append(last)
            if len(inflight) >= depth:
                inflight.popleft().result()
            groups += 1
        c.fence()
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        n = min(groups, slots) * span  # verify what the groups wrote, once (untimed)
        ok = c.checksum(dev, n).result() == transfer.checksum64(src[:n])
    out.put({"rank": rank, "groups": groups, "elapsed_s": elapsed, "cpu_s": cpu, "verified": bool(ok)})


def run(endpoint: str, daemon_pid: int, n: int, size: int, k: int, depth: int, seconds: float, channel: bool = False) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=producer, args=(endpoint, r, size, k, depth, seconds, ready, go, out, channel)) for r in range(n)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=60)
    d0, h0, t0 = cpu_seconds(daemon_pid), host_cpu(), time.perf_counter()
    go.set()
    res = [out.get(timeout=seconds + 60) for _ in procs]
    d1, h1, wall = cpu_seconds(daemon_pid), host_cpu(), time.perf_counter() - t0
    for p in procs:
        p.join(30)
    groups = sum(r["groups"] for r in res)
    span = max(r["elapsed_s"] for r in res)
    return {
        "producers": n, "size": size, "k": k, "depth": depth,
        "groups": groups,
        "groups_per_s": groups / span,
        "requests_per_s": groups * k / span,
        "gbytes_per_s": groups * k * size / span / 1e9,
        "daemon_cpu_per_group_us": (d1 - d0) / groups * 1e6,
        "producer_cpu_per_group_us": sum(r["cpu_s"] for r in res) / groups * 1e6,
        "daemon_cpu_share": (d1 - d0) / wall,
        # What else ran on this host meanwhile: busy cores not charged to the daemon or the
        # producers (others' jobs, and the interrupt time of our own loopback traffic).
        "other_cores": max(0.0, ((h1[0] - h0[0]) - (d1 - d0) - sum(r["cpu_s"] for r in res)) / wall),
        "idle_cores": (h1[1] - h0[1]) / wall,
        "verified": all(r["verified"] for r in res),
    }


def fit(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    """cpu per group = per_request * k + per_frame + per_byte * k * s (least squares, >= 0)."""
    a = np.array([[r["k"], 1.0, r["k"] * r["size"]] for r in rows])
    y = np.array([r[key] * 1e-6 for r in rows])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    coef = np.maximum(coef, 0.0)
    return {"per_request_us": coef[0] * 1e6, "per_frame_us": coef[1] * 1e6, "per_byte_ns": coef[2] * 1e9}


def per_group(c: dict[str, float], size: int, k: int) -> float:
    """Seconds of CPU per group under coefficients `c`."""
    return (c["per_request_us"] * k + c["per_frame_us"]) * 1e-6 + c["per_byte_ns"] * 1e-9 * k * size


#: A group's NIXL post runs on the event loop up to this many bytes, else on a worker thread
#: (max(4 x --inline-bytes, 1 MiB): docs/rdma.md, "Not blocking the loop").
INLINE_POST = 1 << 20


def predict(model: dict[str, Any], one: dict[str, Any], n: int, cores: float) -> dict[str, Any]:
    """Groups/s for `n` producers of `one`'s workload: the least of the limits."""
    size, k = one["size"], one["k"]
    c = model["daemon"]
    d = per_group(c, size, k)
    p = per_group(model["producer"], size, k)
    copy = c["per_byte_ns"] * 1e-9 * k * size
    loop = d if k * size <= INLINE_POST else d - copy
    limits = {
        "producers": n * one["groups_per_s"],  # each producer's own pipeline, as measured alone
        "daemon_loop": 1.0 / loop,  # one trio thread: the control plane (and posts up to 1 MiB)
        "host_cores": cores / (d + p),  # every process here shares this host's cores
    }
    if k * size > INLINE_POST and copy > 0:
        limits["daemon_workers"] = model["threads"] / copy  # larger posts: --threads worker threads
    if model.get("line_gbytes_per_s"):
        limits["line_rate"] = model["line_gbytes_per_s"] * 1e9 / (size * k)
    bound = min(limits, key=lambda x: limits[x])
    return {"groups_per_s": limits[bound], "gbytes_per_s": limits[bound] * size * k / 1e9, "bound": bound, "limits": limits}


#: (bytes per request, requests per frame) for the projection.
PROJECT: list[tuple[int, int]] = [(64 << 10, 1), (64 << 10, 64), (1 << 20, 1), (1 << 20, 16), (8 << 20, 1), (8 << 20, 4), (64 << 20, 1)]


def project(model: dict[str, Any], nic_gbits: float, engine_gbytes: float, producers: int, to_gpu: bool = False) -> list[dict[str, Any]]:
    """One daemon on a GPU host fed over a fabric: GB/s per limit, and which binds.

    With RDMA the NIC moves the bytes, so the daemon's CPU per byte is left out (it was
    UCX cma's copy on loopback); its per-request and per-frame costs stay. A session's
    passes run one after another, so one producer moves s*k bytes per (its frame's CPU
    plus the transfer at line rate). `to_gpu`: the batches land in GPU memory, still one
    READ each (the daemon registers its GPU memory with NIXL as VRAM), their bytes through
    the GPU's PCIe link (GPUDirect RDMA where the NIC allows it), for which
    `engine_gbytes`, the host-to-device rate measured, stands."""
    c = model["daemon"]
    line = nic_gbits / 8 * 1e9
    rows = []
    for size, k in PROJECT:
        cpu = (c["per_request_us"] * k + c["per_frame_us"]) * 1e-6
        nbytes = size * k
        limits = {
            "control_plane": nbytes / cpu / 1e9,
            "nic": line / 1e9,
            "gpu_link": engine_gbytes if to_gpu else float("inf"),
            f"{producers}_producers": producers * nbytes / (cpu + nbytes / line) / 1e9,
        }
        bound = min(limits, key=lambda x: limits[x])
        rows.append({"size": size, "k": k, "requests_per_s": limits[bound] * 1e9 / size, "limits_gbytes_per_s": limits, "bound": bound,
                     "crossover_bytes": line * (c["per_request_us"] + c["per_frame_us"] / k) * 1e-6})
    return rows


def print_projection(rows: list[dict[str, Any]], nic_gbits: float, engine_gbytes: float, producers: int, to_gpu: bool = False) -> None:
    where = f"into GPU memory (its PCIe link {engine_gbytes:g} GB/s)" if to_gpu else "into host memory"
    print(f"one daemon, NIC {nic_gbits:g} Gb/s, {producers} remote producers, {where} (GB/s per limit)")
    print(f"{'request':>8} {'k':>3} {'control plane':>13} {'NIC':>6} {'GPU link':>8} {'producers':>9} {'bound':>14} {'copies/s':>8} {'NIC-bound from':>14}")
    for r in rows:
        lim = r["limits_gbytes_per_s"]
        print(f"{_size(r['size']):>8} {r['k']:3d} {lim['control_plane']:13.2f} {lim['nic']:6.1f} {lim['gpu_link']:8.1f} "
              f"{lim[f'{producers}_producers']:9.2f} {r['bound']:>14} {r['requests_per_s']:8.0f} {_size(int(r['crossover_bytes'])):>14}")


def markdown(doc: dict[str, Any]) -> str:
    """docs/benchmarks.md's and docs/scaling.md's tables, from a result file."""
    names = {name: f"{_size(size)} x {k}" for name, size, k in WORKLOADS}
    out = ["| workload | N | frames/s | requests/s | GB/s | daemon CPU per frame | producers' CPU per frame | daemon cores |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in doc["runs"]:
        out.append(f"| {names.get(r['workload'], r['workload'])} | {r['producers']} | {r['groups_per_s']:,.0f} | {r['requests_per_s']:,.0f} | "
                   f"{r['gbytes_per_s']:.2f} | {r['daemon_cpu_per_group_us']:,.0f} µs | {r['producer_cpu_per_group_us']:,.0f} µs | {r['daemon_cpu_share']:.2f} |")
    out += ["", "| workload | N | predicted, idle host | bound | free cores | predicted, free cores | bound | measured | error, idle | error, free cores |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in doc["checks"]:
        p, q = c["predicted"], c["predicted_free_cores"]
        out.append(f"| {c['workload']} | {c['producers']} | {p['groups_per_s']:,.0f} | {p['bound'].replace('_', ' ')} | {c['free_cores']:.2f} | "
                   f"{q['groups_per_s']:,.0f} | {q['bound'].replace('_', ' ')} | {c['measured_groups_per_s']:,.0f} | {_pct(c['error'])} | {_pct(c['error_free_cores'])} |")
    m = doc["model"]
    out += ["", f"daemon: {fmt(m['daemon'])}; producer: {fmt(m['producer'])}"]
    return "\n".join(out)


def _pct(x: float) -> str:
    return f"{x:+.0%}".replace("-", "\u2212")


def _size(n: int) -> str:
    return f"{n / (1 << 20):.3g} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", type=Path, help="print the cluster projection from this result file, and exit")
    ap.add_argument("--nic-gbits", type=float, default=200.0, help="--project: the NIC's line rate")
    ap.add_argument("--engine-gbytes", type=float, default=54.7, help="--project: the GPU's PCIe link, as the host-to-device rate measured (H100, docs/benchmarks.md)")
    ap.add_argument("--project-producers", type=int, default=8, help="--project: remote producers feeding the daemon")
    ap.add_argument("--to-gpu", action="store_true", help="--project: the batches land in GPU memory")
    ap.add_argument("--markdown", type=Path, help="print the docs' tables from this result file, and exit")
    ap.add_argument("--producers", default="1,2,4", help="producer counts; the first calibrates")
    ap.add_argument("--seconds", type=float, default=3.0, help="per run")
    ap.add_argument("--reps", type=int, default=2, help="runs per cell (the median is kept)")
    ap.add_argument("--depth", type=int, default=2, help="groups in flight per producer")
    ap.add_argument("--channel", action="store_true",
                    help="copies between the daemon's own buffers (each producer's batch already landed): its data "
                         "channel carries them and its ring worker serves them, instead of NIXL READs through the event loop")
    ap.add_argument("--daemon-args", default="", help="more transferd arguments, e.g. \"--worker-spin 0 --worker-spin-spare 0\"")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scaling.json")
    args = ap.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return
    if args.project:
        model = json.loads(args.project.read_text())["model"]
        rows = project(model, args.nic_gbits, args.engine_gbytes, args.project_producers, args.to_gpu)
        print_projection(rows, args.nic_gbits, args.engine_gbytes, args.project_producers, args.to_gpu)
        return
    counts = [int(x) for x in args.producers.split(",")]

    from transfer.testing import loopback_endpoint, run_daemon

    endpoint = loopback_endpoint()
    runs: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    with run_daemon(["--endpoint", endpoint, "--allow-insecure-tcp", "--backend", "numpy", "--session-timeout", "30",
                     *args.daemon_args.split()]) as d:
        for n in counts:
            for name, size, k in WORKLOADS:
                reps = [run(endpoint, d.pid, n, size, k, args.depth, args.seconds, args.channel) for _ in range(args.reps)]
                med = sorted(reps, key=lambda r: r["groups_per_s"])[len(reps) // 2]
                med = {**med, "workload": name, "reps_groups_per_s": [round(r["groups_per_s"], 1) for r in reps]}
                med["verified"] = all(r["verified"] for r in reps)
                runs.append(med)
                print(f"N={n} {name:12s} {med['groups_per_s']:9.1f} groups/s {med['requests_per_s']:9.0f} req/s "
                      f"{med['gbytes_per_s']:6.2f} GB/s  daemon {med['daemon_cpu_per_group_us']:8.1f} us/group "
                      f"({med['daemon_cpu_share']:.2f} cores)  producers {med['producer_cpu_per_group_us']:8.1f} us/group  "
                      f"others {med['other_cores']:.2f} cores  verified={med['verified']}", flush=True)
    calib = [r for r in runs if r["producers"] == counts[0]]
    cores = os.cpu_count() or 1
    model = {"cores": cores, "threads": 2, "daemon": fit(calib, "daemon_cpu_per_group_us"), "producer": fit(calib, "producer_cpu_per_group_us")}
    print(f"model (from N={counts[0]}): daemon {fmt(model['daemon'])}; producer {fmt(model['producer'])}; cores {cores}")
    checks = []
    print("groups/s predicted for an idle host, then for the cores others' jobs left free (measured during each run); measured; errors")
    print(f"{'workload':12s} {'N':>2} {'idle host':>10} {'bound':>12} {'free cores':>10} {'predicted':>10} {'bound':>12} {'measured':>10} {'error':>7} {'error':>7}")
    for r in runs:
        if r["producers"] == counts[0]:
            continue
        one = next(c for c in calib if c["workload"] == r["workload"])
        idle = predict(model, one, r["producers"], cores)  # an otherwise idle host
        free = max(0.1, cores - r["other_cores"])
        busy = predict(model, one, r["producers"], free)  # what others' jobs left us in that run
        err = (idle["groups_per_s"] - r["groups_per_s"]) / r["groups_per_s"]
        err_busy = (busy["groups_per_s"] - r["groups_per_s"]) / r["groups_per_s"]
        checks.append({"workload": r["workload"], "producers": r["producers"], "predicted": idle, "error": err,
                       "free_cores": free, "predicted_free_cores": busy, "error_free_cores": err_busy,
                       "measured_groups_per_s": r["groups_per_s"], "measured_gbytes_per_s": r["gbytes_per_s"]})
        print(f"{r['workload']:12s} {r['producers']:2d} {idle['groups_per_s']:10.1f} {idle['bound']:>12} {free:10.2f} {busy['groups_per_s']:10.1f} "
              f"{busy['bound']:>12} {r['groups_per_s']:10.1f} {err:+7.0%} {err_busy:+7.0%}")
    for key in ("error", "error_free_cores"):
        errs = [abs(c[key]) for c in checks]
        if errs:
            print(f"|{key}|: median {statistics.median(errs):.0%}, max {max(errs):.0%}")
    projection = project(model, 200.0, 54.7, 8)
    print_projection(projection, 200.0, 54.7, 8)
    projection_gpu = project(model, 200.0, 54.7, 8, to_gpu=True)
    print_projection(projection_gpu, 200.0, 54.7, 8, to_gpu=True)
    doc = {
        "bench": "scaling",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_at_end": os.getloadavg()},
        "ucx_tls": os.environ.get("UCX_TLS"),
        "command": "python bench/scaling.py " + " ".join(sys.argv[1:]),
        "wall_s": round(time.perf_counter() - t_start, 1),
        "seconds": args.seconds, "reps": args.reps, "depth": args.depth, "channel": args.channel,
        "model": model, "runs": runs, "checks": checks,
        "projection_200gbit_8_producers": projection,
        "projection_200gbit_8_producers_to_h100": projection_gpu,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    if not all(r["verified"] for r in runs):
        sys.exit(1)


def fmt(c: dict[str, float]) -> str:
    return f"{c['per_request_us']:.1f} us/request + {c['per_frame_us']:.1f} us/frame + {c['per_byte_ns']:.3f} ns/byte"


if __name__ == "__main__":
    main()
