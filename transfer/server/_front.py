"""The session front: frames in, sessions opened and ended, work queued.

`on_message` runs on the socket pump's task for every frame (synchronous,
microseconds): it decodes the frame, opens a session on hello, and queues
the requests on their session in the batch form; the pass (`_pass`) does
the rest. Each session has one task that runs the passes `kick` did not run
inline, and that releases the session's resources when it ends.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Awaitable, Callable

import trio

from .. import _results as R
from .. import errors as E
from .. import protocol as P
from ._accounting import Accounting
from ._control import Control
from ._config import DaemonConfig
from ._ops import SOCKET
from ._pass import Pass
from ._resources import Resources
from ._rings import Rings
from ._session import Phase, Session

__all__ = ["Front"]

log = logging.getLogger("transfer.server")


class Front:
    def __init__(
        self, config: DaemonConfig, pass_: Pass, rings: Rings, resources: Resources, accounting: Accounting,
        hello_info: Callable[[Session], R.HelloResult], control: Control,
    ) -> None:
        self.config = config
        self.pass_ = pass_
        self.rings = rings
        self.resources = resources
        self.accounting = accounting
        self._hello_info = hello_info
        self._control = control
        self.sessions: dict[bytes, Session] = {}
        self.accepting = True
        #: Sessions served at once (the daemon sizes it from the fd limit at startup).
        self.max_sessions = config.max_sessions or 1024
        self.watch_pids = any(e.startswith("ipc://") for e in config.endpoints)
        # Set by the daemon loop:
        self.send: Callable[[bytes, bytes], None] = lambda identity, data: None
        self.nursery: trio.Nursery | None = None

    # --- incoming frames (synchronous, on the pump's task) -------------------------------------
    def on_message(self, parts: list[bytes], secure: bool = False) -> None:
        """One message from a ROUTER socket: [identity, frame]. `secure`: the CURVE (tcp) socket.

        Every frame of a session is counted once it is dealt with (its requests queued, or
        answered): ring descriptors pushed after it wait for that count (`FLAG_AFTER`).

        A fault here that no check foresaw costs the frame's sender its frame and its
        session, never the daemon: this runs on the socket pump's task, which every tenant
        shares."""
        try:
            self._message(parts, secure)
        except Exception as exc:
            self._internal_error(parts[0] if parts else b"", exc)
            return
        session = self.sessions.get(parts[0]) if len(parts) == 2 else None
        if session is not None:
            session.frames_seen += 1
            if session.ring_held is not None:  # ring requests that waited for this frame
                self.rings.after_frame(session)
                self.pass_.kick(session)

    def _message(self, parts: list[bytes], secure: bool) -> None:
        acc = self.accounting
        if len(parts) != 2:
            acc.bad_frame()
            if parts:
                self.send(parts[0], P.frame_error(E.MalformedFrame("expected exactly one frame per message")))
            return
        identity, data = parts
        try:
            reqs = P.decode_requests(data, self.config.limits)
        except E.ProtocolError as exc:
            acc.frame(None)
            acc.bad_frame()
            self.send(identity, P.frame_error(exc))
            return
        session = self.sessions.get(identity)
        acc.frame(session)
        if not reqs:
            return
        if not self.accepting:
            # Draining: nothing new is accepted, whoever sends it (a session that already
            # finished draining is gone from `sessions`, and must not read NoSession).
            acc.received(session, len(reqs))
            self._refuse(identity, session, reqs, E.ShuttingDown("the daemon is shutting down"))
            return
        if session is None:
            first = reqs[0]
            if not isinstance(first, P.Hello):
                acc.received(None, len(reqs))
                no_session = E.NoSession("no session: send hello first (or the daemon restarted)")
                if isinstance(first, P.BadRequest) and first.id:  # (a hello that failed its checks says why)
                    self.accounting.failed(None, first.error.code, 1)
                    self.send(identity, P.encode_replies([P.Reply(first.id, error=first.error)]))
                    reqs = reqs[1:]
                if reqs:
                    self._refuse(identity, None, reqs, no_session)
                return
            try:
                session, result = self._hello(identity, first, secure)
            except E.TransferError as exc:
                acc.received(None, len(reqs))
                self._refuse(identity, None, reqs, exc)
                return
            acc.received(session, len(reqs))
            self.send(identity, P.encode_replies([P.Reply(first.id, result)]))
            reqs = reqs[1:]
            if not reqs:
                return
        else:
            acc.received(session, len(reqs))
        # Pings and stats are answered at once; they must not wait behind a long copy.
        if all(type(r) is P.Ping or type(r) is P.Stats for r in reqs):
            replies = self._control.answer_after(session, reqs)
            refused = [r.error.code for r in replies if r.error is not None]
            if refused:
                self.accounting.failed(session, refused[0], len(refused))
            self.send(identity, P.encode_replies(replies))
            return
        if not session.accepting:
            self._refuse(identity, session, reqs, E.SessionClosed("the session is closing"))
            return
        if session.inflight + len(reqs) > self.config.max_inflight:
            # Clients keep within the credits announced in hello; only a misbehaving one gets here.
            self._refuse(identity, session, reqs, E.QuotaExceeded(f"more than {self.config.max_inflight} requests in flight for this session"))
            return
        if session.ring is not None:  # what the client pushed before this frame goes first
            first = reqs[0]
            self.rings.before_frame(session, first.pushed if type(first) is P.RingMark else None)
        session.queue.extend([(r, SOCKET) for r in reqs])
        session.inflight += len(reqs)
        self.pass_.kick(session)

    def _internal_error(self, identity: bytes, exc: Exception) -> None:
        """A bug met while reading one frame: answer the frame (id 0: nothing in it can be
        trusted now) and end its session; the daemon goes on serving everyone else."""
        log.exception("internal error on a frame; ending its session")
        self.accounting.bad_frame()
        session = self.sessions.get(identity)
        if session is not None:
            self.end_soon(session, f"internal error: {type(exc).__name__}")
        if identity:
            self.send(identity, P.frame_error(E.InternalError(f"{type(exc).__name__}: {exc}")))

    def _spawn(self, fn: Callable[[Session], Awaitable[None]], session: Session) -> None:
        """Start one of a session's tasks so that a bug in it ends that session alone: every
        session's tasks share the daemon's nursery, where an escaping exception would end them all."""
        assert self.nursery is not None
        self.nursery.start_soon(self._isolated, fn, session)

    async def _isolated(self, fn: Callable[[Session], Awaitable[None]], session: Session) -> None:
        try:
            await fn(session)
        except Exception as exc:
            log.exception("session %d: internal error in %s; ending the session", session.id, fn.__name__, extra={"session": session.id})
            if session.phase is not Phase.CLOSED:
                await self.end_session(session, f"internal error: {type(exc).__name__}")

    def reply_overflow(self, identity: bytes) -> None:
        """The client stopped reading its replies and its backlog passed the cap: end it."""
        session = self.sessions.get(identity)
        if session is not None:
            log.warning("session %d: its unread replies passed the backlog cap", session.id, extra={"session": session.id})
            self.end_soon(session, "stopped reading its replies")

    def _refuse(self, identity: bytes, session: Session | None, reqs: list[Any], err: E.TransferError) -> None:
        self.accounting.failed(session, err.code, len(reqs))
        self.send(identity, P.encode_replies([P.Reply(r.id, error=err) for r in reqs]))

    def _hello(self, identity: bytes, req: P.Hello, secure: bool) -> tuple[Session, R.HelloResult]:
        if req.version != P.VERSION:
            raise E.UnsupportedVersion(f"client speaks protocol {req.version}, this daemon {P.VERSION}")
        if not self.accepting:
            raise E.ShuttingDown("the daemon is shutting down")
        if len(self.sessions) >= self.max_sessions:
            raise E.QuotaExceeded(f"daemon at its session limit ({self.max_sessions} sessions): try again later")
        if req.priority not in (P.PRIORITY_NORMAL, P.PRIORITY_LATENCY):
            raise E.InvalidField(f"Hello.priority: {req.priority} is not a priority ({P.PRIORITY_NORMAL}: normal, {P.PRIORITY_LATENCY}: latency)")
        session = Session(identity, req.client, req.pid, remote_peer=secure, last_seen=time.monotonic(), host_pid=req.pid,
                          priority=req.priority)
        info = self._hello_info(session)  # grants arenas: may refuse
        self.sessions[identity] = session
        self._spawn(self._run_session, session)
        if self.watch_pids and req.pid > 0 and not secure:  # not for CURVE tcp peers (other hosts)
            self._spawn(self._watch_pid, session)
        log.info("session %d opened by %r (pid %d)", session.id, req.client, req.pid, extra={"session": session.id})
        return session, info

    # --- per-session task ----------------------------------------------------------------------
    async def _run_session(self, session: Session) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.pass_.pipeline.answer, session)
                try:
                    with session.cancel_scope:
                        while session.running:
                            if session.current is None and not session.queue:
                                if session.phase is Phase.DRAINING and self.rings.drained(session):
                                    break  # (its ring's worker, or the loop, serves up to the cut and wakes us)
                                await session.wake.wait()
                                session.wake = trio.Event()
                                continue
                            await self.pass_.run(session)
                finally:
                    with trio.CancelScope(shield=True):  # queued device work is answered first
                        await self.pass_.pipeline.drain(session)
                    nursery.cancel_scope.cancel()
        finally:
            session.finished.set()
            self.release(session)

    def release(self, session: Session) -> None:
        """Forget a session and everything it owns; every queued request is answered. Idempotent."""
        if self.sessions.get(session.identity) is session:
            del self.sessions[session.identity]
        if session.phase is Phase.CLOSED:
            return
        session.to(Phase.CLOSED)
        if session.pid_watch is not None:
            session.pid_watch.cancel()  # its task and pidfd go now, not when the client process exits
        if session.queue:
            err = E.SessionClosed("the session closed before this request ran")
            socket_reqs = [r for r, route in session.queue if route == SOCKET]
            if socket_reqs:
                self.send(session.identity, P.encode_replies([P.Reply(r.id, error=err) for r in socket_reqs]))
            session.queue.clear()  # ring requests: the ring closes with the session, failing them client-side
        self.rings.close(session, E.SessionClosed if self.accepting else E.ShuttingDown)
        self.resources.release(session)
        self.accounting.ended(session)  # after the ring's worker folded its last counts in

    async def end_session(self, session: Session, why: str) -> None:
        """Reclaim a dead or silent client's session: stop its work, then free its memory."""
        log.info("session %d ended: %s", session.id, why, extra={"session": session.id})
        if session.phase is not Phase.CLOSED:
            session.to(Phase.CLOSING)
        session.cancel_scope.cancel()
        await session.finished.wait()  # a copy running on a thread finishes first
        self.release(session)

    def end_soon(self, session: Session, why: str) -> None:
        """End a session from synchronous code (a broken ring, a lost NIXL peer)."""
        if not session.running:
            return
        session.to(Phase.CLOSING)
        self.accounting.reaped()
        assert self.nursery is not None
        self.nursery.start_soon(self.end_session, session, why)  # (release, its last step, cannot fail)

    async def _watch_pid(self, session: Session) -> None:
        """Same-host clients: a pidfd becomes readable the instant the process dies. The pid is
        the session's `host_pid`: its hello's until its first fd handover shows the process as
        this daemon sees it (a client in a pid namespace of its own), then that one (`rewatch`)."""
        pid = session.host_pid
        try:
            pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            return  # not visible (other pid namespace) or too old a kernel: heartbeats still apply
        try:
            with trio.CancelScope() as scope:
                session.pid_watch = scope  # cancelled by release (a closed session needs no watcher), or by rewatch
                await trio.lowlevel.wait_readable(pidfd)
                self.accounting.reaped()
                await self.end_session(session, f"client pid {pid} exited")
        finally:
            os.close(pidfd)

    def rewatch(self, session: Session, pid: int) -> None:
        """The session's process is `pid` here (its first fd handover said so): watch that one."""
        if not session.running or session.remote_peer or not self.watch_pids:
            return
        if session.pid_watch is not None:
            session.pid_watch.cancel()
            session.pid_watch = None
        log.info("session %d: its process is pid %d here (pid %d in its own namespace)", session.id, pid, session.pid,
                 extra={"session": session.id})
        self._spawn(self._watch_pid, session)

    def reap_silent(self) -> None:
        """Reclaim sessions that sent nothing (not even a ping) for session_timeout_s."""
        now = time.monotonic()
        for session in list(self.sessions.values()):
            worker = session.worker
            if worker is not None and worker.done != session.info.get("worker_done"):
                session.info["worker_done"] = worker.done  # its ring worker served it: not silent
                session.last_seen = now
            if now - session.last_seen > self.config.session_timeout_s and session.running:
                self.end_soon(session, "heartbeat timeout")

    def drain(self) -> list[Session]:
        """Shutdown: accept nothing new (new requests get ShuttingDown, on the socket now and
        on a ring by its close); each session finishes what is queued and what its client
        had published on its ring, then ends."""
        self.accepting = False
        self.pass_.shutting_down = True
        sessions = list(self.sessions.values())
        for s in sessions:
            if s.phase is Phase.OPEN:
                s.to(Phase.DRAINING)
                self.rings.cut(s)  # what its client published on its ring before now is served
            s.wake.set()
        return sessions

    def stop(self, sessions: list[Session]) -> None:
        """The grace ran out: what is queued fails ShuttingDown (replies, ring completions);
        a pass running on a worker finishes its current wave, is answered, and the session ends."""
        err = E.ShuttingDown("the daemon is shutting down: its grace ran out before this request ran")
        for s in sessions:
            if not s.running:
                continue
            self.pass_.fail_queued(s, err)
            s.to(Phase.CLOSING)
            s.wake.set()
