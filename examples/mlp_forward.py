"""A 3-layer MLP as one graph: defined once, then one request per producer batch.

A producer process writes float32 batches into shared-memory slots and sends
only their VAs: each batch is one `run_graph` request whose intermediates live
in the daemon (the producer never allocates or addresses them). The weights sit
in a device buffer the consumer filled and shared. The consumer (this process,
which also runs the daemon) checks every output against NumPy, then prints the
max abs error and batches/s; `--compare` also runs the same math as one compute
request per operator (intermediates in client buffers) on the same batches.

    python examples/mlp_forward.py --batches 200 --batch 64 --compare
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any, Sequence

import numpy as np

import transfer

SIZES = (256, 512, 512, 10)


def make_weights(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    ws = []
    for a, b in zip(SIZES, SIZES[1:]):
        ws += [(rng.standard_normal((b, a)) / np.sqrt(a)).astype(np.float32), rng.standard_normal(b).astype(np.float32)]
    return ws


def batch_of(i: int, batch: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).standard_normal((batch, SIZES[0]), dtype=np.float32)


def reference(x: Any, ws: Sequence[Any], xp: Any = np) -> Any:
    """The MLP as a user writes it (NumPy, or CuPy as `xp`): x @ W.T + b, relu between layers."""
    h = x
    for k in range(0, len(ws), 2):
        h = h @ ws[k].T + ws[k + 1]
        if k + 2 < len(ws):
            h = xp.maximum(h, 0)
    return h


def upload_weights(c: transfer.Client, ws: list[np.ndarray]) -> Any:
    """The weights, one after another, in a device buffer of `c`'s daemon (via a segment)."""
    nw = sum(w.nbytes for w in ws)
    staging, wbuf = c.segment(nw), c.alloc(nw)
    off = 0
    for w in ws:
        staging.ndarray(w.shape, w.dtype, offset=off)[...] = w
        off += w.nbytes
    c.copy(wbuf, staging).result()
    c.free(staging)
    return wbuf


def build(c: transfer.Client, wbuf: transfer.client.SharedSegment, batch: int) -> transfer.Graph:
    """linear -> relu -> linear -> relu -> linear, weights read from `wbuf`."""
    g = c.graph()
    g.input("x", (batch, SIZES[0]), np.float32)
    off, prev = 0, "x"
    for k, (a, b) in enumerate(zip(SIZES, SIZES[1:])):
        g.weight(f"w{k}", wbuf.tensor((b, a), np.float32, offset=off))
        g.weight(f"b{k}", wbuf.tensor((b,), np.float32, offset=off + a * b * 4))
        off += (a * b + b) * 4
        last = k == len(SIZES) - 2
        h = g.output("y", (batch, b), np.float32) if last else g.tensor(f"h{k}", (batch, b), np.float32)
        g.op("linear", [prev, f"w{k}", f"b{k}"], h)
        if not last:
            prev = g.tensor(f"a{k}", (batch, b), np.float32)
            g.op("relu", [h], prev)
    return g


def producer(endpoint: str, wtoken: bytes, otoken: bytes, batches: int, batch: int, per_op: bool, q) -> None:
    """Write each batch once into a slot, send its VA, and let the daemon run the MLP on it."""
    slots = 4
    with transfer.connect(endpoint, name="producer") as c:
        wbuf, out = c.attach(wtoken), c.attach(otoken)
        nin, nout = batch * SIZES[0] * 4, batch * SIZES[-1] * 4
        seg = c.segment(slots * nin)
        g = build(c, wbuf, batch)
        if per_op:  # the same operators, one request each, intermediates in buffers of ours
            mids = [c.alloc(batch * n * 4) for n in SIZES[1:-1] for _ in range(2)]
        pending: list = [None] * slots
        t0 = time.perf_counter()
        for i in range(batches):
            s = i % slots
            if pending[s] is not None:
                pending[s].result()  # the slot is free again once its batch is done
            seg.ndarray((batch, SIZES[0]), np.float32, offset=s * nin)[...] = batch_of(i, batch)
            y = out.va + i * nout
            if not per_op:
                pending[s] = c.run_graph(g, [seg.at(s * nin)], [y])
                continue
            src = seg.tensor((batch, SIZES[0]), np.float32, offset=s * nin)
            off = 0
            for k, (a, b) in enumerate(zip(SIZES, SIZES[1:])):
                w, bias = wbuf.tensor((b, a), np.float32, offset=off), wbuf.tensor((b,), np.float32, offset=off + a * b * 4)
                off += (a * b + b) * 4
                if k == len(SIZES) - 2:
                    pending[s] = c.compute("linear", [src, w, bias], [out.tensor((batch, b), np.float32, offset=i * nout)])
                    break
                h, a_ = mids[2 * k].tensor((batch, b), np.float32), mids[2 * k + 1].tensor((batch, b), np.float32)
                c.compute("linear", [src, w, bias], [h])
                c.compute("relu", [h], [a_])
                src = a_
        c.fence()
        q.put(time.perf_counter() - t0)


def run(endpoint: str, c: transfer.Client, ws: list[np.ndarray], wtoken: bytes, batches: int, batch: int, per_op: bool) -> tuple[float, float]:
    """(batches/s, max abs error) of one producer's run."""
    nout = batch * SIZES[-1] * 4
    out = c.segment(batches * nout)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=producer, args=(endpoint, wtoken, c.share(out), batches, batch, per_op, q))
    p.start()
    elapsed = q.get(timeout=120)
    p.join(30)
    if p.exitcode != 0:
        raise SystemExit(f"producer exited with {p.exitcode}")
    err = 0.0
    for i in range(batches):
        y = out.ndarray((batch, SIZES[-1]), np.float32, offset=i * nout)
        err = max(err, float(np.abs(y - reference(batch_of(i, batch), ws)).max()))
    c.free(out)
    return batches / elapsed, err


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--compare", action="store_true", help="also run one request per operator on the same batches")
    args = ap.parse_args(argv)

    ws = make_weights()
    with transfer.serve_in_process(backend=args.backend) as daemon, transfer.connect(daemon.endpoint, name="consumer") as c:
        wbuf = upload_weights(c, ws)
        wtoken = c.share(wbuf)
        rate, err = run(daemon.endpoint, c, ws, wtoken, args.batches, args.batch, per_op=False)
        print(f"graph: {args.batches} batches of {args.batch}x{SIZES[0]} through {SIZES}: {rate:,.0f} batches/s, max abs error {err:.2e}")
        if err > 1e-3:
            raise SystemExit("the graph's outputs disagree with NumPy")
        if args.compare:
            xs = [batch_of(i, args.batch) for i in range(min(args.batches, 50))]
            t0 = time.perf_counter()
            for x in xs:
                reference(x, ws)
            print(f"in-process NumPy, same math: {len(xs) / (time.perf_counter() - t0):,.0f} batches/s")
            rate1, err1 = run(daemon.endpoint, c, ws, wtoken, args.batches, args.batch, per_op=True)
            print(f"one request per operator: {rate1:,.0f} batches/s, max abs error {err1:.2e}; graph/per-operator = {rate / rate1:.2f}x")
            if err1 > 1e-3:
                raise SystemExit("the per-operator outputs disagree with NumPy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
