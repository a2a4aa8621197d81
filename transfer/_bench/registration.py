"""The `registration` mode: what it costs a producer to make its own memory a remote
segment, and to let it go, against NIXL's own registration of the same buffer.

For each size (1 MiB to 4 GiB by default; the pages are never touched: registration is
of address ranges), `reps` times, alternating the methods:

* `nixl-raw`: `register_memory` and `deregister_memory` of the buffer by a NIXL agent of
  this process (the UCX backend): the floor;
* `transfer`: `Client.register_remote(buffer)` (the NIXL registration and its partial
  metadata; the daemon maps it when the first request naming it arrives, so that cost is
  shown as `first copy`: a 4 KiB copy out of the new segment, the RegisterRemote ahead of it
  in its frame, beside `copy`, the same copy again) and `Client.free(segment)` (it sends
  the Unregister and returns; `freed`: until the daemon's answer is read and the
  registration goes, the free and a fence);
* `transfer-again`: `register_remote` of the same buffer while a registration of it is
  live, and the free of that handle: reused, no registration and no round trip.

The daemon is served over tcp on loopback, as a producer on another host reaches it.
Reported: the median microseconds of each, and `transfer`'s register and free against
`nixl-raw`'s.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .common import fmt_size

SIZES = (1 << 20, 64 << 20, 1 << 30, 4 << 30)


def _us(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e6, out


def run(sizes: list[int] | None = None, *, reps: int = 5, line: Callable[[str], None] = print,
        daemon_args: dict[str, Any] | None = None) -> dict[str, Any]:
    import transfer

    from ..testing import loopback_endpoint, run_daemon
    from ..transport._nixl import NixlEndpoint

    sizes = list(sizes or SIZES)
    endpoint = loopback_endpoint()
    rows: list[dict[str, Any]] = []
    raw = NixlEndpoint("transfer-bench-registration", progress="event")
    gc_was = gc.isenabled()
    gc.disable()  # (a collection inside a timed call is not the call's cost)
    try:
        with tempfile.TemporaryDirectory(prefix="transfer-bench-reg-") as logs, \
                run_daemon(["--endpoint", endpoint, "--allow-insecure-tcp", "--backend", "numpy"], log=Path(logs) / "transferd.log",
                           **(daemon_args or {})) as _, transfer.connect(endpoint, name="registration") as c:
            warm = c.register_remote(np.empty(4096, np.uint8))
            dst = c.alloc(4096)
            c.copy(dst, warm, 4096).result()  # (the agents started and wired up: not a size's cost)
            c.free(warm)
            for size in sizes:
                buf = np.empty(size, np.uint8)  # (never touched: no page is ever made)
                t: dict[str, list[float]] = {k: [] for k in ("raw_register", "raw_deregister", "register", "free", "freed", "again",
                                                             "again_free", "first_copy", "copy")}
                for _ in range(reps):
                    us, reg = _us(lambda: raw.register(buf))  # noqa: B023
                    t["raw_register"].append(us)
                    t["raw_deregister"].append(_us(lambda: raw.deregister(reg))[0])  # noqa: B023
                    us, seg = _us(lambda: c.register_remote(buf))  # noqa: B023
                    t["register"].append(us)
                    us, again = _us(lambda: c.register_remote(buf))  # noqa: B023
                    t["again"].append(us)
                    t["again_free"].append(_us(lambda: c.free(again))[0])  # noqa: B023
                    t["first_copy"].append(_us(lambda: c.copy(dst, seg, 4096).result())[0])  # noqa: B023
                    t["copy"].append(_us(lambda: c.copy(dst, seg, 4096).result())[0])  # noqa: B023
                    us, _ = _us(lambda: c.free(seg))  # noqa: B023
                    t["free"].append(us)
                    t["freed"].append(us + _us(c.fence)[0])  # (deregistered: the next register is a fresh one)
                med = {k: round(statistics.median(v), 1) for k, v in t.items()}
                row = {"size": size, **{f"{k}_us": v for k, v in med.items()},
                       "register_vs_raw": round(med["register"] / med["raw_register"], 2) if med["raw_register"] else None,
                       "free_vs_raw": round(med["free"] / med["raw_deregister"], 2) if med["raw_deregister"] else None,
                       "reps": reps}
                rows.append(row)
                line(f"registration {fmt_size(size):>8}: nixl-raw {med['raw_register']:.0f}/{med['raw_deregister']:.0f} us, "
                     f"transfer {med['register']:.0f}/{med['free']:.0f} us ({row['register_vs_raw']}x/{row['free_vs_raw']}x; "
                     f"freed in {med['freed']:.0f} us), "
                     f"again {med['again']:.1f}/{med['again_free']:.1f} us, first copy {med['first_copy']:.0f} us (then {med['copy']:.0f})")
                del buf
    finally:
        if gc_was:
            gc.enable()
        raw.close()
    return {"rows": rows, "config": {"sizes": sizes, "reps": reps, "endpoint": "tcp loopback"}}


def render(result: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title="registration mode: a producer's memory as a remote segment, register / free, median us (tcp loopback)")
    for col in ("size", "nixl-raw register", "nixl-raw deregister", "transfer register", "transfer free", "vs raw",
                "freed", "again register", "again free", "first copy", "copy"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        t.add_row(fmt_size(r["size"]), f"{r['raw_register_us']:,.0f}", f"{r['raw_deregister_us']:,.0f}", f"{r['register_us']:,.0f}",
                  f"{r['free_us']:,.0f}", f"{r['register_vs_raw']:.2f}x / {r['free_vs_raw']:.2f}x", f"{r['freed_us']:,.0f}",
                  f"{r['again_us']:,.1f}",
                  f"{r['again_free_us']:,.1f}", f"{r['first_copy_us']:,.0f}", f"{r['copy_us']:,.0f}")
    return t
