"""The native data plane, seen from the event loop (native/dataplane.h; docs/ring.md).

Each same-host session's ring gets a worker thread that executes its copies,
fills, checksums and fences itself: no handoff through the event loop, no
GIL while bytes move, and a session's big copies stall nobody else's. The
worker translates VAs against a native mirror of the mapping table, which
this module keeps in step: every segment whose memory is plain host memory
(shared memory, or a NumPy backend's "device" buffer) is mirrored with its
owner and guests, and removed before its memory goes.

Device memory is mirrored too, as CUDA device pointers, when the CUDA driver
loads (`libcuda.so.1`, or the library `TRANSFER_CUDA_DRIVER` names: the test
suite's fake driver): a worker then queues a ring copy or fill that touches a
GPU on a stream of its own and answers it once its event has passed
(native/device.c). Without the driver, device requests take the Python pass,
as every device request did before, and `python_device_requests` counts them.

What a worker does not serve it hands over: it stops at that descriptor and
the ring's ownership passes to the Python pass (`Rings`), which serves it as
it serves a ring without a worker, errors and all, and gives the ring back
(`resume`) once the session is idle again. One implementation of each
request's meaning stays in Python; the worker is the fast path for the
requests it can prove valid, and the equivalence is tested descriptor by
descriptor (tests/integration/test_dataplane.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from .. import protocol as P
from .._native import Table, Worker, copy_helpers, cuda_load
from ..ring import Ring
from ..addressing import Segment, SegmentKind
from ..backends import Backend
from ._accounting import Accounting
from ._config import DaemonConfig
from ._ops import lane_of
from ._session import Session

__all__ = ["DataPlane", "NATIVE", "PYTHON", "BROKEN"]

log = logging.getLogger("transfer.server")

NATIVE, PYTHON, BROKEN = 0, 1, 2
_COUNTED = ("copy", "fill", "checksum", "fused", "shared", "fence", "graph", "bytes", "handovers", "sleeps", "rouses", "device_ns",
            "device_queue_waits",
            "device_copy", "device_fill", "device_bytes", "device_unpinned", "device_faults", "device_parked")
#: The CUDA driver the workers load (a test names its fake driver here).
CUDA_DRIVER_ENV = "TRANSFER_CUDA_DRIVER"


#: The cores this daemon may run on (its workers and, on this host, its clients).
_CPUS = len(os.sched_getaffinity(0))


class DataPlane:
    """The native table and the sessions' workers (absent with --no-ring-workers)."""

    def __init__(self, config: DaemonConfig, accounting: Accounting, backends: list[Backend] = [], pin_cap: int = 0) -> None:
        self.config = config
        self.accounting = accounting
        self.table: Any = Table() if config.ring_workers else None
        #: Why device copies are not the workers' (None: they are, or no backend has a GPU).
        self.cuda_off: str | None = None
        self.cuda_devices = 0
        #: The backends whose device memory the workers reach through the driver.
        self._gpus: list[Backend] = []
        if self.table is not None:
            self._load_cuda(backends, pin_cap)
        self._live: list[Any] = []  # the running workers, whose spin _respin sets
        #: A session's graph runner: the RUN_GRAPHs its worker runs itself (`_inline`; the server's).
        self.graph_runner: Callable[[Session], Any] = lambda session: None
        #: Copy helpers that may share a large copy now (_respin; idle ones sleep).
        self.copy_helpers = 0
        if self.table is not None:
            self._respin()  # (the helpers start now: none run until the daemon says how many)

    @property
    def workers(self) -> int:
        """Running native workers."""
        return len(self._live)

    @property
    def pinned_bytes(self) -> int:
        """Host bytes the workers page-locked for device copies."""
        return int(self.table.pinned_bytes) if self.table is not None else 0

    @property
    def enabled(self) -> bool:
        return self.table is not None

    def describe(self) -> str:
        if self.table is None:
            return "off (--no-ring-workers)"
        if self.cuda_devices:
            return f"native workers, device copies on {self.cuda_devices} CUDA device(s)"
        if self.cuda_off:
            return f"native workers, device copies through the Python pass ({self.cuda_off})"
        return "native workers"

    def _load_cuda(self, backends: list[Backend], pin_cap: int) -> None:
        gpus = [b for b in backends if b.cuda_driver != "never"]
        if not gpus:
            return
        named = os.environ.get(CUDA_DRIVER_ENV)
        if not self.config.device_workers:
            self.cuda_off = "--no-device-workers"
            return
        if not named and all(b.cuda_driver == "if-named" for b in gpus):
            return  # (a simulated GPU: device memory is the simulation's, no driver)
        try:
            self.cuda_devices = cuda_load(named or "libcuda.so.1")
        except OSError as exc:
            self.cuda_off = str(exc)
            log.warning("device copies go through the Python pass: %s", exc)
            return
        self.table.pin_cap = pin_cap
        for b in gpus:
            b.pins_natively = True
        self._gpus = gpus

    # --- the table -----------------------------------------------------------------------------
    def mirror(self, seg: Segment[Any], backend: Backend | None = None) -> None:
        """Mirror a new segment if a worker may touch its memory (host memory only)."""
        if self.table is None:
            return
        if seg.kind == SegmentKind.HOST:
            buf = seg.handle.array
        elif seg.kind == SegmentKind.DEVICE and backend is not None:
            buf = backend.host_buffer(seg.handle)
            if buf is None:
                where = backend.cuda_pointer(seg.handle) if self.cuda_devices else None
                if where is not None:  # device memory the driver knows: the workers queue its copies
                    self.table.add_cuda(seg.id, where[0], seg.nbytes, seg.owner, seg.device, where[1], seg.handle)
                return  # (else the Python pass serves it)
        else:
            return
        self.table.add(seg.id, buf, seg.owner, seg.device)

    def forget(self, seg: Segment[Any]) -> None:
        """Before a segment's memory goes: waits (GIL released) for any worker inside it."""
        if self.table is not None:
            self.table.remove(seg.id)

    def guest(self, seg: Segment[Any], session: Session, allow: bool) -> None:
        if self.table is not None:
            self.table.guest(seg.id, session.id, allow)

    # --- workers ---------------------------------------------------------------------------------
    def start(self, session: Session, ring: Ring, bell_fd: int, cbell_fd: int) -> Any:
        """A worker for the session's new ring, or None (the Python pass serves the ring)."""
        if self.table is None:
            return None
        streams: dict[int, int] = {}
        for backend in self._gpus if self.cuda_devices else ():
            streams.update(backend.lane_streams(lane_of(session.id, 0)))  # (lane 0's streams: shared with the Python pass)
        worker = Worker(
            self.table, ring.inbox, ring.outbox, session.id, bell_fd, cbell_fd,
            self.config.worker_spin_s, self.accounting.metrics.latency_bounds(), streams, self.graph_runner(session),
            session.priority == P.PRIORITY_LATENCY, self.config.device_queue_bytes,
        )
        self._live.append(worker)
        self._respin()
        session.info["native_seen"] = ({k: 0 for k in _COUNTED}, {})
        return worker

    def stop(self, session: Session) -> None:
        """Stop the session's worker (joins its thread), after folding in what it did."""
        worker = session.worker
        if worker is None:
            return
        self.fold(session)
        worker.stop()
        session.worker = None
        self._live.remove(worker)
        self._respin()

    def _respin(self) -> None:
        """How long idle workers poll before they sleep on the futex. A sleeping worker costs
        its client a wake syscall per submission and the scheduler's wake-up latency; a
        polling one costs a core. While every worker and its client (a process each) can have
        a core, they poll for `worker_spin_spare_s`; with more, for `worker_spin_s`, so that
        polling never takes the core a client needs. And how many copy helpers may share a
        large copy: by default only the cores left when every worker and its client have one
        (a helper on a busy client's core slows the client more than it speeds the copy);
        `copy_helpers` set explicitly is taken as it is."""
        spin = self.config.worker_spin_s
        if self.config.worker_spin_spare_s and 2 * len(self._live) <= _CPUS:
            spin = self.config.worker_spin_spare_s
        for worker in self._live:
            worker.spin = spin
        want = self.config.copy_helpers
        if want < 0:  # (before the first session: as for one)
            want = min(8, _CPUS - 2 * max(1, len(self._live)))
        self.copy_helpers = copy_helpers(max(0, want))

    def fold(self, session: Session) -> None:
        """Add what the worker did since the last fold to the one accounting."""
        worker = session.worker
        if worker is None:
            return
        seen_counts, seen_latency = session.info["native_seen"]
        now = worker.counters()
        now["handovers"] = sum(v for k, v in now.items() if k.startswith("handover_"))
        delta = {k: now[k] - seen_counts[k] for k in seen_counts}
        latency = worker.latency()
        lat_delta = {}
        for kind, (counts, total) in latency.items():
            before = seen_latency.get(kind)
            if before is None:
                lat_delta[kind] = (counts, total)
            else:
                lat_delta[kind] = ([a - b for a, b in zip(counts, before[0])], total - before[1])
        session.info["native_seen"] = ({k: now[k] for k in seen_counts}, latency)
        self.accounting.native(session, delta, lat_delta)
