"""Micro-benchmark of the control-plane codec: µs per frame to encode and decode.

Frames measured: 64 Copy requests, one CopyV of 64 copies, 64 replies (nil
results, as copies get). Any protocol.py can be measured, e.g. an older one::

    git show f7b08e5:transfer/protocol.py > /tmp/protocol_old.py
    python bench/codec.py --module /tmp/protocol_old.py --label old --json bench/results/codec.json
    python bench/codec.py --label new --json bench/results/codec.json

A file is loaded as a module inside the `transfer` package (its relative imports
of `errors` and `kernels` resolve there). `--json` merges this run into FILE
under its label.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load(path: str | None) -> ModuleType:
    """The repository's transfer.protocol, or the protocol.py at `path` as transfer._protocol_bench."""
    import transfer  # noqa: F401 - the package the file's relative imports resolve in

    if path is None:
        from transfer import protocol

        return protocol
    name = "transfer._protocol_bench"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def timeit(fn: Callable[[], Any], iterations: int, repeats: int) -> dict[str, float]:
    """Best and median µs per call over `repeats` runs of `iterations` calls each."""
    fn()  # warm up (lazy caches, first allocations)
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(iterations):
            fn()
        per_call.append((time.perf_counter_ns() - t0) / iterations / 1000)
    return {"best_us": round(min(per_call), 3), "median_us": round(statistics.median(per_call), 3)}


def cases(P: ModuleType) -> dict[str, tuple[Callable[[], Any], Callable[[], Any], int]]:
    """name -> (encode, decode, frame bytes)."""
    copies = [P.Copy(i + 1, 1 << 40 | i * 4096, 2 << 40 | i * 4096, 4096, i % 4) for i in range(64)]
    v = np.arange(64, dtype=np.uint64)
    copyv = [P.CopyV(1, (1 << 40) + v * 4096, (2 << 40) + v * 4096, np.full(64, 4096, np.uint64), 0)]
    replies = [P.Reply(i + 1) for i in range(64)]
    copies_b, copyv_b, replies_b = P.encode_requests(copies), P.encode_requests(copyv), P.encode_replies(replies)
    assert len(P.decode_requests(copies_b)) == 64 and isinstance(P.decode_requests(copyv_b)[0], P.CopyV)
    assert len(P.decode_replies(replies_b)) == 64
    return {
        "copy64": (lambda: P.encode_requests(copies), lambda: P.decode_requests(copies_b), len(copies_b)),
        "copyv64": (lambda: P.encode_requests(copyv), lambda: P.decode_requests(copyv_b), len(copyv_b)),
        "reply64": (lambda: P.encode_replies(replies), lambda: P.decode_replies(replies_b), len(replies_b)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--module", help="path of a protocol.py to measure (default: transfer.protocol)")
    ap.add_argument("--label", default=None, help="name of this run in the table and JSON (default: module path)")
    ap.add_argument("--iterations", type=int, default=2000, help="calls per timed run")
    ap.add_argument("--repeats", type=int, default=15, help="timed runs; best and median are reported")
    ap.add_argument("--json", type=Path, help="merge the results into this JSON file under the label")
    args = ap.parse_args()

    P = load(args.module)
    label = args.label or (args.module or "transfer.protocol")
    results: dict[str, Any] = {}
    print(f"{label}: µs per frame (best / median of {args.repeats} x {args.iterations})")
    print(f"{'frame':<10}{'bytes':>7}{'encode best':>13}{'median':>9}{'decode best':>13}{'median':>9}")
    for name, (enc, dec, nbytes) in cases(P).items():
        e, d = timeit(enc, args.iterations, args.repeats), timeit(dec, args.iterations, args.repeats)
        results[name] = {"bytes": nbytes, "encode": e, "decode": d}
        print(f"{name:<10}{nbytes:>7}{e['best_us']:>13.2f}{e['median_us']:>9.2f}{d['best_us']:>13.2f}{d['median_us']:>9.2f}")
    if args.json:
        doc = json.loads(args.json.read_text()) if args.json.exists() else {}
        doc[label] = {
            "module": args.module or "transfer.protocol",
            "python": platform.python_version(),
            "machine": platform.machine(),
            "iterations": args.iterations,
            "repeats": args.repeats,
            "results": results,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
