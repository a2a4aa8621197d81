"""PyTorch DataLoader: stock pickling/collate path versus batch slots through transfer.

Stock: workers build per-image tensors, `default_collate` stacks them into a
batch, the batch travels to the main process through torch's worker queue,
and the main process normalizes it.

transfer: each worker writes its images straight into a batch slot (shared
memory), asks the daemon (embedded in the main process) to normalize the
slot into an output buffer, and returns only the buffer's index. The main
process takes the float32 batch zero-copy with `torch.from_dlpack`.

Both paths produce the same normalized float32 batches (checked). Each path
runs in its own child process, so its CPU time (main + workers + daemon) is
measured whole, from outside.

    python examples/dataloader.py --batches 40 --batch 32 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

MEAN = [123.675, 116.28, 103.53]
STD = [58.395, 57.12, 57.375]


def image(index: int, size: int) -> np.ndarray:
    """A deterministic stand-in for a decoded JPEG."""
    return np.random.default_rng(index).integers(0, 256, (3, size, size), dtype=np.uint8)


# --- stock path ------------------------------------------------------------------------------------
def run_stock(args: argparse.Namespace) -> dict:
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Images(Dataset):
        def __len__(self) -> int:
            return args.batches * args.batch

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.from_numpy(image(i, args.size))

    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    loader = DataLoader(Images(), batch_size=args.batch, num_workers=args.workers, prefetch_factor=args.prefetch)
    checksum = 0.0
    t0 = time.perf_counter()
    for x in loader:
        y = (x.float() - mean) / std
        checksum += float(y[:, :, 0, 0].sum())
    return {"seconds": time.perf_counter() - t0, "checksum": checksum}


# --- transfer path ---------------------------------------------------------------------------------
class SlotBatches:
    """A map-style dataset of whole batches; each worker keeps one session and one slot pool."""

    def __init__(self, endpoint: str, token: bytes, batches: int, batch: int, size: int, ring: int) -> None:
        self.endpoint, self.token = endpoint, token
        self.batches, self.batch, self.size, self.ring = batches, batch, size, ring
        self._client = None

    def __len__(self) -> int:
        return self.batches

    def _setup(self) -> None:
        import transfer

        self._client = transfer.connect(self.endpoint, name=f"loader-worker-{os.getpid()}")
        self._out = self._client.attach(self.token)
        self._pool = self._client.pool(self.batch * 3 * self.size * self.size, slots=2)

    def __getitem__(self, b: int) -> int:
        if self._client is None:
            self._setup()
        shape = (self.batch, 3, self.size, self.size)
        r = b % self.ring
        with self._pool.acquire(timeout=60) as slot:
            x = slot.ndarray(shape, np.uint8)
            for k in range(self.batch):
                x[k] = image(b * self.batch + k, self.size)
            per = int(np.prod(shape)) * 4
            slot.compute("normalize", [slot.tensor(shape, np.uint8)], [self._out.tensor(shape, np.float32, offset=r * per)], {"mean": MEAN, "std": STD}).result()
        return r  # a small int is all that crosses the worker queue


def run_transfer(args: argparse.Namespace) -> dict:
    import torch
    from torch.utils.data import DataLoader

    import transfer

    shape = (args.batch, 3, args.size, args.size)
    per = int(np.prod(shape)) * 4
    # Output buffer r is rewritten by batch r + ring, which the loader asks for only after the
    # main loop has moved past batch r (it runs at most workers * prefetch batches ahead).
    ring = args.workers * args.prefetch + 2
    checksum = 0.0
    with transfer.serve_in_process(backend=args.backend) as daemon, transfer.connect(daemon.endpoint, name="trainer") as c:
        out = c.alloc(ring * per)
        ds = SlotBatches(daemon.endpoint, c.share(out), args.batches, args.batch, args.size, ring)
        loader = DataLoader(ds, batch_size=None, num_workers=args.workers, prefetch_factor=args.prefetch, multiprocessing_context="spawn" if args.spawn else None)
        t0 = time.perf_counter()
        for r in loader:
            y = torch.from_dlpack(daemon.device_array(out, shape, np.float32, offset=int(r) * per))
            checksum += float(y[:, :, 0, 0].sum())
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "checksum": checksum}


# --- driver ------------------------------------------------------------------------------------------
def measure(path: str, argv: list[str]) -> dict:
    """Run one path in a child process; its whole CPU time (with workers and daemon) from rusage."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--path", path, *argv], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result["process_wall_s"] = wall
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--spawn", action="store_true", help="spawn loader workers instead of forking")
    ap.add_argument("--path", choices=("stock", "transfer"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the comparison here")
    args = ap.parse_args(argv)
    if args.path:
        result = run_stock(args) if args.path == "stock" else run_transfer(args)
        print(json.dumps(result))
        return 0
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--json")]
    if args.json:
        passthrough = [a for a in passthrough if a != args.json]
    rows = {p: measure(p, passthrough) for p in ("stock", "transfer")}
    if not np.isclose(rows["stock"]["checksum"], rows["transfer"]["checksum"], rtol=1e-4):
        raise SystemExit(f"the two paths disagree: {rows['stock']['checksum']} vs {rows['transfer']['checksum']}")
    print(f"{'path':10s} {'batches/s':>10s} {'CPU s/batch':>12s} {'loop s':>8s} {'process s':>10s}")
    for p, r in rows.items():
        print(f"{p:10s} {args.batches / r['seconds']:10.1f} {r['cpu_s'] / args.batches:12.4f} {r['seconds']:8.2f} {r['process_wall_s']:10.2f}")
    s, t = rows["stock"], rows["transfer"]
    print(f"transfer/stock: {s['seconds'] / t['seconds']:.2f}x batches/s, {t['cpu_s'] / s['cpu_s']:.2f}x CPU per batch; outputs agree")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k not in ("path", "json")}, "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
