"""The `share` mode: tenants sharing one device through one daemon, against a process each.

Each tenant is a process running the same pipeline, `DEPTH` batches in flight:

1. **host to device**: a batch of `BATCH` x 256 float32 (64 KiB), stamped fresh, copied from
   the tenant's host memory into device memory;
2. **normalize** on the device: x * (1/σ) - μ/σ into a second device buffer;
3. **an MLP** (256 -> 512 -> 10, linear + relu): device memory in, the tenant's host memory out.

Methods, run one after the other with the same tenants and seconds:

* `transfer`: every tenant is a session of one daemon (CuPy on a GPU, NumPy on a CPU): a
  copy, a compute and a graph run per batch, on the ring;
* `processes`: every tenant does the same math in its own process, as a user would without
  the service: on a GPU, each process owns a CUDA context (time-sliced by the driver); on a
  CPU, NumPy. Where the machine already runs NVIDIA MPS (its pipe directory exists), these
  processes are MPS clients and the row says so; MPS is never started or changed here.

Reported per method: the pipelines per second of all tenants together, each tenant's, and
Jain's fairness index over the tenants, (Σx)² / (n Σx²): 1.0 when every tenant gets the
same share. Then **a latency tenant beside a bulk one**: one 64-byte host-to-device copy at
a time through the daemon (p50, p99), alone, then while another tenant of the same daemon
streams large copies (`BULK_GPU` on a GPU, `BULK_CPU` on a CPU) into its device buffer.

BLAS gets one thread in every process (tenants and daemon alike): the same cores for each
method.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .common import BenchFailure, fmt_size
from .latency import _stats

METHODS = ("transfer", "processes")
BATCH = 64
SIZES = (256, 512, 10)
DEPTH = 4
MEAN, STD = 0.5, 2.0
BULK_GPU = 256 << 20
BULK_CPU = 64 << 20
LATENCY_BYTES = 64
_BLAS_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")
#: Where a running MPS control daemon keeps its pipes (CUDA_MPS_PIPE_DIRECTORY's default).
MPS_PIPES = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))


def jain(rates: list[float]) -> float:
    """Jain's fairness index of the tenants' rates: 1/n (one tenant gets all) to 1 (equal shares)."""
    total, squares = sum(rates), sum(r * r for r in rates)
    return total * total / (len(rates) * squares) if squares else 0.0


def mps_running() -> bool:
    return (MPS_PIPES / "control").exists()


def _weights() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    out = []
    for k in range(len(SIZES) - 1):
        out.append((rng.standard_normal((SIZES[k + 1], SIZES[k])) / np.sqrt(SIZES[k])).astype(np.float32))
        out.append(rng.standard_normal(SIZES[k + 1]).astype(np.float32) * 0.1)
    return out


def _timed(step: Callable[[int], None], drain: Callable[[], None], seconds: float) -> tuple[int, float]:
    i, t0 = 0, time.perf_counter()
    end = t0 + seconds
    while True:
        step(i)
        i += 1
        if i % DEPTH == 0 and time.perf_counter() >= end:
            break
    drain()
    return i, time.perf_counter() - t0


# --- the tenants ---------------------------------------------------------------------------------
def _transfer_tenant(endpoint: str, seconds: float, reps: int, barrier: Any) -> list[float]:
    import transfer

    nin, nout = BATCH * SIZES[0] * 4, BATCH * SIZES[-1] * 4
    with transfer.connect(endpoint) as c:
        ws = _weights()
        total = sum(w.nbytes for w in ws)
        stage, wbuf = c.segment(total), c.alloc(total)
        refs, off = [], 0
        for w in ws:
            stage.ndarray(w.shape, np.float32, offset=off)[...] = w
            refs.append(wbuf.tensor(w.shape, np.float32, offset=off))
            off += w.nbytes
        c.copy(wbuf, stage, total).result()
        g = c.graph()
        g.input("x", (BATCH, SIZES[0]), np.float32)
        g.output("y", (BATCH, SIZES[-1]), np.float32)
        g.tensor("h", (BATCH, SIZES[1]), np.float32)
        g.tensor("a", (BATCH, SIZES[1]), np.float32)
        for k, r in enumerate(refs):
            g.weight(f"w{k}", r)
        g.op("linear", ["x", "w0", "w1"], "h")
        g.op("relu", ["h"], "a")
        g.op("linear", ["a", "w2", "w3"], "y")
        host, out = c.segment(DEPTH * nin), c.segment(DEPTH * nout)
        dev, norm = c.alloc(DEPTH * nin), c.alloc(DEPTH * nin)
        xs = host.ndarray((DEPTH, BATCH, SIZES[0]), np.float32)
        xs[...] = np.random.default_rng(os.getpid()).standard_normal(xs.shape, dtype=np.float32)
        pending: list[Any] = [None] * DEPTH

        def step(i: int) -> None:
            s = i % DEPTH
            if pending[s] is not None:
                pending[s].result()
            xs[s, :, 0] = i  # (fresh contents: a stamp per row)
            c.copy(dev.va + s * nin, host.va + s * nin, nin)
            c.compute("scale_add", [dev.tensor((BATCH, SIZES[0]), np.float32, offset=s * nin)],
                      [norm.tensor((BATCH, SIZES[0]), np.float32, offset=s * nin)], {"a": 1 / STD, "b": -MEAN / STD})
            pending[s] = c.run_graph(g, [norm.va + s * nin], [out.va + s * nout])

        def drain() -> None:
            for s, p in enumerate(pending):
                if p is not None:
                    p.result()
                    pending[s] = None

        _timed(step, drain, min(0.3, seconds))
        barrier.wait(120)
        return [n / dt for n, dt in (_timed(step, drain, seconds) for _ in range(reps))]


def _process_tenant(seconds: float, reps: int, barrier: Any) -> list[float]:
    try:
        import cupy as xp

        xp.cuda.runtime.getDeviceCount()
        pinned = True
    except Exception:  # noqa: BLE001 - no GPU: NumPy, as the daemon's CPU device
        xp, pinned = np, False
    ws = [xp.asarray(w) for w in _weights()]
    shape = (DEPTH, BATCH, SIZES[0])
    if pinned:
        mem = xp.cuda.alloc_pinned_memory(int(np.prod(shape)) * 4)
        xs = np.frombuffer(mem, np.float32, int(np.prod(shape))).reshape(shape)
    else:
        xs = np.empty(shape, np.float32)
    xs[...] = np.random.default_rng(os.getpid()).standard_normal(shape, dtype=np.float32)
    dev = xp.empty(shape, xp.float32)
    ys = np.empty((DEPTH, BATCH, SIZES[-1]), np.float32)

    def step(i: int) -> None:
        s = i % DEPTH
        xs[s, :, 0] = i
        dev[s].set(xs[s]) if pinned else np.copyto(dev[s], xs[s])
        h = dev[s] * (1 / STD) + (-MEAN / STD)
        h = xp.maximum(h @ ws[0].T + ws[1], 0)
        y = h @ ws[2].T + ws[3]
        if pinned:
            y.get(out=ys[s])
        else:
            ys[s] = y

    def drain() -> None:
        if pinned:
            xp.cuda.get_current_stream().synchronize()

    _timed(step, drain, min(0.3, seconds))
    barrier.wait(120)
    return [n / dt for n, dt in (_timed(step, drain, seconds) for _ in range(reps))]


def _latency_tenant(endpoint: str, seconds: float, barrier: Any) -> list[float]:
    import transfer

    with transfer.connect(endpoint) as c:
        seg, buf = c.segment(4096), c.alloc(4096)
        for _ in range(200):
            c.copy(buf, seg, LATENCY_BYTES).result()
        barrier.wait(120)
        times: list[float] = []
        end = time.perf_counter() + seconds
        clock = time.perf_counter
        while (t := clock()) < end:
            c.copy(buf, seg, LATENCY_BYTES).result()
            times.append(clock() - t)
        return times


def _bulk_tenant(endpoint: str, nbytes: int, seconds: float, barrier: Any) -> list[float]:
    import transfer

    with transfer.connect(endpoint) as c:
        seg, buf = c.segment(2 * nbytes), c.alloc(2 * nbytes)
        seg.ndarray((2 * nbytes,), np.uint8)[::4096] = 1
        barrier.wait(120)
        pending: list[Any] = [None, None]
        moved, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds + 0.5:  # (outlasts the latency tenant's run)
            for s in range(2):
                if pending[s] is not None:
                    pending[s].result()
                pending[s] = c.copy(buf.va + s * nbytes, seg.va + s * nbytes, nbytes)
                moved += nbytes
        for p in pending:
            p.result()
        return [moved / (time.perf_counter() - t0) / 1e9]


def _child(kind: str, args: tuple[Any, ...], barrier: Any, conn: Any) -> None:
    try:
        fns: dict[str, Callable[..., list[float]]] = {
            "transfer": _transfer_tenant, "processes": _process_tenant, "latency": _latency_tenant, "bulk": _bulk_tenant}
        fn = fns[kind]
        conn.send(("ok", fn(*args, barrier)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        barrier.abort()
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _spawn(jobs: list[tuple[str, tuple[Any, ...]]], timeout: float) -> list[Any]:
    """Processes at once (spawned: CUDA does not survive fork), started together; their results."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(jobs))
    pipes, procs = [], []
    for kind, args in jobs:
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(kind, args, barrier, send), daemon=True)
        p.start()
        pipes.append(recv)
        procs.append(p)
    try:
        out = []
        for (kind, _), recv in zip(jobs, pipes):
            if not recv.poll(timeout):
                raise BenchFailure(f"share: a {kind} tenant did not report within {timeout:.0f} s")
            status, value = recv.recv()
            if status != "ok":
                raise BenchFailure(f"share: a {kind} tenant failed: {value}")
            out.append(value)
        return out
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


# --- the mode -----------------------------------------------------------------------------------
def run(tenants: int = 4, *, reps: int = 3, rep_s: float = 1.0, gpu: bool | None = None,
        line: Callable[[str], None] = print, daemon_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """Both methods with `tenants` tenants, then the latency tenant alone and beside a bulk one."""
    from ..testing import run_daemon

    if gpu is None:
        from .gpu import available

        gpu = available()[0]
    saved = {v: os.environ.get(v) for v in _BLAS_VARS}
    os.environ.update(dict.fromkeys(_BLAS_VARS, "1"))
    timeout = 120 + reps * rep_s * 4
    try:
        with tempfile.TemporaryDirectory(prefix="transfer-bench-share-") as logs, \
                run_daemon(["--backend", "cupy" if gpu else "numpy"], log=Path(logs) / "transferd.log", **(daemon_args or {})) as d:
            per: dict[str, list[list[float]]] = {}
            for method in METHODS:
                job = (d.endpoint, rep_s, reps) if method == "transfer" else (rep_s, reps)
                per[method] = _spawn([(method, job)] * tenants, timeout)
            rows = []
            base = statistics.median(sum(t[r] for t in per["processes"]) for r in range(reps))
            for method, tenant_rates in per.items():
                totals = [sum(t[r] for t in tenant_rates) for r in range(reps)]
                each = [statistics.median(t) for t in tenant_rates]
                rows.append({"method": method + (" (MPS)" if method == "processes" and gpu and mps_running() else ""),
                             "tenants": tenants, "pipelines_per_s": round(statistics.median(totals), 1),
                             "pipelines_per_s_reps": [round(x, 1) for x in totals],
                             "tenant_per_s": [round(x, 1) for x in each], "fairness": round(jain(each), 4),
                             "vs_processes": round(statistics.median(totals) / base, 3) if base else None})
                line(f"share {method}, {tenants} tenants: {rows[-1]['pipelines_per_s']:,.0f} pipelines/s "
                     f"(fairness {rows[-1]['fairness']:.3f}, {rows[-1]['vs_processes']:.2f}x processes)")
            bulk = BULK_GPU if gpu else BULK_CPU
            alone = _stats(_spawn([("latency", (d.endpoint, rep_s))], timeout)[0])
            beside_t, bulk_rate = _spawn([("latency", (d.endpoint, rep_s)), ("bulk", (d.endpoint, bulk, rep_s))], timeout)
            beside = _stats(beside_t)
            latency = {"bytes": LATENCY_BYTES, "alone": alone, "beside_bulk": beside, "bulk_bytes": bulk,
                       "bulk_gbps": round(bulk_rate[0], 3)}
            line(f"share latency, {LATENCY_BYTES} B: alone p50 {alone['p50_us']:.1f} us p99 {alone['p99_us']:.1f}; beside "
                 f"{fmt_size(bulk)} copies ({bulk_rate[0]:.2f} GB/s) p50 {beside['p50_us']:.1f} us p99 {beside['p99_us']:.1f}")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    config = {"tenants": tenants, "reps": reps, "rep_seconds": rep_s, "batch": BATCH, "mlp": list(SIZES), "depth": DEPTH,
              "device": "gpu" if gpu else "cpu", "mps": bool(gpu and mps_running())}
    return {"rows": rows, "latency": latency, "config": config}


def render(result: dict[str, Any]) -> Any:
    from rich.table import Table

    cfg = result["config"]
    t = Table(title=f"share mode: {cfg['tenants']} tenants on one {cfg['device'].upper()}, each copying {BATCH}x{SIZES[0]} "
                    f"float32 to the device, normalizing, running an MLP {'->'.join(map(str, SIZES))}")
    for col in ("method", "pipelines/s", "vs processes", "fairness", "per tenant"):
        t.add_column(col, justify="left" if col in ("method", "per tenant") else "right")
    for r in result["rows"]:
        t.add_row(r["method"], f"{r['pipelines_per_s']:,.0f}", f"{r['vs_processes']:.2f}x", f"{r['fairness']:.3f}",
                  ", ".join(f"{x:,.0f}" for x in r["tenant_per_s"]))
    lat = result["latency"]
    t.caption = (f"{lat['bytes']} B copy, one at a time: alone p50 {lat['alone']['p50_us']:.1f} µs, p99 {lat['alone']['p99_us']:.1f} µs; "
                 f"beside {fmt_size(lat['bulk_bytes'])} copies: p50 {lat['beside_bulk']['p50_us']:.1f} µs, "
                 f"p99 {lat['beside_bulk']['p99_us']:.1f} µs")
    return t
