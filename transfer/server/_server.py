"""The daemon's composition root: devices, the mapping table, and the parts that serve it.

Data flows one way: the socket pump hands each frame to the session front
(`_front`), which queues it on its session; rings (`_rings`) queue their
descriptors the same way; the one pass (`_pass`) plans (`_planner`),
schedules and executes (`_waves`), completes and accounts (`_accounting`);
control requests (`_control`) act on resources (`_resources`). This module
only builds those parts, wires them, and reports `stats()`.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import time
from typing import Any, Callable

import trio

from .. import _results as R
from .. import protocol as P
from ..addressing import MappingTable
from ..backends import Backend, Channel, NumpyBackend, select_backend
from ..memory import DaemonLock, sweep_stale
from ._accounting import Accounting
from ._config import DaemonConfig
from ._control import Control
from ._dataplane import DataPlane
from ._fds import FdChannel
from ._front import Front
from ._metrics import Metrics
from ._pass import Pass
from ._placement import POLICIES, VirtualDevice, make_policy
from ._planner import Planner
from ._remote import RemotePlane
from ._resources import Resources
from ._channels import Channels
from ._rings import Rings
from ._session import Session

__all__ = ["Server"]


def _answers_read_on_loop(nursery: trio.Nursery) -> Callable[[Channel], bool]:
    """`adopt` for the CPU devices' processes: the loop reads their answers (a task per
    process, woken when its socket is readable), so an answer costs no thread and no GIL
    handover (`backends._devproc`). Offered from the thread that started a process; a
    process the loop cannot take any more (it is ending) is read by a thread instead."""
    token = trio.lowlevel.current_trio_token()

    def start(channel: Channel) -> None:
        try:
            nursery.start_soon(_read_answers, channel)
        except RuntimeError:  # the nursery is closing
            channel.pump()

    def adopt(channel: Channel) -> bool:
        try:
            token.run_sync_soon(start, channel)
        except trio.RunFinishedError:
            return False
        return True

    return adopt


async def _read_answers(channel: Channel) -> None:
    """Read a device process's answers as they come, until its stream ends; cancelled (the
    daemon stopping), hand the reading to a thread: workers may still wait for answers."""
    try:
        while True:
            await trio.lowlevel.wait_readable(channel.sock)
            if not channel.read(False):
                break
    except BaseException:
        channel.pump()
        raise
    with trio.CancelScope(shield=True):
        await trio.to_thread.run_sync(channel.end)  # (may wait for the process to exit)


class Server:
    """State and request execution; `transfer.server._daemon` drives its I/O."""

    def __init__(self, config: DaemonConfig, backend: Backend | None = None) -> None:
        self.config = config
        #: Why this backend (`--backend auto` may have fallen back): logged, and in transferd's ready line.
        self.backend, self.backend_reason = (backend, "given by the caller") if backend else select_backend(config.backend, config.devices)
        self.devices = self._build_devices(self.backend, config.devices)
        self.backends = list({id(d.backend): d.backend for d in self.devices}.values())
        pin_cap = config.max_pinned_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
        for b in self.backends:
            b.max_pinned_bytes = pin_cap
        # Worker threads per device: a CPU "device" has several cores; a GPU runs each session
        # on streams of its own (lanes), so sessions' waves overlap on it.
        self.limiters = {d.index: trio.CapacityLimiter(config.threads) for d in self.devices}
        self.table: MappingTable[Any] = MappingTable()
        policies = {name: make_policy(name, config.size_threshold) for name in POLICIES}
        self.planner = Planner(self.table, self.devices, make_policy(config.placement, config.size_threshold), policies)
        # The RDMA data plane (remote segments); its NIXL agent starts with the first RegisterRemote.
        self.remote = RemotePlane(
            f"transferd-{os.getpid()}-{secrets.token_hex(3)}", timeout_s=config.remote_timeout_s, enabled=config.rdma,
        )
        self.planner.remote = self.remote
        self.started = time.monotonic()
        #: Prometheus metrics (served by transferd --metrics-port); updated on the trio thread only.
        self.metrics = Metrics(session_series=config.metrics_sessions)
        self.accounting = Accounting(self.metrics)
        self.planner.counters = self.accounting.counters
        self._lock: DaemonLock | None = None
        #: Where clients collect the memfds behind their segments and rings (no paths: no SIGBUS).
        self.fds = FdChannel(config.shm_dir, lambda: self.instance)
        #: The metrics endpoint's port once it serves (`--metrics-port`; 0: none).
        self.metrics_port = 0
        #: The control sockets' connection guard's counts (`_connections`), once the daemon serves.
        self.connection_counters: dict[str, int] = {"connections_refused": 0, "connections_idle_closed": 0}
        #: Native ring workers and their mirror of the table (when the extension is built).
        self.dataplane = DataPlane(config, self.accounting, self.backends, pin_cap)
        self.resources = Resources(config, self.table, self.devices, self.backends, self.remote, lambda: self.instance, self.fds, self.dataplane)
        self.rings = Rings(config, lambda: self.instance, self.accounting, self.fds, self.dataplane)
        #: Remote sessions' rings, carried over TCP (their listener binds in `open`).
        self.channels = Channels(config, self.rings)
        self.control = Control(self.resources, self.rings, self.channels, self.stats)
        self.pass_ = Pass(config, self.planner, self.limiters, self.control, self.rings, self.accounting, self._send)
        self.front = Front(config, self.pass_, self.rings, self.resources, self.accounting, self._hello_info, self.control)
        self.rings.kick = self.pass_.kick
        self.dataplane.graph_runner = self.planner.inline.runner
        self.planner.inline.report = self._report_run
        self.rings.on_broken = self.front.end_soon
        self.pass_.on_peer_lost = lambda s: self.front.end_soon(s, "NIXL peer disconnected")
        self.pass_.on_closed = self.front.release
        self.fds.on_peer = self.front.rewatch  # a client in a pid namespace of its own: watch its real pid
        #: Where replies go; set by the daemon loop.
        self.send: Callable[[bytes, bytes], None] = lambda identity, data: None
        # A scrape (on the HTTP thread) reads; folding the ring workers' counts stays on this thread.
        self.metrics.set_source(self._daemon_stats, lambda: list(self.front.sessions.values()))

    def _send(self, identity: bytes, data: bytes) -> None:
        self.send(identity, data)

    def _report_run(self, session: Session, rid: int, err: Any) -> None:
        """A graph run a ring worker ran itself failed: its error, as the pass answers one."""
        self.accounting.failed(session, err.code)
        if session.running:
            self._send(session.identity, P.encode_replies([P.Reply(rid, error=err)]))

    @staticmethod
    def _build_devices(backend: Backend, cpu_devices: int) -> list[VirtualDevice]:
        """GPUs first (if the backend has them), then `cpu_devices` CPU devices."""
        devices: list[VirtualDevice] = []
        if backend.name != "numpy":
            for i in range(backend.device_count):
                devices.append(VirtualDevice(len(devices), "gpu", backend, i))
            cpu_backend: Backend = NumpyBackend(max(cpu_devices, 1))
        else:
            cpu_backend = backend
        for i in range(max(cpu_devices, 1)):
            devices.append(VirtualDevice(len(devices), "cpu", cpu_backend, i))
        return devices

    # --- wiring for the daemon loop ----------------------------------------------------------
    def attach(self, nursery: trio.Nursery, send: Callable[[bytes, bytes], None]) -> None:
        """Give the server its nursery (session tasks, the ring loop) and its reply path."""
        self.send = send
        self.front.send = send
        self.front.nursery = nursery
        self.control.nursery = nursery
        adopt = _answers_read_on_loop(nursery)
        for backend in self.backends:
            backend.read_answers_with(adopt)

    def on_message(self, parts: list[bytes], secure: bool = False) -> None:
        self.front.on_message(parts, secure)

    @property
    def sessions(self) -> dict[bytes, Session]:
        return self.front.sessions

    # --- lifecycle ---------------------------------------------------------------------------
    def open(self) -> list[str]:
        """Take the instance lock and sweep what dead daemons left; return swept names."""
        shm_dir = self.config.shm_dir  # never created here: a missing one is refused (_preflight)
        swept = sweep_stale(shm_dir)
        self._lock = DaemonLock(shm_dir)
        try:
            self.fds.open()
            self.channels.bind()
        except BaseException:
            self.fds.close()
            self._lock.release()
            self._lock = None
            raise
        return swept

    def close(self) -> None:
        for session in list(self.sessions.values()):
            self.front.release(session)
        self.remote.close()
        self.rings.shutdown()
        self.channels.close()
        self.fds.close()
        for backend in self.backends:
            backend.close()  # the CPU devices' processes
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @property
    def instance(self) -> str:
        assert self._lock is not None, "Server.open() first"
        return self._lock.instance

    async def reap_silent(self) -> None:
        """Once a period: reclaim silent sessions, fold the ring workers' counts in (what a
        scrape sees of them is at most this old), and give the C heap's free pages back
        (after a flood, glibc would keep them resident)."""
        sessions_before = 0
        while True:
            await trio.sleep(min(1.0, self.config.session_timeout_s / 4))
            self.front.reap_silent()
            self._fold()
            if len(self.sessions) < sessions_before:
                _trim_heap()  # sessions ended since the last look: their memory is free now
            sessions_before = len(self.sessions)

    def _hello_info(self, session: Session) -> R.HelloResult:
        home, arenas = self.resources.admit(session)  # may refuse
        cfg = self.config
        return R.HelloResult(
            session=session.id,
            server_pid=os.getpid(),
            version=P.VERSION,
            limits=R.WireLimits(**cfg.limits.to_wire()),
            max_inflight=cfg.max_inflight,
            backend=self.backend.describe(),
            devices=[R.DeviceInfo(d.index, d.kind, d.backend.name) for d in self.devices],
            heartbeat_s=cfg.heartbeat_s,
            session_timeout_s=cfg.session_timeout_s,
            shm_dir=str(cfg.shm_dir),
            fd_socket=str(self.fds.path),
            home_device=home,
            arenas=arenas,
        )

    def _fold(self) -> None:
        """Bring what the native ring workers did into the accounting."""
        for s in list(self.rings.sessions.values()):
            self.dataplane.fold(s)

    def stats(self, session: Session | None = None) -> dict[str, Any]:
        self._fold()
        out: dict[str, Any] = {"daemon": self._daemon_stats()}
        if session is not None:
            out["session"] = {"id": session.id, "home_device": session.home_device, **session.stats.to_wire(), "segments": len(session.segments),
                              "ring": session.ring is not None, "priority": "latency" if session.priority == P.PRIORITY_LATENCY else "normal"}
        return out

    def _daemon_stats(self) -> dict[str, Any]:
        """The daemon-wide counters and levels, read only: a metrics scrape calls this from
        its own thread (copies of dicts whose keys never change, lengths, ints)."""
        return {
            **self.accounting.counters,
            "sessions": len(self.sessions),
            "rings": len(self.rings.sessions),
            "ring_workers": self.dataplane.workers,
            "segments": len(self.table),
            "queued_requests": sum(len(s.queue) for s in list(self.sessions.values())),
            "device_bytes": self.resources.device_bytes,
            "pinned_bytes": sum(b.pinned_bytes for b in self.backends) + self.dataplane.pinned_bytes,
            "devices": [{"index": d.index, "kind": d.kind, "queued_bytes": d.queued_bytes, "batches": d.completed} for d in self.devices],
            "uptime_s": round(time.monotonic() - self.started, 3),
            **self.remote.counters,
            **self.fds.counters,
            **self.connection_counters,
            **self.channels.counters,
        }


def _load_trim() -> Callable[[], None]:
    """glibc's malloc_trim(0), or a no-op where there is none (musl, other platforms)."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: fn(0) and None


_trim_heap = _load_trim()
