"""A producer of the main deployment (see trainer.py): any number, started on their own.

    python examples/deployment/producer.py --rendezvous ipc:///run/transfer/trainer.sock --name decoder-0

It connects to the daemon ($TRANSFER_ENDPOINT) and to the trainer's rendezvous,
attaches the trainer's batch slots, and for every step the trainer lends it
writes the images once, into a slot of its own pool, and has the daemon
normalize them straight into the trainer's slot.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import zmq

import transfer
from common import MEAN, STD, synthesize


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rendezvous", required=True, help="the trainer's socket (ipc://PATH)")
    ap.add_argument("--name", default="producer", help="this producer's client name (logs, metrics)")
    args = ap.parse_args(argv)

    with transfer.connect(name=args.name) as c, zmq.Context() as ctx:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(args.rendezvous)
        sock.send(b'{"hello": true}')
        layout = json.loads(sock.recv())
        inbox = c.attach(bytes.fromhex(layout["token"]))  # the trainer's slots, by VA only
        shape = tuple(layout["shape"])
        steps = 0
        with c.pool(int(np.prod(shape)), slots=2) as pool:  # this producer's own staging slots
            while True:
                task = json.loads(sock.recv())
                if task.get("stop"):
                    break
                slot = pool.acquire(timeout=60)
                synthesize(task["step"], slot.ndarray(shape, np.uint8))  # the images, written once
                slot.compute(
                    "normalize",
                    [slot.tensor(shape, np.uint8)],
                    [inbox.tensor(shape, np.float32, offset=task["fill"] * layout["slot_bytes"])],
                    {"mean": MEAN, "std": STD},
                ).result()  # done in the daemon: the trainer may read it now
                sock.send(json.dumps({"filled": task["fill"], "step": task["step"]}).encode())
                steps += 1
        sock.close()
    print(f"{args.name}: {steps} batches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
