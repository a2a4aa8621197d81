"""transfer.torch's TransferLoader against a stock torch DataLoader, same datasets, one run.

Two workloads: image-like (3x224x224 uint8, batch 32) and token-like (2048
int64 tokens, batch 64). Both loaders use 2 worker processes (prefetch 2,
pin_memory off: the batches stay on the CPU). A sample is a tensor taken from
a bank of 16 pre-made ones, so the workers' own work is small and the
loaders' costs show: the stock path collates (stacks) each batch into fresh
shared memory and passes it by fd; TransferLoader's workers write into reused
slots and pass four integers.

The trainer reads one byte of every 4 KiB page of each batch (as a copy to a
device would touch all of them) and keeps a checksum, which must be equal for
both paths. Per run: samples/s and the trainer's CPU seconds per batch
(`time.process_time()` in the trainer process: its threads included, so the
daemon that TransferLoader embeds there is counted), both measured after the
first `--warmup` batches (worker start-up is not the steady state). Runs
alternate stock/transfer `--repeats` times; the table shows medians.

    python bench/torch_loader.py                 # writes bench/results/torch_loader.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from transfer.torch import TransferLoader

WORKLOADS = {
    # name: (sample shape, dtype, batch size, batches per run)
    "image 3x224x224 uint8": ((3, 224, 224), np.uint8, 32, 120),
    "tokens 2048 int64": ((2048,), np.int64, 64, 300),
}


class Bank(Dataset):
    """`n` samples drawn from 16 pre-made random ones (deterministic)."""

    def __init__(self, n: int, shape: tuple[int, ...], dtype: Any) -> None:
        rng = np.random.default_rng(0)
        hi = 256 if dtype == np.uint8 else 50_000
        self.bank = [torch.from_numpy(rng.integers(0, hi, shape).astype(dtype)) for _ in range(16)]
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.bank[i % 16]


def touch(x: torch.Tensor) -> int:
    """Read one byte per page of the batch (what a host-to-device copy would touch, cheaply)."""
    return int(x.reshape(-1).view(torch.uint8)[::4096].sum())


def run(make: Callable[[], Any], batches: int, batch: int, warmup: int) -> dict[str, float]:
    loader = make()
    try:
        checksum, n = 0, 0
        it = iter(loader)
        for _ in range(warmup):
            checksum += touch(next(it))
        t0, c0 = time.perf_counter(), time.process_time()
        for x in it:
            checksum += touch(x)
            n += 1
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    assert n == batches - warmup
    return {"samples_per_s": n * batch / wall, "trainer_cpu_s_per_batch": cpu / n, "wall_s": wall, "checksum": checksum}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the batches per run")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "torch_loader.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the trainer's own ops; both paths alike
    results: dict[str, Any] = {}
    for name, (shape, dtype, batch, batches) in WORKLOADS.items():
        batches = max(args.warmup + 2, int(batches * args.scale))
        ds = Bank(batches * batch, shape, dtype)
        makers = {
            "stock DataLoader": lambda: DataLoader(ds, batch_size=batch, num_workers=args.workers, pin_memory=False),
            "TransferLoader": lambda: TransferLoader(ds, batch_size=batch, num_workers=args.workers, backend="numpy"),
        }
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in makers}
        for _ in range(args.repeats):
            for path, make in makers.items():
                runs[path].append(run(make, batches, batch, args.warmup))
        sums = {r["checksum"] for rs in runs.values() for r in rs}
        if len(sums) != 1:
            raise SystemExit(f"{name}: the loaders disagree (checksums {sums})")
        results[name] = {
            "batch": batch, "batches_measured": batches - args.warmup,
            "paths": {
                path: {
                    "samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
                    "trainer_cpu_ms_per_batch": 1e3 * statistics.median(r["trainer_cpu_s_per_batch"] for r in rs),
                    "runs": rs,
                }
                for path, rs in runs.items()
            },
        }
    print(f"{'workload':24s} {'loader':18s} {'samples/s':>10s} {'trainer CPU ms/batch':>21s}")
    for name, res in results.items():
        for path, r in res["paths"].items():
            print(f"{name:24s} {path:18s} {r['samples_per_s']:10.0f} {r['trainer_cpu_ms_per_batch']:21.3f}")
    out = {
        "config": vars(args) | {"json": None},
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform()},
        "results": results,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
