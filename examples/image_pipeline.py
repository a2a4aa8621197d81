"""A multi-process image pipeline through transfer.

N producer processes synthesize uint8 image batches straight into batch slots
(shared memory), and ask the daemon to normalize each batch into the
consumer's output ring (float32, in the daemon's device memory). The
consumer (this process, which also runs the daemon) reads the results
zero-copy through DLPack and checks them against its own computation.

Only VAs, sizes and a few integers cross process boundaries; pixel data is
written once by its producer and read once by the normalize kernel.

    python examples/image_pipeline.py --producers 4 --batches 50 --batch 32 --size 224
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np

import transfer

MEAN = [123.675, 116.28, 103.53]
STD = [58.395, 57.12, 57.375]


def synthesize(producer: int, index: int, out: np.ndarray) -> None:
    """Deterministic 'decoded' images, so the consumer can check every batch."""
    rng = np.random.default_rng(producer * 1_000_003 + index)
    out[...] = rng.integers(0, 256, out.shape, dtype=np.uint8)


def producer(endpoint: str, token: bytes, rank: int, batches: int, shape: tuple, free_q, done_q) -> None:
    with transfer.connect(endpoint, name=f"producer{rank}") as c:
        ring = c.attach(token)  # the consumer's output ring, shared with us
        per = int(np.prod(shape)) * 4
        with c.pool(int(np.prod(shape)), slots=2) as pool:
            for i in range(batches):
                r = free_q.get()  # an output slot the consumer has finished with
                slot = pool.acquire(timeout=60)
                synthesize(rank, i, slot.ndarray(shape, np.uint8))
                slot.compute(
                    "normalize",
                    [slot.tensor(shape, np.uint8)],
                    [ring.tensor(shape, np.float32, offset=r * per)],
                    {"mean": MEAN, "std": STD},
                ).result()
                done_q.put((r, rank, i))
    done_q.put(None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--producers", type=int, default=4)
    ap.add_argument("--batches", type=int, default=50, help="batches per producer")
    ap.add_argument("--batch", type=int, default=32, help="images per batch")
    ap.add_argument("--size", type=int, default=224, help="image height and width")
    ap.add_argument("--ring", type=int, default=0, help="output buffers (default 2 per producer)")
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args(argv)

    shape = (args.batch, 3, args.size, args.size)
    ring_n = args.ring or 2 * args.producers
    per = int(np.prod(shape)) * 4
    mean = np.float32(MEAN).reshape(1, 3, 1, 1)
    std = np.float32(STD).reshape(1, 3, 1, 1)

    ctx = mp.get_context("spawn")
    with transfer.serve_in_process(backend=args.backend) as daemon, transfer.connect(daemon.endpoint, name="consumer") as c:
        ring = c.alloc(ring_n * per)
        token = c.share(ring)
        free_q, done_q = ctx.Queue(), ctx.Queue()
        for r in range(ring_n):
            free_q.put(r)
        procs = [
            ctx.Process(target=producer, args=(daemon.endpoint, token, k, args.batches, shape, free_q, done_q))
            for k in range(args.producers)
        ]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        finished, received, checked = 0, 0, 0
        expect = np.empty(shape, np.uint8)
        while finished < args.producers:
            item = done_q.get(timeout=120)
            if item is None:
                finished += 1
                continue
            r, rank, i = item
            batch = daemon.device_array(ring, shape, np.float32, offset=r * per)
            arr = np.from_dlpack(batch) if isinstance(batch.array, np.ndarray) else batch.array.get()  # GPU: copy to check
            synthesize(rank, i, expect)  # the consumer's own check of every batch
            want = (expect.astype(np.float32) - mean) / std
            if not np.allclose(arr, want, rtol=1e-5, atol=1e-4):
                raise SystemExit(f"batch {i} of producer {rank} is wrong")
            checked += 1
            received += 1
            free_q.put(r)  # done reading: the producers may overwrite it
        elapsed = time.perf_counter() - t0
        for p in procs:
            p.join(30)
            if p.exitcode != 0:
                raise SystemExit(f"producer exited with {p.exitcode}")
    images = received * args.batch
    print(
        f"{args.producers} producers, {received} batches of {shape}: {images / elapsed:,.0f} images/s, "
        f"{received * int(np.prod(shape)) / elapsed / 1e9:.2f} GB/s of uint8 in, all {checked} batches verified"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
