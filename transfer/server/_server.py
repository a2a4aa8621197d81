"""The daemon's core: sessions, the mapping table, and request execution.

Data flows one way: the socket pump hands each frame to `on_message`
(synchronous, microseconds), which decodes it and queues it on its
session; the session's task executes frames in order and queues the reply
frame on the pump. Every VA is translated (bounds, ownership) before any
memory is touched; large copies run on worker threads so the loop stays free.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Any, Callable

import numpy as np
import trio

from .. import errors as E
from .. import protocol as P
from ..addressing import MAX_SEGMENT_BYTES, MappingTable, Segment, SegmentKind
from ..backends import Backend, NumpyBackend, make_backend
from ..kernels import POLICIES, VirtualDevice, make_policy, tensor_extent
from ..memory import DaemonLock, ShmFile, sweep_stale
from ._config import DaemonConfig
from ._scheduler import Planner, assign_waves, execute_waves, plan_requests, replies_for, run_wave_inline
from ._deferred import define, grant_arenas, release_arenas, resolve
from ._ringpath import Doorbell, RingBatch, completion_bell_path, open_ring
from .._ring import COMPLETION_DTYPE, RingCorrupted
from ._metrics import Metrics
from ._session import Session
from ..transport._remote import RemotePlane

__all__ = ["Server"]

log = logging.getLogger("transfer.server")

#: Requests that act as barriers: a pass stops before them, and runs them alone.
_CONTROL = (P.Define, P.OpenRing, P.RegisterHost, P.RegisterRemote, P.Unregister, P.Alloc, P.Free, P.Share, P.Attach, P.Close, P.Hello)
#: Answered once everything taken before them in the pass has completed.
_AFTER_PASS = (P.Fence, P.Ping, P.Stats, P.Wait)


def _bytes_hint(req: P.Request) -> int:
    """Bytes a data request claims to touch (unvalidated: only to choose inline or thread)."""
    if isinstance(req, (P.Copy, P.Fill, P.Checksum)):
        return req.nbytes
    if isinstance(req, P.CopyV):
        return int(req.nbytes.sum(dtype=np.uint64))
    if isinstance(req, P.Compute):
        return sum(tensor_extent(t) for t in (*req.inputs, *req.outputs))
    if isinstance(req, RingBatch):
        return req.nbytes_hint
    return 0


def _zmq_count(items: Any) -> int:
    """Queue entries that came as zmq requests (they count against max_inflight; ring batches do not)."""
    return sum(1 for r in items if not isinstance(r, RingBatch))


class Server:
    """State and request execution; `transfer.server._daemon` drives its I/O."""

    def __init__(self, config: DaemonConfig, backend: Backend | None = None) -> None:
        self.config = config
        self.backend = backend or make_backend(config.backend, config.devices)
        self.devices = self._build_devices(self.backend, config.devices)
        self.backends = list({id(d.backend): d.backend for d in self.devices}.values())
        # A GPU executes one stream's waves at a time; a CPU "device" has several cores.
        self.limiters = {d.index: trio.CapacityLimiter(config.threads if d.kind == "cpu" else 1) for d in self.devices}
        self.table: MappingTable[Any] = MappingTable()
        policies = {name: make_policy(name, config.size_threshold) for name in POLICIES}
        self.planner = Planner(self.table, self.devices, make_policy(config.placement, config.size_threshold), policies)
        # The RDMA data plane (remote segments); its NIXL agent starts with the first RegisterRemote.
        self.remote = RemotePlane(
            f"transferd-{os.getpid()}-{secrets.token_hex(3)}",
            timeout_s=getattr(config, "remote_timeout_s", 30.0),
            enabled=getattr(config, "rdma", True),
        )
        self.planner.remote = self.remote
        self._remote_start = trio.Lock()
        self.sessions: dict[bytes, Session] = {}
        #: Share tokens -> segment id (see Share/Attach).
        self.shares: dict[bytes, int] = {}
        self.device_bytes = 0
        self.accepting = True
        self.started = time.monotonic()
        self.counters = {
            "frames": 0, "requests": 0, "errors": 0, "bad_frames": 0, "sessions_reaped": 0,
            "passes": 0, "waves": 0, "ops": 0,
        }
        self.watch_pids = any(e.startswith("ipc://") for e in config.endpoints)
        #: Prometheus counters (served by transferd --metrics-port); updated on the trio thread only.
        self.metrics = Metrics()
        self._lock: DaemonLock | None = None
        #: Sessions with a request ring, and the FIFO clients ring when the daemon sleeps.
        self.ring_sessions: dict[int, Session] = {}
        self.bell: Doorbell | None = None
        #: Per-session completion doorbells: our end of a ring writes one when the client armed it.
        self.cbells: dict[int, Doorbell] = {}
        self._ring_loop_started = False
        # Set by the daemon loop:
        self.send: Callable[[bytes, bytes], None] = lambda identity, data: None
        self.nursery: trio.Nursery | None = None

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

    # --- lifecycle ------------------------------------------------------------
    def open(self) -> list[str]:
        """Take the instance lock and sweep what dead daemons left; return swept names."""
        shm_dir = self.config.shm_dir
        shm_dir.mkdir(parents=True, exist_ok=True)
        swept = sweep_stale(shm_dir)
        self._lock = DaemonLock(shm_dir)
        return swept

    def close(self) -> None:
        for session in list(self.sessions.values()):
            self._release(session)
        self.remote.close()
        if self.bell is not None:
            self.bell.close()
            self.bell = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @property
    def instance(self) -> str:
        assert self._lock is not None, "Server.open() first"
        return self._lock.instance

    # --- incoming frames (synchronous, on the pump's task) ----------------------
    def on_message(self, parts: list[bytes]) -> None:
        if len(parts) != 2:
            self.counters["bad_frames"] += 1
            if parts:
                self.send(parts[0], P.frame_error(E.MalformedFrame("expected exactly one frame per message")))
            return
        identity, data = parts
        self.counters["frames"] += 1
        try:
            reqs = P.decode_requests(data, self.config.limits)
        except E.ProtocolError as exc:
            self.counters["bad_frames"] += 1
            self.send(identity, P.frame_error(exc))
            return
        if not reqs:
            return
        self.counters["requests"] += len(reqs)
        session = self.sessions.get(identity)
        if session is None:
            first = reqs[0]
            if not isinstance(first, P.Hello):
                self._reply_all(identity, reqs, E.NoSession("no session: send hello first (or the daemon restarted)"))
                return
            try:
                session, result = self._hello(identity, first)
            except E.TransferError as exc:
                self._reply_all(identity, reqs, exc)
                return
            self.send(identity, P.encode_replies([P.Reply(first.id, result)]))
            reqs = reqs[1:]
            if not reqs:
                return
        session.last_seen = time.monotonic()
        session.stats.frames += 1
        session.stats.requests += len(reqs)
        # Pings and stats are answered at once; they must not wait behind a long copy.
        if all(isinstance(r, (P.Ping, P.Stats)) for r in reqs):
            self.send(identity, P.encode_replies([self._immediate(session, r) for r in reqs]))
            return
        if session.closing or not self.accepting:
            self._reply_all(identity, reqs, E.SessionClosed("the session is closing"))
            return
        if session.ring is not None:
            self._ring_ingest(session)  # what the client pushed before this frame goes first
        if session.inflight + len(reqs) > self.config.max_inflight:
            # Clients keep within the credits announced in hello; only a misbehaving one gets here.
            self._reply_all(identity, reqs, E.QuotaExceeded(f"more than {self.config.max_inflight} requests in flight for this session"))
            return
        idle = not session.queue and not session.busy
        if not session.queue:
            session.arrived = time.perf_counter()
        self.metrics.batch(len(reqs))
        session.queue.extend(reqs)
        session.inflight += len(reqs)
        if idle and self._try_inline_pass(session):
            return
        session.wake.set()

    def _try_inline_pass(self, session: Session) -> bool:
        """Small work on an idle session runs right here: no task hop, reply in the same pass.

        Only when every queued request is data or fence/ping/stats (no barrier) and the
        bytes touched stay under inline_bytes; anything else goes to the session task.
        """
        q = session.queue
        if len(q) == 1 and type(q[0]) is RingBatch and self.remote.ep is None and self._ring_now(session, q[0]):
            return True
        if len(q) > self.config.max_pass or any(isinstance(r, (*_CONTROL, P.ComputeRef)) for r in q):
            return False
        data = [r for r in q if not isinstance(r, (P.BadRequest, *_AFTER_PASS))]
        if self.remote.ep is not None and any(
            type(r) is P.Copy and self.planner._names_remote(session.id, (r.dst, r.src)) for r in data
        ):
            return False  # remote copies are posted from the session task (planned once, there)
        if sum(map(_bytes_hint, data)) >= self.config.inline_bytes:
            return False  # decided from the requests' own sizes, before any planning
        ops, refused = plan_requests(self.planner, session.id, data)
        if any(op.remote is not None for op in ops):
            return False  # NIXL posts run on a worker thread, from the session task
        if sum(op.nbytes for op in ops) >= self.config.inline_bytes:
            return False  # planning is pure: the session task will plan again
        taken = list(q)
        q.clear()
        replies = [P.Reply(r.id, error=r.error) for r in taken if isinstance(r, P.BadRequest)] + refused
        waves = assign_waves(ops)
        for wave in waves:
            run_wave_inline(wave)
        replies.extend(replies_for(ops))
        replies.extend(self._execute_control(session, r) for r in taken if isinstance(r, _AFTER_PASS))
        self._complete_ring(session, taken, replies)
        self._account(session, _zmq_count(taken), replies, len(waves), ops)
        if replies:
            self.send(session.identity, P.encode_replies(replies))
        return True

    def _account(self, session: Session, taken: int, replies: list[P.Reply], waves: int, ops: list[Any]) -> None:
        self.counters["passes"] += 1
        self.counters["waves"] += waves
        self.counters["ops"] += len(ops)
        session.stats.bytes_moved += sum(op.nbytes for op in ops)
        session.inflight -= taken
        failed = 0
        metrics = self.metrics
        for r in replies:
            if r.error is not None:
                failed += 1
                metrics.error(r.error.code)
        session.stats.errors += failed
        self.counters["errors"] += failed
        # Latency from the first queued arrival to this pass's completion, per op kind.
        dt = time.perf_counter() - session.arrived if session.arrived else 0.0
        session.arrived = time.perf_counter() if session.queue else 0.0
        kinds: dict[str, int] = {}
        for op in ops:
            name = op.kind
            kinds[name] = kinds.get(name, 0) + 1 + len(op.more_rids or ())
            metrics.bytes_moved(op.device.kind, op.nbytes)
        for name, n in kinds.items():
            metrics.request_done(name, dt, n)

    def _reply_all(self, identity: bytes, reqs: list[P.Decoded], err: E.TransferError) -> None:
        self.counters["errors"] += len(reqs)
        self.metrics.error(err.code, len(reqs))
        self.send(identity, P.encode_replies([P.Reply(r.id, error=err) for r in reqs]))

    def _immediate(self, session: Session, req: P.Decoded) -> P.Reply:
        if isinstance(req, P.Ping):
            return P.Reply(req.id, None)
        return P.Reply(req.id, self.stats(session))

    def _hello(self, identity: bytes, req: P.Hello) -> tuple[Session, dict[str, Any]]:
        if req.version != P.VERSION:
            raise E.UnsupportedVersion(f"client speaks protocol {req.version}, this daemon {P.VERSION}")
        if not self.accepting:
            raise E.SessionClosed("the daemon is shutting down")
        session = Session(identity, req.client, req.pid, last_seen=time.monotonic())
        self.sessions[identity] = session
        assert self.nursery is not None
        self.nursery.start_soon(self._run_session, session)
        if self.watch_pids and req.pid > 0 and identity[:1] != b"\x01":  # not for CURVE tcp peers (other hosts)
            self.nursery.start_soon(self._watch_pid, session)
        log.info("session %d opened by %r (pid %d)", session.id, req.client, req.pid, extra={"session": session.id})
        return session, {
            "session": session.id,
            "server_pid": os.getpid(),
            "version": P.VERSION,
            "limits": self.config.limits.to_wire(),
            "max_inflight": self.config.max_inflight,
            "backend": self.backend.describe(),
            "devices": [{"index": d.index, "kind": d.kind, "backend": d.backend.name} for d in self.devices],
            "heartbeat_s": self.config.heartbeat_s,
            "session_timeout_s": self.config.session_timeout_s,
            "shm_dir": str(self.config.shm_dir),
            "arenas": grant_arenas(self, session),
        }

    # --- per-session execution --------------------------------------------------
    async def _run_session(self, session: Session) -> None:
        try:
            with session.cancel_scope:
                while True:
                    if not session.queue:
                        if session.draining:
                            break
                        await session.wake.wait()
                        session.wake = trio.Event()
                        continue
                    replies = await self.run_pass(session)
                    if replies:
                        self.send(session.identity, P.encode_replies(replies))
                    if session.closing:
                        break
        finally:
            session.finished.set()
            self._release(session)

    async def run_pass(self, session: Session) -> list[P.Reply]:
        """Take what is queued (up to a barrier), plan, cut into waves, execute, answer."""
        q = session.queue
        replies: list[P.Reply] = []
        data: list[P.Request] = []
        after: list[P.Decoded] = []
        taken = 0
        while q and taken < self.config.max_pass:
            req = q[0]
            if isinstance(req, _CONTROL):
                if data or after:
                    break  # a barrier: run it alone, once what came before has completed
                q.popleft()
                taken += 1
                if isinstance(req, P.RegisterRemote):
                    replies.append(await self._register_remote(session, req))
                else:
                    replies.append(self._execute_control(session, req))
                if session.closing:
                    # Answer what was queued behind the Close in the same reply frame.
                    err = E.SessionClosed("the session closed before this request ran")
                    replies.extend(P.Reply(r.id, error=err) for r in q if not isinstance(r, RingBatch))
                    taken += _zmq_count(q)
                    q.clear()  # ring batches: the ring closes with the session, failing them client-side
                    break
                continue
            q.popleft()
            taken += 1
            if isinstance(req, P.BadRequest):
                replies.append(P.Reply(req.id, error=req.error))
            elif isinstance(req, _AFTER_PASS):
                after.append(req)
            elif isinstance(req, P.ComputeRef):
                try:
                    data.append(resolve(session, req))
                except E.TransferError as exc:
                    replies.append(P.Reply(req.id, error=exc))
            else:
                data.append(req)
        ops: list[Any] = []
        waves: list[Any] = []
        if data:
            ops, refused = plan_requests(self.planner, session.id, data)
            replies.extend(refused)
            waves = assign_waves(ops)
            session.busy = True
            try:
                await execute_waves(waves, self.limiters, self.config.inline_bytes)
            finally:
                session.busy = False
            replies.extend(replies_for(ops))
            if any(isinstance(op.error, E.PeerDisconnected) for op in ops if op.remote is not None) and not session.closing:
                # The producer's NIXL agent is gone (killed mid-transfer): its session goes too.
                assert self.nursery is not None
                self.counters["sessions_reaped"] += 1
                self.nursery.start_soon(self.end_session, session, "NIXL peer disconnected")
        for req in after:
            replies.append(self._execute_control(session, req))
        self._complete_ring(session, data, replies)
        self._account(session, taken - (len(data) - _zmq_count(data)), replies, len(waves), ops)
        return replies

    def _execute_control(self, session: Session, req: P.Decoded) -> P.Reply:
        try:
            if isinstance(req, P.BadRequest):
                raise req.error
            if isinstance(req, P.RegisterHost):
                return P.Reply(req.id, self._register_host(session, req.nbytes))
            if isinstance(req, P.Alloc):
                return P.Reply(req.id, self._alloc(session, req.nbytes, req.device))
            if isinstance(req, (P.Unregister, P.Free)):
                kind = SegmentKind.HOST if isinstance(req, P.Unregister) else SegmentKind.DEVICE
                if kind == SegmentKind.HOST:
                    found = self.table.get(req.va >> 40)
                    if found is not None and found.kind == SegmentKind.REMOTE:
                        kind = SegmentKind.REMOTE  # Unregister releases remote segments too
                self._free(session, req.va, kind)
                return P.Reply(req.id, None)
            if isinstance(req, P.Define):
                return P.Reply(req.id, define(self, session, req))
            if isinstance(req, P.Wait):
                session.stats.blocking += 1
                return P.Reply(req.id, None)
            if isinstance(req, P.Share):
                return P.Reply(req.id, self._share(session, req.va))
            if isinstance(req, P.Attach):
                return P.Reply(req.id, self._attach(session, req.token))
            if isinstance(req, P.OpenRing):
                return P.Reply(req.id, self._open_ring(session, req.capacity))
            if isinstance(req, P.Fence):
                return P.Reply(req.id, None)  # requests before it in this session are done
            if isinstance(req, P.Close):
                session.closing = True
                return P.Reply(req.id, None)
            if isinstance(req, (P.Ping, P.Stats)):
                return self._immediate(session, req)
            if isinstance(req, P.Hello):
                raise E.InvalidField("hello on an established session")
            raise E.UnknownOperation(f"{type(req).__name__} is not served here")
        except E.TransferError as exc:
            return P.Reply(req.id, error=exc)
        except Exception as exc:  # a bug: fail this request, keep serving
            log.exception("internal error on %s", type(req).__name__)
            return P.Reply(req.id, error=E.InternalError(f"{type(exc).__name__}: {exc}"))

    # --- resources ------------------------------------------------------------------------
    def _check_quota(self, session: Session, nbytes: int, kind: SegmentKind) -> None:
        cfg = self.config
        if not 0 < nbytes <= MAX_SEGMENT_BYTES:
            raise E.InvalidField(f"segment size {nbytes} is outside 1..{MAX_SEGMENT_BYTES}")
        if cfg.max_segments_per_session and len(session.segments) >= cfg.max_segments_per_session:
            raise E.QuotaExceeded(f"session already has {len(session.segments)} segments (limit {cfg.max_segments_per_session})")
        if kind == SegmentKind.HOST:
            limit, used = cfg.max_host_bytes_per_session, session.host_bytes
            what = "host"
        else:
            limit, used = cfg.max_device_bytes_per_session, session.device_bytes
            what = "device"
            if self.device_bytes + nbytes > cfg.max_device_bytes:
                raise E.OutOfDeviceMemory(
                    f"alloc of {nbytes} bytes: the daemon's device budget has {cfg.max_device_bytes - self.device_bytes} of {cfg.max_device_bytes} bytes left"
                )
        if limit and used + nbytes > limit:
            raise E.QuotaExceeded(f"{what} bytes quota: {used} used + {nbytes} asked > {limit}")

    def _register_host(self, session: Session, nbytes: int) -> dict[str, Any]:
        self._check_quota(session, nbytes, SegmentKind.HOST)
        sid = self.table.reserve_id()
        shm = ShmFile.create(self.config.shm_dir, self.instance, sid, nbytes)
        try:
            for backend in self.backends:
                backend.register_host(shm)
            seg = self.table.add_reserved(sid, SegmentKind.HOST, nbytes, session.id, shm)
        except BaseException:
            shm.unlink()
            shm.close()
            raise
        session.segments.add(seg.id)
        session.host_bytes += nbytes
        return {"va": seg.va, "nbytes": nbytes, "path": str(shm.path)}

    def _alloc(self, session: Session, nbytes: int, device: int) -> dict[str, Any]:
        return self.alloc_at(session, None, nbytes, device)

    def alloc_at(self, session: Session, segment_id: int | None, nbytes: int, device: int) -> dict[str, Any]:
        """Allocate a device buffer; under a given (arena) segment id for deferred allocations."""
        self._check_quota(session, nbytes, SegmentKind.DEVICE)
        ndev = len(self.devices)
        if device == -1:
            # Default: the least-used device of the fastest kind present (GPUs before CPUs).
            kind = self.devices[0].kind
            device = min((d for d in self.devices if d.kind == kind), key=lambda d: (d.info.get("bytes", 0), d.index)).index
        if not 0 <= device < ndev:
            raise E.InvalidField(f"device {device} does not exist (this daemon has {ndev})")
        if segment_id is not None and self.table.get(segment_id) is not None:
            raise E.InvalidAddress(f"segment {segment_id} is already allocated (defined twice?)")
        vdev = self.devices[device]
        try:
            mem = vdev.backend.alloc(nbytes, vdev.local_id)
        except MemoryError:
            raise E.OutOfDeviceMemory(f"device {device} cannot allocate {nbytes} bytes") from None
        if segment_id is None:
            seg = self.table.add(SegmentKind.DEVICE, nbytes, session.id, mem, device)
        else:
            seg = self.table.add_reserved(segment_id, SegmentKind.DEVICE, nbytes, session.id, mem, device)
        session.segments.add(seg.id)
        session.device_bytes += nbytes
        self.device_bytes += nbytes
        vdev.info["bytes"] = vdev.info.get("bytes", 0) + nbytes
        return {"va": seg.va, "nbytes": nbytes, "device": device}

    def _share(self, session: Session, va: int) -> dict[str, Any]:
        seg = self.table.lookup(va, session.id)
        if seg.owner != session.id:
            raise E.NotOwner(f"only the owner may share segment {seg.id}")
        if va != seg.va:
            raise E.InvalidAddress(f"share needs a segment's base VA ({seg.va:#x}), got {va:#x}")
        token = secrets.token_bytes(16)
        self.shares[token] = seg.id
        seg.info.setdefault("tokens", []).append(token)
        return {"token": token}

    def _attach(self, session: Session, token: bytes) -> dict[str, Any]:
        sid = self.shares.get(token)
        seg = self.table.get(sid) if sid is not None else None
        if seg is None:
            raise E.UnknownSegment("no shared segment has that token (never shared, or freed since)")
        if seg.owner != session.id:
            seg.guests.add(session.id)
            session.attached.add(seg.id)
        return {"va": seg.va, "nbytes": seg.nbytes, "kind": seg.kind.name.lower(), "device": seg.device}

    async def _register_remote(self, session: Session, req: P.RegisterRemote) -> P.Reply:
        """Map a producer's NIXL-registered buffer as a remote segment (agent start and
        metadata loading run on a worker thread: the first one takes ~0.6 s)."""
        try:
            cfg = self.config
            if not 0 < req.nbytes <= MAX_SEGMENT_BYTES:
                raise E.InvalidField(f"segment size {req.nbytes} is outside 1..{MAX_SEGMENT_BYTES}")
            if cfg.max_segments_per_session and len(session.segments) >= cfg.max_segments_per_session:
                raise E.QuotaExceeded(f"session already has {len(session.segments)} segments (limit {cfg.max_segments_per_session})")
            if not self.remote.available():
                raise E.InvalidField(
                    "remote segments need NIXL in the daemon (pip install --no-deps nixl-cu12==1.5.1)"
                    if self.remote.enabled else "remote segments are disabled in this daemon"
                )
            async with self._remote_start:
                handle = await trio.to_thread.run_sync(
                    self.remote.add_segment, session.id, req.metadata, req.descs, req.nbytes
                )
            if session.closing or self.sessions.get(session.identity) is not session:
                self.remote.drop_segment(handle)
                raise E.SessionClosed("the session is closing")
            seg = self.table.add(SegmentKind.REMOTE, req.nbytes, session.id, handle)
            session.segments.add(seg.id)
            log.info("session %d: remote segment %d of %d bytes from agent %r", session.id, seg.id, req.nbytes, handle.peer)
            return P.Reply(req.id, {"va": seg.va, "nbytes": req.nbytes, "agent": self.remote.name})
        except E.TransferError as exc:
            return P.Reply(req.id, error=exc)
        except Exception as exc:  # a bug: fail this request, keep serving
            log.exception("internal error on RegisterRemote")
            return P.Reply(req.id, error=E.InternalError(f"{type(exc).__name__}: {exc}"))

    def _free(self, session: Session, va: int, kind: SegmentKind) -> None:
        seg = self.table.lookup(va, session.id)
        if va != seg.va:
            raise E.InvalidAddress(f"free needs a segment's base VA ({seg.va:#x}), got {va:#x}")
        if seg.kind != kind:
            raise E.InvalidField(f"segment {seg.id} is a {seg.kind.name.lower()} segment")
        self._drop(session, seg)

    def drop_segment(self, session: Session, seg: Segment[Any]) -> None:
        self._drop(session, seg)

    def _drop(self, session: Session, seg: Segment[Any]) -> None:
        self.table.remove(seg.id)
        for token in seg.info.get("tokens", ()):
            self.shares.pop(token, None)
        session.segments.discard(seg.id)
        if seg.kind == SegmentKind.REMOTE:
            self.remote.drop_segment(seg.handle)
            return
        self.remote.forget_local(seg)  # deregister from our NIXL agent before the memory goes
        if seg.kind == SegmentKind.HOST:
            session.host_bytes -= seg.nbytes
            shm: ShmFile = seg.handle
            try:
                for backend in self.backends:
                    backend.unregister_host(shm)
            finally:
                shm.unlink()
                shm.close()
        elif seg.kind == SegmentKind.DEVICE:
            session.device_bytes -= seg.nbytes
            self.device_bytes -= seg.nbytes
            vdev = self.devices[seg.device]
            vdev.info["bytes"] -= seg.nbytes
            vdev.backend.free(seg.handle)

    def _release(self, session: Session) -> None:
        """Forget a session and everything it owns. Idempotent."""
        if self.sessions.get(session.identity) is session:
            del self.sessions[session.identity]
        if session.pid_watch is not None:
            session.pid_watch.cancel()  # its task and pidfd go now, not when the client process exits
        if session.queue:
            # Every request gets an answer: those queued behind a Close (or a reclaim) too.
            err = E.SessionClosed("the session closed before this request ran")
            zmq_reqs = [r for r in session.queue if not isinstance(r, RingBatch)]
            if zmq_reqs:
                self.send(session.identity, P.encode_replies([P.Reply(r.id, error=err) for r in zmq_reqs]))
            session.queue.clear()
        if session.ring is not None:
            # Closing sets our closed flag and wakes a client sleeping on the ring: it fails its
            # outstanding descriptors with SessionClosed. Nothing maps the ring afterwards.
            self.ring_sessions.pop(session.id, None)
            ring, session.ring = session.ring, None
            ring.unlink()  # the client unlinks it on attach; a client that died first did not
            ring.close()
            cbell = self.cbells.pop(session.id, None)
            if cbell is not None:
                cbell.close()  # after the closed flag: a client polling it sees EOF, then the flag
        release_arenas(self, session)
        for sid in session.attached:
            seg = self.table.get(sid)
            if seg is not None:
                seg.guests.discard(session.id)
        session.attached.clear()
        for sid in list(session.segments):
            seg = self.table.get(sid)
            if seg is not None:
                self._drop(session, seg)
        session.segments.clear()
        self.remote.drop_session(session.id)

    # --- request rings (same-host clients; server._ringpath, docs/ring.md) -------------------
    def _open_ring(self, session: Session, capacity: int) -> dict[str, Any]:
        if not self.config.rings:
            raise E.RingUnavailable("request rings are disabled on this daemon (--no-rings)")
        if session.identity[:1] == b"\x01":
            raise E.RingUnavailable("request rings are for clients on the daemon's host")
        if session.ring is not None:
            raise E.RingUnavailable("this session already has a ring")
        ring = open_ring(self.config.shm_dir, self.instance, session.id, capacity, self.config.max_ring_capacity)
        if self.bell is None:  # made with the first ring: daemons without ring clients have none
            try:
                self.bell = Doorbell(self.config.shm_dir, self.instance)
            except OSError as exc:
                ring.unlink()
                ring.close()
                raise E.OutOfSharedMemory(f"cannot create the ring doorbell in {self.config.shm_dir}: {exc}") from None
        try:  # the client's completion doorbell: for a client that sleeps on an fd (trio), not a futex
            cbell = Doorbell(self.config.shm_dir, self.instance, path=completion_bell_path(ring))
        except OSError as exc:
            ring.unlink()
            ring.close()
            raise E.OutOfSharedMemory(f"cannot create the ring's completion doorbell in {self.config.shm_dir}: {exc}") from None
        ring.set_doorbell(cbell.fd)
        self.cbells[session.id] = cbell
        session.ring = ring
        self.ring_sessions[session.id] = session
        ring.arm()  # if the ring loop sleeps now, the client's first push must ring the bell
        if not self._ring_loop_started:
            assert self.nursery is not None
            self._ring_loop_started = True
            self.nursery.start_soon(self._ring_loop)
        log.info("session %d opened a %d-descriptor ring", session.id, ring.request_capacity, extra={"session": session.id})
        return {
            "path": str(ring.path),
            "bell": str(self.bell.path),  # type: ignore[union-attr]
            "cbell": str(cbell.path),
            "capacity": ring.request_capacity,
            "completion_capacity": ring.completion_capacity,
        }

    def _ring_budget(self, session: Session) -> int:
        """Descriptors we may still pop: each needs a completion slot when it is answered."""
        return session.ring.free() - session.ring_pending

    def _ring_ingest(self, session: Session) -> int:
        """Pop what the session's ring holds (within its completion budget) into its queue."""
        ring = session.ring
        if ring is None or session.closing or not self.accepting:
            return 0
        try:
            avail = ring.available()
            if not avail:
                return 0
            n = min(avail, self._ring_budget(session), self.config.max_pass)
            if n <= 0:
                return 0  # the client has not taken its completions: it waits, we do not
            if n <= 4:  # the short path: tuples, no NumPy (one wake for the batch, if any)
                batch = RingBatch(rows=[ring.pop(wake=False) for _ in range(n)])
                ring.inbox.notify()
            else:
                batch = RingBatch(array=ring.pop_many(n))
        except RingCorrupted as exc:
            self._ring_broken(session, exc)
            return 0
        n = batch.n
        if not session.queue:
            session.arrived = time.perf_counter()
        session.queue.append(batch)
        session.ring_pending += n
        session.last_seen = time.monotonic()
        session.stats.requests += n
        self.counters["requests"] += n
        self.metrics.batch(n)
        return n

    def _ring_now(self, session: Session, batch: RingBatch) -> bool:
        """The ring's short path: a few small descriptors run in order at once (RingBatch.run_now)."""
        done = batch.run_now(self.planner, session.id, self.config.inline_bytes)
        if done is None:
            return False
        comps, details, moved = done
        session.queue.clear()
        session.ring_pending -= len(comps)
        self.counters["passes"] += 1
        self.counters["ops"] += len(comps)
        session.stats.bytes_moved += moved
        if details:
            self.counters["errors"] += len(details)
            session.stats.errors += len(details)
            for r in details:
                self.metrics.error(r.error.code)  # type: ignore[union-attr]
            self.send(session.identity, P.encode_replies(details))
        self._push_completions(session, comps[0] if len(comps) == 1 else np.array(comps, dtype=COMPLETION_DTYPE))
        self.metrics.request_done("ring", time.perf_counter() - session.arrived, len(comps))
        session.arrived = 0.0
        return True

    def _complete_ring(self, session: Session, taken: Any, replies: list[P.Reply]) -> None:
        """Answer a pass's ring batches: completions on the ring, error details as replies."""
        batches = [r for r in taken if isinstance(r, RingBatch)]
        if not batches:
            return
        for batch in batches:
            comps, details = batch.outcome()
            session.ring_pending -= batch.n
            replies.extend(details)
            self._push_completions(session, comps)

    def _push_completions(self, session: Session, comps: tuple[int, ...] | np.ndarray) -> None:
        """One completion tuple or an array of them; a ring that cannot take them ends its session."""
        ring = session.ring
        if ring is None or session.closing:
            return  # the ring closes with the session; the client fails what it waits for
        try:
            ok = ring.push(comps) if isinstance(comps, tuple) else ring.push_many(comps) == len(comps)
        except RingCorrupted as exc:
            self._ring_broken(session, exc)
            return
        if not ok:  # the budget reserved these slots: only a hostile client gets here
            self._ring_broken(session, RingCorrupted("the completion queue was full although its slots were reserved"))

    def _ring_broken(self, session: Session, exc: Exception) -> None:
        if session.closing:
            return  # already on its way out
        log.warning("session %d: %s; ending the session", session.id, exc, extra={"session": session.id})
        session.closing = True
        self.counters["sessions_reaped"] += 1
        assert self.nursery is not None
        self.nursery.start_soon(self.end_session, session, f"ring: {exc}")

    def _poll_rings(self) -> int:
        """Ingest every ring; an idle session's small work runs right here (as for zmq frames)."""
        took = 0
        for session in list(self.ring_sessions.values()):
            idle = not session.queue and not session.busy
            try:
                n = self._ring_ingest(session)
                if n:
                    took += n
                    if not (idle and self._try_inline_pass(session)):
                        session.wake.set()
            except Exception as exc:  # a bug: this session goes, the daemon keeps serving the rest
                log.exception("session %d: internal error on its ring", session.id, extra={"session": session.id})
                self._ring_broken(session, exc)
        return took

    async def _ring_loop(self) -> None:
        """Drain the rings: busy-poll while they are busy, then sleep on the doorbell FIFO.

        Busy-polling holds the event loop for at most 50 µs at a time, then lets the
        other tasks (the zmq pump) run; after `ring_spin_s` without a descriptor it
        arms every ring (a client's next push then writes the FIFO) and sleeps.
        """
        assert self.bell is not None
        bell = self.bell
        spin = self.config.ring_spin_s
        clock = time.perf_counter
        poll = self._poll_rings
        until = 0.0
        while True:
            try:
                now = clock()
                if poll():
                    until = now + spin
                if clock() < until:
                    # Busy: keep polling (answering at once) for a slice, then let other tasks run.
                    end = min(until, clock() + 50e-6)
                    while (now := clock()) < end:
                        if poll():
                            until = now + spin
                            end = min(until, now + 50e-6)
                    await trio.lowlevel.checkpoint()
                    continue
                if self._arm_rings():
                    continue
                await trio.lowlevel.wait_readable(bell.fd)
                bell.drain()
                for session in list(self.ring_sessions.values()):
                    if session.ring is not None:
                        session.ring.disarm()
            except RingCorrupted:  # a ring went bad between checks: _ring_ingest ends its session
                await trio.lowlevel.checkpoint()

    def _arm_rings(self) -> bool:
        """Arm every ring's doorbell; True (and disarmed) if one has work after all."""
        ready = False
        for session in list(self.ring_sessions.values()):
            ring = session.ring
            if ring is None or session.closing:
                continue
            try:
                if ring.arm() and self._ring_budget(session) > 0:
                    ready = True
            except RingCorrupted as exc:
                self._ring_broken(session, exc)
        if ready:
            for session in self.ring_sessions.values():
                if session.ring is not None:
                    session.ring.disarm()
        return ready

    async def end_session(self, session: Session, why: str) -> None:
        """Reclaim a dead or silent client's session: stop its work, then free its memory."""
        log.info("session %d ended: %s", session.id, why, extra={"session": session.id})
        session.closing = True
        session.cancel_scope.cancel()
        await session.finished.wait()  # a copy running on a thread finishes first
        self._release(session)

    async def _watch_pid(self, session: Session) -> None:
        """Same-host clients: a pidfd becomes readable the instant the process dies."""
        try:
            pidfd = os.pidfd_open(session.pid)
        except (OSError, AttributeError):
            return  # not visible (other pid namespace) or too old a kernel: heartbeats still apply
        try:
            with trio.CancelScope() as scope:
                session.pid_watch = scope  # cancelled by _release: a closed session needs no watcher
                await trio.lowlevel.wait_readable(pidfd)
                self.counters["sessions_reaped"] += 1
                await self.end_session(session, f"client pid {session.pid} exited")
        finally:
            os.close(pidfd)

    async def reap_silent(self) -> None:
        """Reclaim sessions that sent nothing (not even a ping) for session_timeout_s."""
        while True:
            await trio.sleep(min(1.0, self.config.session_timeout_s / 4))
            now = time.monotonic()
            self.metrics.set_gauges(
                sessions=len(self.sessions),
                segments=len(self.table),
                queued=sum(len(s.queue) for s in self.sessions.values()),
                device_bytes=self.device_bytes,
            )
            for session in list(self.sessions.values()):
                if now - session.last_seen > self.config.session_timeout_s and not session.closing:
                    self.counters["sessions_reaped"] += 1
                    assert self.nursery is not None
                    self.nursery.start_soon(self.end_session, session, "heartbeat timeout")

    def stats(self, session: Session | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "daemon": {
                **self.counters,
                "sessions": len(self.sessions),
                "rings": len(self.ring_sessions),
                "segments": len(self.table),
                "device_bytes": self.device_bytes,
                "devices": [{"index": d.index, "kind": d.kind, "queued_bytes": d.queued_bytes, "batches": d.completed} for d in self.devices],
                "uptime_s": round(time.monotonic() - self.started, 3),
                **self.remote.counters,
            }
        }
        if session is not None:
            out["session"] = {"id": session.id, **session.stats.to_wire(), "segments": len(session.segments), "ring": session.ring is not None}
        return out
