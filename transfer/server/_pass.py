"""The one pass every request goes through, whatever brought it.

Socket frames, ring descriptors and remote sessions all queue the same
batch form on their session: (request, route) pairs in arrival order, where
the route says only where the answer goes (a reply frame, or a completion on
the ring). A pass then:

1. **takes** what is queued up to the next barrier (control requests before
   it run first, in order: `_control`);
2. **plans** it (`_planner`: every VA translated and checked, runs of copies
   as one vector op);
3. **schedules** the ops into hazard-free waves (`_waves`);
4. **executes** them: on the event loop when the pass is small (at most
   `inline_bytes`, no RDMA), else on the devices' worker threads, or (a CPU
   device's kernels) sent to its process, the loop told when they are done.
   Inline is a decision here, not a second implementation;
5. makes the device work **visible** (each device synchronized as its share
   of a wave ends), and only then
6. **completes**: one reply frame for socket requests, completions on the
   ring for ring requests, error details as replies;
7. **accounts** once (`_accounting`).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import trio

from .. import errors as E
from .. import protocol as P
from ..ring import COMPLETION_DETAIL, COMPLETION_DTYPE, CopyRun
from ._accounting import Accounting
from ._config import DaemonConfig
from ._control import AFTER_PASS, BARRIERS, Control
from ._deferred import resolve
from ._ops import RING, runs_inline
from ._batch import Batch, joins, one_lane, plan_batch
from ._pipeline import Pipeline
from ._planner import Planner
from ._rings import Rings
from ._session import Phase, Session
from ._waves import assign_waves, run_inline, run_waves

__all__ = ["Pass"]

_BARRIERS = frozenset(BARRIERS)
_AFTER = frozenset(AFTER_PASS)
#: Passes in a row that `kick` runs inline before it hands the rest to the session's task.
_INLINE_PASSES = 4


class Pass:
    def __init__(
        self, config: DaemonConfig, planner: Planner, limiters: dict[int, trio.CapacityLimiter],
        control: Control, rings: Rings, accounting: Accounting, send: Callable[[bytes, bytes], None],
    ) -> None:
        self.config = config
        self.planner = planner
        self.limiters = limiters
        self.control = control
        self.rings = rings
        self.accounting = accounting
        self.send = send
        #: Set by the server: end a session (its NIXL peer died mid-transfer).
        self.on_peer_lost: Callable[[Session], None] = lambda s: None
        #: Releases a session (the front's `release`): a client's Close is answered only once
        #: everything its session held is released, so its close() returning means so.
        self.on_closed: Callable[[Session], None] = lambda s: None
        #: The daemon is draining (set by the front): what cannot run fails ShuttingDown.
        self.shutting_down = False
        #: Threads waiting for pipelined passes' fences (apart from the devices' workers).
        self.waiters = trio.CapacityLimiter(64)
        #: Passes queued behind one another on a GPU lane or a CPU device (`_pipeline`).
        self.pipeline = Pipeline(self)

    # --- entry points --------------------------------------------------------------------------
    def kick(self, session: Session) -> None:
        """Requests were queued: run small passes right now, queue a pass that only joins the
        session's CPU pipeline right now, and hand anything else to the session's task."""
        if session.ring_wait is not None:
            # A frame waits for the ring requests its client pushed before it (`Rings.catch_up`).
            session.wake.set()
            return
        for _ in range(_INLINE_PASSES):
            if session.current is not None or not session.queue:
                break
            tail = session.pipeline[-1] if session.pipeline else None
            if tail is not None and (tail.fence is not None or type(session.queue[0][0]) in _BARRIERS):
                break  # a GPU pipeline, or a barrier that waits for the pipeline: the task's
            if self.planner.remote_bound(session.queue[0][0]):
                # Never inline (it waits on a NIXL post): the task takes it, with what the pump
                # delivers before the task runs (the rest of this burst). Taken here, it was a
                # pass of its own: 1.6 requests a pass against 2.0, each pass one post and one
                # reply (~4 us of the daemon's thread per 1 MiB request).
                break
            batch = self.take(session)
            if joins(batch, tail):
                # Only queued (what `run` would do, without the hop to the session's task):
                # the completer's worker runs it in turn, after the passes before it.
                self.pipeline.queue_cpu(session, batch)
                continue
            if tail is not None or not batch.inline:
                session.current = batch  # answers stay in order: the task runs it in its turn
                break
            run_inline(batch.waves)
            self.complete(batch)
        if session.current is not None or session.queue or not session.accepting:
            session.wake.set()  # else the task has nothing to do: only passes were queued

    async def run(self, session: Session) -> None:
        """The session task's step: the pass `kick` handed over, or a new one."""
        if session.current is None and session.ring_wait is not None:
            await self.rings.catch_up(session)
            return
        if session.current is None and session.pipeline and session.queue and type(session.queue[0][0]) in _BARRIERS:
            await self.pipeline.drain(session)  # a barrier runs once everything before it is done
        batch = session.current or self.take(session)
        session.current = batch
        pipelined = False
        try:
            if batch.pipe is not None and (session.pipeline or not batch.inline):
                pipelined = await self.pipeline.enqueue(session, batch)
            else:
                await self.pipeline.drain(session)
                if batch.remote is not None:
                    batch.replies.append((batch.remote.id, 0, await self.control.execute_async(session, batch.remote)))
                elif batch.inline:
                    run_inline(batch.waves)
                else:
                    await run_waves(batch.waves, self.limiters, self.config.inline_bytes, lambda: self.stopped(session))
        finally:
            session.current = None
        if not pipelined:
            self.complete(batch)
        await trio.lowlevel.checkpoint()  # a queue of inline passes must not hold the loop

    def stopped(self, session: Session) -> E.TransferError | None:
        """Between waves: the error for what has not started, once the session stopped running."""
        if session.running:
            return None
        if self.shutting_down:
            return E.ShuttingDown("the daemon is shutting down: its grace ran out before this request ran")
        return E.SessionClosed("the session closed before this request ran")

    def fail_queued(self, session: Session, err: E.TransferError) -> None:
        """Answer everything queued with `err` (socket replies; completions for ring requests)."""
        b = Batch(session)
        q = session.queue
        session.queue_taken += len(q)
        while q:
            req, route = q.popleft()
            b.count(req, route)
            if type(req) is CopyRun:
                b.refused.extend((int(i), route, err) for i in req.ids.tolist())
            else:
                b.refused.append((req.id, route, err))
        if b.refused:
            self.complete(b)

    # --- take and plan -------------------------------------------------------------------------
    def take(self, session: Session) -> Batch:
        """Steps 1-3: take up to a barrier (running the barriers at the head), plan, schedule."""
        q = session.queue
        b = Batch(session)
        taken = 0
        limit = self.config.max_pass
        running = session.running
        while q and taken < limit and running:
            req, route = q[0]
            t = type(req)
            if t in _BARRIERS:
                if b.data or b.after:
                    break  # a barrier: it runs once what came before it has completed
                if t is P.RegisterRemote:
                    reply = self.control.register_remote_now(session, req)
                    if reply is None:  # it waits on a thread: a pass of its own
                        if not taken:
                            _pop(session)
                            b.count(req, route)
                            b.remote = req
                            b.inline = False
                            b.control.append(t)
                        break
                    _pop(session)
                    taken += 1
                    b.count(req, route)
                    b.control.append(t)
                    b.replies.append((req.id, route, reply))
                    continue
                _pop(session)
                taken += 1
                b.count(req, route)
                b.control.append(t)
                b.replies.append((req.id, route, self.control.execute(session, req)))
                running = session.running  # a Close stops the take here
                continue
            _pop(session)
            taken += 1
            b.count(req, route)
            if t is P.BadRequest:
                b.refused.append((req.id, route, req.error))
            elif t in _AFTER:
                b.after.append((req, route))
                b.control.append(t)
            elif t is P.ComputeRef:
                try:
                    b.data.append((resolve(session, req), route))
                except E.TransferError as exc:
                    b.refused.append((req.id, route, exc))
            else:
                b.data.append((req, route))
        if not running and q:
            # Closed in this pass (a Close, or reclaimed): what was queued behind it is answered now.
            err = E.SessionClosed("the session closed before this request ran")
            while q:
                req, route = _pop(session)
                b.count(req, route)
                if type(req) is P.Wait:  # the marker of the frame that closed: nothing to run, no failure
                    b.replies.append((req.id, route, P.Reply(req.id)))
                elif route != RING:  # ring requests: the ring closes with the session, failing them client-side
                    b.refused.append((req.id, route, err))
        if b.data:
            b.ops, refused = plan_batch(self.planner, session.id, b.data)
            if refused:
                b.refused.extend(refused)
            b.waves = assign_waves(b.ops)
            for op in b.ops:
                if op.remote is not None or (op.kind == "compute" and op.device.kind == "gpu"):
                    b.inline = False  # remote posts wait; GPU kernels may compile (never on the loop)
            if not runs_inline(b.ops, self.config.inline_bytes):
                b.inline = False
            b.pipe = one_lane(b.ops)
        return b

    # --- complete and account ------------------------------------------------------------------
    def complete(self, b: Batch) -> None:
        """Steps 6-7: answer every request of the pass, then account for it once."""
        session = b.session
        if P.Close in b.control and not session.running:
            self.on_closed(session)  # (before the answer: idempotent, the session task's end releases nothing more)
        replies: list[P.Reply] = [r for _, route, r in b.replies]
        comps: list[tuple[int, int, int, int, int]] = []
        arrays: list[np.ndarray] = []
        codes: list[int] = [r.error.code for r in replies if r.error is not None]
        for rid, route, refusal in b.refused:
            codes.append(refusal.code)
            replies.append(P.Reply(rid, error=refusal))
            if route == RING:
                comps.append((rid, refusal.code, 0, COMPLETION_DETAIL, 0))
        peer_lost = False
        for op in b.ops:
            if op.rid == 0:
                continue  # internal (a staging pull): its compute answers
            err = op.error
            if err is not None:
                peer_lost = peer_lost or (op.remote is not None and isinstance(err, E.PeerDisconnected))
            ids = op.answered()
            if op.route == RING:
                if op.ids is None and err is None and type(op.result) is bytes:  # a verified CopyV: a completion per piece
                    c = np.zeros(len(op.result) // 8, COMPLETION_DTYPE)
                    c["id"], c["result"] = ids, np.frombuffer(op.result, "<u8")
                    arrays.append(c)
                elif op.ids is None:
                    comps.append((ids, 0, _result(op.result), 0, 0) if err is None else (ids, err.code, 0, COMPLETION_DETAIL, 0))
                else:
                    c = np.zeros(len(ids), COMPLETION_DTYPE)
                    c["id"] = ids
                    if err is not None:
                        c["status"], c["flags"] = err.code, COMPLETION_DETAIL
                    arrays.append(c)
                if err is not None:
                    codes.extend([err.code] * op.count())
                    replies.extend(P.Reply(int(r), error=err) for r in np.atleast_1d(ids).tolist())
            elif op.ids is None:
                replies.append(P.Reply(ids, op.result if err is None else None, err))
                if err is not None:
                    codes.append(err.code)
            else:
                replies.extend(P.Reply(int(r), None, err) for r in ids)
                if err is not None:
                    codes.extend([err.code] * op.count())
        after = self.control.answer_after(session, [req for req, _ in b.after])
        for (req, route), reply in zip(b.after, after):
            if reply.error is not None:
                codes.append(reply.error.code)
            if route == RING:
                comps.append((req.id, 0, 0, 0, 0))
            else:
                replies.append(reply)
        if replies:
            self.send(session.identity, P.encode_replies(replies))
        if comps or arrays:
            if arrays:
                if comps:
                    arrays.append(np.array(comps, dtype=COMPLETION_DTYPE))
                out = np.empty(sum(len(a) for a in arrays), COMPLETION_DTYPE)  # concatenate would repack the dtype
                at = 0
                for a in arrays:
                    out[at : at + len(a)] = a
                    at += len(a)
                self.rings.push(session, out)
            else:
                self.rings.push(session, comps)
        session.inflight -= b.socket_n
        session.ring_pending -= b.ring_n
        self.accounting.passed(session, b.ops, len(b.waves), codes, b.control)
        if session.worker is not None:
            self.rings.settle(session)  # the ring goes back to its worker once the session is idle
        if session.phase is Phase.DRAINING:
            session.wake.set()  # (its task, idle, waits for these last answers to end the session)
        if peer_lost and session.running:
            self.on_peer_lost(session)  # the producer's NIXL agent is gone: its session goes too


def _result(value: Any) -> int:
    return int(value) if isinstance(value, (int, np.integer)) else 0


def _pop(session: Session) -> tuple[Any, int]:
    """The request at the head of the session's queue, taken (counted: `Session.queue_taken`)."""
    session.queue_taken += 1
    return session.queue.popleft()
