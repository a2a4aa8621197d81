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
import time
from typing import Any, Callable

import numpy as np
import trio

from .. import errors as E
from .. import protocol as P
from ..addressing import MAX_SEGMENT_BYTES, MappingTable, Segment, SegmentKind
from ..backends import Backend, Span, make_backend
from ..memory import DaemonLock, ShmFile, sweep_stale
from ._config import DaemonConfig
from ._session import Session

__all__ = ["Server"]

log = logging.getLogger("transfer.server")

_DATA_OPS = (P.Copy, P.CopyV, P.Fill, P.Checksum)


class Server:
    """State and request execution; `transfer.server._daemon` drives its I/O."""

    def __init__(self, config: DaemonConfig, backend: Backend | None = None) -> None:
        self.config = config
        self.backend = backend or make_backend(config.backend, config.devices)
        self.table: MappingTable[Any] = MappingTable()
        self.sessions: dict[bytes, Session] = {}
        self.limiter = trio.CapacityLimiter(config.threads)
        self.device_bytes = 0
        self.accepting = True
        self.started = time.monotonic()
        self.counters = {"frames": 0, "requests": 0, "errors": 0, "bad_frames": 0, "sessions_reaped": 0}
        self.watch_pids = any(e.startswith("ipc://") for e in config.endpoints)
        self._lock: DaemonLock | None = None
        # Set by the daemon loop:
        self.send: Callable[[bytes, bytes], None] = lambda identity, data: None
        self.nursery: trio.Nursery | None = None

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
        try:
            session.inbox_send.send_nowait(reqs)
        except trio.WouldBlock:
            self._reply_all(
                identity, reqs, E.QuotaExceeded(f"more than {self.config.max_queued_frames} frames queued for this session")
            )

    def _reply_all(self, identity: bytes, reqs: list[P.Decoded], err: E.TransferError) -> None:
        self.counters["errors"] += len(reqs)
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
        send, recv = trio.open_memory_channel[list[P.Decoded]](self.config.max_queued_frames)
        session = Session(identity, req.client, req.pid, send, recv, last_seen=time.monotonic())
        self.sessions[identity] = session
        assert self.nursery is not None
        self.nursery.start_soon(self._run_session, session)
        if self.watch_pids and req.pid > 0:
            self.nursery.start_soon(self._watch_pid, session)
        log.info("session %d opened by %r (pid %d)", session.id, req.client, req.pid)
        return session, {
            "session": session.id,
            "server_pid": os.getpid(),
            "version": P.VERSION,
            "limits": self.config.limits.to_wire(),
            "backend": self.backend.describe(),
            "heartbeat_s": self.config.heartbeat_s,
            "session_timeout_s": self.config.session_timeout_s,
            "shm_dir": str(self.config.shm_dir),
        }

    # --- per-session execution --------------------------------------------------
    async def _run_session(self, session: Session) -> None:
        try:
            with session.cancel_scope:
                async for reqs in session.inbox_recv:
                    replies = await self.execute(session, reqs)
                    self.send(session.identity, P.encode_replies(replies))
                    if session.closing:
                        break
        finally:
            session.finished.set()
            self._release(session)

    async def execute(self, session: Session, reqs: list[P.Decoded]) -> list[P.Reply]:
        """Run one frame's requests in order; each fails alone."""
        replies: list[P.Reply] = []
        i = 0
        while i < len(reqs):
            req = reqs[i]
            if isinstance(req, _DATA_OPS):
                j = i
                while j < len(reqs) and isinstance(reqs[j], _DATA_OPS):
                    j += 1
                replies.extend(await self._execute_data(session, reqs[i:j]))
                i = j
                continue
            replies.append(self._execute_control(session, req))
            i += 1
        failed = sum(1 for r in replies if r.error is not None)
        session.stats.errors += failed
        self.counters["errors"] += failed
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
                self._free(session, req.va, kind)
                return P.Reply(req.id, None)
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

    # --- data requests --------------------------------------------------------------
    def _span(self, session: Session, va: int, nbytes: int) -> Span:
        seg, off = self.table.translate(va, nbytes, session.id)
        if seg.kind == SegmentKind.REMOTE:
            raise E.InvalidField("remote segments are not served by this daemon build")
        return Span(seg.kind, seg.handle, off, nbytes)

    def _plan(self, session: Session, req: P.Request) -> tuple[Callable[[], Any], int]:
        """Translate a data request; return (work, bytes touched). Raises before touching memory."""
        backend = self.backend
        if isinstance(req, P.Copy):
            dst, src = self._span(session, req.dst, req.nbytes), self._span(session, req.src, req.nbytes)
            session.stats.bytes_copied += req.nbytes
            return (lambda: backend.copy(dst, src)), req.nbytes
        if isinstance(req, P.Fill):
            dst = self._span(session, req.dst, req.nbytes)
            return (lambda: backend.fill(dst, req.value)), req.nbytes
        if isinstance(req, P.Checksum):
            src = self._span(session, req.src, req.nbytes)
            session.stats.bytes_read += req.nbytes
            return (lambda: backend.checksum(src)), req.nbytes
        assert isinstance(req, P.CopyV)
        pairs = self._plan_vector(session, req)
        total = int(req.nbytes.sum(dtype=np.uint64)) if len(req.nbytes) else 0
        session.stats.bytes_copied += total

        def run() -> int:
            for d, s in pairs:
                backend.copy(d, s)
            return len(req.nbytes)

        return run, total

    def _plan_vector(self, session: Session, req: P.CopyV) -> list[tuple[Span, Span]]:
        """Validate a vector copy with NumPy, then merge contiguous runs into single copies."""
        n = len(req.nbytes)
        if n == 0:
            return []
        table = self.table
        dsid, doff, dsegs = table.translate_many(req.dst, req.nbytes, session.id)
        ssid, soff, ssegs = table.translate_many(req.src, req.nbytes, session.id)
        for seg in (*dsegs.values(), *ssegs.values()):
            if seg.kind == SegmentKind.REMOTE:
                raise E.InvalidField("remote segments are not served by this daemon build")
        size = req.nbytes
        # A copy continues the previous one if both ends pick up exactly where it stopped.
        cont = np.zeros(n, dtype=bool)
        if n > 1:
            cont[1:] = (
                (dsid[1:] == dsid[:-1])
                & (ssid[1:] == ssid[:-1])
                & (doff[1:] == doff[:-1] + size[:-1])
                & (soff[1:] == soff[:-1] + size[:-1])
            )
        starts = np.flatnonzero(~cont)
        ends = np.append(starts[1:], n)
        csum = np.concatenate(([0], np.cumsum(size, dtype=np.uint64)))
        pairs: list[tuple[Span, Span]] = []
        for a, b in zip(starts.tolist(), ends.tolist()):
            run_bytes = int(csum[b] - csum[a])
            ds, ss = dsegs[int(dsid[a])], ssegs[int(ssid[a])]
            do, so = int(doff[a]), int(soff[a])
            if b - a > 1 and ds is ss and do < so + run_bytes and so < do + run_bytes:
                # Overlapping run: one memmove would differ from copying piece by piece.
                for k in range(a, b):
                    nb = int(size[k])
                    pairs.append((Span(ds.kind, ds.handle, int(doff[k]), nb), Span(ss.kind, ss.handle, int(soff[k]), nb)))
                continue
            pairs.append((Span(ds.kind, ds.handle, do, run_bytes), Span(ss.kind, ss.handle, so, run_bytes)))
        return pairs

    async def _execute_data(self, session: Session, reqs: list[P.Decoded]) -> list[P.Reply]:
        planned: list[tuple[int, Callable[[], Any] | None, E.TransferError | None]] = []
        total = 0
        for req in reqs:
            try:
                if isinstance(req, P.BadRequest):
                    raise req.error
                work, nbytes = self._plan(session, req)  # type: ignore[arg-type]
                planned.append((req.id, work, None))
                total += nbytes
            except E.TransferError as exc:
                planned.append((req.id, None, exc))

        def run_all() -> list[P.Reply]:
            out = []
            for rid, work, err in planned:
                if work is None:
                    out.append(P.Reply(rid, error=err))
                    continue
                try:
                    result = work()
                    out.append(P.Reply(rid, result if isinstance(result, int) else None))
                except E.TransferError as exc:
                    out.append(P.Reply(rid, error=exc))
                except Exception as exc:
                    log.exception("backend failure")
                    out.append(P.Reply(rid, error=E.BackendError(f"{type(exc).__name__}: {exc}")))
            return out

        if total < self.config.inline_bytes:
            return run_all()
        return await trio.to_thread.run_sync(run_all, limiter=self.limiter)

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
            self.backend.register_host(shm)
            seg = self.table.add_reserved(sid, SegmentKind.HOST, nbytes, session.id, shm)
        except BaseException:
            shm.unlink()
            shm.close()
            raise
        session.segments.add(seg.id)
        session.host_bytes += nbytes
        return {"va": seg.va, "nbytes": nbytes, "path": str(shm.path)}

    def _alloc(self, session: Session, nbytes: int, device: int) -> dict[str, Any]:
        self._check_quota(session, nbytes, SegmentKind.DEVICE)
        ndev = self.backend.device_count
        if device == -1:
            device = 0
        if not 0 <= device < ndev:
            raise E.InvalidField(f"device {device} does not exist (this daemon has {ndev})")
        try:
            mem = self.backend.alloc(nbytes, device)
        except MemoryError:
            raise E.OutOfDeviceMemory(f"device {device} cannot allocate {nbytes} bytes") from None
        seg = self.table.add(SegmentKind.DEVICE, nbytes, session.id, mem, device)
        session.segments.add(seg.id)
        session.device_bytes += nbytes
        self.device_bytes += nbytes
        return {"va": seg.va, "nbytes": nbytes, "device": device}

    def _free(self, session: Session, va: int, kind: SegmentKind) -> None:
        seg = self.table.lookup(va, session.id)
        if va != seg.va:
            raise E.InvalidAddress(f"free needs a segment's base VA ({seg.va:#x}), got {va:#x}")
        if seg.kind != kind:
            raise E.InvalidField(f"segment {seg.id} is a {seg.kind.name.lower()} segment")
        self._drop(session, seg)

    def _drop(self, session: Session, seg: Segment[Any]) -> None:
        self.table.remove(seg.id)
        session.segments.discard(seg.id)
        if seg.kind == SegmentKind.HOST:
            session.host_bytes -= seg.nbytes
            shm: ShmFile = seg.handle
            try:
                self.backend.unregister_host(shm)
            finally:
                shm.unlink()
                shm.close()
        elif seg.kind == SegmentKind.DEVICE:
            session.device_bytes -= seg.nbytes
            self.device_bytes -= seg.nbytes
            self.backend.free(seg.handle)

    def _release(self, session: Session) -> None:
        """Forget a session and everything it owns. Idempotent."""
        if self.sessions.get(session.identity) is session:
            del self.sessions[session.identity]
        session.inbox_send.close()
        for sid in list(session.segments):
            seg = self.table.get(sid)
            if seg is not None:
                self._drop(session, seg)
        session.segments.clear()

    async def end_session(self, session: Session, why: str) -> None:
        """Reclaim a dead or silent client's session: stop its work, then free its memory."""
        log.info("session %d ended: %s", session.id, why)
        session.closing = True
        session.inbox_send.close()
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
                session.info["pid_scope"] = scope
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
                "segments": len(self.table),
                "device_bytes": self.device_bytes,
                "uptime_s": round(time.monotonic() - self.started, 3),
            }
        }
        if session is not None:
            out["session"] = {"id": session.id, **session.stats.to_wire(), "segments": len(session.segments)}
        return out
