"""One accounting for every path: requests, bytes, errors, per session and daemon-wide.

Whatever brought a request (a socket frame, a ring descriptor, a remote
session), the pass reports it here once, and `Server.stats()` and the
Prometheus metrics both read what this module counted.
"""

from __future__ import annotations

import time
from typing import Iterable

from .. import protocol as P
from ._metrics import Metrics
from ._ops import Op
from ._session import Session

__all__ = ["Accounting", "CONTROL_OPS"]

#: Control requests a pass answers, as the `op` label of their latency histogram. Pings and
#: stats are left out: the front answers most of them at once, outside any pass.
CONTROL_OPS: dict[type, str] = {
    P.RegisterHost: "register_host", P.RegisterRemote: "register_remote", P.Unregister: "unregister",
    P.Alloc: "alloc", P.Free: "free", P.Share: "share", P.Attach: "attach", P.Define: "define",
    P.OpenRing: "open_ring", P.OpenChannel: "open_channel", P.Close: "close", P.Fence: "fence", P.Wait: "wait",
}


class Accounting:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.counters = {
            "frames": 0, "requests": 0, "errors": 0, "bad_frames": 0, "sessions_reaped": 0,
            "passes": 0, "waves": 0, "ops": 0, "bytes_moved": 0,
            # Passes queued on a GPU lane behind the one still running (answered at its fence).
            "pipelined_passes": 0,
            # Ring requests a native worker executed (also in "requests"; docs/ring.md).
            "native_requests": 0, "ring_handovers": 0,
            # Of those, checksums a worker answered from the sum of the copy that read or
            # wrote their range earlier in the same batch (docs/ring.md, "Verified copies").
            "fused_checksums": 0,
            # Of those, large copies a worker shared with the copy helpers (docs/ring.md, "Copy helpers").
            "shared_copies": 0,
            # Times a worker found its ring idle past its spin and slept: the submission that
            # woke it paid for the wake-up (tens of microseconds on a VM; docs/ring.md).
            "ring_worker_sleeps": 0,
            # Completions a worker pushed to a client asleep on them: each a FUTEX_WAKE on the
            # worker's thread (a blocking client's wait for a graph run naps instead: client/_naps.py).
            "ring_client_wakes": 0,
            # Ring copies and fills of GPU memory the workers queued through the CUDA driver;
            # those the Python pass served (no driver, a handover, a socket request); of the
            # workers', copies from host memory that was not page-locked (the pin cap); and
            # requests that failed on a device error.
            "device_native_requests": 0, "python_device_requests": 0, "device_unpinned_copies": 0,
            "device_faults": 0,
            # Batches of device work a worker answered after queueing the next one behind it; and
            # the waits of workers at their bound on copies queued ahead (--device-queue-bytes).
            "device_batches_pipelined": 0, "device_queue_waits": 0,
            # Graph runs that reused the plan of an earlier run with the same VAs (nothing
            # translated or placed: server/_graphrun.py).
            "graph_plans_reused": 0,
            # Graph runs a ring worker ran itself, on its thread (server/_inline.py); of those on a
            # GPU, stretches captured into a CUDA graph, captures that failed (then launched
            # kernel by kernel), launches of a captured graph, and kernel-by-kernel runs
            # (backends/_replay.py).
            "native_graph_runs": 0, "graph_captures": 0, "graph_capture_failures": 0, "graph_replays": 0,
            "graph_eager_runs": 0,
        }

    def native(self, session: Session, counts: dict[str, int], latency: dict[str, tuple[list[int], float]]) -> None:
        """What a session's native ring worker did since the last fold (`_dataplane`)."""
        n = counts["copy"] + counts["fill"] + counts["checksum"] + counts["fence"] + counts["graph"]
        c = self.counters
        c["native_graph_runs"] += counts["graph"]
        c["requests"] += n
        c["native_requests"] += n
        c["ring_handovers"] += counts["handovers"]
        c["fused_checksums"] += counts["fused"]
        c["shared_copies"] += counts["shared"]
        c["ring_worker_sleeps"] += counts["sleeps"]
        c["ring_client_wakes"] += counts["rouses"]
        c["bytes_moved"] += counts["bytes"]
        c["device_native_requests"] += counts["device_copy"] + counts["device_fill"]
        c["device_unpinned_copies"] += counts["device_unpinned"]
        c["device_faults"] += counts["device_faults"]
        c["device_batches_pipelined"] += counts["device_parked"]
        c["device_queue_waits"] += counts["device_queue_waits"]
        session.stats.requests += n
        session.stats.bytes_moved += counts["bytes"]
        session.stats.device_ns += counts["device_ns"]
        host = counts["bytes"] - counts["device_bytes"]
        if host:
            self.metrics.bytes_moved("cpu", host)  # a worker copies host memory on its own core
        if counts["device_bytes"]:
            self.metrics.bytes_moved("gpu", counts["device_bytes"])
        for kind, (hist, seconds) in latency.items():
            if any(hist):
                self.metrics.requests_histogram(kind, hist, seconds)

    def frame(self, session: Session | None) -> None:
        self.counters["frames"] += 1
        if session is not None:
            session.stats.frames += 1

    def bad_frame(self) -> None:
        self.counters["bad_frames"] += 1

    def received(self, session: Session | None, n: int) -> None:
        """`n` requests arrived together (one frame, or one ring batch)."""
        self.counters["requests"] += n
        self.metrics.batch(n)
        if session is not None:
            session.stats.requests += n
            session.last_seen = time.monotonic()
            if session.idle:
                session.arrived = time.perf_counter()

    def failed(self, session: Session | None, code: int, n: int = 1) -> None:
        """`n` requests answered with error `code`."""
        self.counters["errors"] += n
        self.metrics.error(code, n)
        if session is not None:
            session.stats.errors += n

    def reaped(self) -> None:
        self.counters["sessions_reaped"] += 1

    def ended(self, session: Session) -> None:
        """A session was released (its ring worker's last counts folded in first)."""
        self.metrics.session_ended(session)

    def passed(self, session: Session, ops: Iterable[Op], waves: int, error_codes: Iterable[int], control: Iterable[type] = ()) -> None:
        """A pass finished: its ops' bytes, its errors, and its latency per kind of request
        (`control`: the types of the control requests it answered)."""
        c = self.counters
        c["passes"] += 1
        c["waves"] += waves
        metrics = self.metrics
        for code in error_codes:
            self.failed(session, code)
        dt = time.perf_counter() - session.arrived if session.arrived else 0.0
        session.arrived = time.perf_counter() if session.queue else 0.0
        kinds: dict[str, int] = {}
        moved = 0
        nops = 0
        for op in ops:
            nops += 1
            if op.rid == 0:
                continue  # an internal op (a staging pull): its request counts it
            moved += op.nbytes
            kinds[op.kind] = kinds.get(op.kind, 0) + op.count()
            metrics.bytes_moved(op.device.kind, op.nbytes)
        c["ops"] += nops
        c["bytes_moved"] += moved
        session.stats.bytes_moved += moved
        for t in control:
            name = CONTROL_OPS.get(t)
            if name is not None:
                kinds[name] = kinds.get(name, 0) + 1
        for name, n in kinds.items():
            metrics.request_done(name, dt, n)
