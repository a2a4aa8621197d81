"""Image preprocessing as a graph: uint8 HWC batches from two producers -> normalized float CHW.

Each producer process defines one graph (a horizontal flip, then a normalize
that also turns NHWC into NCHW) and, per batch, writes the decoded uint8
images once into a shared-memory slot and sends one `run_graph` request naming
the slot's VA and an output VA in the consumer's device buffer (shared with
the producers). The flipped intermediate lives in the daemon only. The
consumer (this process, which also runs the daemon) reads each result
zero-copy through DLPack and checks it against NumPy.

    python examples/image_preprocess.py --batches 50 --batch 16 --size 128
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import time

import numpy as np

import transfer

PRODUCERS = 2
MEAN = [123.675, 116.28, 103.53]
STD = [58.395, 57.12, 57.375]


def images(rank: int, index: int, shape: tuple[int, ...]) -> np.ndarray:
    """Deterministic 'decoded' images (N, H, W, 3), so the consumer can check every batch."""
    return np.random.default_rng(rank * 1_000_003 + index).integers(0, 256, shape, dtype=np.uint8)


def expected(x: np.ndarray) -> np.ndarray:
    y = x[:, :, ::-1, :].astype(np.float32)
    y = (y - np.float32(MEAN)) / np.float32(STD)
    return np.ascontiguousarray(y.transpose(0, 3, 1, 2))


def build(c: transfer.Client, hwc: tuple[int, ...], chw: tuple[int, ...]) -> transfer.Graph:
    """uint8 HWC images -> flipped along W -> float32 CHW, normalized per channel."""
    g = c.graph()
    g.input("img", hwc, np.uint8)
    g.tensor("flipped", hwc, np.uint8)
    g.output("x", chw, np.float32)
    g.op("flip", ["img"], "flipped", {"axes": [2]})
    g.op("normalize", ["flipped"], "x", {"mean": MEAN, "std": STD, "layout": "NHWC", "out_layout": "NCHW"})
    return g


def producer(endpoint: str, token: bytes, rank: int, batches: int, hwc: tuple[int, ...], free_q, done_q) -> None:
    n, h, w, ch = hwc
    chw = (n, ch, h, w)
    slots = 2
    with transfer.connect(endpoint, name=f"producer{rank}") as c:
        out = c.attach(token)  # the consumer's output buffers
        g = build(c, hwc, chw)
        nin, nout = int(np.prod(hwc)), int(np.prod(chw)) * 4
        seg = c.segment(slots * nin)
        pending: list = [None] * slots
        meta: list = [None] * slots  # (output buffer, rank, batch) of what each slot carries
        for i in range(batches + slots):
            s = i % slots
            if pending[s] is not None:
                pending[s].result()  # done: the slot is free, the output ready for the consumer
                done_q.put(meta[s])
                pending[s] = None
            if i >= batches:
                continue
            r = free_q.get(timeout=60)  # an output buffer the consumer has finished with
            seg.ndarray(hwc, np.uint8, offset=s * nin)[...] = images(rank, i, hwc)
            pending[s] = c.run_graph(g, [seg.at(s * nin)], [out.va + r * nout])
            meta[s] = (r, rank, i)
    done_q.put(None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=50, help="batches per producer")
    ap.add_argument("--batch", type=int, default=16, help="images per batch")
    ap.add_argument("--size", type=int, default=128, help="image height and width")
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args(argv)

    hwc = (args.batch, args.size, args.size, 3)
    chw_n = int(np.prod(hwc)) * 4
    ring_n = 4 * PRODUCERS
    ctx = mp.get_context("spawn")
    with transfer.serve_in_process(backend=args.backend) as daemon, transfer.connect(daemon.endpoint, name="consumer") as c:
        out = c.alloc(ring_n * chw_n)
        token = c.share(out)
        free_q, done_q = ctx.Queue(), ctx.Queue()
        for r in range(ring_n):
            free_q.put(r)
        procs = [ctx.Process(target=producer, args=(daemon.endpoint, token, k, args.batches, hwc, free_q, done_q)) for k in range(PRODUCERS)]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        finished = checked = 0
        err = 0.0
        chw = (args.batch, 3, args.size, args.size)
        while finished < PRODUCERS:
            try:
                item = done_q.get(timeout=1)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise SystemExit("a producer failed") from None
                continue
            if item is None:
                finished += 1
                continue
            r, rank, i = item
            if not checked:
                t0 = time.perf_counter()  # from the first result: the producers' start is not the pipeline's rate
            view = daemon.device_array(out, chw, np.float32, offset=r * chw_n)
            got = np.from_dlpack(view) if isinstance(view.array, np.ndarray) else view.array.get()  # GPU: copy to check
            err = max(err, float(np.abs(got - expected(images(rank, i, hwc))).max()))
            checked += 1
            free_q.put(r)  # done reading: a producer may overwrite it
        elapsed = time.perf_counter() - t0
        for p in procs:
            p.join(30)
            if p.exitcode != 0:
                raise SystemExit(f"producer exited with {p.exitcode}")
    print(f"{PRODUCERS} producers, {checked} batches of {hwc} uint8 HWC -> float32 CHW: "
          f"{(checked - 1) / elapsed:,.0f} batches/s ({(checked - 1) * args.batch / elapsed:,.0f} images/s), max abs error {err:.2e}")
    if err > 1e-4 or checked != PRODUCERS * args.batches:
        raise SystemExit("outputs disagree with NumPy")
    print(f"all {checked} batches verified")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
