"""The trainer of the main deployment: a standalone transferd, this trainer, separate producers.

    transferd --endpoint ipc:///run/transfer/transferd.sock &          # or deploy/transferd.service
    export TRANSFER_ENDPOINT=ipc:///run/transfer/transferd.sock
    python examples/deployment/trainer.py --rendezvous ipc:///run/transfer/trainer.sock --producers 2 &
    python examples/deployment/producer.py --rendezvous ipc:///run/transfer/trainer.sock --name decoder-0 &
    python examples/deployment/producer.py --rendezvous ipc:///run/transfer/trainer.sock --name decoder-1

The trainer owns the batch slots: one segment of shared memory that it and the
daemon map. It lends the segment to the producers by capability (`share`), and
hands each step's slot to a producer over a small zmq socket of its own (the
rendezvous). The producer has the daemon normalize its uint8 images into that
slot as float32 and says so; the trainer reads the slot in place (no copy, no
pickling), checks it, trains on it, and lends it out again. docs/guide.md walks
through it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections import deque
from pathlib import Path

import numpy as np
import zmq

import transfer
from common import expected


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rendezvous", required=True, help="where producers find this trainer (ipc://PATH)")
    ap.add_argument("--producers", type=int, default=2, help="wait for this many before the first step")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8, help="images per batch")
    ap.add_argument("--size", type=int, default=64, help="image height and width")
    ap.add_argument("--slots", type=int, default=0, help="batch slots (default: 2 per producer)")
    args = ap.parse_args(argv)
    shape = (args.batch, 3, args.size, args.size)
    slot_bytes = int(np.prod(shape)) * 4  # float32
    slots = args.slots or 2 * args.producers

    with transfer.connect(name="trainer") as c, zmq.Context() as ctx, contextlib.ExitStack() as stack:  # $TRANSFER_ENDPOINT names the daemon
        inbox = c.segment(slots * slot_bytes)  # the batch slots, mapped here and in the daemon
        token = c.share(inbox)  # a capability: whoever holds it may name inbox's VAs
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 2000
        sock.bind(args.rendezvous)
        if args.rendezvous.startswith("ipc://"):  # zmq leaves an ipc socket's file: remove it when done
            stack.callback(Path(args.rendezvous[len("ipc://"):]).unlink, missing_ok=True)
        producers = []
        while len(producers) < args.producers:  # each producer says hello and gets the layout
            who, msg = sock.recv_multipart()
            producers.append(who)
            sock.send_multipart([who, json.dumps({"token": token.hex(), "shape": shape, "slot_bytes": slot_bytes}).encode()])
        free, lent, done, per_producer = deque(range(slots)), 0, 0, {p: 0 for p in producers}
        t0 = time.perf_counter()
        while done < args.steps:
            while free and lent < args.steps:  # lend every free slot, round robin
                who = producers[lent % len(producers)]
                sock.send_multipart([who, json.dumps({"fill": free.popleft(), "step": lent}).encode()])
                lent += 1
            who, msg = sock.recv_multipart()
            ready = json.loads(msg)  # {"filled": slot, "step": step}
            batch = inbox.ndarray(shape, np.float32, offset=ready["filled"] * slot_bytes)  # a view, no copy
            if not np.allclose(batch, expected(ready["step"], shape), rtol=1e-5, atol=1e-4):
                raise SystemExit(f"step {ready['step']}: the batch in slot {ready['filled']} is wrong")
            train_step(batch)
            free.append(ready["filled"])  # read: the slot may be lent again
            done += 1
            per_producer[who] += 1
        elapsed = time.perf_counter() - t0
        for who in producers:
            sock.send_multipart([who, b'{"stop": true}'])
        sock.close()
    print(f"trainer: {len(producers)} producers, {done} steps of {shape} in {elapsed:.2f} s "
          f"({done / elapsed:.0f} batches/s; per producer {sorted(per_producer.values())}); all {done} batches verified")
    return 0


def train_step(batch: np.ndarray) -> None:
    """Stands for the model's step (with PyTorch: torch.from_numpy(batch), no copy)."""
    float(batch.mean())


if __name__ == "__main__":
    raise SystemExit(main())
