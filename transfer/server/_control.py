"""Control requests: everything that is not data. Each is a barrier in its session's pass.

Registering, allocating, freeing, sharing, definitions, rings and data channels, fences, stats
and close are answered here, in order with the data requests around them;
the pass runs each once what came before it has completed.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import trio

from .. import errors as E
from .. import protocol as P
from ..addressing import SegmentKind
from ._deferred import define
from ._resources import Resources
from ._channels import Channels
from ._rings import Rings
from ._session import Phase, Session

__all__ = ["Control", "BARRIERS", "AFTER_PASS", "STATS_PER_FRAME"]

log = logging.getLogger("transfer.server")

#: Requests that act as barriers: a pass stops before them, and runs them before what follows.
BARRIERS: tuple[type[P.Request], ...] = (P.Define, P.OpenRing, P.OpenChannel, P.RegisterHost, P.RegisterRemote, P.Unregister, P.Alloc, P.Free, P.Share, P.Attach, P.Close, P.Hello)
#: Answered once everything taken before them in the pass has completed.
AFTER_PASS: tuple[type[P.Request], ...] = (P.Fence, P.Ping, P.Stats, P.Wait, P.RingMark)
#: Stats answered per frame (or pass): a reply is ~1 KiB, so many would amplify a small
#: frame into megabytes. More get QuotaExceeded.
STATS_PER_FRAME = 16


class Control:
    def __init__(self, resources: Resources, rings: Rings, channels: Channels, stats: Callable[[Session], dict[str, Any]]) -> None:
        self.resources = resources
        self.rings = rings
        self.channels = channels
        self.stats = stats
        #: Set by the daemon loop: where session-scoped tasks (the ring loop) start.
        self.nursery: trio.Nursery | None = None

    def execute(self, session: Session, req: Any) -> P.Reply:
        """Answer one control request; its failure is its own reply, never the daemon's."""
        try:
            return P.Reply(req.id, self._execute(session, req))
        except E.TransferError as exc:
            return P.Reply(req.id, error=exc)
        except Exception as exc:  # a bug: fail this request, keep serving
            log.exception("internal error on %s", type(req).__name__)
            return P.Reply(req.id, error=E.InternalError(f"{type(exc).__name__}: {exc}"))

    def register_remote_now(self, session: Session, req: P.RegisterRemote) -> P.Reply | None:
        """RegisterRemote answered on the loop, or None: it waits on a thread (`execute_async`)."""
        try:
            value = self.resources.register_remote_now(session, req)
            return None if value is None else P.Reply(req.id, value)
        except Exception as exc:
            return self._remote_failed(req, exc)

    async def execute_async(self, session: Session, req: P.RegisterRemote) -> P.Reply:
        """RegisterRemote waits on a worker thread (the NIXL agent's first start takes ~0.6 s)."""
        try:
            return P.Reply(req.id, await self.resources.register_remote(session, req))
        except Exception as exc:
            return self._remote_failed(req, exc)

    @staticmethod
    def _remote_failed(req: P.RegisterRemote, exc: Exception) -> P.Reply:
        if not isinstance(exc, E.TransferError):  # a bug: fail this request, keep serving
            log.exception("internal error on RegisterRemote")
            return P.Reply(req.id, error=E.InternalError(f"{type(exc).__name__}: {exc}"))
        if req.site:  # a deferred registration: named by where the client's code made it
            exc = type(exc)(f"remote segment registered at {req.site}: {exc.message}")
        return P.Reply(req.id, error=exc)

    def answer_after(self, session: Session, reqs: list[Any]) -> list[P.Reply]:
        """Fences, pings, waits and stats, once what came before them is done: the counters
        are read once for all of them, and at most `STATS_PER_FRAME` Stats are answered."""
        stats: Any = None
        n_stats = 0
        out = []
        for req in reqs:
            if type(req) is not P.Stats:
                out.append(self.execute(session, req))
                continue
            n_stats += 1
            if n_stats > STATS_PER_FRAME:
                out.append(P.Reply(req.id, error=E.QuotaExceeded(f"at most {STATS_PER_FRAME} Stats requests per frame")))
                continue
            if stats is None:
                stats = self.stats(session)
            out.append(P.Reply(req.id, stats))
        return out

    def _execute(self, session: Session, req: Any) -> Any:
        res = self.resources
        t = type(req)
        if t is P.BadRequest:
            raise req.error
        if t is P.Fence or t is P.Ping or t is P.RingMark:
            return None  # a fence: everything before it in the session is done
        if t is P.Stats:
            return self.stats(session)
        if t is P.Wait:
            session.stats.blocking += 1
            return None
        if t is P.RegisterHost:
            return res.register_host(session, req.nbytes)
        if t is P.Alloc:
            return res.alloc_at(session, None, req.nbytes, req.device)
        if t is P.Unregister:
            res.free(session, req.va, SegmentKind.HOST)
            return None
        if t is P.Free:
            res.free(session, req.va, SegmentKind.DEVICE)
            return None
        if t is P.Define:
            return define(res, session, req)
        if t is P.Share:
            return res.share(session, req.va)
        if t is P.Attach:
            return res.attach(session, req.token)
        if t is P.OpenRing:
            assert self.nursery is not None
            return self.rings.open(session, req.capacity, req.completion_bell, self.nursery)
        if t is P.OpenChannel:
            assert self.nursery is not None
            return self.channels.open(session, req.capacity, self.nursery)
        if t is P.Close:
            session.to(Phase.CLOSING)
            log.info("session %d closed by its client", session.id, extra={"session": session.id})
            return None
        if t is P.Hello:
            raise E.InvalidField("hello on an established session")
        raise E.UnknownOperation(f"{t.__name__} is not served here")
