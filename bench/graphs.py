"""Graphs through the daemon against the same math in-process.

Same run, same machine, same data, same dtype (float32), so the ratios hold on a
noisy machine:

* **MLP** (the 3-layer MLP of examples/mlp_forward.py: 256 -> 512 -> 512 -> 10,
  linear + relu): a producer writes each batch into a slot of a registered
  shared-memory segment and sends one `run_graph` naming the slot's VA and an
  output VA (weights in a device buffer, intermediates in the daemon), keeping
  `--slots` runs in flight; against the same MLP computed in this process with
  NumPy (CuPy on a GPU: the batch copied up and the result copied back, as the
  daemon does), at batch 1 to 1024. A third column, "kernels", runs the
  daemon's own kernels (`transfer.kernels`) on the same data in this process,
  one after another: the service's overhead is `daemon` next to `kernels`.
* **Image preprocessing** (examples/image_preprocess.py's graph: uint8 NHWC ->
  horizontal flip -> normalize to float32 NCHW), in images/s, against NumPy
  in-process as a user would write it, and against the graph's kernels run here.
* `--latency N`: one request at a time, a 64-float compute and a 64 B copy, p50 and p99
  (with `--baseline`, on both daemons in turn).
* `--baseline DIR`: the MLP also through a transferd imported from DIR (a
  checkout of another commit, its native extension built), in the same run:
  before and after a change, under the same load.

Each point gives each side `--seconds`, in half-second slices taken in turn, `--reps`
times; the tables show medians and the median of the per-rep ratios. Outputs are
checked (max abs error against the in-process result) before timing, untimed.
BLAS threads are set for this process and the daemon alike (`--blas-threads`,
before NumPy loads; the daemon inherits it).

    python bench/graphs.py [--backend auto|numpy|cupy] [--batches 1,4,16,64,256,1024]
                           [--seconds 2] [--reps 3] [--blas-threads 1] [--baseline DIR]
                           [--json bench/results/graphs.json]
"""

from __future__ import annotations

import os
import sys

_BLAS_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")


def _set_blas_threads(argv: list[str]) -> str:
    """BLAS reads its thread count once, when NumPy loads it: set it (here and, by
    inheritance, in the daemon) before anything imports NumPy."""
    n = "1"
    for i, a in enumerate(argv):
        if a == "--blas-threads" and i + 1 < len(argv):
            n = argv[i + 1]
        elif a.startswith("--blas-threads="):
            n = a.split("=", 1)[1]
    if n != "default":
        for v in _BLAS_VARS:
            os.environ[v] = n
    return n


if __name__ == "__main__":
    _set_blas_threads(sys.argv[1:])

import argparse
import contextlib
import importlib
import json
import platform
import shlex
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

import transfer
from transfer._bench import latency as latency_bench
from transfer.kernels import REGISTRY, fuse_steps, run_steps
from transfer.testing import run_daemon

from _examples import load as load_example  # (bench/ is the script's directory: on sys.path)
from _proc import started_from

_MLP, _IMAGES = load_example("mlp_forward"), load_example("image_preprocess")
SIZES, make_weights, mlp, mlp_graph, upload_weights = _MLP.SIZES, _MLP.make_weights, _MLP.reference, _MLP.build, _MLP.upload_weights
MEAN, STD = _IMAGES.MEAN, _IMAGES.STD
#: Distinct input batches cycled through (so no run reads the same cache-hot batch twice in a row).
DISTINCT = 4
#: One side of a comparison: step(i) runs item i, finish() waits for what is in flight.
Step = Callable[[int], None]
Side = tuple[Step, Callable[[], None]]


def _nothing() -> None:
    return None


def _each(fn: Callable[[np.ndarray], None], xs: Sequence[np.ndarray]) -> Step:
    """A step that calls fn(xs[i % len(xs)])."""
    def step(i: int) -> None:
        fn(xs[i % len(xs)])
    return step


# --- the math, in-process ---------------------------------------------------------------------
def preprocess(x: Any, xp: Any) -> Any:
    """The image graph's math as a user writes it: flip W, to float, normalize, NHWC -> NCHW."""
    y = x[:, :, ::-1, :].astype(xp.float32)
    y = (y - xp.asarray(MEAN, dtype=xp.float32)) / xp.asarray(STD, dtype=xp.float32)
    return xp.ascontiguousarray(y.transpose(0, 3, 1, 2))


class InProcess:
    """The in-process side: NumPy, or CuPy with the input copied up and the output copied
    back per batch (what the daemon does with host input and output)."""

    def __init__(self, backend: str) -> None:
        self.gpu = backend == "cupy"
        if self.gpu:
            self.xp: Any = importlib.import_module("cupy")  # only where the daemon runs on a GPU
        else:
            self.xp = np

    def device_name(self) -> str | None:
        if not self.gpu:
            return None
        name = self.xp.cuda.runtime.getDeviceProperties(self.xp.cuda.Device().id)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)

    def put(self, a: np.ndarray) -> Any:
        return self.xp.asarray(a) if self.gpu else a

    def get(self, a: Any, out: np.ndarray) -> None:
        if self.gpu:
            a.get(out=out)  # synchronizes: the result is on the host, as the daemon's is
        else:
            out[...] = a

    def step(self, fn: Callable[[Any], Any], xs: Sequence[np.ndarray], out: np.ndarray) -> Step:
        """The timed loop's step: out = fn(batch i), batch i being xs[i % len(xs)]."""
        def step(i: int) -> None:
            self.get(fn(self.put(xs[i % len(xs)])), out)
        return step


# --- measuring --------------------------------------------------------------------------------
def throughput(step: Step, finish: Callable[[], None], seconds: float) -> tuple[int, float]:
    """(items, seconds) of running `step(i)` for about `seconds`, `finish()` included."""
    i = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while True:
        step(i)
        i += 1
        if i % 4 == 0 and time.perf_counter() >= end:
            break
    finish()
    return i, time.perf_counter() - t0


def compare(sides: dict[str, Side], seconds: float, reps: int,
            slice_s: float = 0.5) -> dict[str, list[float]]:
    """Items per second of each side, `reps` times: each rep gives each side `seconds`, in
    slices of about `slice_s` taken in turn, so load that comes and goes on a shared machine
    falls on all sides alike (after one short warm-up each)."""
    for step, finish in sides.values():
        throughput(step, finish, min(0.2, seconds))
    slices = max(1, round(seconds / slice_s))
    rates: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(reps):
        items = dict.fromkeys(sides, 0)
        spent = dict.fromkeys(sides, 0.0)
        for _ in range(slices):
            for name, (step, finish) in sides.items():
                n, dt = throughput(step, finish, seconds / slices)
                items[name] += n
                spent[name] += dt
        for name in sides:
            rates[name].append(items[name] / spent[name])
    return rates


class Producer:
    """Slots of one host segment and one output segment; `run(i, x)` writes x into slot i % n
    and runs the graph on it, keeping at most n runs in flight."""

    def __init__(self, c: transfer.Client, g: transfer.Graph, nin: int, nout: int, slots: int) -> None:
        self.c, self.g, self.nin, self.nout, self.slots = c, g, nin, nout, slots
        self.seg, self.out = c.segment(slots * nin), c.segment(slots * nout)
        self.pending: list[Any] = [None] * slots
        #: The index of the batch each slot's output holds (-1: none yet).
        self.last = [-1] * slots

    def slot(self, s: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return self.seg.ndarray(shape, dtype, offset=s * self.nin)

    def output(self, s: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return self.out.ndarray(shape, dtype, offset=s * self.nout)

    def run(self, i: int, x: np.ndarray) -> int:
        s = i % self.slots
        if self.pending[s] is not None:
            self.pending[s].result()  # the slot (and its output) is free again
        self.slot(s, x.shape, x.dtype)[...] = x
        self.pending[s] = self.c.run_graph(self.g, [self.seg.at(s * self.nin)], [self.out.at(s * self.nout)])
        self.last[s] = i
        return s

    def step(self, xs: Sequence[np.ndarray]) -> Step:
        """The timed loop's step: batch i is xs[i % len(xs)]."""
        def step(i: int) -> None:
            self.run(i, xs[i % len(xs)])
        return step

    def error(self, want: Sequence[np.ndarray], shape: tuple[int, ...]) -> float:
        """Max abs error of what the slots hold now against `want[i % len(want)]` (after finish)."""
        err = 0.0
        for s, i in enumerate(self.last):
            if i >= 0:
                err = max(err, float(np.abs(self.output(s, shape, np.float32) - want[i % len(want)]).max()))
        return err

    def finish(self) -> None:
        for s, p in enumerate(self.pending):
            if p is not None:
                p.result()
                self.pending[s] = None

    def close(self) -> None:
        self.finish()
        self.c.free(self.seg)
        self.c.free(self.out)


def summarize(rates: dict[str, list[float]], base: str, per: float = 1.0) -> dict[str, Any]:
    """Medians per side (times `per`: images per batch), and each side's median per-rep ratio to `base`."""
    row: dict[str, Any] = {}
    for name, rs in rates.items():
        row[f"{name}_per_s"] = statistics.median(rs) * per
        row[f"{name}_reps"] = [r * per for r in rs]
        if name != base:
            row[f"{name}_vs_{base}"] = statistics.median(a / b for a, b in zip(rs, rates[base]))
    return row


# --- the MLP ----------------------------------------------------------------------------------
def kernels_mlp(batch: int, ws: list[np.ndarray]) -> Callable[[np.ndarray, np.ndarray], None]:
    """The daemon's own kernels (chosen by dtype as the daemon chooses them), run here on
    NumPy arrays as the daemon's ring worker runs a kept run: intermediates laid out as the
    daemon lays them out (a linear and its relu share one block: `parse_graph`), the steps
    fused as it fuses them (`fuse_steps`), run by the same loop (`run_steps`). The graph's
    work without the service. Returns run(x, y): y = the MLP of x."""
    f = "float32"
    lin = REGISTRY.lookup("linear", (f, f, f, f), "cpu")
    relu = REGISTRY.lookup("relu", (f, f), "cpu")
    acts = [np.empty((batch, w.shape[0]), np.float32) for w in ws[0:-2:2]]
    bound: dict[tuple[int, int], list[Any]] = {}  # (input, output) -> its steps, bound once as a kept run's are

    def steps(x: np.ndarray, y: np.ndarray) -> list[Any]:
        out: list[Any] = []
        h = x
        for k in range(0, len(ws), 2):
            dst = y if k + 2 == len(ws) else acts[k // 2]
            out.append((len(out), lin, [h, ws[k], ws[k + 1]], [dst], {}, (len(out) - 1,) if out else (), None))
            if dst is not y:
                out.append((len(out), relu, [dst], [dst], {}, (len(out) - 1,), None))
            h = dst
        return fuse_steps(out)

    def compute(kernel: Any, ins: Any, outs: Any, params: Any) -> Any:
        return kernel.run(ins, outs, params, np)

    def run(x: np.ndarray, y: np.ndarray) -> None:
        ready = bound.get((id(x), id(y)))
        if ready is None:
            ready = bound[(id(x), id(y))] = steps(x, y)
        run_steps(ready, set(), compute)

    return run


def bench_mlp(clients: dict[str, transfer.Client], side: InProcess, batches: Sequence[int], slots: int,
              seconds: float, reps: int) -> list[dict[str, Any]]:
    """`clients`: "daemon", and "baseline" where another daemon is compared (`--baseline`)."""
    ws = make_weights()
    wbufs = {name: upload_weights(c, ws) for name, c in clients.items()}
    rows = [mlp_point(clients, side, wbufs, ws, batch, slots, seconds, reps) for batch in batches]
    for name, c in clients.items():
        c.free(wbufs[name])
    return rows


def mlp_point(clients: dict[str, transfer.Client], side: InProcess, wbufs: dict[str, Any], ws: list[np.ndarray],
              batch: int, slots: int, seconds: float, reps: int) -> dict[str, Any]:
    """One batch size: checked, then timed; its table row."""
    rng = np.random.default_rng(batch)
    xs = [rng.standard_normal((batch, SIZES[0]), dtype=np.float32) for _ in range(DISTINCT)]
    want = [mlp(x, ws, np) for x in xs]
    yshape = (batch, SIZES[-1])
    prods = {name: Producer(c, mlp_graph(c, wbufs[name], batch), batch * SIZES[0] * 4, batch * SIZES[-1] * 4, slots)
             for name, c in clients.items()}
    # Correctness, untimed: each distinct batch through the graph (the first run defines it).
    err = 0.0
    for prod in prods.values():
        for k, x in enumerate(xs):
            prod.run(k, x)
        prod.finish()
        err = max(err, prod.error(want, yshape))
    here = np.empty(yshape, np.float32)
    dws = [side.put(w) for w in ws]
    sides: dict[str, Side] = {name: (prod.step(xs), prod.finish) for name, prod in prods.items()}
    sides["in_process"] = (side.step(lambda x: mlp(x, dws, side.xp), xs, here), _nothing)
    if not side.gpu:
        kern = kernels_mlp(batch, ws)
        kern(xs[0], here)
        err_k = float(np.abs(here - want[0]).max())
        if err_k > 1e-3:
            raise SystemExit(f"batch {batch}: the kernels in-process disagree with NumPy (max abs error {err_k:.2e})")
        sides["kernels"] = (_each(lambda x: kern(x, here), xs), _nothing)
    load = os.getloadavg()[0]
    rates = compare(sides, seconds, reps)
    for name, prod in prods.items():
        err = max(err, prod.error(want, yshape))  # the last timed runs' outputs are right too
        prod.close()
        clients[name].free(prod.g)
    if err > 1e-3:
        raise SystemExit(f"batch {batch}: the graph's outputs disagree with NumPy (max abs error {err:.2e})")
    row: dict[str, Any] = {"batch": batch, "max_abs_error": err, "max_abs_output": float(max(np.abs(w).max() for w in want)),
                           "load_before": load, "load_after": os.getloadavg()[0]}
    row.update(summarize(rates, "in_process"))
    for other in ("kernels", "baseline"):  # kernels: the service's own cost; baseline: another daemon's
        if other in rates:
            row[f"daemon_vs_{other}"] = statistics.median(a / b for a, b in zip(rates["daemon"], rates[other]))
    row["samples_per_s_daemon"] = row["daemon_per_s"] * batch
    row["samples_per_s_in_process"] = row["in_process_per_s"] * batch
    print(_mlp_line(row), flush=True)
    return row


def _mlp_line(r: dict[str, Any]) -> str:
    k = f"{r['kernels_per_s']:10,.0f} {r['daemon_vs_kernels']:8.2f}x" if "kernels_per_s" in r else f"{'-':>10s} {'-':>9s}"
    b = f" {r['baseline_per_s']:10,.0f} {r['baseline_vs_in_process']:8.2f}x" if "baseline_per_s" in r else ""
    return (f"{r['batch']:6d} {r['daemon_per_s']:10,.0f} {r['in_process_per_s']:10,.0f} {r['daemon_vs_in_process']:8.2f}x "
            f"{k} {r['max_abs_error']:10.1e} {r['load_before']:5.1f}{b}")


# --- image preprocessing ----------------------------------------------------------------------
def bench_images(clients: dict[str, transfer.Client], side: InProcess, batches: Sequence[int], size: int, slots: int,
                 seconds: float, reps: int) -> list[dict[str, Any]]:
    """`clients`: "daemon", and "baseline" where another daemon is compared (`--baseline`)."""
    return [images_point(clients, side, n, size, slots, seconds, reps) for n in batches]


def images_point(clients: dict[str, transfer.Client], side: InProcess, n: int, size: int, slots: int, seconds: float,
                 reps: int) -> dict[str, Any]:
    """n images per batch (examples/image_preprocess.py's graph): checked, then timed; its table row."""
    hwc, chw = (n, size, size, 3), (n, 3, size, size)
    rng = np.random.default_rng(n)
    xs = [rng.integers(0, 256, hwc, dtype=np.uint8) for _ in range(DISTINCT)]
    want = [preprocess(x, np) for x in xs]
    prods = {name: Producer(c, _IMAGES.build(c, hwc, chw), int(np.prod(hwc)), int(np.prod(chw)) * 4, slots)
             for name, c in clients.items()}
    err = 0.0
    for prod in prods.values():
        for k, x in enumerate(xs[:slots]):
            prod.run(k, x)
        prod.finish()
        err = max(err, prod.error(want, chw))
    here = np.empty(chw, np.float32)
    sides: dict[str, Side] = {name: (prod.step(xs), prod.finish) for name, prod in prods.items()}
    sides["in_process"] = (side.step(lambda x: preprocess(x, side.xp), xs, here), _nothing)
    if not side.gpu:
        kern = kernels_images(hwc)
        kern(xs[0], here)
        if float(np.abs(here - want[0]).max()) > 1e-4:
            raise SystemExit(f"images x{n}: the kernels in-process disagree with NumPy")
        sides["kernels"] = (_each(lambda x: kern(x, here), xs), _nothing)
    load = os.getloadavg()[0]
    rates = compare(sides, seconds, reps)
    for name, prod in prods.items():
        err = max(err, prod.error(want, chw))
        prod.close()
        clients[name].free(prod.g)
    if err > 1e-4:
        raise SystemExit(f"images x{n}: the graph's outputs disagree with NumPy (max abs error {err:.2e})")
    row: dict[str, Any] = {"images": n, "size": size, "max_abs_error": err, "load_before": load, "load_after": os.getloadavg()[0]}
    row.update(summarize(rates, "in_process", per=n))
    for other in ("kernels", "baseline"):
        if other in rates:
            row[f"daemon_vs_{other}"] = statistics.median(a / b for a, b in zip(rates["daemon"], rates[other]))
    kcols = f"{row['kernels_per_s']:12,.0f} {row['daemon_vs_kernels']:8.2f}x" if "kernels" in rates else f"{'-':>12s} {'-':>9s}"
    bcols = f" {row['baseline_per_s']:12,.0f} {row['daemon_vs_baseline']:8.2f}x" if "baseline" in rates else ""
    print(f"{n:6d} {size:4d} {row['daemon_per_s']:12,.0f} {row['in_process_per_s']:14,.0f} {row['daemon_vs_in_process']:8.2f}x "
          f"{kcols} {err:10.1e} {load:5.1f}{bcols}", flush=True)
    return row


def kernels_images(hwc: tuple[int, ...]) -> Callable[[np.ndarray, np.ndarray], None]:
    """The image graph's kernels (flip, then normalize with the layout change) run here on
    NumPy arrays with a preallocated intermediate: its work without the service."""
    flip = REGISTRY.lookup("flip", ("uint8", "uint8"), "cpu")
    norm = REGISTRY.lookup("normalize", ("uint8", "float32"), "cpu")
    flipped = np.empty(hwc, np.uint8)
    params = {"mean": MEAN, "std": STD, "layout": "NHWC", "out_layout": "NCHW"}

    def run(x: np.ndarray, y: np.ndarray) -> None:
        flip.run([x], [flipped], {"axes": [2]}, np)
        norm.run([flipped], [y], params, np)

    return run


def bench_latency(clients: dict[str, transfer.Client], n: int, reps: int) -> list[dict[str, Any]]:
    """One request at a time: a 64-float `scale_add` (a compute far too small to be worth a
    process hop: what a CPU device's process costs per request, over the control socket)
    and, for scale, a 64 B copy (on the ring, as the client sends it by default), on each
    daemon; p50 and p99 in us. The daemons take
    turns, `n` requests a turn, `reps` turns each."""
    rows = []
    segs = {name: (c.segment(256), c.segment(256)) for name, c in clients.items()}
    for what in ("compute", "copy"):
        times: dict[str, list[float]] = {name: [] for name in clients}
        for _ in range(reps):
            for name, c in clients.items():
                seg, out = segs[name]
                src, dst = seg.tensor(64, np.float32), out.tensor(64, np.float32)
                one = ((lambda: c.compute("scale_add", [src], [dst], {"a": 2.0, "b": 1.0}).result()) if what == "compute"  # noqa: B023
                       else (lambda: c.copy(out.va, seg.va, 64).result()))  # noqa: B023
                # (warm-up first: the device process started, caches hot)
                times[name] += latency_bench._timed(one, n, max(n // 10, 1))
        row: dict[str, Any] = {"request": what}
        for name, ts in times.items():
            stats = latency_bench._stats(ts)  # the p50/p99 transfer-bench's latency mode reports
            row[f"{name}_p50_us"], row[f"{name}_p99_us"] = stats["p50_us"], stats["p99_us"]
        rows.append(row)
        print(f"{what:>8s} " + " ".join(f"{row[f'{k}_p50_us']:9.1f} {row[f'{k}_p99_us']:9.1f}" for k in clients))
    return rows


@contextlib.contextmanager
def baseline_daemon(checkout: Path, backend: str) -> Iterator[Any]:
    """A transferd whose package comes from `checkout`, started from a directory with no
    `transfer` in it (`python -m` puts the working directory first on the path)."""
    if not (checkout / "transfer" / "__init__.py").is_file():
        raise SystemExit(f"--baseline {checkout}: no transfer package there")
    with tempfile.TemporaryDirectory(prefix="graphs-baseline-") as neutral, contextlib.ExitStack() as stack:
        with started_from(neutral, str(checkout.resolve())):
            d = stack.enter_context(run_daemon(["--backend", backend]))
        yield d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto", choices=("auto", "numpy", "cupy"), help="the daemon's; the in-process side follows it")
    ap.add_argument("--batches", default="1,4,16,64,256,1024", help="MLP batch sizes ('' skips the MLP)")
    ap.add_argument("--image-batches", default="8,32", help="images per batch ('' skips the images)")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--slots", type=int, default=4, help="runs the producer keeps in flight")
    ap.add_argument("--seconds", type=float, default=2.0, help="per side, per rep")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--blas-threads", default="1", help="BLAS threads here and in the daemon ('default': leave the environment as it is)")
    ap.add_argument("--baseline", type=Path, metavar="DIR",
                    help="also run the MLP through a transferd imported from DIR (a checkout of another commit, "
                         "its native extension built): before/after in one run")
    ap.add_argument("--latency", type=int, default=0, metavar="N",
                    help="also time N single requests per turn (3 turns): a 64-float compute and a 64 B copy, p50/p99")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    def parse(text: str, what: str) -> list[int]:
        try:
            sizes = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            ap.error(f"{what}: a comma-separated list of positive integers, got {text!r}")
        if any(n < 1 for n in sizes):
            ap.error(f"{what}: sizes must be at least 1 (an empty list skips that part), got {text!r}")
        return sizes

    batches, image_batches = parse(args.batches, "--batches"), parse(args.image_batches, "--image-batches")

    with contextlib.ExitStack() as stack:
        d = stack.enter_context(run_daemon(["--backend", args.backend]))
        backend = d.ready["backend"]
        if backend not in ("numpy", "cupy"):
            raise SystemExit(f"unexpected backend {backend!r}")
        side = InProcess(backend)
        c = stack.enter_context(transfer.connect(d.endpoint, name="graphs-bench"))
        clients = {"daemon": c}
        if args.baseline is not None:
            base = stack.enter_context(baseline_daemon(args.baseline, args.backend))
            clients["baseline"] = stack.enter_context(transfer.connect(base.endpoint, name="graphs-bench-baseline"))
        print(f"backend {backend}, BLAS threads {os.environ.get('OPENBLAS_NUM_THREADS', 'default')}, "
              f"{args.slots} runs in flight, {args.reps} x {args.seconds:g} s per side")
        print(f"{'batch':>6s} {'daemon/s':>10s} {'in-proc/s':>10s} {'ratio':>9s} {'kernels/s':>10s} {'d/kern':>9s} {'max err':>10s} {'load':>5s}"
              + (f" {'base/s':>10s} {'b ratio':>9s}" if args.baseline is not None else ""))
        mlp_rows = bench_mlp(clients, side, batches, args.slots, args.seconds, args.reps)
        print(f"{'images':>6s} {'size':>4s} {'daemon img/s':>12s} {'in-proc img/s':>14s} {'ratio':>9s} {'kernels img/s':>12s} {'d/kern':>9s} {'max err':>10s} {'load':>5s}"
              + (f" {'base img/s':>12s} {'d/base':>9s}" if args.baseline is not None else ""))
        img_rows = bench_images(clients, side, image_batches, args.image_size, min(args.slots, 2),
                                args.seconds, args.reps)
        lat_rows: list[dict[str, Any]] = []
        if args.latency:
            print(f"{'one at a time':>13s} " + " ".join(f"{k + ' p50':>9s} {'p99 us':>9s}" for k in clients))
            lat_rows = bench_latency(clients, args.latency, 3)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "command": "python bench/graphs.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "python": platform.python_version(), "numpy": np.__version__, "backend": backend,
                        "gpu": side.device_name(), "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
                        "load_note": "1-minute load average before and after each point: others share this machine"},
            "config": {"mlp": list(SIZES), "dtype": "float32", "slots": args.slots, "seconds": args.seconds, "reps": args.reps,
                       "baseline": None if args.baseline is None else str(args.baseline)},
            "mlp": mlp_rows,
            "images": img_rows,
            "latency": lat_rows,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
